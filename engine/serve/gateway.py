"""`crescent gateway`: an OpenAI-compatible HTTP front door over prefill and decode engines.

POST /v1/completions, POST /v1/chat/completions (``stream: true`` as SSE), POST /v1/responses (and
GET, DELETE /v1/responses/{id}), POST /tokenize, /detokenize, GET /v1/models, /health, /metrics.
Each request: tokenize, route (round-robin,
or the conductor), Prefill on the prefill engine (first token; the prompt's
chunks go to the store), then Generate on the decode engine (loads the chunks,
streams the rest). If the prefill engine fails, the decode engine prefills
locally: the request still completes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import math
import queue
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.beam_search import BeamSearchParams, beam_search
from engine.chat_template import ChatTemplate
from engine.sampling import TokenLogprobs
from engine.serve.openai_protocol import (UINT32_MAX, BadRequest, ParsedRequest, bad_words_ids, check_model, flag,
                                          full_response, logprobs_body, new_id, parse_request, prompt_logprobs_body,
                                          stream_chunk, tag_tail, usage)
from engine.serve.router import ConductorRouter, NoRoute, Rejected, RoundRobinRouter, Router
from engine.serve import reasoning
from engine.serve.responses import ResponseStore, StreamEvents, from_chat, to_chat
from engine.serve.tools import PARSERS, CallStream, extract, tool_call
from engine.tokenizer import load_tokenizer
from kvstore import tls
from kvstore.liveness import ENGINE_MESSAGE_BYTES, channel_options
from kvstore.procs import HTTP_POLL_S, StopSignals, say
from proto.crescent.v1 import engine_pb2 as pb
from proto.crescent.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
POST_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
               "/tokenize": "tokenize", "/detokenize": "detokenize"}
MAX_BODY = 8 << 20
MAX_DISCARD = 64 << 20
"""An over-limit body up to this size is read and dropped, so that its sender gets the 400."""
RETRY_AFTER_S = 1
"""The Retry-After of a 429 or 503."""


def _byte_count(raw: str) -> int | None:
    """A header's byte count (HTTP's ASCII digits: ``"²".isdigit()`` holds, and ``int`` refuses
    it), else None."""
    raw = raw.strip()
    return int(raw) if raw.isascii() and raw.isdigit() else None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes):
    """A request body's JSON; BadRequest for what is not JSON, or is JSON no handler could use:
    nested too deeply, a number of over 4,300 digits (Python's limit on reading an int), a
    string holding an unpaired UTF-16 surrogate (``"\\ud800"``: valid JSON, but no UTF-8
    text, so no prompt, salt or pattern)."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    except ValueError:  # (int's limit on digits)
        raise BadRequest("the body's JSON holds a number too long to read") from None
    if _SURROGATE_ESCAPE.search(raw):  # (only an escape can make one: the UTF-8 decoder refuses them)
        todo = [body]
        while todo:
            v = todo.pop()
            if isinstance(v, dict):
                todo += v.keys()
                todo += v.values()
            elif isinstance(v, list):
                todo += v
            elif isinstance(v, str):
                try:
                    v.encode()
                except UnicodeEncodeError:
                    raise BadRequest("the body's JSON holds a string with an unpaired UTF-16 surrogate "
                                     "(\\ud800-\\udfff)") from None
    return body


class StreamCut(Exception):
    """A stream ended early with an error event (its engine went away, or another prompt of its
    batch was refused)."""


ENGINE_IDLE_S = 300.0
"""An engine's channel closes this long after the longest call on it could have ended."""


class Engines:
    """gRPC channels to the engines, one each, opened on first use.

    The engines named at start (``--prefill``/``--decode``) keep theirs. A channel to any other (an
    engine the conductor routed to) closes once unused for ``idle_s``, with what the gateway learnt of
    that engine's model: an autoscaler's engines come and go at new addresses, and a gateway that runs
    for months kept a channel for every engine it ever called. ``idle_s`` is longer than any call's
    deadline, so a channel it closes has no call in flight.
    """

    def __init__(self, addresses: list[str], idle_s: float, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._pinned = tuple(dict.fromkeys(addresses))
        self.idle_s = idle_s
        self._clock = clock
        self._open = {a: self._connect(a) for a in self._pinned}
        self._used: dict[str, float] = {}
        """When each unpinned engine's channel was last asked for."""
        self._models: dict[str, tuple[frozenset[int], int]] = {}
        self._swept = clock()

    @staticmethod
    def _connect(address: str) -> tuple[grpc.Channel, pb_grpc.EngineStub]:
        # keepalive: a Prefill on a cut engine fails in seconds (then the decode engine prefills)
        ch = tls.channel(address, channel_options(ENGINE_MESSAGE_BYTES))
        return ch, pb_grpc.EngineStub(ch)

    def __getitem__(self, address: str) -> pb_grpc.EngineStub:
        with self._lock:
            now = self._clock()
            entry = self._open.get(address)
            if entry is None:
                entry = self._open[address] = self._connect(address)
            if address not in self._pinned:
                self._used[address] = now
            idle = self._idle(now)
        for ch in idle:
            ch.close()
        return entry[1]

    def _idle(self, now: float) -> list[grpc.Channel]:
        """Takes out the unpinned channels unused for ``idle_s`` (looked for at most every ``idle_s / 8``)."""
        if now - self._swept < self.idle_s / 8:
            return []
        self._swept = now
        gone = [a for a, t in self._used.items() if now - t > self.idle_s]
        for a in gone:
            del self._used[a]
            self._models.pop(a, None)
        return [self._open.pop(a)[0] for a in gone]

    def addresses(self) -> list[str]:
        """The engines a channel is open to now."""
        with self._lock:
            return list(self._open)

    def model(self, address: str, timeout_s: float) -> tuple[frozenset[int], int, int]:
        """An engine's EOS tokens, context length and vocabulary size (its Health), asked once while its
        channel is open."""
        with self._lock:
            known = self._models.get(address)
        if known is None:
            h = self[address].Health(pb.EngineHealthRequest(), timeout=timeout_s)
            known = frozenset(h.eos_token_ids), h.max_model_len, h.vocab_size
            with self._lock:
                if address in self._open:
                    self._models[address] = known
        return known

    def health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """Whether each engine named at start answers its Health."""
        out = {}
        for a in self._pinned:
            try:
                out[a] = self[a].Health(pb.EngineHealthRequest(), timeout=timeout_s).serving
            except grpc.RpcError:
                out[a] = False
        return out

    def close(self) -> None:
        with self._lock:
            channels = [ch for ch, _ in self._open.values()]
            self._open.clear()
            self._used.clear()
        for ch in channels:
            ch.close()


@dataclasses.dataclass(frozen=True)
class ApiTenant:
    name: str
    cache_salt: str | None
    """The salt of this tenant's chunk keys: its name, the group it shares prefixes with, or None
    (``"share_prefixes": true``: the shared namespace)."""
    max_concurrent: int | None = None
    """Its quota of requests in flight at once (over it: 429 with Retry-After); None: no bound."""


def load_api_keys(path: str) -> dict[bytes, ApiTenant]:
    """SHA-256 of each OpenAI-style API key → its tenant, from ``--api-keys FILE``:
    ``{"keys": [{"key": "sk-...", "tenant": "acme"}, {"key": ..., "tenant": "b", "cache_salt": "group1"},
    {"key": ..., "tenant": "c", "share_prefixes": true, "max_concurrent": 4}]}``.

    Raises:
        ValueError: the file cannot be read or is malformed.
    """
    from kvstore.auth import json_entries

    entries = json_entries(path, "--api-keys", "keys", '{"key", "tenant"}')
    out, limits = {}, {}
    for i, e in enumerate(entries):
        key, tenant = (e.get("key"), e.get("tenant")) if isinstance(e, dict) else (None, None)
        if not isinstance(key, str) or len(key) < 8 or not isinstance(tenant, str) or not tenant:
            raise ValueError(f"--api-keys {path}: keys[{i}] needs a key of at least 8 characters and a tenant")
        salt = None if e.get("share_prefixes") else e.get("cache_salt", tenant)
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"--api-keys {path}: keys[{i}].cache_salt must be a string")
        limit = e.get("max_concurrent")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"--api-keys {path}: keys[{i}].max_concurrent must be a positive integer")
        if limit != limits.setdefault(tenant, limit):
            raise ValueError(f"--api-keys {path}: the keys of tenant {tenant!r} give different max_concurrent")
        out[hashlib.sha256(key.encode()).digest()] = ApiTenant(tenant, salt, limit)
    return out


class Gateway:
    def __init__(self, model: str, prefill: list[str], decode: list[str], served_model_name: str | None = None,
                 router: Router | None = None, timeout_s: float = 600.0, conductor: str | None = None,
                 etcd: str | None = None, api_keys: dict[bytes, ApiTenant] | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None,
                 trust_request_chat_template: bool = False, max_stored_responses: int = 1000,
                 max_stored_responses_mib: int = 256) -> None:
        self.model_name = served_model_name or model
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_parser!r} (known: {', '.join(PARSERS)})")
        self.tool_parser = tool_parser
        """Reads tool calls out of a model's text for ``tool_choice: auto`` (engine/serve/tools.py)."""
        if reasoning_parser is not None and reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {', '.join(reasoning.PARSERS)})")
        self.reasoning_parser = reasoning_parser
        """Splits a chat choice's reasoning from its content (engine/serve/reasoning.py)."""
        self.trust_request_chat_template = trust_request_chat_template
        """Chat requests may bring their own ``chat_template`` (Jinja code the gateway runs, sandboxed)."""
        if max_stored_responses_mib <= 0:
            raise ValueError(f"--max-stored-responses-mib must be > 0, got {max_stored_responses_mib}")
        self.responses = ResponseStore(max_stored_responses, max_stored_responses_mib << 20)
        """The Responses API's kept responses (``previous_response_id``, ``GET /v1/responses/{id}``)."""
        self._compile = functools.lru_cache(maxsize=32)(
            lambda source: ChatTemplate(source, self.tokenizer.special_tokens))
        """Requests' templates, compiled; the 32 used last are kept (thread-safe: handlers share it)."""
        self.api_keys = api_keys
        """With ``--api-keys``: who may call, and the tenant (and cache salt) each key stands for."""
        self._inflight: dict[str, int] = {}
        self._inflight_lock = threading.Lock()
        self.tokenizer = load_tokenizer(model, require=True)  # the gateway's whole job is text to token ids
        static = RoundRobinRouter(prefill, decode) if decode else None
        if router is None and (conductor or etcd):
            router = ConductorRouter(conductor, fallback=static, etcd=etcd)
        if router is None and static is None:
            raise ValueError("give --decode engines, or a --conductor to find them")
        self.router = router or static
        self.timeout_s = timeout_s
        self.engines = Engines(prefill + decode, idle_s=timeout_s + ENGINE_IDLE_S)
        self.registry = CollectorRegistry()
        self.m_requests = Counter("crescent_gateway_requests", "Requests by endpoint and status",
                                  ["endpoint", "status"], registry=self.registry)
        self.m_ttft = Histogram("crescent_gateway_ttft_seconds", "Request arrival to first token (end to end)",
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                registry=self.registry)
        self.m_itl = Histogram("crescent_gateway_itl_seconds", "Time between tokens (end to end)",
                               buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                               registry=self.registry)
        self.m_tokens = Counter("crescent_gateway_tokens", "Tokens by kind", ["kind"], registry=self.registry)
        self.m_fallbacks = Counter("crescent_gateway_prefill_fallbacks",
                                   "Requests whose prefill failed and were prefilled by the decode engine",
                                   registry=self.registry)
        self.m_refused = Counter("crescent_gateway_connections_refused",
                                 "Connections refused past --max-connections (a 503 with Retry-After)",
                                 registry=self.registry)
        self.m_open = Gauge("crescent_gateway_open_connections", "Client connections served now (a thread each)",
                            registry=self.registry)
        self.m_decode_retries = Counter("crescent_gateway_decode_retries",
                                        "Decode calls refused or unreachable before their first token (UNAVAILABLE: "
                                        "an engine stopping or gone), sent again to another decode engine",
                                        registry=self.registry)
        Gauge("crescent_gateway_engine_channels", "Engines the gateway holds a gRPC channel to: those named at "
              "start, and those called in the last 15 min (the longest call's 10 min, plus 5)",
              registry=self.registry).set_function(lambda: len(self.engines.addresses()))
        Gauge("crescent_gateway_stored_responses", "Responses API responses kept (previous_response_id)",
              registry=self.registry).set_function(lambda: len(self.responses))

    def admit(self, tenant: ApiTenant) -> bool:
        """Counts one more request of ``tenant`` in flight, unless that passes its quota."""
        with self._inflight_lock:
            n = self._inflight.get(tenant.name, 0)
            if tenant.max_concurrent is not None and n >= tenant.max_concurrent:
                return False
            self._inflight[tenant.name] = n + 1
            return True

    def done(self, tenant: ApiTenant) -> None:
        with self._inflight_lock:
            self._inflight[tenant.name] -= 1

    def tenant(self, authorization: str | None) -> ApiTenant | None:
        """The tenant of a request's ``Authorization: Bearer <key>`` (None: no such key)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hashlib.sha256(authorization[len("Bearer "):].strip().encode()).digest()
        return next((t for d, t in self.api_keys.items() if hmac.compare_digest(d, digest)), None)

    def health(self) -> tuple[bool, dict]:
        """Serving when every known engine answers (with a conductor: when it knows a live engine)."""
        if isinstance(self.router, ConductorRouter):
            from kvstore.conductor.membership import MemberKind
            from kvstore.errors import CrescentError

            try:
                members = self.router.client.members()
            except CrescentError as exc:
                return False, {"conductor": f"unreachable: {exc}"}
            engines = {m.address: m.state for m in members if m.kind is not MemberKind.STORE}
            return any(st not in ("dead", "draining") for st in engines.values()), {"engines": engines}
        engines = self.engines.health()
        return bool(engines) and all(engines.values()), {"engines": engines}

    def with_reasoning(self, req: ParsedRequest, prompt: list[int]) -> ParsedRequest:
        """A chat request, with a reasoning parser: whether its prompt opened the reasoning, and
        then where its grammar (if any) starts: after ``</think>``."""
        if not req.chat or self.reasoning_parser is None:
            return req
        is_open = reasoning.opened(self.tokenizer.decode(prompt[-16:]))
        after = tuple(self.tokenizer.encode(reasoning.END, add_bos=False)) if is_open and req.structured else ()
        return dataclasses.replace(req, reasoning=is_open, structured_after=after)

    def encode(self, req: ParsedRequest) -> list[int]:
        if req.tools is not None and req.tools.choice == "auto" and self.tool_parser is None:
            raise BadRequest("tool_choice \"auto\" (the default with tools) needs a gateway started with "
                             "--tool-call-parser; \"required\", a named function and \"none\" work without",
                             "tool_choice")
        if req.chat:
            template = self._request_template(req.chat_template) if req.chat_template is not None else None
            try:
                ids = self.tokenizer.encode_chat(req.prompt, template=template, **req.template_kwargs)
            except ValueError as exc:  # the template refused the conversation
                raise BadRequest(str(exc), "messages" if template is None else "chat_template") from None
            if req.add_special_tokens and self.tokenizer.bos_token_id is not None:
                ids = [self.tokenizer.bos_token_id, *ids]  # (as vLLM: before the template's own, if any)
        elif isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt, add_bos=req.add_special_tokens)
        else:
            ids = list(req.prompt)
        return ids[-req.truncate_prompt_tokens:] if req.truncate_prompt_tokens else ids

    def _request_template(self, source: str) -> ChatTemplate:
        """A request's ``chat_template``, compiled (kept for the next requests that bring it)."""
        if not self.trust_request_chat_template:
            raise BadRequest("this gateway renders chats with the model's own template; it takes one from the "
                             "request only when started with --trust-request-chat-template (a template is code "
                             "it runs)", "chat_template")
        try:
            return self._compile(source)
        except ValueError as exc:
            raise BadRequest(str(exc), "chat_template") from None

    def tokenize(self, body) -> dict:
        """vLLM's ``/tokenize``: a ``prompt`` (``add_special_tokens``, default true: with BOS) or
        chat ``messages`` (rendered as a chat request's) to ``{"count", "tokens"}``, and
        ``token_strs`` with ``return_token_strs``."""
        check_model(body, self.model_name)
        if "messages" in body:
            ids = self.encode(parse_request(body, True, self.model_name))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("'prompt' must be a string (or give chat 'messages')", "prompt")
            ids = self.tokenizer.encode(text, add_bos=flag(body, "add_special_tokens", True))
        out = {"count": len(ids), "tokens": ids}
        if flag(body, "return_token_strs", False):
            out["token_strs"] = [self.tokenizer.decode([i]) for i in ids]
        return out

    def detokenize(self, body) -> dict:
        """vLLM's ``/detokenize``: ``tokens`` to ``{"prompt": text}``."""
        check_model(body, self.model_name)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX
                                                for t in ids):
            raise BadRequest("'tokens' must be a list of token ids", "tokens")
        try:
            return {"prompt": self.tokenizer.decode(ids)}
        except Exception as exc:  # noqa: BLE001 - the tokenizer's own refusal (an id beyond its vocabulary)
            raise BadRequest(f"cannot decode these tokens: {exc}", "tokens") from None

    def _sampling(self, req: ParsedRequest, choice: int = 0, prompt_logprobs: bool = True) -> pb.SamplingOptions:
        """Choice ``i`` of a seeded request draws from ``seed + i`` (in 64 bits); ``prompt_logprobs``:
        ask for the prompt's (``req.prompt_logprobs``) too."""
        seed = req.seed if req.seed is None or not choice else (req.seed + choice + (1 << 63)) % (1 << 64) - (1 << 63)
        # (max_tokens 0, with echo: the prompt is computed for its logprobs and the token is dropped)
        return pb.SamplingOptions(max_tokens=max(1, req.max_tokens), temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, min_p=req.min_p, stop_token_ids=req.stop_token_ids,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                                  logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
                                  bad_words=[pb.TokenIds(ids=w) for w in bad_words_ids(req.bad_words, self.tokenizer)],
                                  structured=pb.StructuredOutput(kind=req.structured[0], spec=req.structured[1],
                                                                 after=req.structured_after)
                                  if req.structured else None,
                                  seed=seed, ignore_eos=req.ignore_eos, no_speculation=not req.speculative,
                                  logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs if prompt_logprobs else None,
                                  priority=req.priority)

    def _prefill(self, prefill: str, prompt: list[int], req: ParsedRequest, sampling, replicate: bool):
        """The prefill engine's response, or None when it failed (the decode engine prefills)."""
        try:
            return self.engines[prefill].Prefill(
                pb.PrefillRequest(prompt_token_ids=prompt, sampling=sampling, cache_salt=req.cache_salt,
                                  replicate=replicate), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(exc.details()) from None
            log.warning("prefill on %s failed (%s): the decode engine prefills locally", prefill, exc.code().name)
            self.m_fallbacks.inc()
            return None

    @staticmethod
    def _pieces(call, cached: int | None) -> Iterator[Piece]:
        """A decode engine's stream as ``Piece``s (``cached``: the prefill engine's count, if any)."""
        try:
            for msg in call:
                yield Piece(list(msg.token_ids), msg.finish_reason if msg.finished else None,
                            cached if cached is not None else msg.num_cached_tokens, _logprobs(msg.logprobs),
                            _logprobs(msg.prompt_logprobs))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(exc.details()) from None
            raise
        finally:
            call.cancel()  # the client went away mid-stream: the decode engine frees the pages

    def generate(self, prompt: list[int], req: ParsedRequest, calls: dict | None = None) \
            -> Iterator[tuple[int, Piece]]:
        """Yields ``(choice, Piece)`` as the engines send them, for ``req.n`` choices. The prefill
        engine computes the prompt once (and choice 0's first token); every other choice is a decode
        stream of its own that loads the prompt's KV the prefill engine saved and samples its own
        first token. ``calls`` gets each choice's decode call, for the caller to cancel one that is
        done (a stop string); closing the generator cancels them all."""
        if req.beam_search:
            yield from self._beam_search(prompt, req)
            return
        route = self.router.route(prompt, req.cache_salt, req.max_tokens)
        sampling = self._sampling(req)
        first, keys, cached, shared_plps = None, [], None, None
        r = self._prefill(route.prefill, prompt, req, sampling, route.replicate) if route.prefill is not None else None
        if r is not None:
            first, keys, cached = r.first_token, list(r.chunk_keys), r.num_cached_tokens
            shared_plps = _logprobs(r.prompt_logprobs)
            yield 0, Piece([first], r.finish_reason if r.finished else None, cached,
                           _logprobs([r.first_logprobs] if r.HasField("first_logprobs") else []), shared_plps)
            sampling.ClearField("prompt_logprobs")  # computed: the decode engine reuses the prompt's KV
        calls = {} if calls is None else calls
        ended = threading.Event()  # set as the request ends: no choice's stream is sent again after it
        # (the prompt's logprobs from the prefill engine if it ran, else each choice's own)
        samplings = {0: sampling} | {i: self._sampling(req, i, r is None) for i in range(1, req.n)}
        try:
            if r is None or not r.finished:
                calls[0] = self._decode(route.decode, prompt, req, sampling, first, keys)
            for i in range(1, req.n):
                calls[i] = self._decode(route.decode, prompt, req, samplings[i], None, keys)
            streams = {i: (lambda i=i: self._retried(calls, i, ended, route.decode, prompt, req, samplings[i],
                                                     None if i else first, keys, None if i else cached))
                       for i in list(calls)}
            if req.n == 1:
                if 0 in streams:
                    yield from ((0, p) for p in streams[0]())
                return
            yield from self._merged(streams, shared_plps)
        finally:
            ended.set()
            for call in list(calls.values()):
                call.cancel()

    def _retried(self, calls: dict, i: int, ended: threading.Event, decode: str, prompt: list[int],
                 req: ParsedRequest, sampling, first, keys, cached) -> Iterator[Piece]:
        """Choice ``i``'s decode stream; a call that fails UNAVAILABLE before its first piece (its engine
        is stopping, so it refuses new calls, or is gone) is sent again to another decode engine the
        router names, up to MAX_DECODE_RETRIES times: nothing of that choice reached the client yet.
        ``calls[i]`` is always the choice's current call (the caller cancels them as the request ends)."""
        tried = {decode}
        while True:
            pieces = self._pieces(calls[i], cached)
            try:
                head = next(pieces)
            except StopIteration:
                return
            except grpc.RpcError as exc:
                other = None if ended.is_set() else \
                    self._replacement(exc, decode, prompt, req, tried, f"decode of choice {i} before its first token")
                if other is None:
                    raise
                decode = other
                calls[i] = self._decode(other, prompt, req, sampling, first, keys)
                if ended.is_set():  # the request ended meanwhile (its calls were cancelled before this one)
                    calls[i].cancel()
                continue
            yield head
            yield from pieces
            return

    def _replacement(self, exc: grpc.RpcError, address: str, prompt: list[int], req: ParsedRequest,
                     tried: set[str], what: str) -> str | None:
        """Another decode engine for ``what``, which ``exc`` ended on ``address``: added to ``tried``,
        logged and counted; or None: not UNAVAILABLE, MAX_DECODE_RETRIES reached, or none the router
        picks (a few asks) is new."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or len(tried) > MAX_DECODE_RETRIES:
            return None
        for _ in range(3):
            try:
                route = self.router.route(prompt, req.cache_salt, req.max_tokens)
            except (NoRoute, Rejected):
                return None
            if route.decode not in tried:
                log.warning("%s on %s failed (%s): sent to %s", what, address, exc.code().name, route.decode)
                self.m_decode_retries.inc()
                tried.add(route.decode)
                return route.decode
        return None

    def _beam_search(self, prompt: list[int], req: ParsedRequest) -> Iterator[tuple[int, Piece]]:
        """vLLM's ``use_beam_search``: the ``req.n`` best hypotheses of a beam search of width
        ``req.n`` (engine/beam_search.py), each a choice, all sent once the search is done. Each step
        is a one-token request per live beam, all in flight at once, on the prefill engine the
        router picked (whose prefix cache holds all but the beam's last tokens), or its decode
        engine (when there is no prefill engine, or from the step the prefill engine failed). The
        search's state is the gateway's, and nothing reaches the client before it ends: a decode
        engine that refuses a step (UNAVAILABLE) is replaced by another, as ``_retried`` does."""
        route = self.router.route(prompt, req.cache_salt, req.max_tokens)
        targets = [("prefill", route.prefill)] if route.prefill is not None else []
        targets.append(("decode", route.decode))
        tried = {route.decode}

        def on_target(call):
            """``call(role, address)`` on the prefill engine, or, from the first time it fails, the decode
            engine (another one, ``_replacement``, when that one is unavailable)."""
            while True:
                role, address = targets[0]
                try:
                    return call(role, address)
                except grpc.RpcError as exc:
                    if len(targets) == 1:
                        other = self._replacement(exc, address, prompt, req, tried, "beam search")
                        if other is None:
                            raise
                        targets[0] = ("decode", other)
                        continue
                    log.warning("beam search on %s failed (%s): its decode engine goes on", address, exc.code().name)
                    self.m_fallbacks.inc()
                    targets.pop(0)

        eos, context, vocab = on_target(lambda role, address: self._model(address))
        if len(prompt) + req.max_tokens > context:
            raise BadRequest(f"prompt ({len(prompt)}) + max_tokens ({req.max_tokens}) exceeds the model's context "
                             f"of {context}", "max_tokens")
        if any(t >= vocab for t in req.stop_token_ids):  # (the search applies them here: no engine sees them)
            raise BadRequest(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        params = BeamSearchParams(beam_width=req.n, max_tokens=req.max_tokens, length_penalty=req.length_penalty,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=req.logprobs)
        first: dict = {}  # the first step's cached tokens and prompt logprobs

        def expand(beams: list[list[int]]) -> list[TokenLogprobs]:
            sampling = pb.SamplingOptions(max_tokens=1, ignore_eos=True, logprobs=params.alternatives,
                                          no_speculation=True, priority=req.priority,
                                          prompt_logprobs=None if first else req.prompt_logprobs)
            got = on_target(lambda role, address: self._first_tokens(role, address, [prompt + b for b in beams], req,
                                                                     sampling))
            if not first:
                first.update(cached=got[0][1], plps=got[0][2])
            return [lp for lp, _, _ in got]

        for i, b in enumerate(beam_search(expand, params, eos)):
            yield i, Piece(b.tokens, b.finish_reason, first["cached"], b.logprobs, first["plps"])

    def _model(self, address: str) -> tuple[frozenset[int], int, int]:
        """An engine's EOS tokens, context length and vocabulary size."""
        return self.engines.model(address, self.timeout_s)

    def _first_tokens(self, role: str, address: str, prompts: list[list[int]], req: ParsedRequest, sampling) \
            -> list[tuple[TokenLogprobs, int, list[TokenLogprobs]]]:
        """The first token's logprobs after each of ``prompts`` (one-token requests, all in flight at
        once), with the prompt tokens the engine did not compute and the prompt's logprobs (if asked)."""
        stub = self.engines[address]
        if role == "prefill":
            calls = [stub.Prefill.future(pb.PrefillRequest(prompt_token_ids=p, sampling=sampling,
                                                           cache_salt=req.cache_salt), timeout=self.timeout_s)
                     for p in prompts]
        else:
            calls = [stub.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling, cache_salt=req.cache_salt),
                                   timeout=self.timeout_s) for p in prompts]
        try:
            out = []
            for call in calls:
                if role == "prefill":
                    try:
                        r = call.result()
                    except grpc.RpcError as exc:
                        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            raise BadRequest(exc.details()) from None
                        raise
                    out.append((_logprobs([r.first_logprobs])[0], r.num_cached_tokens, _logprobs(r.prompt_logprobs)))
                else:
                    pieces = list(self._pieces(call, None))
                    out.append((next(lp for pc in pieces for lp in pc.logprobs), pieces[-1].cached,
                                pieces[0].prompt_logprobs))
            return out
        finally:
            for call in calls:
                call.cancel()

    def _decode(self, decode: str, prompt: list[int], req: ParsedRequest, sampling, first, keys):
        return self.engines[decode].Generate(
            pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, cache_salt=req.cache_salt,
                               first_token=first, chunk_keys=keys), timeout=self.timeout_s)

    @staticmethod
    def _merged(streams: dict, shared_plps) -> Iterator[tuple[int, Piece]]:
        """Several choices' streams (``streams[i]()``), each read by a thread of its own, as their pieces
        arrive. Choices after the first get the prompt's logprobs the prefill engine computed (if any) in
        their first piece; an error in any stream ends them all."""
        started = set()
        for i, item in merge_threads(streams):
            if i not in started and i and shared_plps is not None:
                item = item._replace(prompt_logprobs=shared_plps)
            started.add(i)
            yield i, item


def merge_threads(sources: dict) -> Iterator[tuple]:
    """``(key, item)`` of every ``sources[key]()`` iterator, each read by a thread of its own, as the
    items arrive. A source cancelled (a gRPC CANCELLED: a choice ended by a stop string) just ends;
    any other error ends them all, raised here. Closing this stops every thread after its next item
    (its iterator closed in its own thread)."""
    q: queue.Queue = queue.Queue()
    stopping = threading.Event()

    def pump(key, source) -> None:
        it = source()
        try:
            for item in it:
                q.put((key, item))
                if stopping.is_set():
                    break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                q.put((key, exc))
                return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer's thread
            q.put((key, exc))
            return
        finally:
            it.close()
        q.put((key, None))

    for key, source in sources.items():
        threading.Thread(target=pump, args=(key, source), name=f"gateway-merge-{key}", daemon=True).start()
    live = len(sources)
    try:
        while live:
            key, item = q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield key, item
    finally:
        stopping.set()


class Piece(NamedTuple):
    """What one engine message brings: new token ids, the finish reason (None: more to come), the
    prompt tokens the engine did not recompute, the new tokens' logprobs (with ``req.logprobs``)
    and, in the first message with ``req.prompt_logprobs``, those of prompt tokens 1..n-1."""

    ids: list[int]
    reason: str | None
    cached: int
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs]


def _logprobs(msgs) -> list[TokenLogprobs]:
    return [TokenLogprobs(m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs)), m.rank or None) for m in msgs]


class _Detok:
    """Incremental detokenization that never emits half a character, with stop strings: the text
    ends where the first of them begins (``include_stop``: where it ends). With ``min_tokens``, as
    in vLLM, a stop string counts only once more tokens are out and only where it ends in their text.

    Each push decodes only the tokens since the last text it took, beside the ones before them (the
    way vLLM's detokenizer does: a decoder's handling of where a sequence starts, such as a leading
    space, then falls on text already taken), and looks for stop strings only where a new one can
    end: a push costs the same at the 10th token and the 10,000th."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, min_tokens: int = 0,
                 skip_special: bool = True) -> None:
        self.tok, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.min_tokens = min_tokens
        self.skip_special = skip_special  # (vLLM's skip_special_tokens: special tokens' text left out)
        self.floor: int | None = None if min_tokens else 0  # a stop string must end past this in the text
        self.ids: list[int] = []
        self.decoded = ""  # the text of ids[:read] (no trailing partial character, unless final)
        self.prefix = self.read = 0  # ids[prefix:read]: the tokens whose text the last decode took
        self.scanned = 0  # no stop string ends within decoded[:scanned] (past the floor)
        self.end: int | None = None  # where the first stop string cuts the text
        self.sent = 0
        self.stopped = False

    def _decode(self, final: bool) -> None:
        """Takes the text of the tokens not decoded yet (held back while it ends in half a character)."""
        if self.read == len(self.ids):
            return
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip_special)
        text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip_special)
        if len(text) > len(before) and (final or not text.endswith("\ufffd")):
            self.decoded += text[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def _cut(self) -> None:
        """Looks for the first stop string where a new one can end (sets ``stopped`` and ``end``)."""
        if not self.stop or self.stopped:
            return
        if self.floor is None:
            if len(self.ids) <= self.min_tokens:
                return
            self.floor = len(self.tok.decode(self.ids[:self.min_tokens],
                                             skip_special_tokens=self.skip_special).rstrip("\ufffd"))
        text = self.decoded
        found = [(i, -len(s)) for s in self.stop
                 if (i := text.find(s, max(0, self.floor - len(s) + 1, self.scanned - len(s) + 1))) >= 0]
        self.scanned = len(text)
        if found:
            i, neg_len = min(found)  # the earliest; of those starting there, the longest
            self.stopped, self.end = True, i - neg_len if self.include_stop else i

    def push(self, ids: list[int], final: bool = False) -> str:
        """New text since the last push; holds back a trailing partial character unless ``final``."""
        self.ids += ids
        if self.stopped:
            return ""
        self._decode(final)
        self._cut()
        end = len(self.decoded) if self.end is None else self.end
        if not self.stopped and not final:
            # hold back a tail that may begin a stop string: the next tokens may complete it
            end -= max((tag_tail(self.decoded, s, end) for s in self.stop), default=0)
        out = self.decoded[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def text(self) -> str:
        """All the text, cut at the first stop string."""
        if not self.stopped:
            self._decode(final=True)
            self._cut()
        return self.decoded if self.end is None else self.decoded[:self.end]


IDLE_S = 60.0
"""How long a client connection may stay silent: waiting for its next request (kept alive), in the
middle of a request's headers or body, or not reading what the gateway sends. Then it is closed, and
its thread freed. A request's head (its line and headers) must also be whole within IDLE_S of the
connection's last answer (or its start): a client that trickles a byte now and then is cut off too."""
HEAD_CHECK_S = 0.5
MAX_DECODE_RETRIES = 2
MAX_CONNECTIONS = 1024


class _Connections:
    """The gateway's open client connections, each either inside a request (its head read, its answer not
    yet sent whole) or waiting for one's head, which is due within ``idle_s`` of the wait's start. A
    thread shuts down (``SHUT_RDWR``) a connection still waiting past that, which ends its handler's
    blocked read: a client that trickles its head a byte at a time is never silent for the socket's
    timeout. A drain waits for the busy ones and closes the waiting ones."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._due: dict = {}  # socket: when its request head is due (None: inside a request)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-head-deadlines", daemon=True)
        self._thread.start()

    def waiting(self, sock) -> None:
        """``sock`` (new, or done with a request) waits for a request's head."""
        with self._changed:
            self._due[sock] = time.monotonic() + self.idle_s
            self._changed.notify_all()

    def busy(self, sock) -> None:
        """``sock``'s request head is read: a drain lets its request finish."""
        with self._changed:
            if sock in self._due:
                self._due[sock] = None
                self._changed.notify_all()

    def closed(self, sock) -> None:
        with self._changed:
            self._due.pop(sock, None)
            self._changed.notify_all()

    def num_busy(self) -> int:
        with self._changed:
            return sum(due is None for due in self._due.values())

    @staticmethod
    def _shut(socks) -> None:
        import socket

        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(HEAD_CHECK_S):
            now = time.monotonic()
            with self._changed:
                late = [s for s, due in self._due.items() if due is not None and due <= now]
                for s in late:
                    self._due[s] = math.inf  # (shut once; it stays until its handler ends)
            self._shut(late)

    def drain(self, grace_s: float, cut: threading.Event) -> int:
        """Closes each waiting connection (now, or as its request ends) until none is busy, ``grace_s``
        passes or ``cut`` is set; returns how many were still busy then."""
        deadline = time.monotonic() + grace_s
        while True:
            with self._changed:
                idle = [s for s, due in self._due.items() if due is not None]
                busy = len(self._due) - len(idle)
            self._shut(idle)  # (its thread waits for a next request, or is reading one's head)
            left = deadline - time.monotonic()
            if not busy or left <= 0 or cut.is_set():
                return busy
            with self._changed:
                self._changed.wait(min(left, 0.2))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def make_handler(gw: Gateway, idle_s: float = IDLE_S):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        default_request_version = "HTTP/1.0"
        """What a request line too garbled to name its version is answered in: http.server's
        HTTP/0.9 wrote the error's body alone, with no status line or headers."""
        server_version = "crescent-gateway"
        timeout = idle_s  # (http.server sets it on the socket; a silent connection ends in TimeoutError)

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status in (429, 503):  # overloaded or an engine away: worth retrying shortly
                self.send_header("Retry-After", str(RETRY_AFTER_S))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self._headers_sent = True
            self.wfile.write(data)

        def _discard(self, length: int) -> None:
            self.close_connection = True  # what is left of the body must never be parsed as a request
            left = min(length, MAX_DISCARD)
            while left > 0 and (piece := self.rfile.read1(min(left, 1 << 20))):
                left -= len(piece)

        def _error(self, status: int, message: str, etype: str = "invalid_request_error", **kw) -> None:
            self._json(status, {"error": {"message": message, "type": etype, "param": kw.get("param"),
                                          "code": kw.get("code")}})

        def send_error(self, code, message=None, explain=None):
            """http.server's own errors (a malformed request line or header, an unsupported
            method) in the OpenAI error shape too, on a connection then closed."""
            self.close_connection = True
            if self.command == "HEAD":
                super().send_error(code, message, explain)
                return
            self._error(code, message or HTTPStatus(code).phrase,  # (505: the client's HTTP version)
                        "invalid_request_error" if code < 500 or code == 505 else "server_error")

        def parse_request(self) -> bool:
            """http.server's parsing, and then the framing it lets through that a proxy in front may read
            another way (so that the body's end, and so the next request, would differ between the two):
            Content-Length headers that disagree; a line that is no header (``Content-Length : 5``,
            white space before the colon: http.server ends the headers there and takes the rest for
            the body); a header folded over lines. Each is a 400 on a connection then closed (RFC 9112,
            5.1, 5.2 and 6.3)."""
            ok = super().parse_request()
            self.server.connections.busy(self.connection)  # the head is read (whole or not)
            if not ok:
                return False
            msg = self.headers
            lengths = {v.strip() for v in msg.get_all("Content-Length", ())}
            if len(lengths) > 1:
                self.send_error(400, f"several Content-Length headers that disagree: {sorted(lengths)}")
                return False
            if msg.defects or msg.get_payload():
                self.send_error(400, "a malformed header line (no field name and colon)")
                return False
            if any("\n" in v for v in msg.values()):
                self.send_error(400, "a header folded over lines (obs-fold)")
                return False
            return True

        def setup(self) -> None:
            super().setup()
            self.server.connections.waiting(self.connection)

        def finish(self) -> None:
            self.server.connections.closed(self.connection)
            super().finish()

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            finally:
                self.server.connections.waiting(self.connection)
                if self.server.draining:
                    self.close_connection = True  # (stopping: no next request on this connection)

        def handle_expect_100(self) -> bool:
            """``Expect: 100-continue`` (curl sends it with bodies over 1 MiB): a body this gateway would
            only drop (over MAX_BODY, or to a path it does not serve) is refused before the client
            sends it, on a connection then closed; otherwise the client is told to go on."""
            raw = self.headers.get("Content-Length", "")
            too_big = (_byte_count(raw) or 0) > MAX_BODY
            if self.command == "POST" and (too_big or self.path not in POST_ROUTES):
                endpoint = POST_ROUTES.get(self.path, "completions")
                self.close_connection = True
                if too_big:
                    gw.m_requests.labels(endpoint, "400").inc()
                    self._error(400, f"request body over {MAX_BODY} bytes")
                else:
                    self._error(404, f"no route for POST {self.path}", code="not_found")
                return False
            return super().handle_expect_100()

        def _no_body(self) -> None:
            """For a request that takes no body (GET, DELETE, the unsupported methods): one sent anyway
            is read and dropped (up to MAX_DISCARD) and the connection closed after the answer, so that
            it is never parsed as the connection's next request (a request smuggled behind this one,
            e.g. through a proxy that shares connections)."""
            length = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True  # a length not known without parsing it: nothing more is read
            elif length is not None and length.strip() != "0":
                if (n := _byte_count(length)) is not None:
                    self._discard(n)
                self.close_connection = True

        def _not_allowed(self):
            self._no_body()
            self._error(405, f"{self.command} is not supported here (GET /v1/models, /v1/responses/{{id}}, /health, "
                             "/metrics; POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, "
                             "/detokenize; DELETE /v1/responses/{id})", code="method_not_allowed")

        do_PUT = do_PATCH = do_OPTIONS = _not_allowed

        def do_HEAD(self):
            """A 405 as for the other methods, without a body (a HEAD response has none)."""
            self._no_body()
            self.send_error(405, "HEAD is not supported here")

        def _body_length(self) -> int:
            """The request's Content-Length; BadRequest (the connection then closed) when the
            body's length cannot be known: chunked, missing with a body, or not a number."""
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                raise BadRequest("send the body with a Content-Length (chunked transfer encoding is not supported)")
            raw = self.headers.get("Content-Length")
            length = _byte_count(raw) if raw is not None else 0
            if length is None:
                self.close_connection = True
                raise BadRequest(f"Content-Length must be a byte count, got {raw!r}")
            return length

        def _authorized(self, endpoint: str):
            """(ok, tenant): with API keys, the caller's tenant, or a 401 already sent (ok False)."""
            if gw.api_keys is None:
                return True, None
            tenant = gw.tenant(self.headers.get("Authorization"))
            if tenant is None:
                gw.m_requests.labels(endpoint, "401").inc()
                self._error(401, "a valid API key is needed (Authorization: Bearer <key>)", code="invalid_api_key")
                return False, None
            return True, tenant

        @staticmethod
        def _responses_request(body):
            """A Responses request with ``store`` settled (kept: unless it says false, when this
            gateway keeps any); BadRequest for a ``previous_response_id`` that is not a string."""
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            prev = body.get("previous_response_id")
            if prev is not None and not isinstance(prev, str):
                raise BadRequest("'previous_response_id' must be a response id", "previous_response_id")
            store = body.get("store")
            return {**body, "store": gw.responses.max_items > 0 and (store is None or store is True)}

        def _stored_response(self, method: str, rid: str) -> None:
            """GET or DELETE /v1/responses/{rid}: a kept response, read back or forgotten; 404 when
            it is not kept (or not the caller's)."""
            endpoint = "responses_get" if method == "GET" else "responses_delete"
            ok, tenant = self._authorized(endpoint)
            if not ok:
                return
            owner = _owner(tenant)
            if method == "GET":
                resp = gw.responses.get(rid, owner)
                found = resp is not None
            else:
                found = gw.responses.delete(rid, owner)
                resp = {"id": rid, "object": "response", "deleted": True}
            if not found:
                gw.m_requests.labels(endpoint, "404").inc()
                return self._error(404, f"no stored response {rid!r}", code="not_found")
            gw.m_requests.labels(endpoint, "200").inc()
            self._json(200, resp)

        def do_DELETE(self):
            rid = _stored_id(self.path)
            if rid is not None:
                self._no_body()
                return self._stored_response("DELETE", rid)
            self._not_allowed()

        def do_GET(self):
            self._no_body()
            rid = _stored_id(self.path)
            if rid is not None:
                return self._stored_response("GET", rid)
            if self.path == "/v1/models":
                if gw.api_keys is not None and gw.tenant(self.headers.get("Authorization")) is None:
                    return self._error(401, "a valid API key is needed (Authorization: Bearer <key>)",
                                       code="invalid_api_key")
                self._json(200, {"object": "list", "data": [{"id": gw.model_name, "object": "model",
                                                             "created": 0, "owned_by": "crescent"}]})
            elif self.path == "/health":
                ok, detail = gw.health()
                self._json(200 if ok else 503, {"status": "ok" if ok else "degraded", **detail})
            elif self.path == "/metrics":
                data = generate_latest(gw.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            else:
                self._error(404, f"no route for GET {self.path}", code="not_found")

        def do_POST(self):
            self._headers_sent = False
            chat = self.path == "/v1/chat/completions"
            endpoint = POST_ROUTES.get(self.path, "completions")
            try:
                length = self._body_length()
                if length > MAX_BODY or self.path not in POST_ROUTES:
                    # NOTE: read first: a client still sending its body would not see an early answer,
                    # and a body left unread would be parsed as the connection's next request
                    self._discard(length)
                    if length > MAX_BODY:
                        raise BadRequest(f"request body over {MAX_BODY} bytes")
                    return self._error(404, f"no route for POST {self.path}", code="not_found")
                body = self.rfile.read(length)
                ok, tenant = self._authorized(endpoint)  # before the body's contents: no model name to a stranger
                if not ok:
                    return
                body = parse_body(body)
                if endpoint in ("tokenize", "detokenize"):
                    self._json(200, gw.tokenize(body) if endpoint == "tokenize" else gw.detokenize(body))
                    gw.m_requests.labels(endpoint, "200").inc()
                    return
                asked = body
                if endpoint == "responses":  # (a chat request written another way: answered as one)
                    asked = self._responses_request(body)
                    prev = asked.get("previous_response_id")
                    history = gw.responses.history(prev, _owner(tenant)) if prev is not None else None
                    body, chat = to_chat(body, history, gw.responses.max_items > 0), True
                req = parse_request(body, chat, gw.model_name)
                if tenant is not None:
                    # the tenant's cache salt comes from its key, never from the request
                    req = dataclasses.replace(req, cache_salt=tenant.cache_salt)
                    if not gw.admit(tenant):
                        gw.m_requests.labels(endpoint, "429").inc()
                        return self._error(429, f"tenant {tenant.name!r} has {tenant.max_concurrent} requests in "
                                                "flight, its quota; retry shortly", "rate_limit_error",
                                           code="tenant_quota_exceeded")
                try:
                    # (a completions batch: a request per prompt, answered together)
                    subs = [(gw.with_reasoning(r, p), p) for r in req.split() for p in (gw.encode(r),)]
                    if req.stream:
                        events = StreamEvents(asked, gw.reasoning_parser is not None) if endpoint == "responses" \
                            else None
                        self._stream(subs, events)
                        if events is not None and asked["store"]:
                            gw.responses.put(events.resp, _owner(tenant), asked.get("previous_response_id"), asked)
                    elif endpoint == "responses":
                        resp = from_chat(asked, self._complete(subs), gw.reasoning_parser is not None)
                        if asked["store"]:
                            gw.responses.put(resp, _owner(tenant), asked.get("previous_response_id"), asked)
                        self._json(200, resp)
                    else:
                        self._json(200, self._complete(subs))
                finally:
                    if tenant is not None:
                        gw.done(tenant)
                gw.m_requests.labels(endpoint, "200").inc()
            except BadRequest as exc:
                gw.m_requests.labels(endpoint, "400").inc()
                self._json(400, exc.body())
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # gone, or silent for idle_s
                gw.m_requests.labels(endpoint, "disconnected").inc()
                self.close_connection = True
            except Rejected as exc:
                gw.m_requests.labels(endpoint, "429").inc()
                self._error(429, f"rejected by the scheduler: {exc}", "server_overloaded", code="slo_rejected")
            except NoRoute as exc:
                gw.m_requests.labels(endpoint, "503").inc()
                self._error(503, str(exc), "server_error")
            except grpc.RpcError as exc:
                gw.m_requests.labels(endpoint, "503").inc()
                self._error(503, f"engine unavailable: {exc.code().name}", "server_error")
            except StreamCut:
                gw.m_requests.labels(endpoint, "503").inc()
                self.close_connection = True
            except Exception:  # noqa: BLE001 - a bug must still answer, never drop the connection
                log.exception("request to %s failed", self.path)
                gw.m_requests.labels(endpoint, "500").inc()
                self.close_connection = True
                if not self._headers_sent:
                    self._error(500, "internal error (logged by the gateway)", "server_error")

        def _run(self, req, prompt, calls: dict):
            """``gw.generate``'s ``(0, choice, Piece)``s, checked, with the TTFT and ITL metrics."""
            t0 = time.perf_counter()
            last: dict[int, float] = {}  # when each choice's last tokens came
            seen: set[int] = set()
            for i, piece in gw.generate(prompt, req, calls):
                ids = piece.ids
                if req.logprobs is not None and len(piece.logprobs) != len(ids):  # (an engine that dropped them)
                    raise RuntimeError(f"the engine sent {len(piece.logprobs)} logprobs for {len(ids)} tokens")
                if req.prompt_logprobs is not None and i not in seen and len(piece.prompt_logprobs) != len(prompt) - 1:
                    raise RuntimeError(f"the engine sent {len(piece.prompt_logprobs)} prompt logprobs for "
                                       f"{len(prompt)} prompt tokens")
                seen.add(i)
                if req.max_tokens == 0:  # echo alone: the prompt's logprobs, no completion
                    yield 0, i, piece._replace(ids=[], reason="length", logprobs=[])
                    continue
                now = time.perf_counter()
                if ids:
                    if i not in last:
                        if not last:
                            gw.m_ttft.observe(now - t0)
                    else:
                        gw.m_itl.observe((now - last[i]) / len(ids))
                    last[i] = now
                yield 0, i, piece

        def _echo(self, req, prompt: list[int], prompt_logprobs: list) -> tuple[str, list[int], list]:
            """What an echoed prompt adds before the completion: its text, its tokens and their
            logprobs (None for the first); nothing without ``echo``."""
            if not req.echo:
                return "", [], []
            text = req.prompt if isinstance(req.prompt, str) and not req.truncate_prompt_tokens \
                else gw.tokenizer.decode(prompt)
            if req.logprobs is not None and (req.prompt_logprobs or 0) > req.logprobs:  # (more were asked for the
                prompt_logprobs = [lp._replace(top=lp.top[:req.logprobs]) for lp in prompt_logprobs]  # body)
            return text, list(prompt), [None, *prompt_logprobs]

        def _choices(self, subs: list, choices: list[_Choice]):
            """Yields ``(choice, its _Choice, the Piece, the new text)`` until every choice has ended
            (its stream done, or a stop string found: then its decode call is cancelled). ``subs``:
            ``(request, prompt)`` of each prompt of a batch (one otherwise); prompt ``b``'s choice
            ``i`` is ``choices[b * n + i]``."""
            n = subs[0][0].n
            calls: list[dict] = [{} for _ in subs]
            shown: dict[int, list] = {}  # prompt b's prompt_logprobs body, made once for its n choices
            gen = self._run(*subs[0], calls[0]) if len(subs) == 1 else self._batch(subs, calls)
            try:
                for b, i, piece in gen:
                    req, prompt = subs[b]
                    c = choices[b * n + i]
                    if c.reason:  # (a choice ended by a stop string: what its stream still had)
                        continue
                    if c.echo is None:
                        c.echo = self._echo(req, prompt, piece.prompt_logprobs)
                        if req.show_prompt_logprobs is not None:
                            if b not in shown:
                                shown[b] = prompt_logprobs_body(prompt, piece.prompt_logprobs,
                                                                req.show_prompt_logprobs, gw.tokenizer)
                            c.prompt_logprobs = shown[b]
                    c.cached = piece.cached
                    c.n += len(piece.ids)
                    c.lps += piece.logprobs
                    text = c.detok.push(piece.ids, final=piece.reason is not None)
                    c.reason = "stop" if c.detok.stopped else piece.reason
                    yield b * n + i, c, piece, text
                    if c.detok.stopped and i in calls[b]:
                        calls[b][i].cancel()
                    if all(c.reason for c in choices):
                        break
            finally:
                gen.close()
            for c in choices:
                c.reason = c.reason or "length"
            gw.m_tokens.labels("prompt").inc(sum(len(p) for _, p in subs))
            gw.m_tokens.labels("cached").inc(sum(c.cached for c in choices[::n]))
            gw.m_tokens.labels("completion").inc(sum(c.n for c in choices))

        def _batch(self, subs: list, calls: list[dict]):
            """The ``(prompt, choice, Piece)``s of a batch's requests, each run by a thread of its own,
            as they arrive; an error in any ends them all (closing this cancels every call)."""
            try:
                for b, (_, i, piece) in merge_threads({b: (lambda b=b: self._run(*subs[b], calls[b]))
                                                       for b in range(len(subs))}):
                    yield b, i, piece
            finally:
                for cs in calls:
                    for call in list(cs.values()):
                        call.cancel()

        def _complete(self, subs: list) -> dict:
            """The whole answer (a chat or completions response body)."""
            req = subs[0][0]
            run = subs
            if req.best_of:  # best_of candidates, with their logprobs, each
                run = [(dataclasses.replace(r, n=r.best_of, logprobs=r.logprobs or 0), p) for r, p in subs]
            choices = self._new_choices(run)
            gen = self._choices(run, choices)
            try:
                for _ in gen:
                    pass
            finally:
                gen.close()  # (an error: a batch's other prompts' calls cancelled now)
            answered = choices
            if req.best_of:  # each prompt's n likeliest per token, likeliest first
                answered = [c for b in range(len(subs)) for c in sorted(
                    choices[b * req.best_of:(b + 1) * req.best_of], key=_mean_logprob, reverse=True)[:req.n]]
            body, thoughts = [], []
            for c in answered:
                text = c.detok.text()
                echo = c.echo or ("", [], [])
                # (logprobs of every token generated, the one completing a stop string included, as vLLM)
                lps = logprobs_body(req, echo[1] + c.detok.ids, echo[2] + c.lps, gw.tokenizer)
                if req.reasoning is not None:
                    thought, text = reasoning.split(text, req.reasoning)
                    thoughts.append(thought if req.include_reasoning else None)
                if req.chat_echo:  # (vLLM's chat echo: the final assistant message's text first)
                    text = req.chat_echo + (text or "")
                if req.tools is not None:
                    content, calls = self._tool_calls(req, c, text or "")
                    body.append((content or None if req.reasoning is not None else content, c.reason, lps, calls))
                else:
                    body.append((echo[0] + text if text is not None else None, c.reason, lps))
            # (the usage counts every candidate's tokens: they were all generated)
            resp = full_response(req, new_id(req.chat), gw.model_name, body, self._usage(run, choices),
                                 thoughts if req.reasoning is not None else None,
                                 [c.prompt_logprobs for c in answered] if req.show_prompt_logprobs is not None
                                 else None)
            if req.return_token_ids:  # (vLLM's: the prompt's ids, per choice for completions, and each choice's)
                if req.chat:
                    resp["prompt_token_ids"] = list(subs[0][1])
                for k, (out, c) in enumerate(zip(resp["choices"], answered)):
                    if not req.chat:
                        out["prompt_token_ids"] = list(subs[k // req.n][1])
                    out["token_ids"] = list(c.detok.ids)
            return resp

        @staticmethod
        def _new_choices(subs: list) -> list[_Choice]:
            req = subs[0][0]
            return [_Choice(gw.tokenizer, req.stop, req.include_stop_str_in_output, req.min_tokens,
                            req.skip_special_tokens) for _ in range(req.n * len(subs))]

        @staticmethod
        def _usage(subs: list, choices: list[_Choice]) -> dict:
            """Every prompt's tokens, every choice's, the cached ones of each prompt's first choice, and
            (with a reasoning parser) the choices' reasoning tokens."""
            req = subs[0][0]
            thought = None if req.reasoning is None else sum(
                reasoning.reasoning_tokens(c.detok.ids, gw.tokenizer.decode, req.reasoning) for c in choices)
            return usage(sum(len(p) for _, p in subs), sum(c.n for c in choices),
                         sum(c.cached for c in choices[::req.n]), thought)

        @staticmethod
        def _tool_calls(req, c: _Choice, text: str) -> tuple[str | None, list[dict]]:
            """A chat choice's content and tool calls; a choice that called tools (not a named
            function, which was asked for) ends with ``tool_calls``."""
            content, calls = extract(req.tools, text, gw.tool_parser)
            if calls and req.tools.choice != "named" and c.reason == "stop":
                c.reason = "tool_calls"
            return content, calls

        def _send_chunk(self, payload: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            self.wfile.flush()

        def _stream(self, subs: list, events: StreamEvents | None = None):
            """Streams the answer as server-sent chat/completions chunks, or through ``events``
            (the Responses API's)."""
            req = subs[0][0]
            rid = new_id(req.chat)
            choices = self._new_choices(subs)
            for c in choices if req.reasoning is not None else ():
                c.think = reasoning.Stream(req.reasoning)
            gen = self._choices(subs, choices)
            try:
                first_item = next(gen)  # errors before the first token still answer 400/503
            except BaseException:
                gen.close()  # (a batch's other prompts: their calls cancelled now)
                raise
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._headers_sent = True

            def emit(obj):
                if req.continuous_usage and obj.get("choices"):  # (vLLM's: the usage so far, in every chunk)
                    obj["usage"] = self._usage(subs, choices)
                if req.return_token_ids and obj.get("choices"):  # (vLLM's: the tokens since the choice's last chunk)
                    out = obj["choices"][0]
                    c = choices[out["index"]]
                    if c.ids_sent < 0:
                        prompt = list(subs[out["index"] // req.n][1])
                        if req.chat:
                            obj["prompt_token_ids"] = prompt
                        else:
                            out["prompt_token_ids"] = prompt
                        c.ids_sent = 0
                    out["token_ids"] = c.detok.ids[c.ids_sent:]
                    c.ids_sent = len(c.detok.ids)
                if events is None:
                    self._send_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")
                else:
                    for event in events.chunk(obj):
                        self._send_chunk(event)

            for event in events.start() if events is not None else ():
                self._send_chunk(event)

            # tool calls stream as they are written: a call's first delta names it, the next ones carry its
            # arguments in pieces. A named function's arguments are the text, each piece with its logprobs;
            # "required" calls are the text's JSON list; with "auto" the content streams up to where a call may
            # begin (the parser says) and the calls are read from there on. Their logprobs come at the end
            tools = req.tools.choice if req.tools is not None and req.tools.choice != "none" else None
            try:
                for i, c, piece, text in _chain(first_item, gen):
                    if c.first and req.chat_echo:  # (vLLM's chat echo: the final assistant message's text first)
                        emit(stream_chunk(req, rid, gw.model_name, req.chat_echo, None, first=True, index=i))
                        c.first = False
                    if c.think is not None:  # the reasoning streams first; what follows is the content
                        thought, text = c.think.feed(text, final=c.reason is not None)
                        if thought and req.include_reasoning:
                            emit(stream_chunk(req, rid, gw.model_name, None, None, first=c.first, index=i,
                                              reasoning=thought))
                            c.first = False
                    if tools in ("auto", "required"):
                        c.held[1].extend(piece.logprobs)
                        if c.calls is None:
                            c.calls = CallStream(req.tools, gw.tool_parser)
                        out, calls = c.calls.feed(text, final=c.reason is not None)
                        if c.calls.sent and c.reason == "stop":
                            c.reason = "tool_calls"
                        if out or calls or c.reason or c.first:
                            emit(stream_chunk(req, rid, gw.model_name, out or None, c.reason, first=c.first,
                                              index=i, tool_calls=calls,
                                              logprobs=logprobs_body(req, c.detok.ids, c.held[1], gw.tokenizer)
                                              if c.reason else None))
                            c.first = False
                        continue
                    if tools == "named":  # the text is the call's arguments: they stream as they come
                        c.held[0].extend(piece.ids)
                        c.held[1].extend(piece.logprobs)
                        if text or c.reason:
                            opening = not c.called
                            call = tool_call(req.tools.name, text) if opening else {"function": {"arguments": text}}
                            emit(stream_chunk(req, rid, gw.model_name, None, c.reason, first=c.first, index=i,
                                              tool_calls=[call] if text or opening else None,
                                              logprobs=logprobs_body(req, c.held[0], c.held[1], gw.tokenizer)))
                            c.held, c.first, c.called = [[], []], False, True
                        continue
                    if c.first:  # the echoed prompt goes first, in the choice's first chunk
                        c.held = [list(c.echo[1]), list(c.echo[2])]
                    c.held[0].extend(piece.ids)
                    c.held[1].extend(piece.logprobs)
                    if c.first:
                        text = c.echo[0] + text
                    if text or c.reason or c.first:
                        body = logprobs_body(req, c.held[0], c.held[1], gw.tokenizer, c.offset)
                        if body is not None and not req.chat and c.held[0]:
                            c.offset = body["text_offset"][-1] + len(body["tokens"][-1])
                        c.held = [[], []]
                        emit(stream_chunk(req, rid, gw.model_name, text, c.reason, first=c.first, logprobs=body,
                                          index=i))
                        c.first = False
                if req.include_usage:
                    emit(stream_chunk(req, rid, gw.model_name, None, None,
                                      use=self._usage(subs, choices)))
            except (grpc.RpcError, BadRequest, Rejected, NoRoute) as exc:
                # mid-stream (the engine went away; or, in a batch, another prompt was refused after this
                # one's tokens went out): say so in the stream, end it
                if isinstance(exc, grpc.RpcError):
                    err = {"message": f"engine unavailable mid-stream: {exc.code().name}; retry the request",
                           "type": "server_error", "param": None, "code": "engine_unavailable"}
                elif isinstance(exc, BadRequest):
                    err = exc.body()["error"]
                else:
                    err = {"message": str(exc), "type": "server_error", "param": None,
                           "code": "slo_rejected" if isinstance(exc, Rejected) else None}
                if events is None:
                    emit({"error": err})
                else:
                    for event in events.error(err):
                        self._send_chunk(event)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                raise StreamCut(err["message"]) from None
            else:
                for event in events.end() if events is not None else [b"data: [DONE]\n\n"]:
                    self._send_chunk(event)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            finally:
                gen.close()
    return Handler


class _Choice:
    """One choice of a request as the gateway assembles it."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, min_tokens: int = 0,
                 skip_special: bool = True) -> None:
        self.detok = _Detok(tokenizer, stop, include_stop, min_tokens, skip_special)
        self.reason: str | None = None  # set once it has ended
        self.n = 0  # tokens generated
        self.cached = 0
        self.lps: list = []  # the tokens' logprobs
        self.echo: tuple | None = None  # (text, tokens, logprobs) of the echoed prompt
        self.prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, where asked for
        self.first = True  # no chunk sent yet (streaming)
        self.held: list[list] = [[], []]  # tokens and logprobs not in a chunk yet
        self.offset = 0  # text offset of the next chunk's first token
        self.called = False  # a named function's call was opened (streaming)
        self.think = None  # streamed, with a reasoning parser: the reasoning.Stream splitting the text
        self.calls: CallStream | None = None  # streamed, "required" or "auto" tool calls
        self.ids_sent = -1  # streamed, with return_token_ids: generated tokens sent (-1: the prompt's not yet)


def _stored_id(path: str) -> str | None:
    """The id of ``/v1/responses/{id}`` (a query string aside), or None for any other path."""
    path = path.split("?", 1)[0]
    rest = path.removeprefix("/v1/responses/")
    return rest if rest != path and rest and "/" not in rest else None


def _owner(tenant) -> str | None:
    """Whose kept responses a request reaches: its tenant's (everyone's without API keys)."""
    return tenant.name if tenant is not None else None


def _mean_logprob(c: _Choice) -> float:
    """A choice's log-probability per generated token (OpenAI's ``best_of`` ranking)."""
    return sum(lp.logprob for lp in c.lps) / len(c.lps) if c.lps else float("-inf")


def _chain(first, rest):
    yield first
    yield from rest


class _HttpServer(ThreadingHTTPServer):
    """A client that drops its connection (reset while the next request is awaited, a broken pipe)
    is logged in one line at debug level, not with a traceback on stderr. At most ``max_connections``
    are served at once (a thread each): one more is answered 503 with Retry-After (over HTTPS, whose
    handshake has not begun, closed) and closed at once, without a thread."""

    max_connections = MAX_CONNECTIONS
    idle_s = IDLE_S
    on_refused = None  # called for each connection refused (a metric)

    def server_activate(self) -> None:
        super().server_activate()
        self.num_open = 0
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self._open_lock:
            full = self.num_open >= self.max_connections
            if not full:
                self.num_open += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # (a thread of its own)
        except BaseException:
            self._closed_one()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed_one()

    def _closed_one(self) -> None:
        with self._open_lock:
            self.num_open -= 1

    def _refuse(self, request) -> None:
        if self.on_refused is not None:
            self.on_refused()
        if not isinstance(self, _HttpsServer):
            body = json.dumps({"error": {"message": f"the gateway serves {self.max_connections} connections at "
                                                    "once: retry shortly", "type": "server_error", "param": None,
                                         "code": "too_many_connections"}}).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\nRetry-After: %d\r\nConnection: close\r\n\r\n%s"
                                % (len(body), RETRY_AFTER_S, body))
            except OSError:
                pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("gateway: connection from %s dropped: %s", client_address, exc)
        else:
            log.exception("gateway: serving %s failed", client_address)


class _HttpsServer(_HttpServer):
    """HTTPS: each connection's TLS handshake runs on its own thread (a slow or broken client never
    holds up the accept loop) and a failed one just closes that connection."""

    ssl_context = None

    def finish_request(self, request, client_address):
        try:
            # (for a handshake, Python's ssl takes the socket's timeout as a deadline for the whole of
            # it: a client that trickles its ClientHello is cut off too)
            request.settimeout(self.idle_s)
            request = self.ssl_context.wrap_socket(request, server_side=True)
            request.settimeout(None)
        except OSError as exc:  # ssl.SSLError included: plaintext, a wrong CA, a dropped connection
            log.debug("gateway: TLS handshake with %s failed: %s", client_address, exc)
            return
        try:
            super().finish_request(request, client_address)
        finally:
            try:
                request.close()
            except OSError:
                pass


def https_context(cert: str, key: str):
    """The gateway's server ``ssl.SSLContext`` (TLS 1.2+) from a certificate chain and key (PEM).

    Raises:
        ValueError: a file is missing or not a matching certificate and key.
    """
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--https-cert {cert} / --https-key {key}: {getattr(exc, 'strerror', None) or exc}") from None
    return ctx


class GatewayServer:
    def __init__(self, gw: Gateway, listen: str, ssl_context=None, idle_s: float = IDLE_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {max_connections}")
        host, _, port = listen.rpartition(":")
        attrs = {"max_connections": max_connections, "on_refused": staticmethod(gw.m_refused.inc), "idle_s": idle_s}
        cls = type("GatewayHttp", (_HttpServer,), attrs)
        if ssl_context is not None:
            cls = type("GatewayHttps", (_HttpsServer,), {"ssl_context": ssl_context, **attrs})
        try:
            self.httpd = cls((host, int(port)), make_handler(gw, idle_s))
        except OSError as exc:
            raise OSError(f"cannot listen on {listen}: {exc.strerror}") from None
        self.httpd.daemon_threads = True
        gw.m_open.set_function(lambda: self.httpd.num_open)
        self.httpd.connections = _Connections(idle_s)
        self.httpd.draining = False
        self.cut = threading.Event()
        """Set: a drain under way ends now (a second SIGTERM)."""
        self.port = self.httpd.server_address[1]
        self.url = f"{'https' if ssl_context is not None else 'http'}://{host}:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": HTTP_POLL_S},
                                        name="gateway", daemon=True)

    def start(self) -> GatewayServer:
        self._thread.start()
        return self

    def stop(self, grace_s: float = 0.0) -> int:
        """Stops taking connections, closes the idle ones, and lets the requests in flight finish for
        up to ``grace_s`` (or until ``cut`` is set), each connection closed after its answer; returns
        how many were still in flight then (their threads end with the process)."""
        self.httpd.draining = True
        self.httpd.shutdown()
        self.httpd.server_close()
        left = self.httpd.connections.drain(grace_s, self.cut)
        self.httpd.connections.stop()
        return left


def serve(gw: Gateway, listen: str, ssl_context=None, idle_s: float = IDLE_S, grace_s: float = 30.0,
          max_connections: int = MAX_CONNECTIONS) -> None:
    srv = GatewayServer(gw, listen, ssl_context, idle_s, max_connections).start()
    stop = StopSignals(on_again=srv.cut.set)
    say(f"crescent gateway serving {gw.model_name} on {srv.url}/v1")
    stop.wait()
    busy = srv.httpd.connections.num_busy()
    say(f"crescent gateway: stopping ({busy} requests in flight: up to {grace_s:g} s for them; a second "
        "signal ends it)" if busy else "crescent gateway: stopping")
    left = srv.stop(grace_s)
    if left:
        say(f"crescent gateway: {left} requests still in flight after {grace_s:g} s: cut off")
