"""Which engines serve a request: round-robin, or the conductor's ``Schedule``."""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from kvstore import tls

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Route:
    prefill: str | None
    """Prefill engine address; None: the decode engine prefills locally."""
    decode: str
    replicate: bool = False
    """Ask the prefill engine to keep the prefix it pulls from other nodes on its own node."""


class Rejected(Exception):
    """The conductor predicts the request would miss its SLO (early rejection)."""


class NoRoute(Exception):
    """No engine can take the request (none registered, or the conductor unreachable)."""


class Router(Protocol):
    def route(self, prompt_ids: list[int], cache_salt: str | None, num_output_tokens: int = 0) -> Route: ...


class RoundRobinRouter:
    """Cycles through the prefill engines and the decode engines independently."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not decode:
            raise ValueError("at least one decode engine is needed")
        self._prefill = itertools.cycle(prefill) if prefill else None
        self._decode = itertools.cycle(decode)
        self._lock = threading.Lock()

    def route(self, prompt_ids: list[int], cache_salt: str | None, num_output_tokens: int = 0) -> Route:
        with self._lock:
            return Route(next(self._prefill) if self._prefill else None, next(self._decode))


class ConductorRouter:
    """Asks the conductor's ``Schedule`` with the prompt's chunk keys.

    The keys need the engines' model fingerprint (it, plus the request's
    tenant salt, gives the namespace): the router reads it once from a
    registered engine's ``Health``. If the conductor cannot be reached, the
    ``fallback`` router (when given) takes over for that request.
    """

    def __init__(self, conductor: str | None, fallback: Router | None = None, timeout_s: float = 5.0,
                 etcd: str | None = None) -> None:
        from kvstore.conductor.client import ConductorClient

        self.client = ConductorClient(conductor, timeout_s=timeout_s, etcd=etcd)
        self.fallback = fallback
        self._fingerprint = None
        self._lock = threading.Lock()

    def _keys(self, prompt_ids: list[int], cache_salt: str | None) -> tuple[list[bytes], int]:
        from kvstore.keys import chunk_keys, make_namespace

        fp = self._engine_fingerprint()
        if fp is None:
            return [], 0
        return chunk_keys(prompt_ids, make_namespace(fp, cache_salt), fp.chunk_tokens), fp.chunk_tokens

    def _engine_fingerprint(self):
        import grpc

        from kvstore.conductor.membership import MemberKind
        from kvstore.keys import ModelFingerprint
        from kvstore.liveness import channel_options
        from proto.crescent.v1 import engine_pb2, engine_pb2_grpc

        with self._lock:
            if self._fingerprint is not None:
                return self._fingerprint
        for m in self.client.members():
            if m.kind in (MemberKind.PREFILL, MemberKind.DECODE) and m.state != "dead":
                try:
                    with tls.channel(m.address, channel_options()) as ch:
                        h = engine_pb2_grpc.EngineStub(ch).Health(engine_pb2.EngineHealthRequest(), timeout=5)
                    fp = ModelFingerprint.decode(h.fingerprint)
                except (grpc.RpcError, ValueError):
                    continue
                with self._lock:
                    self._fingerprint = fp
                return fp
        return None

    def route(self, prompt_ids: list[int], cache_salt: str | None, num_output_tokens: int = 0) -> Route:
        from kvstore.errors import CrescentError

        try:
            keys, chunk_tokens = self._keys(prompt_ids, cache_salt)
            r = self.client.schedule(keys, len(prompt_ids), chunk_tokens=chunk_tokens,
                                     num_output_tokens=num_output_tokens)
        except CrescentError as exc:
            if self.fallback is None:
                raise NoRoute(f"the conductor cannot schedule: {exc}") from None
            log.warning("conductor unavailable (%s): routing without it", exc)
            return self.fallback.route(prompt_ids, cache_salt, num_output_tokens)
        if not r.accepted:
            raise Rejected(r.reject_reason)
        if not r.prefill_address and not r.decode_address:
            raise NoRoute("no engine is registered with the conductor")
        if not r.decode_address:
            if self.fallback is not None:
                # decode engines were configured but none is registered now (e.g. a healed partition:
                # members register again one by one): never send a decode to a prefill-only engine
                log.warning("the conductor knows no decode engine: routing without it")
                return self.fallback.route(prompt_ids, cache_salt, num_output_tokens)
            return Route(None, r.prefill_address)  # no decode pool: the chosen engine does both
        return Route(r.prefill_address or None, r.decode_address, replicate=r.replicate_to is not None)
