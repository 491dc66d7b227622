"""Mooncake Store's Python client API over Crescent: change one import, keep the code.

``MooncakeDistributedStore`` has the methods (and return conventions) of
``mooncake.store.MooncakeDistributedStore`` that Mooncake Store users, SGLang's
Mooncake HiCache backend and vLLM's Mooncake store connector call:

- ``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
  protocol, device_name, master_server_address)``: ``master_server_address`` names a
  Crescent store node or a conductor (``host:port``; a conductor makes this a
  ``ClusterClient`` over every store node it knows). Mooncake's other arguments have no
  Crescent counterpart (Crescent nodes own their memory; the client contributes no
  segment): they are accepted and noted in the log. Returns 0, or a negative code.
- Status calls return 0 or a negative Mooncake ``ErrorCode`` value; reads return bytes
  (``b""`` on a miss) or byte counts (negative on error); existence checks 1 / 0 / -1.
- Keys are ``str`` (UTF-8, at most 1024 bytes in Crescent). A put to a key that exists
  replaces its value (Crescent's keys are content hashes: the value is the same).
- The zero-copy calls (``put_from``, ``get_into``, ``batch_put_from``,
  ``batch_get_into``) take raw addresses, as Mooncake's do. They must lie inside a
  buffer given to ``register_buffer`` (Mooncake calls anything else undefined
  behaviour; here it is ``INVALID_PARAMS``): bytes move through Crescent's own movers
  (shared memory on the node's host, else its TCP data channel).

``ReplicateConfig.replica_num`` > 1 writes that many copies when the master is a
conductor; with one store node it is noted and ignored.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence

from kvstore.config import MAX_KEY_BYTES
from kvstore.errors import (CrescentError, DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError,
                            UnavailableError)

log = logging.getLogger("crescent.compat.mooncake")

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this client returns.
OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
RPC_TIMEOUT = -901


def error_code(exc: Exception) -> int:
    """The Mooncake code for a Crescent error."""
    if isinstance(exc, UnavailableError):
        return RPC_FAIL
    if isinstance(exc, DeadlineExceededError):
        return RPC_TIMEOUT
    if isinstance(exc, ResourceExhaustedError):
        return NO_AVAILABLE_HANDLE
    if isinstance(exc, InvalidArgumentError):
        return INVALID_PARAMS
    return INTERNAL_ERROR


class ReplicateConfig:
    """Mooncake's replication settings; ``replica_num`` is honoured over a conductor."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.preferred_segment = ""


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: Python's buffer protocol, plus Mooncake's ``size()`` and ``ptr()``."""

    def size(self) -> int:
        return len(self)

    def ptr(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0


class MooncakeDistributedStore:
    def __init__(self) -> None:
        self._client = None
        self._cluster = False
        self._hostname = ""
        self._replicated: dict[int, object] = {}  # replica_num → a ClusterClient writing that many copies
        self._buffers: dict[int, int] = {}  # registered address → size
        self._lock = threading.Lock()
        self._slabs = None  # kvstore.client.ReadSlabs, what get_size reads into (made by setup)

    # ---- lifecycle -------------------------------------------------------------------

    def setup(self, local_hostname: str, metadata_server: str = "", global_segment_size: int = 0,
              local_buffer_size: int = 0, protocol: str = "tcp", device_name: str = "",
              master_server_address: str = "") -> int:
        from kvstore.client import ClusterClient, ReadSlabs, StoreClient
        from kvstore.conductor.client import ConductorClient

        self._slabs = self._slabs or ReadSlabs()

        if not master_server_address:
            log.error("setup: master_server_address must name a Crescent store node or conductor (host:port)")
            return INVALID_PARAMS
        ignored = {k: v for k, v in (("metadata_server", metadata_server), ("global_segment_size", global_segment_size),
                                     ("local_buffer_size", local_buffer_size), ("device_name", device_name)) if v}
        if ignored or protocol not in ("tcp", ""):
            log.info("setup: %s have no Crescent counterpart and are ignored (protocol %r: Crescent picks its "
                     "mover, shared memory on the node's host, else TCP or RDMA)", ", ".join(ignored) or "no options",
                     protocol)
        self._hostname = local_hostname
        self.close()  # a second setup replaces the first's clients, not leaks them
        try:
            store = StoreClient(master_server_address, timeout_s=30)
        except CrescentError as exc:
            log.error("setup: %s", exc)
            return INVALID_PARAMS
        try:
            store.health()
            self._client, self._cluster = store, False
            return OK
        except CrescentError as exc:
            store.close()
            first = exc
        try:  # not a store node: a conductor?
            with ConductorClient(master_server_address, timeout_s=30) as cc:
                cc.members()
        except CrescentError:
            log.error("setup: no Crescent store node or conductor answers at %s: %s", master_server_address, first)
            return error_code(first)
        self._client, self._cluster = ClusterClient(master_server_address, timeout_s=30), True
        return OK

    def close(self) -> int:
        for c in (self._client, *self._replicated.values()):
            if c is not None:
                c.close()
        self._client = None
        self._replicated.clear()
        return OK

    def get_hostname(self) -> str:
        return self._hostname

    # ---- values ---------------------------------------------------------------------

    def _put(self, items: list[tuple[bytes, object]], config: ReplicateConfig | None) -> list[int]:
        c = self._client
        if c is None:
            return [INTERNAL_ERROR] * len(items)
        replicas = getattr(config, "replica_num", 1) or 1
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            log.error("replica_num must be a positive integer, got %r", replicas)
            return [INVALID_PARAMS] * len(items)
        try:
            if self._cluster and replicas > 1:
                rc = self._replicated.get(replicas)
                if rc is None:
                    from kvstore.client import ClusterClient

                    rc = self._replicated[replicas] = ClusterClient(",".join(c.conductor.addresses),
                                                                    replicas=replicas, timeout_s=30)
                stored = rc.batch_put(items)
            else:
                if replicas > 1:
                    log.info("replica_num %d: one store node holds one copy", replicas)
                stored = c.batch_put(items)
        except CrescentError as exc:
            return [error_code(exc)] * len(items)
        return [OK if ok else NO_AVAILABLE_HANDLE for ok in stored]

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._put([(_key(key), value)], config)[0]

    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        return self._put([(_key(key), list(parts))], config)[0]

    def put_batch(self, keys: Sequence[str], values: Sequence, config: ReplicateConfig | None = None) -> int:
        if len(keys) != len(values):
            return INVALID_PARAMS
        return next((r for r in self._put([(_key(k), v) for k, v in zip(keys, values)], config) if r != OK), OK)

    def get(self, key: str) -> bytes:
        return self.get_batch([key])[0]

    def _read(self, keys: Sequence[str], fetch) -> list:
        """The values (None: a miss, or the node could not be read), by ``fetch(store keys)``."""
        if self._client is None:
            return [None] * len(keys)
        try:
            return fetch([_key(k) for k in keys])
        except CrescentError as exc:
            log.warning("read: %s", exc)
            return [None] * len(keys)

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        # (batch_get_bytes: one allocation per value, the bytes themselves)
        return [v if v is not None else b"" for v in self._read(keys, lambda ks: self._client.batch_get_bytes(ks))]

    def get_buffer(self, key: str) -> BufferHandle | None:
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        # (each value read straight into its handle)
        return self._read(keys, lambda ks: self._client.batch_get(ks, lambda _, size: BufferHandle(size)))

    def get_size(self, key: str) -> int:
        """The value's size, or OBJECT_NOT_FOUND (reads the value, into a kept buffer: Crescent keeps no
        separate size index)."""
        if self._client is None:
            return INTERNAL_ERROR
        slab = self._slabs.take()
        try:
            (v,) = self._client.batch_get([_key(key)], slab.alloc)
        except CrescentError as exc:
            return error_code(exc)
        finally:
            self._slabs.give(slab)
        return len(v) if v is not None else OBJECT_NOT_FOUND

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if self._client is None:
            return [-1] * len(keys)
        try:
            return [int(x) for x in self._client.exists([_key(k) for k in keys])]
        except CrescentError:
            return [-1] * len(keys)

    def remove(self, key: str) -> int:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        if self._client is None:
            return [INTERNAL_ERROR] * len(keys)
        ks = [_key(k) for k in keys]
        try:
            held = self._client.exists(ks)
            self._client.delete([k for k, h in zip(ks, held) if h])
        except CrescentError as exc:
            return [error_code(exc)] * len(keys)
        return [OK if h else OBJECT_NOT_FOUND for h in held]

    def remove_all(self) -> int:
        """Removes every object (on every store node of a conductor's cluster); returns how many, or -1."""
        if self._client is None:
            return -1
        try:
            return self._client.clear()
        except CrescentError as exc:
            log.warning("remove_all: %s", exc)
            return -1

    # ---- zero copy ------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (buffer_ptr, size)):
            return INVALID_PARAMS
        if not buffer_ptr or size <= 0:
            return INVALID_PARAMS
        with self._lock:
            for start, n in self._buffers.items():
                if start < buffer_ptr + size and buffer_ptr < start + n and (start, n) != (buffer_ptr, size):
                    return INVALID_PARAMS  # overlapping another registration
            self._buffers[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            return OK if self._buffers.pop(buffer_ptr, None) is not None else INVALID_PARAMS

    def _view(self, ptr: int, size: int) -> memoryview | None:
        """A writable view of ``size`` bytes at ``ptr``, if they lie inside a registered buffer."""
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (ptr, size)):
            return None
        with self._lock:
            ok = size >= 0 and any(start <= ptr and ptr + size <= start + n for start, n in self._buffers.items())
        if not ok:
            return None
        # NOTE: an empty buffer is writable too (an empty value reads into it: 0 bytes)
        return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B") if size else memoryview(bytearray())

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._view(p, n) for p, n in zip(buffer_ptrs, sizes)]
        out = [INVALID_PARAMS if v is None else OK for v in views]
        todo = [i for i, v in enumerate(views) if v is not None]
        for i, code in zip(todo, self._put([(_key(keys[i]), views[i]) for i in todo], config)):
            out[i] = code
        return out

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Per key: bytes read into its buffer, OBJECT_NOT_FOUND, BUFFER_OVERFLOW (value larger than the
        buffer), INVALID_PARAMS (an unregistered buffer) or an RPC error."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        if self._client is None:
            return [INTERNAL_ERROR] * len(keys)
        views = [self._view(p, n) if _valid_key(k) else None for k, p, n in zip(keys, buffer_ptrs, sizes)]
        out = [INVALID_PARAMS] * len(keys)
        todo = [i for i, v in enumerate(views) if v is not None]
        try:
            got = self._client.batch_get_into([_key(keys[i]) for i in todo], [views[i] for i in todo])
        except InvalidArgumentError:  # a value larger than its buffer: find which, key by key
            got = []
            for i in todo:
                try:
                    got += self._client.batch_get_into([_key(keys[i])], [views[i]])
                except InvalidArgumentError:
                    got.append(BUFFER_OVERFLOW)
                except CrescentError as exc:
                    got.append(error_code(exc))
        except CrescentError as exc:
            got = [error_code(exc)] * len(todo)
        for i, n in zip(todo, got):
            out[i] = OBJECT_NOT_FOUND if n is None else n
        return out


def _key(key: str) -> bytes:
    """Mooncake's keys are strings (its binding refuses other types: so does this one); bytes pass."""
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    raise TypeError(f"a key is a str, got {type(key).__name__}")  # bytes(5) would be five NUL bytes


def _valid_key(key) -> bool:
    try:
        return 0 < len(_key(key)) <= MAX_KEY_BYTES
    except TypeError:
        return False
