"""KV chunk codec: a verified header in front of a layer-major payload.

Layout of an encoded chunk (all integers little-endian)::

    offset  size  field
    0       4     magic b"CRKV"
    4       2     version (1)
    6       1     dtype code (see _DTYPES)
    7       1     ndim of the payload shape
    8       16    namespace
    24      16    parent key
    40      4     num_tokens
    44      4     payload check: 0 xxh3_64 (version 1), 1 wsum64 (version 2)
    48      8     payload bytes
    56      8     the payload's checksum
    64      4*ndim     shape
    ...     4*num_tokens token ids (int32)
    ...     8     xxh3_64 of every header byte before this field
    ...     pad with zeros to a multiple of 64
    ...     payload: [layers, 2 (K,V), kv_heads, chunk_tokens, head_dim], C order

The payload starts 64-byte aligned so a reader can view it in place.

Two payload checks: xxh3_64, fast on a CPU (8 GB/s on one core) but serial and
holding the GIL; and wsum64, ``sum_i w_i * ((2i + 1) * K) mod 2^64`` over the
payload's little-endian u64 words ``w_i`` with ``K = 0x9E3779B97F4A7C15``: a
product and a sum, so a GPU computes it over the bytes it has just copied in
microseconds (and a CPU with torch at about 1 GB/s). Every multiplier is odd, so
any error confined to one word is always caught. Engines on a GPU write wsum64
and check it on the device after the copy; CPU engines write xxh3_64. The chunk's
own key is not stored: a reader recomputes ``chunk_key(parent, namespace,
tokens)`` and compares it with the key it asked for, which catches collisions
and mislabelled values as well as corruption.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstore.errors import ChunkVerificationError
from kvstore.keys import KEY_BYTES, ChunkKey, Namespace, chunk_key, tokens_to_bytes

MAGIC = b"CRKV"
CHECK_XXH3, CHECK_WSUM = 0, 1
_VERSION_OF = {CHECK_XXH3: 1, CHECK_WSUM: 2}  # the format version each payload check is written under
WSUM_K = 0x9E3779B97F4A7C15
ALIGN = 64
_FIXED = struct.Struct("<4sHBB16s16sII QQ".replace(" ", ""))
assert _FIXED.size == 64

_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float8_e4m3fn,
    5: torch.float8_e5m2,
    6: torch.uint8,
    7: torch.int8,
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    namespace: Namespace
    parent: ChunkKey
    tokens: np.ndarray
    """``[num_tokens]`` int32 token ids of this chunk."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_offset: int
    payload_bytes: int
    payload_hash: int
    check: int = CHECK_XXH3
    """How ``payload_hash`` was computed: CHECK_XXH3 or CHECK_WSUM."""


_MULTIPLIERS: dict[tuple[int, str], torch.Tensor] = {}


def _multipliers(n: int, device: torch.device) -> torch.Tensor:
    """``(2i + 1) * K mod 2^64`` for i < n, as int64 (two's complement), cached per length and device."""
    key = (n, str(device))
    m = _MULTIPLIERS.get(key)
    if m is None:
        if len(_MULTIPLIERS) >= 8:
            _MULTIPLIERS.clear()
        k = WSUM_K - (1 << 64)  # the same 64 bits as a signed integer
        m = _MULTIPLIERS[key] = (torch.arange(n, dtype=torch.int64, device=device) * 2 + 1) * k
    return m


def wsum64(payload: torch.Tensor) -> torch.Tensor:
    """The wsum64 of a payload's bytes, on the tensor's device, as a 0-dim int64 tensor.

    Args:
        payload: any contiguous tensor (its bytes, a multiple of 8, are the payload), on
            any device; integer arithmetic wraps mod 2^64 on every device alike.
    """
    w = payload.reshape(-1).view(torch.uint8).view(torch.int64)
    return (w * _multipliers(w.numel(), w.device)).sum()


def wsum64_rows(rows: torch.Tensor, word_offset: int, total_words: int) -> torch.Tensor:
    """``[N]`` int64: row ``n``'s share of the wsum64 of a payload of ``total_words`` 8-byte
    words in which the row starts at word ``word_offset`` (the same offset for every row).

    The sum is linear with a weight per position, so the shares of a payload's parts add up
    (mod 2^64) to its wsum64: a load that lands a chunk layer by layer checks it as it goes.

    Args:
        rows: ``[N, ...]``, each row contiguous, a multiple of 8 bytes.
    """
    w = rows.reshape(rows.shape[0], -1).view(torch.uint8).view(torch.int64)
    m = _multipliers(total_words, w.device)[word_offset : word_offset + w.shape[1]]
    return (w * m).sum(-1)


def _unsigned(x: int) -> int:
    return x & ((1 << 64) - 1)


def payload_checksum(payload: torch.Tensor | memoryview, check: int) -> int:
    """The payload's checksum of kind ``check``, as the header stores it (unsigned)."""
    if check == CHECK_WSUM:
        if not isinstance(payload, torch.Tensor):
            with warnings.catch_warnings():  # read-only bytes: wsum64 only reads them
                warnings.simplefilter("ignore", UserWarning)
                payload = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0)
        return _unsigned(int(wsum64(payload)))
    if isinstance(payload, torch.Tensor):
        payload = tensor_bytes(payload)
    return xxhash.xxh3_64_intdigest(payload)


def _header_bytes(namespace: bytes, parent: bytes, tokens_le: bytes, dtype: torch.dtype,
                  shape: Sequence[int], payload: memoryview, check: int = CHECK_XXH3,
                  payload_hash: int | None = None) -> bytes:
    if dtype not in _CODES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    if len(namespace) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise ValueError("namespace and parent key must be 16 bytes each")
    num_tokens = len(tokens_le) // 4
    if payload_hash is None:
        payload_hash = payload_checksum(payload, check)
    head = _FIXED.pack(MAGIC, _VERSION_OF[check], _CODES[dtype], len(shape), bytes(namespace), bytes(parent),
                       num_tokens, check, payload.nbytes, _unsigned(payload_hash))
    head += struct.pack(f"<{len(shape)}I", *shape) + tokens_le
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return head + bytes(-len(head) % ALIGN)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.device.type != "cpu":
        raise ValueError("encode from a CPU tensor (copy device tensors to pinned host memory first)")
    if not t.is_contiguous():
        raise ValueError("the KV tensor must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def encode_chunk(kv: torch.Tensor, namespace: Namespace, parent: bytes,
                 tokens: Sequence[int] | np.ndarray, check: int = CHECK_XXH3,
                 payload_hash: int | None = None) -> list[bytes | memoryview]:
    """Encodes one chunk as ``[header, payload]`` segments, without copying the payload.

    Args:
        kv: ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` contiguous tensor: on the CPU,
            or on a GPU with a wsum64 check (the payload segment is then the device tensor's
            bytes, for a client that writes it into the store straight from the device).
        namespace: the chunk's namespace.
        parent: key of the previous chunk (``ROOT_KEY`` for the first).
        tokens: ``[chunk_tokens]`` token ids of this chunk.
        check: the payload check, CHECK_XXH3 or CHECK_WSUM (needs a payload of whole u64 words).
        payload_hash: the payload's checksum when the caller has it already (e.g. a
            wsum64 computed on the GPU before the copy to host); else computed here.

    Returns:
        The header (bytes) and a view of ``kv``'s memory. Send them in order (a
        gather write) or join them with ``b"".join`` for a single value. The
        view aliases ``kv``: keep ``kv`` unchanged until the bytes are sent.
    """
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, kv_heads, chunk_tokens, head_dim], got {tuple(kv.shape)}")
    tokens_le = tokens_to_bytes(tokens)
    if len(tokens_le) // 4 != kv.shape[3]:
        raise ValueError(f"{len(tokens_le) // 4} token ids for a chunk of {kv.shape[3]} tokens")
    if kv.device.type == "cpu":
        payload = tensor_bytes(kv)
    elif check != CHECK_WSUM or not kv.is_contiguous():
        raise ValueError("a chunk encoded from device memory needs a contiguous tensor and the wsum64 check")
    else:
        payload = kv.reshape(-1).view(torch.uint8)
    if check not in _VERSION_OF:
        raise ValueError(f"unknown payload check {check}")
    if check == CHECK_WSUM and payload.nbytes % 8:
        raise ValueError(f"wsum64 needs whole u64 words; the payload has {payload.nbytes} bytes")
    if payload_hash is None and check == CHECK_WSUM:
        payload_hash = payload_checksum(kv, check)
    return [_header_bytes(namespace, parent, tokens_le, kv.dtype, kv.shape, payload, check, payload_hash), payload]


def parse_header(buf: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parses and self-checks a chunk's header; raises ChunkVerificationError."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < _FIXED.size + 8:
        raise ChunkVerificationError(f"chunk of {mv.nbytes} bytes is shorter than a header")
    magic, version, code, ndim, ns, parent, num_tokens, check, payload_bytes, payload_hash = \
        _FIXED.unpack_from(mv, 0)
    if magic != MAGIC or _VERSION_OF.get(check) != version:
        raise ChunkVerificationError("not a Crescent KV chunk (bad magic, version or payload check)")
    if code not in _DTYPES:
        raise ChunkVerificationError(f"unknown dtype code {code}")
    end = _FIXED.size + 4 * ndim + 4 * num_tokens
    if mv.nbytes < end + 8:
        raise ChunkVerificationError("truncated chunk header")
    (header_hash,) = struct.unpack_from("<Q", mv, end)
    if xxhash.xxh3_64_intdigest(mv[:end]) != header_hash:
        raise ChunkVerificationError("chunk header checksum mismatch")
    shape = struct.unpack_from(f"<{ndim}I", mv, _FIXED.size)
    tokens = np.frombuffer(mv, dtype="<i4", count=num_tokens, offset=_FIXED.size + 4 * ndim).copy()
    offset = end + 8 + (-(end + 8) % ALIGN)
    if bytes(mv[end + 8:min(offset, mv.nbytes)]).strip(b"\0"):  # (no byte of a chunk goes unchecked)
        raise ChunkVerificationError("nonzero bytes in the chunk header's padding")
    return ChunkHeader(Namespace(ns), ChunkKey(parent), tokens, _DTYPES[code], tuple(shape),
                       offset, payload_bytes, payload_hash, check)


def verify_chunk(buf: bytes | bytearray | memoryview, *, key: bytes, namespace: Namespace,
                 parent: bytes | None = None, tokens: Sequence[int] | np.ndarray | None = None,
                 dtype: torch.dtype | None = None, shape: Sequence[int] | None = None,
                 payload: bool = True) -> ChunkHeader:
    """Checks everything a reader relies on; any mismatch raises ChunkVerificationError.

    Checks the header checksum, the namespace, the parent key and token ids
    (when given), that ``chunk_key(parent, namespace, tokens) == key`` (no
    collision, no mislabelled value), dtype and shape (when given), the payload
    length and its checksum. ``payload=False`` leaves a wsum64 payload's checksum
    to the caller (who computes it where the bytes land, e.g. on the GPU, and
    compares it with ``header.payload_hash``); an xxh3_64 payload is always checked here.
    """
    mv = memoryview(buf).cast("B")
    hdr = verify_header(mv, mv.nbytes, key=key, namespace=namespace, parent=parent, tokens=tokens,
                        dtype=dtype, shape=shape)
    if payload or hdr.check == CHECK_XXH3:
        check_payload(hdr, mv[hdr.payload_offset:])
    return hdr


def verify_header(buf: bytes | bytearray | memoryview, total_bytes: int, *, key: bytes, namespace: Namespace,
                  parent: bytes | None = None, tokens: Sequence[int] | np.ndarray | None = None,
                  dtype: torch.dtype | None = None, shape: Sequence[int] | None = None) -> ChunkHeader:
    """``verify_chunk`` but for the payload's checksum, from the chunk's first bytes (at least
    its header) and its whole length: for readers whose payload is elsewhere (still in the
    store's memory, or on its way to a GPU). Follow with ``check_payload`` or a device check."""
    hdr = parse_header(buf)
    if hdr.namespace != bytes(namespace):
        raise ChunkVerificationError("chunk namespace differs (another model or tenant)")
    if parent is not None and hdr.parent != bytes(parent):
        raise ChunkVerificationError("chunk parent key differs")
    if tokens is not None and tokens_to_bytes(tokens) != hdr.tokens.tobytes():
        raise ChunkVerificationError("chunk token ids differ")
    if chunk_key(hdr.parent, hdr.namespace, hdr.tokens) != bytes(key):
        raise ChunkVerificationError("chunk does not hash to the requested key")
    if dtype is not None and hdr.dtype != dtype:
        raise ChunkVerificationError(f"chunk dtype {hdr.dtype} differs from {dtype}")
    if shape is not None and tuple(shape) != hdr.shape:
        raise ChunkVerificationError(f"chunk shape {hdr.shape} differs from {tuple(shape)}")
    elem = torch.empty((), dtype=hdr.dtype).element_size()
    if hdr.payload_bytes != elem * int(np.prod(hdr.shape, dtype=np.int64)):
        raise ChunkVerificationError("chunk payload length does not match its shape")
    if total_bytes != hdr.payload_offset + hdr.payload_bytes:
        raise ChunkVerificationError(
            f"chunk is {total_bytes} bytes, header promises {hdr.payload_offset + hdr.payload_bytes}")
    return hdr


def check_payload(hdr: ChunkHeader, payload: memoryview | torch.Tensor) -> None:
    """Raises ChunkVerificationError unless ``payload`` (host bytes) has the header's checksum."""
    if payload_checksum(payload, hdr.check) != hdr.payload_hash:
        raise ChunkVerificationError("chunk payload checksum mismatch")


def decode_chunk(buf: bytearray | memoryview | bytes, *, key: bytes, namespace: Namespace,
                 parent: bytes | None = None, tokens: Sequence[int] | np.ndarray | None = None,
                 dtype: torch.dtype | None = None, shape: Sequence[int] | None = None,
                 copy: bool = False) -> torch.Tensor:
    """Verifies a chunk and returns its payload as a tensor.

    Returns:
        ``[layers, 2, kv_heads, chunk_tokens, head_dim]``. With ``copy=False``
        the tensor views ``buf`` (which must then be writable, e.g. a bytearray);
        ``copy=True`` or a read-only ``buf`` gives an owned copy.
    """
    hdr = verify_chunk(buf, key=key, namespace=namespace, parent=parent, tokens=tokens,
                       dtype=dtype, shape=shape)
    mv = memoryview(buf).cast("B")[hdr.payload_offset:]
    if copy or mv.readonly:
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=hdr.dtype).view(hdr.shape)


def encoded_size(shape: Sequence[int], dtype: torch.dtype, num_tokens: int) -> int:
    """Bytes of an encoded chunk of this shape (header, padding and payload)."""
    end = _FIXED.size + 4 * len(shape) + 4 * num_tokens + 8
    elem = torch.empty((), dtype=dtype).element_size()
    return end + (-end % ALIGN) + elem * int(np.prod(shape, dtype=np.int64))
