"""Which engines serve a request. The conductor's ``Schedule`` fills this interface when configured."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Route:
    prefill: str | None
    """Prefill engine address; None: the decode engine prefills locally."""
    decode: str


class Router(Protocol):
    def route(self, prompt_ids: list[int], cache_salt: str | None) -> Route: ...


class RoundRobinRouter:
    """Cycles through the prefill engines and the decode engines independently."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not decode:
            raise ValueError("at least one decode engine is needed")
        self._prefill = itertools.cycle(prefill) if prefill else None
        self._decode = itertools.cycle(decode)
        self._lock = threading.Lock()

    def route(self, prompt_ids: list[int], cache_salt: str | None) -> Route:
        with self._lock:
            return Route(next(self._prefill) if self._prefill else None, next(self._decode))
