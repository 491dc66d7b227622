"""Chunk codec: round trips, and every verification failure reads as ChunkVerificationError."""

import pytest
import torch

from kvstore.chunk import decode_chunk, encode_chunk, encoded_size, parse_header, verify_chunk
from kvstore.errors import ChunkVerificationError, DataLossError
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_key, make_namespace

NS = make_namespace(ModelFingerprint("tiny", "float32", 2, 2, 64, 8))
OTHER_NS = make_namespace(ModelFingerprint("tiny", "float32", 2, 2, 64, 8), "tenant")
TOKENS = list(range(100, 108))
SHAPE = (2, 2, 2, 8, 64)


def _chunk(dtype=torch.float32, parent=ROOT_KEY, tokens=TOKENS):
    kv = torch.randn(SHAPE).to(dtype)
    key = chunk_key(parent, NS, tokens)
    return kv, key, bytearray(b"".join(encode_chunk(kv, NS, parent, tokens)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip(dtype):
    kv, key, buf = _chunk(dtype)
    assert len(buf) == encoded_size(SHAPE, dtype, len(TOKENS))
    out = decode_chunk(buf, key=key, namespace=NS, parent=ROOT_KEY, tokens=TOKENS, dtype=dtype, shape=SHAPE)
    assert out.dtype == dtype and out.shape == SHAPE
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


def test_decode_views_the_buffer_without_copy():
    kv, key, buf = _chunk()
    out = decode_chunk(buf, key=key, namespace=NS)
    hdr = parse_header(buf)
    assert hdr.payload_offset % 64 == 0
    buf[hdr.payload_offset] ^= 0xFF  # the tensor aliases the buffer
    assert out.view(torch.uint8).flatten()[0] == buf[hdr.payload_offset]
    owned = decode_chunk(bytes(_chunk()[2]), key=key, namespace=NS)  # read-only input: a copy
    assert owned.shape == SHAPE


def test_encode_does_not_copy_the_payload():
    kv = torch.randn(SHAPE)
    header, payload = encode_chunk(kv, NS, ROOT_KEY, TOKENS)
    kv[0, 0, 0, 0, 0] = 12345.0
    assert torch.frombuffer(bytearray(payload), dtype=torch.float32)[0] == 12345.0


def test_chained_parent():
    _, k0, _ = _chunk()
    kv, k1, buf = _chunk(parent=k0, tokens=list(range(8)))
    decode_chunk(buf, key=k1, namespace=NS, parent=k0, tokens=list(range(8)))
    with pytest.raises(ChunkVerificationError, match="parent"):
        verify_chunk(buf, key=k1, namespace=NS, parent=ROOT_KEY)


def _flip(buf, i):
    b = bytearray(buf)
    b[i] ^= 0x01
    return b


@pytest.mark.parametrize("case", ["payload_bit", "last_byte", "header_token", "header_shape", "magic",
                                  "truncated", "extra_byte", "empty", "wrong_key", "wrong_namespace",
                                  "wrong_tokens", "wrong_dtype", "wrong_shape"])
def test_every_mismatch_is_detected(case):
    kv, key, buf = _chunk()
    hdr = parse_header(buf)
    kwargs = {"key": key, "namespace": NS}
    if case == "payload_bit":
        buf = _flip(buf, hdr.payload_offset + 100)
    elif case == "last_byte":
        buf = _flip(buf, len(buf) - 1)
    elif case == "header_token":
        buf = _flip(buf, 64 + 4 * 5 + 1)
    elif case == "header_shape":
        buf = _flip(buf, 64)
    elif case == "magic":
        buf = _flip(buf, 0)
    elif case == "truncated":
        buf = buf[:-1]
    elif case == "extra_byte":
        buf = buf + b"\0"
    elif case == "empty":
        buf = b""
    elif case == "wrong_key":
        kwargs["key"] = chunk_key(ROOT_KEY, NS, [1] * 8)
    elif case == "wrong_namespace":
        kwargs["namespace"] = OTHER_NS
    elif case == "wrong_tokens":
        kwargs["tokens"] = [0] * 8
    elif case == "wrong_dtype":
        kwargs["dtype"] = torch.float16
    elif case == "wrong_shape":
        kwargs["shape"] = (2, 2, 2, 4, 128)
    with pytest.raises(ChunkVerificationError):
        decode_chunk(buf, **kwargs)


def test_every_byte_before_the_payload_is_checked_padding_included():
    """A flip of any header byte, the zero padding to the payload's 64-byte alignment included, is a miss."""
    kv, key, buf = _chunk()
    hdr = parse_header(buf)
    assert hdr.payload_offset > 64 + 4 * 5 + 4 * 8 + 8  # (this header has padding)
    for i in range(hdr.payload_offset):
        with pytest.raises(ChunkVerificationError):
            decode_chunk(_flip(buf, i), key=key, namespace=NS)


def test_collision_with_forged_header_is_detected():
    """A value stored under a key it does not hash to (a collision or a mislabel) is a miss."""
    _, key_a, _ = _chunk(tokens=[1] * 8)
    _, _, buf_b = _chunk(tokens=[2] * 8)
    with pytest.raises(ChunkVerificationError, match="hash to the requested key"):
        decode_chunk(buf_b, key=key_a, namespace=NS)


def test_verification_error_is_a_data_loss_error():
    assert issubclass(ChunkVerificationError, DataLossError)


def test_bad_encode_input():
    with pytest.raises(ValueError, match="layers, 2"):
        encode_chunk(torch.zeros(2, 3, 2, 8, 64), NS, ROOT_KEY, TOKENS)
    with pytest.raises(ValueError, match="token ids"):
        encode_chunk(torch.zeros(SHAPE), NS, ROOT_KEY, TOKENS[:4])
    with pytest.raises(ValueError, match="contiguous"):
        encode_chunk(torch.zeros(2, 2, 2, 64, 8).transpose(3, 4), NS, ROOT_KEY, TOKENS)


# ---- wsum64, the device-friendly payload check -----------------------------------------------

from kvstore.chunk import CHECK_WSUM, CHECK_XXH3, WSUM_K, payload_checksum, wsum64  # noqa: E402


def _kv(dtype, seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _wsum_by_hand(b: bytes) -> int:
    """The documented formula in plain integers: sum of w_i * ((2i+1) * K) mod 2^64."""
    words = [int.from_bytes(b[i:i + 8], "little") for i in range(0, len(b), 8)]
    return sum(w * ((2 * i + 1) * WSUM_K) for i, w in enumerate(words)) % (1 << 64)


@pytest.mark.parametrize("nwords", [1, 2, 7, 1000, 65537])
def test_wsum64_is_the_documented_formula(nwords):
    g = torch.Generator().manual_seed(nwords)
    t = torch.randint(0, 256, (8 * nwords,), dtype=torch.uint8, generator=g)
    assert payload_checksum(t, CHECK_WSUM) == _wsum_by_hand(bytes(t.numpy()))
    # hand-checked small case: words 1 and 2 -> 1*K + 2*3K = 7K mod 2^64
    two = (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    assert payload_checksum(memoryview(two), CHECK_WSUM) == (7 * WSUM_K) % (1 << 64) == 0x538454127B096493
    assert int(wsum64(torch.zeros(16, dtype=torch.uint8))) == 0


def test_wsum_chunk_round_trip_and_every_single_byte_error_is_caught():
    kv = _kv(torch.bfloat16, seed=3)
    parts = encode_chunk(kv, NS, ROOT_KEY, TOKENS, check=CHECK_WSUM)
    buf = bytearray(b"".join(parts))
    key = chunk_key(ROOT_KEY, NS, TOKENS)
    hdr = verify_chunk(buf, key=key, namespace=NS, parent=ROOT_KEY, tokens=TOKENS)
    assert hdr.check == CHECK_WSUM and int.from_bytes(buf[4:6], "little") == 2
    assert torch.equal(decode_chunk(buf, key=key, namespace=NS), kv)
    rng = torch.Generator().manual_seed(0)
    for pos in torch.randint(hdr.payload_offset, len(buf), (64,), generator=rng).tolist():
        bad = bytearray(buf)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(ChunkVerificationError, match="payload checksum"):
            verify_chunk(bad, key=key, namespace=NS)
        # payload=False leaves the wsum64 to the caller (checked on the device after the copy)
        assert verify_chunk(bad, key=key, namespace=NS, payload=False).payload_hash == hdr.payload_hash
    # two words swapped: caught too
    bad = bytearray(buf)
    o = hdr.payload_offset
    bad[o:o + 8], bad[o + 8:o + 16] = buf[o + 8:o + 16], buf[o:o + 8]
    if bytes(bad) != bytes(buf):
        with pytest.raises(ChunkVerificationError):
            verify_chunk(bad, key=key, namespace=NS)


def test_a_given_payload_hash_is_written_as_is_and_xxh3_chunks_keep_version_1():
    kv = _kv(torch.float16, seed=4)
    h = payload_checksum(kv, CHECK_WSUM)
    assert encode_chunk(kv, NS, ROOT_KEY, TOKENS, check=CHECK_WSUM, payload_hash=h - (1 << 64))[0] == \
        encode_chunk(kv, NS, ROOT_KEY, TOKENS, check=CHECK_WSUM)[0]  # a signed int64 from the GPU is the same
    xx = b"".join(encode_chunk(kv, NS, ROOT_KEY, TOKENS))
    assert int.from_bytes(xx[4:6], "little") == 1 and parse_header(xx).check == CHECK_XXH3
    # xxh3 payloads are checked even when the caller says it checks the payload itself
    bad = bytearray(xx)
    bad[-1] ^= 1
    with pytest.raises(ChunkVerificationError, match="payload checksum"):
        verify_chunk(bad, key=chunk_key(ROOT_KEY, NS, TOKENS), namespace=NS, payload=False)


def test_a_check_that_does_not_match_its_version_is_refused():
    kv = _kv(torch.float32, seed=5)
    buf = bytearray(b"".join(encode_chunk(kv, NS, ROOT_KEY, TOKENS, check=CHECK_WSUM)))
    buf[4:6] = (1).to_bytes(2, "little")  # wsum64 under version 1: an old reader's format
    with pytest.raises(ChunkVerificationError, match="version"):
        parse_header(buf)
    with pytest.raises(ValueError, match="payload check"):
        encode_chunk(kv, NS, ROOT_KEY, TOKENS, check=7)


def test_a_chunk_encoded_from_device_memory_needs_the_wsum64_check():
    """A device chunk's payload is never hashed on the host: xxh3 from device memory is refused
    (a clear error, not a silent copy); wsum64 is summed where the tensor is (GPU: tests/engine)."""
    kv = torch.empty((2, 2, 1, 4, 8), device="meta")
    with pytest.raises(ValueError, match="wsum64"):
        encode_chunk(kv, b"n" * 16, bytes(ROOT_KEY), [1, 2, 3, 4], check=CHECK_XXH3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wsum64_shares_of_a_payloads_parts_add_up_to_its_wsum64(dtype):
    """A load landing a chunk layer by layer sums each layer's share where it landed: the shares
    (every row its own chunk, each layer at its word offset) add up, mod 2^64, to each chunk's
    wsum64; a flipped bit in one layer changes only that chunk's sum."""
    from kvstore.chunk import wsum64_rows

    g = torch.Generator().manual_seed(3)
    chunks = torch.randn(3, 4, 2, 2, 8, 16, generator=g).to(dtype)  # [N, L, 2, KVH, T, D]
    layer_words = chunks[0, 0].numel() * chunks.element_size() // 8
    total = layer_words * chunks.shape[1]
    shares = sum(wsum64_rows(chunks[:, l].contiguous(), l * layer_words, total) for l in range(chunks.shape[1]))
    assert shares.tolist() == [int(wsum64(c)) for c in chunks]
    bad = chunks.clone()
    bad[1, 2].view(torch.uint8).view(-1)[5] ^= 0x10
    again = sum(wsum64_rows(bad[:, l].contiguous(), l * layer_words, total) for l in range(bad.shape[1]))
    assert again[0] == shares[0] and again[2] == shares[2] and again[1] != shares[1]
