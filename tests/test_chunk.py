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
