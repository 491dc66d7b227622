"""A store client for serving stacks: every fault reads as a miss.

``StoreLink`` wraps ``StoreClient`` for callers that must never fail a request
because of the cache: a lookup that cannot reach the node finds nothing, a
fetch returns only the leading chunks that arrived and verified, a save that
cannot be delivered is dropped. After a connection fault the link stays away
from the node for ``cooldown_s`` (a circuit breaker), so an engine whose store
is down pays one failed call per cooldown, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.chunk import CHECK_WSUM, encoded_size, verify_chunk
from kvstore.client import Retry, StoreClient
from kvstore.errors import ChunkVerificationError, CrescentError, DataLossError, DeadlineExceededError, UnavailableError
from kvstore.keys import ChunkKey, Namespace
from kvstore.transport.descriptors import Mover

log = logging.getLogger("crescent.integrations")

_CONNECTION_FAULTS = (UnavailableError, DeadlineExceededError, DataLossError, OSError)


@dataclass(frozen=True)
class StoreLinkConfig:
    """How an integration reaches its store node."""

    address: str
    """``host:port`` of the store node's gRPC listener."""
    timeout_s: float = 10.0
    """Deadline of each store call; a slower call counts as a fault."""
    attempts: int = 2
    """Tries per call when the node is UNAVAILABLE (one retry by default)."""
    cooldown_s: float = 5.0
    """After a connection fault, seconds during which the node is not asked at all."""

    def __post_init__(self) -> None:
        from kvstore.client import MAX_TIMEOUT_S
        from kvstore.config import check_address

        check_address("store address", self.address)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # also NaN
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.timeout_s}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if not 0 <= self.cooldown_s <= 3600:
            raise ValueError(f"cooldown_s must be in [0, 3600] seconds, got {self.cooldown_s}")


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """What a reader expects of one chunk: its key, its parent's key and its tokens."""

    key: ChunkKey
    parent: ChunkKey
    tokens: np.ndarray
    """``[chunk_tokens]`` int32 token ids."""
    namespace: Namespace | None = None
    """The namespace this chunk must carry, where it is its own (``keys.chunk_namespace``);
    None: the one ``fetch_prefix`` is given."""


class StoreLink:
    """Fault-tolerant chunk I/O against one store node (thread-safe).

    Args:
        config: address, deadlines and breaker cooldown.
    """

    def __init__(self, config: StoreLinkConfig) -> None:
        self.config = config
        self._client: StoreClient | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.num_faults = 0
        """Calls that failed (connection faults, refused values, unexpected errors)."""
        self.num_rejected = 0
        """Chunks that arrived but failed verification (read as misses)."""
        self._no_shm = False
        """The node's arena cannot serve in-place reads here (CUDA could not register it)."""

    # ---- breaker -------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker keeps the link away from the node."""
        return time.monotonic() >= self._down_until

    def _client_or_none(self) -> StoreClient | None:
        if not self.available:
            return None
        with self._lock:
            if self._client is None:
                retry = Retry(attempts=self.config.attempts, backoff_s=0.05, max_backoff_s=0.5)
                self._client = StoreClient(self.config.address, timeout_s=self.config.timeout_s,
                                           retry=retry)
            return self._client

    def shm_session(self, register_cuda: bool = False):
        """The client's shm ``DescriptorSession`` with the node (it runs on this host: chunks can
        be leased and read where it keeps them), or None: another host, the store away, or, with
        ``register_cuda``, a mapping CUDA could not page-lock (a copy from it would not be DMA)."""
        client = self._client_or_none()
        if client is None or self._no_shm:
            return None
        try:
            session = client.descriptor_session()
        except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, never a failed request
            self._fault("session", exc)
            return None
        if session is None or session.mover is not Mover.SHM:
            return None
        if register_cuda:
            why = session.register_cuda()  # (once: later calls find it done)
            if why is not None:
                log.warning("crescent: the node's arena could not be registered with CUDA (%s); "
                            "loads copy into a pinned buffer instead", why)
                self._no_shm = True
                return None
        return session

    def _fault(self, what: str, exc: BaseException) -> None:
        self.num_faults += 1
        if isinstance(exc, _CONNECTION_FAULTS):
            first = self.available
            self._down_until = time.monotonic() + self.config.cooldown_s
            if first:
                log.warning("crescent store %s: %s failed (%s); treating it as absent for %.1fs",
                            self.config.address, what, exc, self.config.cooldown_s)
            with self._lock:  # NOTE: a fresh client after a fault reconnects cleanly.
                client, self._client = self._client, None
            if client is not None:
                try:
                    client.close()
                except Exception as close_exc:  # noqa: BLE001 - closing a broken client must not raise
                    log.debug("crescent: closing a broken client: %r", close_exc)
        else:
            log.warning("crescent store %s: %s failed: %r", self.config.address, what, exc,
                        exc_info=not isinstance(exc, CrescentError))

    # ---- calls ---------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the run of leading keys present on the node; 0 on any fault."""
        if not keys:
            return 0
        client = self._client_or_none()
        if client is None:
            return 0
        try:
            return client.lookup(keys)
        except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, never a failed request
            self._fault("lookup", exc)
            return 0

    def fetch_prefix(self, refs: Sequence[ChunkRef], namespace: Namespace | None, dtype: torch.dtype,
                     shape: Sequence[int], into: torch.Tensor | None = None,
                     deferred: list[int | None] | None = None) -> list[torch.Tensor]:
        """Fetches and verifies chunks; returns the leading run that verified.

        Args:
            refs: the chunks, in sequence order.
            namespace: the namespace every chunk must carry (but those whose ref names its own).
            dtype: the KV dtype every chunk must have.
            shape: ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` of every chunk.
            into: a contiguous ``uint8`` host buffer of at least ``len(refs) *
                encoded_size(...)`` bytes (see ``staging_bytes``) that chunk ``i`` is read into
                at ``i * encoded_size``: no allocation per chunk. None: a buffer per chunk.
            deferred: a list to leave wsum64 payload checks to the caller (who sums the bytes
                where they land, e.g. on a GPU): per returned chunk, the checksum its header
                promises, or None where the payload was checked here (xxh3_64 is always).

        Returns:
            Payload tensors of ``refs[:n]`` (each of ``shape``), where chunk ``n``
            is the first that is missing, failed verification or could not be
            read. They view ``into`` when given (valid until it is reused), else own
            their memory.
        """
        if not refs:
            return []
        if namespace is None and any(r.namespace is None for r in refs):
            raise ValueError("fetch_prefix: every chunk needs a namespace to be verified against")
        client = self._client_or_none()
        if client is None:
            return []
        size = encoded_size(shape, dtype, len(refs[0].tokens))
        if into is None:
            buffers = [bytearray(size) for _ in refs]
        else:
            if into.dtype != torch.uint8 or not into.is_contiguous() or into.numel() < size * len(refs):
                raise ValueError(f"fetch_prefix: into must be contiguous uint8 of at least {size * len(refs)} bytes")
            buffers = [into[i * size:(i + 1) * size] for i in range(len(refs))]
        try:
            sizes = client.batch_get_into([r.key for r in refs], buffers)
        except Exception as exc:  # noqa: BLE001
            self._fault("fetch", exc)
            return []
        out: list[torch.Tensor] = []
        for ref, buf, n in zip(refs, buffers, sizes):
            if n is None:
                break
            try:
                view = memoryview(buf)[:n] if into is None else memoryview(buf.numpy())[:n]
                hdr = verify_chunk(view, key=ref.key, namespace=ref.namespace or namespace, parent=ref.parent,
                                   tokens=ref.tokens, dtype=dtype, shape=shape, payload=deferred is None)
                payload = view[hdr.payload_offset:]
                out.append(torch.frombuffer(payload, dtype=dtype).view(hdr.shape))
                if deferred is not None:
                    deferred.append(hdr.payload_hash if hdr.check == CHECK_WSUM else None)
            except ChunkVerificationError as exc:
                self.num_rejected += 1
                log.warning("crescent chunk %s rejected: %s", bytes(ref.key).hex(), exc)
                break
        return out

    @staticmethod
    def staging_bytes(num_chunks: int, dtype: torch.dtype, shape: Sequence[int]) -> int:
        """Bytes ``fetch_prefix`` needs in ``into`` for ``num_chunks`` chunks of this kind."""
        return num_chunks * encoded_size(shape, dtype, shape[3])

    def save(self, items: Sequence[tuple[ChunkKey, list]]) -> int:
        """Stores encoded chunks (``(key, [header, payload])``); returns how many were stored."""
        if not items:
            return 0
        client = self._client_or_none()
        if client is None:
            return 0
        try:
            return sum(client.batch_put(list(items)))
        except Exception as exc:  # noqa: BLE001
            self._fault("save", exc)
            return 0

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
