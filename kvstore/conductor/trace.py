"""Mooncake-format request traces (JSONL).

One JSON object per line: ``timestamp`` (ms since the trace's start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: prefix-chained
ids of the prompt's 512-token blocks (equal ids mean a reusable prefix; the
last block may be partial). See tests/data/SOURCES.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in Mooncake's traces."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field(obj: dict, name: str, where: str) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: {name!r} must be an integer >= 0, got {v!r}")
    return v


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """Reads a trace, sorted by timestamp; ``limit`` keeps the first requests.

    Raises:
        ValueError: an unreadable file or a malformed line (named by number).
    """
    out: list[TraceRequest] = []
    try:
        f = open(path)
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    with f:
        for num, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{num}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
            req = TraceRequest(_field(obj, "timestamp", where), _field(obj, "input_length", where),
                               _field(obj, "output_length", where), tuple(ids))
            if req.input_length == 0:
                raise ValueError(f"{where}: 'input_length' must be positive")
            out.append(req)
    if not out:
        raise ValueError(f"the trace {path} holds no requests")
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def infinite_cache_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Fraction of prompt blocks that an unbounded, instantly updated cache would serve.

    A request hits the leading blocks whose ids appeared in any earlier request.
    """
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit += k
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0
