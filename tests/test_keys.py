"""Chunk keys: golden vectors (they must never change silently) and the spec'd encoding."""

import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore.keys import (ROOT_KEY, ModelFingerprint, Placeholder, chunk_key, chunk_keys, chunk_namespace,
                          embedding_placeholders, make_namespace, placeholder_extras)

LLAMA = ModelFingerprint("llama-3-8b", "bfloat16", 32, 8, 128, 256)
TINY = ModelFingerprint("tiny", "float32", 2, 2, 64, 4)

GOLDEN_NS = {None: "490e85c2e7f0e95eadd3249536e38969", "tenant-a": "71c987b9f7a2da2e79e610cfe2fdccb6"}
GOLDEN_TINY_NS = "4ab3f94c133bbfdaca18399c1625af71"
GOLDEN_TINY_KEYS = ["599d769cc899dbbd07d7efc95870ded0", "788fbf481e0d06320351a17b6596eb41"]
GOLDEN_EXTREMES = "585571c016c84d0a4a7a73ca16eec8ee"
# tokens 1..12, 4-token chunks, an item "img-a" over tokens 2..6: chunks 0 and 1 refined, chunk 2 plain
GOLDEN_PLACEHOLDER_KEYS = ["6595e142c21adcae926f7f87bf6f00ca", "378c3dac57a5a59f2a92acb374722ad1",
                           "c0a5c5f38012e84564285b8289cedc67"]


def test_fingerprint_encoding():
    assert LLAMA.encode() == (b"model_id=llama-3-8b\ndtype=bfloat16\nnum_layers=32\nnum_kv_heads=8\n"
                              b"head_dim=128\nchunk_tokens=256\ntp_rank=0\ntp_size=1\n")


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_golden_namespaces(salt):
    assert make_namespace(LLAMA, salt).hex() == GOLDEN_NS[salt]


def test_golden_chunk_keys():
    ns = make_namespace(TINY)
    assert ns.hex() == GOLDEN_TINY_NS
    assert [k.hex() for k in chunk_keys(list(range(1, 11)), ns, 4)] == GOLDEN_TINY_KEYS
    assert chunk_key(ROOT_KEY, ns, [0, -1, 2**31 - 1, -(2**31)]).hex() == GOLDEN_EXTREMES


def test_encoding_matches_the_documented_bytes():
    """Recompute from the spec in docs/keys.md with nothing but struct and xxhash."""
    fp = TINY.encode()
    ns = xxhash.xxh3_128(b"crescent/namespace/v1\x00" + struct.pack("<I", len(fp)) + fp
                         + struct.pack("<I", 0)).digest()
    assert ns == make_namespace(TINY)
    parent = bytes(16)
    expected = []
    for i in range(2):
        toks = struct.pack("<4i", *range(1 + 4 * i, 5 + 4 * i))
        parent = xxhash.xxh3_128(parent + ns + toks, seed=0).digest()
        expected.append(parent)
    assert chunk_keys(list(range(1, 11)), make_namespace(TINY), 4) == expected


def test_golden_placeholder_keys_and_their_documented_bytes():
    ns = make_namespace(TINY)
    extras = placeholder_extras([Placeholder("img-a", 2, 5)], 4, 3)
    keys = chunk_keys(list(range(1, 13)), ns, 4, extras)
    assert [k.hex() for k in keys] == GOLDEN_PLACEHOLDER_KEYS
    # from docs/keys.md with struct and xxhash only
    item = lambda rel: struct.pack("<I", 5) + b"img-a" + struct.pack("<iI", rel, 5)  # noqa: E731
    assert extras == [item(2), item(-2), None]
    parent, expected = bytes(16), []
    for i in range(3):
        cns = ns if extras[i] is None else xxhash.xxh3_128(
            b"crescent/chunk-extra/v1\x00" + ns + struct.pack("<I", len(extras[i])) + extras[i]).digest()
        parent = xxhash.xxh3_128(parent + cns + struct.pack("<4i", *range(1 + 4 * i, 5 + 4 * i))).digest()
        expected.append(parent)
    assert keys == expected
    # a chunk the item does not overlap keeps its namespace, but its key differs through the chain
    assert chunk_namespace(ns, extras[2]) == ns and keys[2] != chunk_keys(list(range(1, 13)), ns, 4)[2]
    assert chunk_key(keys[0], chunk_namespace(ns, extras[1]), [5, 6, 7, 8]) == keys[1]


def test_placeholders_name_content_place_and_length():
    ns, toks = make_namespace(TINY), list(range(1, 17))

    def keys(*items):
        return chunk_keys(toks, ns, 4, placeholder_extras([Placeholder(*i) for i in items], 4, 4))

    plain = chunk_keys(toks, ns, 4)
    a = keys(("img-a", 5, 6))  # tokens 5..10: chunks 1 and 2
    assert a[0] == plain[0] and a[1] != plain[1]
    assert keys(("img-b", 5, 6))[1] != a[1]  # other content
    assert keys(("img-a", 6, 5))[1] != a[1]  # same content, another place
    assert keys(("img-a", 5, 7))[1] != a[1]  # longer
    assert keys(("img-a", 5, 6), ("img-b", 12, 4))[:3] == a[:3]  # a later item changes later chunks only
    assert keys(("img-b", 12, 4), ("img-a", 5, 6)) == keys(("img-a", 5, 6), ("img-b", 12, 4))  # offset order
    two = placeholder_extras([Placeholder("x", 1, 1), Placeholder("y", 3, 1)], 4, 1)[0]
    assert two == struct.pack("<I", 1) + b"x" + struct.pack("<iI", 1, 1) + struct.pack("<I", 1) + b"y" + \
        struct.pack("<iI", 3, 1)
    assert placeholder_extras([Placeholder("x", 30, 10)], 4, 2) == [None, None]  # past the chunks asked for
    with pytest.raises(ValueError, match="placeholder"):
        Placeholder("x", 0, 0)


def test_prompt_embeddings_name_each_chunks_rows():
    """A prompt given as embeddings (its token ids all 0): each chunk-sized piece is a placeholder
    named by its rows' bytes, dtype and width (docs/keys.md), so prompts whose rows share a prefix
    share those chunks' keys and nothing else does."""
    ns, zeros = make_namespace(TINY), [0] * 10
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (10, 8), dtype=np.uint8)

    def keys(rows, dtype="bfloat16", is_token=None):
        marks = embedding_placeholders(rows, dtype, 4, is_token)
        return chunk_keys(zeros, ns, 4, placeholder_extras(marks, 4, 2))

    marks = embedding_placeholders(a, "bfloat16", 4)
    assert [(p.offset, p.length) for p in marks] == [(0, 4), (4, 4), (8, 2)]
    digest = xxhash.xxh3_128(b"bfloat16:8:" + a[4:8].tobytes()).hexdigest()  # (from docs/keys.md)
    assert marks[1].identity == f"prompt-embeds:{digest}"
    b = a.copy()
    b[5, 3] ^= 1  # one byte of chunk 1
    assert keys(b)[0] == keys(a)[0] and keys(b)[1] != keys(a)[1]
    assert keys(a) != chunk_keys(zeros, ns, 4)  # (the ids alone name no rows)
    assert keys(a, "float16") != keys(a)  # the same bytes as another dtype
    assert keys(a.reshape(10, 2, 4)[:, 0].copy()) != keys(a)  # (narrower rows: other bytes)
    mixed = [True] * 2 + [False] * 8
    assert keys(a, is_token=mixed)[0] != keys(a)[0] and keys(a, is_token=mixed)[1] != keys(a)[1]
    assert keys(a, is_token=[False] * 10) == keys(a)  # (no position given as a token: no flags)
    with pytest.raises(ValueError, match="rows must be"):
        embedding_placeholders(a.astype(np.int16), "bfloat16", 4)
    with pytest.raises(ValueError, match="is_token"):
        embedding_placeholders(a, "bfloat16", 4, [True])


def test_deterministic_across_processes():
    code = ("from kvstore.keys import *; ns = make_namespace(ModelFingerprint('tiny','float32',2,2,64,4));"
            "print(chunk_keys(list(range(1, 11)), ns, 4)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in (1, 2)}
    assert outs == {GOLDEN_TINY_KEYS[-1]}


def test_chain_partial_tail_and_input_types():
    ns = make_namespace(TINY)
    toks = list(range(1, 11))
    keys = chunk_keys(toks, ns, 4)
    assert len(keys) == 2  # the 2-token tail has no key
    assert chunk_keys(np.array(toks, dtype=np.int64), ns, 4) == keys
    assert chunk_keys(toks[:8], ns, 4) == keys
    assert chunk_keys(toks[:3], ns, 4) == []
    # chained: the second key depends on the first chunk's tokens
    assert chunk_keys([99] + toks[1:], ns, 4)[1] != keys[1]
    assert chunk_key(keys[0], ns, toks[4:8]) == keys[1]


def test_salt_isolates_and_no_salt_shares():
    toks = list(range(100))
    a = chunk_keys(toks, make_namespace(TINY, "alice"), 4)
    b = chunk_keys(toks, make_namespace(TINY, "bob"), 4)
    assert not set(a) & set(b)
    assert chunk_keys(toks, make_namespace(TINY), 4) == chunk_keys(toks, make_namespace(TINY, ""), 4)


def test_fingerprint_fields_change_the_namespace():
    base = make_namespace(LLAMA)
    for change in ({"dtype": "float16"}, {"num_layers": 31}, {"chunk_tokens": 128},
                   {"tp_rank": 1, "tp_size": 2}, {"model_id": "other"}):
        fp = ModelFingerprint(**{**{f: getattr(LLAMA, f) for f in LLAMA.__slots__}, **change})
        assert make_namespace(fp) != base, change


@pytest.mark.parametrize("bad", [[2**31], [-(2**31) - 1], [[1, 2]], [1.5]])
def test_bad_tokens_raise(bad):
    with pytest.raises(ValueError):
        chunk_keys(bad, make_namespace(TINY), 1)


def test_bad_fingerprint_names_the_knob():
    with pytest.raises(ValueError, match="tp_rank"):
        ModelFingerprint("m", "float32", 1, 1, 64, 4, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ModelFingerprint("m", "float32", 1, 1, 64, 0)


def test_fingerprint_decodes_its_own_encoding_only():
    assert ModelFingerprint.decode(LLAMA.encode()) == LLAMA
    for bad in (b"", b"model_id=x\n", LLAMA.encode().replace(b"num_layers=32", b"num_layers=thirty")):
        with pytest.raises(ValueError):
            ModelFingerprint.decode(bad)
