"""`crescent engine prefill|decode|both`: an LLMEngine behind the crescent.v1.Engine gRPC service."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams, TokenLogprobs
from engine.serve.loop import EngineLoop, Handle
from engine.serve.metrics import EngineMetrics
from kvstore import auth, tls
from kvstore.health import HealthStatus, advertised_host
from kvstore.liveness import ENGINE_MESSAGE_BYTES, rpc_server, server_options
from kvstore.metrics import stop_http
from kvstore.procs import StopSignals, say
from proto.crescent.v1 import engine_pb2 as pb
from proto.crescent.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")


def sampling_from_pb(s: pb.SamplingOptions) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens, min_tokens=s.min_tokens, logit_bias=dict(s.logit_bias),
                          allowed_token_ids=tuple(s.allowed_token_ids) or None,
                          bad_words_ids=tuple(tuple(w.ids) for w in s.bad_words),
                          structured=(s.structured.kind, s.structured.spec) if s.HasField("structured") else None,
                          structured_after=tuple(s.structured.after),
                          temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty or 1.0,
                          seed=s.seed if s.HasField("seed") else None,
                          stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          speculative=not s.no_speculation,
                          logprobs=s.logprobs if s.HasField("logprobs") else None,
                          prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                          priority=s.priority)


def logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top], rank=lp.rank or 0)


def _prompt_logprobs(seq, sent: int) -> list[pb.TokenLogprobs]:
    """A stream's prompt logprobs: in its first message (none asked for: none)."""
    return [logprobs_to_pb(lp) for lp in seq.prompt_logprobs[1:]] if seq is not None and not sent else []


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, role: str, engine: LLMEngine, loop: EngineLoop, fetch_timeout_s: float) -> None:
        self.role = role
        self.engine = engine
        self.loop = loop
        self.fetch_timeout_s = fetch_timeout_s
        self.num_local_prefills = 0
        self.agent = None  # a MemberAgent when a conductor is configured

    def _params(self, s: pb.SamplingOptions, context) -> SamplingParams:
        try:
            return sampling_from_pb(s)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _submit(self, context, *args, **kw) -> Handle:
        try:
            h = self.loop.submit(*args, **kw)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: self.loop.abort(h))  # the client went away: free the pages
        return h

    def Prefill(self, request, context):
        if self.role == "decode":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a decode engine")
        params = self._params(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        try:  # (the whole request: the decode engine, the same model, would refuse it after this prefill)
            self.engine.check_context(len(prompt), params.max_tokens)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # (the request's first token only: its minimum length still masks a stop token there)
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(1, params.min_tokens))
        salt = request.cache_salt if request.HasField("cache_salt") else None
        t0 = time.perf_counter()
        h = self._submit(context, prompt, first_params, salt, replicate=request.replicate)
        first = None
        while True:
            kind, val = h.events.get()
            if kind == "token":
                first = val
            elif kind == "done":
                break
            else:
                context.abort(grpc.StatusCode.INTERNAL if kind == "failed" else grpc.StatusCode.INVALID_ARGUMENT, val)
        if first is None:
            context.abort(grpc.StatusCode.CANCELLED, "request aborted")
        seq = h.seq
        elapsed = time.perf_counter() - t0
        if self.agent is not None:
            cached = seq.num_store_tokens + seq.num_local_tokens
            self.agent.record_prefill(len(prompt) - cached, cached, elapsed)
        conn = self.engine.connector
        # NOTE: while saves fail (the store is unreachable) no keys: the decode engine prefills at once
        # instead of waiting its fetch timeout for chunks that will not arrive
        keys = conn.keys(prompt, salt) if conn is not None and conn.saves_reach_store else []
        if params.max_tokens <= 1:
            finished, reason = True, "length"
        elif params.is_stop(first, 1, self.engine.eos):
            finished, reason = True, "stop"
        else:
            finished, reason = False, ""
        lps = logprobs_to_pb(h.logprobs[0]) if h.logprobs else None
        return pb.PrefillResponse(first_token=first, chunk_keys=keys, first_logprobs=lps,
                                  prompt_logprobs=map(logprobs_to_pb, seq.prompt_logprobs[1:]),
                                  num_cached_tokens=seq.num_store_tokens + seq.num_local_tokens,
                                  num_saved_chunks=seq.num_saved_chunks, prefill_s=elapsed,
                                  finished=finished, finish_reason=reason)

    def Generate(self, request, context):
        if self.role == "prefill":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a prefill engine")
        params = self._params(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        try:  # before anything reads the prompt (its chunk keys below), as _submit does again
            self.engine.validate(prompt, params)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        salt = request.cache_salt if request.HasField("cache_salt") else None
        prefix = [request.first_token] if request.HasField("first_token") else None
        if prefix is None:
            self.num_local_prefills += 1
        else:
            first = request.first_token
            vocab = self.engine.model_config.vocab_size
            if first >= vocab:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first_token must be in [0, {vocab})")
            # NOTE: the prefill engine's token may end the request already (as its response says)
            done = "length" if params.max_tokens <= 1 else "stop" if params.is_stop(first, 1, self.engine.eos) else None
            if done:
                yield pb.GenerateResponse(finished=True, finish_reason=done, num_prompt_tokens=len(prompt))
                return
        prefetched, skip = None, 0
        conn = self.engine.connector
        if conn is not None and request.chunk_keys:
            expected = conn.keys(prompt, salt)
            if list(request.chunk_keys) == expected:  # never trust keys that are not this prompt's own
                # NOTE: chunks this engine's own pages already hold are not fetched again
                skip = self.engine.local_prefix_chunks(prompt, salt)
                prefetched = conn.fetch_as_they_arrive(expected[skip:], self.fetch_timeout_s)
        h = self._submit(context, prompt, params, salt, prefix, prefetched, prefetch_skip=skip)
        pending, sent = [], 0  # sent: tokens streamed (h.logprobs has one per token, with logprobs)
        while True:
            kind, val = h.events.get()
            if kind in ("error", "failed"):
                context.abort(grpc.StatusCode.INTERNAL if kind == "failed" else grpc.StatusCode.INVALID_ARGUMENT, val)
            seq = h.seq
            cached = seq.num_store_tokens + seq.num_local_tokens if seq is not None else 0
            if kind == "token":
                pending.append(val)
                if h.events.empty():
                    # (the prompt's logprobs are all computed before its first token is sampled)
                    yield pb.GenerateResponse(token_ids=pending, num_cached_tokens=cached,
                                              num_prompt_tokens=len(prompt),
                                              logprobs=map(logprobs_to_pb, h.logprobs[sent:sent + len(pending)]),
                                              prompt_logprobs=_prompt_logprobs(seq, sent))
                    sent += len(pending)
                    pending = []
            else:
                yield pb.GenerateResponse(token_ids=pending, finished=True, finish_reason=val or "",
                                          num_cached_tokens=cached, num_prompt_tokens=len(prompt),
                                          logprobs=map(logprobs_to_pb, h.logprobs[sent:sent + len(pending)]),
                                          prompt_logprobs=_prompt_logprobs(seq, sent))
                return

    def Health(self, request, context):
        mc = self.engine.model_config
        return pb.EngineHealthResponse(serving=True, role=self.role, model=self.engine.cfg.model,
                                       vocab_size=mc.vocab_size, max_model_len=mc.max_position_embeddings,
                                       fingerprint=self.engine.fingerprint.encode(),
                                       eos_token_ids=sorted(self.engine.eos))

    def Stats(self, request, context):
        eng = self.engine
        st = eng.connector.stats if eng.connector else None
        return pb.EngineStatsResponse(
            role=self.role, num_waiting=len(eng.scheduler.waiting), num_running=len(eng.scheduler.running),
            num_pages=eng.blocks.num_pages, num_free_pages=eng.blocks.num_free,
            chunks_loaded=st.chunks_loaded if st else 0, bytes_loaded=st.bytes_loaded if st else 0,
            chunks_saved=st.chunks_saved if st else 0, bytes_saved=st.bytes_saved if st else 0,
            num_requests=self.loop.num_requests, num_local_prefills=self.num_local_prefills)


class EngineNode:
    def __init__(self, role: str, cfg: EngineConfig, listen: str = "127.0.0.1:0",
                 metrics_port: int | None = None, fetch_timeout_s: float = 2.0,
                 advertise_host: str | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.role = role
        self.engine = LLMEngine(cfg)
        self.metrics = EngineMetrics(role, self.engine)
        self.server, _, rpcs = rpc_server("engine-rpc", server_options(ENGINE_MESSAGE_BYTES),
                                          auth.server_interceptors(auth.table()))
        self.metrics.watch_rpcs(rpcs)
        self.port = tls.add_port(self.server, listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {listen} (address in use or not local)")
        self.host = listen.rpartition(":")[0]
        self.address = f"{advertised_host(self.host, advertise_host)}:{self.port}"
        self._metrics_port = metrics_port
        self._metrics_server = None
        self.agent = self._make_agent(cfg) if cfg.conductor or cfg.etcd else None
        on_step = (lambda: self.agent.report_load(self.engine.load())) if self.agent else None
        self.loop = EngineLoop(self.engine, on_token=self.metrics.on_token, on_finish=self.metrics.on_finish,
                               on_step=on_step, on_step_time=self._on_step_time)
        self.service = EngineService(role, self.engine, self.loop, fetch_timeout_s)
        self.service.agent = self.agent
        pb_grpc.add_EngineServicer_to_server(self.service, self.server)
        self.health = HealthStatus(self.server, "crescent.v1.Engine")

    def _on_step_time(self, seconds: float, prefill_tokens: int) -> None:
        self.metrics.on_step_time(seconds, prefill_tokens)
        if self.agent is not None and prefill_tokens == 0:  # a pure decode step: the conductor's decode model
            self.agent.record_decode(self.engine.last_step_seqs, self.engine.last_step_context_tokens, seconds)

    def _make_agent(self, cfg: EngineConfig):
        """Registers with the conductor as a prefill engine (``both`` too) or a decode engine."""
        from kvstore.client import StoreClient
        from kvstore.conductor.agent import MemberAgent
        from kvstore.conductor.membership import MemberKind
        from kvstore.errors import CrescentError

        store_node = None
        if cfg.store:
            try:
                with StoreClient(cfg.store, timeout_s=10) as c:
                    store_node = c.health()["node_id"]
            except CrescentError:
                pass  # the store is down: register without a co-located node
        runner = self.engine.runner
        conn = self.engine.connector
        kind = MemberKind.DECODE if self.role == "decode" else MemberKind.PREFILL
        return MemberAgent(cfg.conductor or "", f"{self.role}@{self.address}", kind, self.address, etcd=cfg.etcd,
                           store_node=store_node, kv_bytes_per_token=runner.page_bytes // cfg.page_size,
                           namespace=bytes(conn.namespace(None)) if conn else b"", chunk_tokens=cfg.chunk_tokens)

    @property
    def metrics_port(self) -> int | None:
        """The /metrics port once started (with ``metrics_port=0``: the one it got); None without one."""
        return self._metrics_server.server_port if self._metrics_server is not None else None

    def start(self) -> EngineNode:
        self.loop.start()
        self.server.start()
        if self.agent is not None:
            self.agent.start()
        if self._metrics_port is not None:
            self._metrics_server = self.metrics.serve(self._metrics_port, self.host)
        return self

    def stop(self, grace: float = 2.0, cut: threading.Event | None = None) -> None:
        """Leaves the cluster, refuses new calls (UNAVAILABLE) and lets the calls in flight finish for up
        to ``grace`` seconds, or until ``cut`` is set; then cancels what is left and stops."""
        self.health.stop()
        if self.agent is not None:
            self.agent.stop()
        done = self.server.stop(grace)
        if cut is not None:
            while not done.wait(0.2):
                if cut.is_set():
                    self.server.stop(0)  # (the earlier deadline wins: what is left is cancelled now)
                    break
        done.wait()
        self.loop.stop()
        if self._metrics_server is not None:
            stop_http(self._metrics_server)
        self.engine.close()


def serve(role: str, cfg: EngineConfig, listen: str, metrics_port: int | None, fetch_timeout_s: float,
          advertise_host: str | None = None, grace_s: float = 30.0) -> None:
    node = EngineNode(role, cfg, listen, metrics_port, fetch_timeout_s, advertise_host).start()
    cut = threading.Event()
    stop = StopSignals(on_again=cut.set)
    store = f", store {cfg.store}" if cfg.store else ""
    m = f", metrics :{node.metrics_port}" if node.metrics_port is not None else ""
    say(f"crescent engine {role} ({cfg.model}) listening on {node.address}{m}{store}")
    stop.wait()
    say(f"crescent engine {role}: stopping (the calls in flight get up to {grace_s:g} s; a second signal ends it)")
    node.stop(grace_s, cut)
