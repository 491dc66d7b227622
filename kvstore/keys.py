"""Chunk identity: chained content hashes over token blocks.

    key_i = xxh3_128(key_{i-1} ‖ namespace_i ‖ tokens_i as little-endian int32)
    key_{-1} = 16 zero bytes

``namespace_i`` is the sequence's namespace, or, for a chunk whose KV depends on
more than its token ids (an image's placeholder tokens stand for the image), that
namespace refined by what they stand for (``chunk_namespace``).

Every digest is xxh3-128 with seed 0, in its canonical 16-byte big-endian form
(``XXH128_canonicalFromHash``). Nothing here depends on the process, the host or
a random seed, so a router in another language recomputes the same keys; the
byte encoding is specified in docs/keys.md and pinned by golden vectors in
tests/test_keys.py.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NewType

import numpy as np
import xxhash

ChunkKey = NewType("ChunkKey", bytes)
"""16-byte identity of one chunk of one sequence under one namespace."""

Namespace = NewType("Namespace", bytes)
"""16-byte digest of a model fingerprint and a tenant salt."""

KEY_BYTES = 16
ROOT_KEY = ChunkKey(bytes(KEY_BYTES))
_NS_DOMAIN = b"crescent/namespace/v1\x00"
_EXTRA_DOMAIN = b"crescent/chunk-extra/v1\x00"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that makes two engines' KV bytes interchangeable.

    Two engines share chunks only when every field matches: a different dtype,
    layer count, head layout, chunk size or tensor-parallel shard gives a
    different namespace and so different keys.
    """

    model_id: str
    """Model name or checkpoint identity (e.g. a path's basename plus its config digest)."""
    dtype: str
    """KV dtype as torch names it, e.g. ``"bfloat16"``."""
    num_layers: int
    num_kv_heads: int
    """KV heads held by this shard (after tensor-parallel split)."""
    head_dim: int
    chunk_tokens: int
    """Tokens per chunk (default 256)."""
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelFingerprint.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"ModelFingerprint.tp_rank {self.tp_rank} is outside [0, tp_size={self.tp_size})")

    def encode(self) -> bytes:
        """Canonical bytes: ``name=value`` lines in field order, UTF-8, ``\\n``-terminated."""
        return "".join(f"{f.name}={getattr(self, f.name)}\n" for f in fields(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> ModelFingerprint:
        """Inverse of ``encode``; raises ValueError on anything else."""
        try:
            pairs = dict(line.split("=", 1) for line in data.decode().splitlines())
            kw = {f.name: (pairs[f.name] if f.type in ("str", str) else int(pairs[f.name])) for f in fields(cls)}
            fp = cls(**kw)
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a model fingerprint: {exc}") from None
        if fp.encode() != data:
            raise ValueError("not a canonical model fingerprint")
        return fp


def make_namespace(fingerprint: ModelFingerprint, tenant_salt: str | bytes | None = None) -> Namespace:
    """Namespace digest of a model fingerprint and an optional tenant salt.

    No salt (or an empty one) shares chunks across tenants; a salt isolates a
    tenant: its keys never equal another salt's.

    Encoding: ``xxh3_128("crescent/namespace/v1\\0" ‖ u32le(len(fp)) ‖ fp ‖
    u32le(len(salt)) ‖ salt)`` with ``fp = fingerprint.encode()`` and the salt as
    UTF-8.
    """
    fp = fingerprint.encode()
    salt = tenant_salt.encode() if isinstance(tenant_salt, str) else (tenant_salt or b"")
    data = _NS_DOMAIN + struct.pack("<I", len(fp)) + fp + struct.pack("<I", len(salt)) + salt
    return Namespace(xxhash.xxh3_128_digest(data))


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes; raises ValueError outside int32."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def chunk_key(parent: bytes, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> ChunkKey:
    """Key of one chunk given its parent's key (``ROOT_KEY`` for the first)."""
    if len(parent) != KEY_BYTES or len(namespace) != KEY_BYTES:
        raise ValueError("parent key and namespace must be 16 bytes each")
    return ChunkKey(xxhash.xxh3_128_digest(bytes(parent) + bytes(namespace) + tokens_to_bytes(tokens)))


def chunk_keys(
    tokens: Sequence[int] | np.ndarray, namespace: Namespace, chunk_tokens: int,
    extras: Sequence[bytes | None] | None = None,
) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens``; a partial tail chunk has no key.

    Args:
        tokens: ``[num_tokens]`` token ids.
        namespace: from ``make_namespace``.
        chunk_tokens: tokens per chunk.
        extras: per chunk, what its KV depends on beyond its tokens (``placeholder_extras``), or
            None; chunk ``i`` is keyed under ``chunk_namespace(namespace, extras[i])``. Chunks past
            the end of ``extras`` have none.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    raw = tokens_to_bytes(tokens)
    step = 4 * chunk_tokens
    keys: list[ChunkKey] = []
    parent = bytes(ROOT_KEY)
    ns = bytes(namespace)
    for i, off in enumerate(range(0, len(raw) - step + 1, step)):
        extra = extras[i] if extras is not None and i < len(extras) else None
        cns = ns if extra is None else bytes(chunk_namespace(namespace, extra))
        parent = xxhash.xxh3_128_digest(parent + cns + raw[off : off + step])
        keys.append(ChunkKey(parent))
    return keys


def chunk_namespace(namespace: Namespace, extra: bytes | None) -> Namespace:
    """The namespace of one chunk whose KV depends on ``extra`` beyond its tokens (None or empty:
    ``namespace`` itself).

    Encoding: ``xxh3_128("crescent/chunk-extra/v1\\0" ‖ namespace ‖ u32le(len(extra)) ‖ extra)``.
    The chunk's header carries this namespace, so a reader verifies it as any other.
    """
    if len(namespace) != KEY_BYTES:
        raise ValueError("namespace must be 16 bytes")
    if not extra:
        return namespace
    return Namespace(xxhash.xxh3_128_digest(_EXTRA_DOMAIN + bytes(namespace) + struct.pack("<I", len(extra)) + extra))


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A run of prompt tokens that stand for something else (an image, an audio clip): the KV of
    the chunks it overlaps depends on what it stands for, named by ``identity`` (a content hash,
    e.g. vLLM's ``MultiModalFeatureSpec.identifier``)."""

    identity: str
    offset: int
    """Index of its first token in the sequence."""
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"placeholder offset must be >= 0 and length > 0, got {self.offset}, {self.length}")


def embedding_placeholders(rows: np.ndarray, dtype: str, chunk_tokens: int,
                           is_token: Sequence[bool] | None = None) -> tuple[Placeholder, ...]:
    """A prompt given (wholly or in part) as embeddings, as placeholders a key can name: one per
    chunk-sized piece of the prompt, whose identity is ``"prompt-embeds:"`` and the hex
    ``xxh3_128(dtype ‖ ":" ‖ row bytes ‖ ":" ‖ the piece's rows' bytes [‖ one byte per position: 1
    for a token id, 0 for an embedding])``, the last part only for a prompt that mixes token ids
    and embeddings (some flag set). So a chunk's key names the rows its positions were given, as
    an image's names its content hash: prompts whose embeddings share a prefix share its chunks,
    any other row (or dtype) makes other keys.

    Args:
        rows: ``[positions, row bytes]`` uint8, the embeddings' bytes, one row per position.
        dtype: their element type's name (e.g. ``bfloat16``).
        chunk_tokens: positions per chunk.
        is_token: per position, whether it is given as a token id (a mixed prompt), or None.
    """
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError(f"rows must be [positions, row bytes] uint8, got {rows.dtype} {rows.shape}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if is_token is not None and len(is_token) != rows.shape[0]:
        raise ValueError(f"{len(is_token)} is_token flags for {rows.shape[0]} positions")
    if is_token is not None and not any(is_token):
        is_token = None  # (every position an embedding: the same prompt as without flags)
    rows = np.ascontiguousarray(rows)
    out = []
    for start in range(0, rows.shape[0], chunk_tokens):
        piece = rows[start:start + chunk_tokens]
        h = xxhash.xxh3_128(f"{dtype}:{rows.shape[1]}:".encode())
        h.update(piece.data)
        if is_token is not None:
            h.update(bytes(bool(t) for t in is_token[start:start + piece.shape[0]]))
        out.append(Placeholder(f"prompt-embeds:{h.hexdigest()}", start, piece.shape[0]))
    return tuple(out)


def placeholder_extras(placeholders: Sequence[Placeholder], chunk_tokens: int,
                       num_chunks: int) -> list[bytes | None]:
    """Per chunk ``i`` (tokens ``[i*C, (i+1)*C)``), the bytes that name the placeholders it
    overlaps, or None where it overlaps none.

    Encoding, for each overlapping placeholder in order of offset:
    ``u32le(len(identity)) ‖ identity (UTF-8) ‖ i32le(offset - i*C) ‖ u32le(length)``: the same
    item at another place in the chunk, or a longer one, names another chunk.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    out: list[bytes | None] = [None] * num_chunks
    for p in sorted(placeholders, key=lambda p: p.offset):
        ident = p.identity.encode()
        first, last = p.offset // chunk_tokens, (p.offset + p.length - 1) // chunk_tokens
        for i in range(first, min(last, num_chunks - 1) + 1):
            part = struct.pack("<I", len(ident)) + ident + struct.pack("<iI", p.offset - i * chunk_tokens, p.length)
            out[i] = (out[i] or b"") + part
    return out
