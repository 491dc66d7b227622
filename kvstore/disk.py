"""Disk tier: values in one LMDB environment.

Each batch of writes is one LMDB write transaction, so a batch appears whole or
not at all and a committed value survives kill -9 (and power loss with
``sync=True``). Each stored value is prefixed by a 24-byte record header
(xxh3_64 of the value, its size, and the time it was written), so a value that
rots on disk reads as DATA_LOSS, never as wrong bytes, and the index rebuilt at
start knows every size and the write order without reading the values.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator

import lmdb
import xxhash

from kvstore.errors import DataLossError, ResourceExhaustedError

_REC = struct.Struct("<QQd")  # xxh3_64, size, unix time of the write
PAGE = 4096


class DiskTierError(RuntimeError):
    """The disk tier cannot start (unreadable, corrupt or locked LMDB file)."""


def disk_cost(size: int) -> int:
    """Bytes a value of ``size`` is charged on disk: its record rounded up to LMDB pages."""
    return -(-(size + _REC.size + 64) // PAGE) * PAGE


class DiskTier:
    """LMDB-backed tier. Thread-safe: LMDB serialises writers, readers never block."""

    def __init__(self, path: str, capacity_bytes: int, sync: bool = False) -> None:
        os.makedirs(path, exist_ok=True)
        # NOTE: LMDB needs room for its B-tree and free pages beyond the values'
        # own pages: the tier admits values up to 85% of the map size.
        self.capacity_bytes = int(capacity_bytes * 0.85)
        try:
            self.env = lmdb.open(path, map_size=capacity_bytes, subdir=True, max_dbs=1,
                                 sync=sync, metasync=sync, readahead=False, lock=True)
            self.db = self.env.open_db(b"values")
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot open the disk tier at {path}: {exc}") from exc

    def scan(self) -> Iterator[tuple[bytes, int, float]]:
        """Yields ``(key, size, written_at)`` of every stored value (reads headers only).

        Raises:
            DiskTierError: the file is corrupt.
        """
        try:
            with self.env.begin(db=self.db, buffers=True) as txn:
                for key, val in txn.cursor():
                    if len(val) < _REC.size:
                        raise DiskTierError(f"corrupt record under key {bytes(key).hex()}")
                    _, size, ts = _REC.unpack_from(val, 0)
                    if size != len(val) - _REC.size:
                        raise DiskTierError(f"truncated record under key {bytes(key).hex()}")
                    yield bytes(key), size, ts
        except lmdb.Error as exc:
            raise DiskTierError(f"the disk tier is corrupt: {exc}") from exc

    def put_many(self, items: list[tuple[bytes, list[memoryview] | bytes]]) -> None:
        """Writes every ``(key, value parts)`` in one transaction.

        Raises:
            ResourceExhaustedError: the LMDB map is full (nothing of the batch is written).
        """
        now = time.time()
        try:
            with self.env.begin(db=self.db, write=True) as txn:
                for key, parts in items:
                    if isinstance(parts, (bytes, bytearray, memoryview)):
                        parts = [parts]
                    h = xxhash.xxh3_64()
                    size = 0
                    for p in parts:
                        h.update(p)
                        size += len(p)
                    txn.put(key, b"".join([_REC.pack(h.intdigest(), size, now), *parts]))
        except lmdb.MapFullError as exc:
            raise ResourceExhaustedError("the disk tier is full") from exc

    def get(self, key: bytes) -> bytes | None:
        """The value, verified against its checksum; None if absent.

        Raises:
            DataLossError: the stored record is corrupt.
        """
        with self.env.begin(db=self.db, buffers=True) as txn:
            val = txn.get(key)
            if val is None:
                return None
            if len(val) < _REC.size:
                raise DataLossError(f"corrupt disk record for key {key.hex()}")
            digest, size, _ = _REC.unpack_from(val, 0)
            data = bytes(val[_REC.size:])
        if size != len(data) or xxhash.xxh3_64_intdigest(data) != digest:
            raise DataLossError(f"disk record for key {key.hex()} failed its checksum")
        return data

    def delete_many(self, keys: list[bytes]) -> None:
        if not keys:
            return
        with self.env.begin(db=self.db, write=True) as txn:
            for k in keys:
                txn.delete(k)

    def close(self) -> None:
        self.env.close()
