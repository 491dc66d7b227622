"""Model and engine configuration.

``ModelConfig`` reads a Hugging Face ``config.json`` (Llama, Qwen2, Mistral
layouts, old ``rope_scaling`` and new ``rope_parameters`` spellings) or names a
seeded random preset (``random:tiny|small|medium``). ``EngineConfig`` holds the
engine's own knobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape; field names follow Hugging Face's LlamaConfig."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` or None (plain RoPE)."""
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    name: str = ""
    """Identity used in chunk-key namespaces (a preset name or the folder's basename)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (one of {SUPPORTED_TYPES})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(f"rope type {self.rope_scaling.get('rope_type')!r} is not supported (default, llama3)")

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "") -> ModelConfig:
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type", "default") == "default":
            rope = {}
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        model_type = d.get("model_type", "llama")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            name=name,
        )

    @classmethod
    def from_folder(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ValueError(f"{path} has no config.json (a Hugging Face checkpoint folder is expected)")
        with open(cfg_path) as f:
            d = json.load(f)
        return cls.from_hf_dict(d, name=os.path.basename(os.path.normpath(path)))


# Seeded random models. Vocabularies leave room for the byte tokenizer (256 bytes + BOS/EOS).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    # NOTE: sized so that a 4k-token prefill takes seconds on a 2-core CPU (the
    # prefix-reuse benchmark's baseline), with Llama-3-like GQA and head_dim 128.
    "medium": dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=128),
    # Real models' shapes (their config.json), random weights: GPU benchmarks of the data
    # path at the KV sizes people serve. Cut depth with hf_overrides={"num_hidden_layers": N}.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      max_position_embeddings=8192),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                     rope_theta=1000000.0, max_position_embeddings=32768, attention_bias=True),
}
BYTE_BOS, BYTE_EOS = 256, 257


def preset_config(name: str, overrides: dict | None = None) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset random:{name} (choose from {', '.join('random:' + p for p in PRESETS)})")
    base = dict(model_type="llama", rope_theta=500000.0, bos_token_id=BYTE_BOS, eos_token_id=(BYTE_EOS,),
                name=f"random:{name}")
    return apply_overrides(ModelConfig(**{**base, **PRESETS[name]}), overrides)


def apply_overrides(mc: ModelConfig, overrides: dict | None) -> ModelConfig:
    """``mc`` with fields replaced, vLLM's ``hf_overrides`` convention (e.g. ``{"num_hidden_layers": 8}``).

    The overrides join the model's name; ``model_identity`` puts them in its chunk keys'
    namespace, so a cut model never reads a full one's KV.

    Raises:
        ValueError: an unknown field, or a value of the wrong type.
    """
    if not overrides:
        return mc
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"name", "model_type"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"hf_overrides: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    overrides = {k: tuple(v) if k == "eos_token_id" and isinstance(v, list) else v for k, v in overrides.items()}
    for k, v in overrides.items():
        want = type(getattr(mc, k))
        if want in (int, float, bool, str) and not (isinstance(v, want) or (want is float and type(v) is int)) \
                or (want is int and isinstance(v, bool)):
            raise ValueError(f"hf_overrides: {k} must be {want.__name__}, got {v!r}")
        if want is int and k != "bos_token_id" and v <= 0:
            raise ValueError(f"hf_overrides: {k} must be positive, got {v}")
    tag = json.dumps(overrides, sort_keys=True, separators=(",", ":"))
    return dataclasses.replace(mc, **overrides, name=f"{mc.name}{tag}")


@dataclass
class EngineConfig:
    """Knobs of one engine (``LLM(...)`` and ``crescent engine``)."""

    model: str = "random:tiny"
    """A Hugging Face checkpoint folder, or a random preset: ``random:tiny|small|medium``, or
    ``random:llama3-8b|qwen2-7b`` (real shapes)."""
    hf_overrides: dict | None = None
    """Model config fields to replace, as JSON (vLLM's convention), e.g. ``{"num_hidden_layers": 8}``."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights/KV dtype; auto is float32 on CPU, bfloat16 on CUDA."""
    device: str = "auto"
    """``cpu``, ``cuda`` or auto."""
    seed: int = 0
    """Seed of random presets' weights."""
    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int = 0
    """KV pages in the pool; 0 sizes it from kv_cache_memory."""
    kv_cache_memory: int = field(default=1 << 30, metadata={"size": True})
    """Bytes for the KV pool when num_pages is 0."""
    chunk_size: int = 512
    """Most prompt tokens one sequence prefills in one step (chunked prefill)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes first, then prefill chunks)."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    enforce_eager: bool = False
    """Launch decode steps kernel by kernel instead of replaying CUDA graphs captured at start
    (CUDA only; graphs cover batches up to max_num_seqs, sequences up to the model's
    max_position_embeddings)."""
    async_scheduling: bool = False
    """Overlap the host's work with the device's: schedule and launch the next step before the
    tokens of the one running are back on the host (they are fed to it on the device), and
    report each step's tokens one step late. Decodes, prompt chunks and admissions alike; a
    step that could preempt, proposes drafts, or has nothing left to launch waits for the tokens
    first. A sequence that stops on a stop token has one extra row computed and thrown away."""
    enable_prefix_caching: bool = True
    """Share full pages between sequences with a common prefix (local prefix cache)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """fcfs: requests in arrival order, the newest running one preempted when pages run out.
    priority (vLLM's): by each request's ``priority`` (lower first), then arrival; waiting requests
    are admitted in that order, running ones get the step's budget in it, and the last in it is
    preempted first."""
    store: str | None = None
    """Store node address host:port; None runs without the store."""
    conductor: str | None = None
    """Conductor address host:port: the engine registers and reports its load, and reads and
    writes chunks across the cluster (ClusterClient, preferring the ``store`` node)."""
    etcd: str | None = None
    """etcd endpoints host:port[,host:port...] ($CRESCENT_ETCD) where conductor replicas register: with it
    the conductor addresses come from there (--conductor may then be left out)."""
    chunk_tokens: int = 256
    """Tokens per stored chunk (a multiple of page_size)."""
    tenant_salt: str | None = None
    """Isolates this engine's chunks from other tenants' (None shares them)."""
    save_to_store: bool = True
    """Save newly computed full chunks to the store."""
    load_from_store: bool = True
    """Load hit prefixes from the store."""
    store_load_batch: int = 8
    """Chunks fetched per batch of a pipelined load (the next batch is fetched while this one
    lands); the staging pool, allocated at start, holds two batches (pinned on CUDA)."""
    store_save_buffers: int = 16
    """Chunks on their way to the store at once (host buffers made at start, pinned on CUDA);
    when all are taken for 5 s, the engine skips saving rather than wait."""
    chunk_check: Literal["auto", "xxh3", "wsum"] = "auto"
    """Payload check of the chunks this engine saves (docs/keys.md): wsum computes on the GPU
    beside its copies, xxh3 is fastest on a CPU; auto picks wsum on CUDA, xxh3 on CPU.
    Loads check whatever a chunk carries."""
    store_transport: Literal["auto", "shm", "rdma", "tcp", "grpc"] = "auto"
    """How chunk bytes move to and from the store: auto (shm on the node's host, rdma where
    both ends have a device, else the TCP data channel), shm, rdma, tcp or grpc."""
    stream_loads: bool = True
    """Chunks not read in place (another host's node, a node's disk tier) stream in layer-major and
    land beside the step that needs them; off: they all land before it, through the staging pool."""
    land_direct: bool = False
    """CUDA: the landing kernel reads each chunk's layer where its bytes are (the node's registered
    arena, the stream's pinned buffers) over the bus, instead of a DMA into a device stage first."""

    speculative: Literal["none", "ngram", "draft"] = "none"
    """Speculative decoding: ``ngram`` drafts from the sequence's own earlier tokens (prompt lookup),
    ``draft`` with a small model (``draft_model``); the drafts are verified in one forward, and greedy
    output stays token for token the same (docs/engine.md, "Speculative decoding")."""
    draft_model: str | None = None
    """With ``speculative draft``: the draft model, a checkpoint folder or random preset with the
    target's vocabulary (its KV takes pages of its own, as many as the target's)."""
    draft_hf_overrides: dict | None = None
    """Model config fields of the draft model to replace, as JSON."""
    num_speculative_tokens: int = 4
    """With ``speculative``: most tokens drafted per sequence per step."""
    ngram_max: int = 3
    """With ``speculative ngram``: the longest and the shortest n-gram looked up (longest first)."""
    ngram_min: int = 1
    ngram_history: int = 0
    """With ``speculative ngram``: finished sequences kept to draft from when a sequence's own tokens
    have no match for its last ``ngram_max`` tokens (requests sharing a prefix often go on alike); 0: none."""

    def __post_init__(self) -> None:
        from kvstore.config import check_etcd, parse_size

        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        check_etcd(self.etcd)
        if self.page_size <= 0 or self.chunk_tokens <= 0:
            raise ValueError(f"page_size ({self.page_size}) and chunk_tokens ({self.chunk_tokens}) must be positive")
        if self.chunk_tokens % self.page_size:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of page_size ({self.page_size})")
        if self.chunk_size <= 0 or self.max_num_batched_tokens < self.chunk_size:
            raise ValueError("need 0 < chunk_size <= max_num_batched_tokens")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.speculative not in ("none", "ngram", "draft"):
            raise ValueError(f"speculative must be none, ngram or draft, got {self.speculative!r}")
        if (self.speculative == "draft") != bool(self.draft_model):
            raise ValueError("--speculative draft needs --draft-model, and --draft-model needs --speculative draft")
        if self.speculative != "none" and not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in 1..64, got {self.num_speculative_tokens}")
        if self.ngram_history < 0:
            raise ValueError(f"ngram_history must be >= 0, got {self.ngram_history}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max ({self.ngram_max})")
        if self.store_load_batch <= 0 or self.store_save_buffers <= 0:
            raise ValueError("store_load_batch and store_save_buffers must be positive")
        from kvstore.transport.identity import REQUESTS

        if self.store_transport not in REQUESTS:
            raise ValueError(f"store_transport must be one of {', '.join(REQUESTS)}, got {self.store_transport!r}")
        from kvstore.config import check_address

        if self.store is not None:
            check_address("--store", self.store)
        for c in (self.conductor or "").split(",") if self.conductor else ():
            check_address("--conductor", c.strip())
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint folder or a random: preset, got {self.model!r}")
        for name, allowed in (("dtype", ("auto", "float32", "float16", "bfloat16")),
                              ("chunk_check", ("auto", "xxh3", "wsum")), ("scheduling_policy", ("fcfs", "priority"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must be >= 0 (0: from kv_cache_memory), got {self.num_pages}")
        if self.kv_cache_memory <= 0 and not self.num_pages:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")

    def torch_device(self) -> torch.device:
        import torch  # here, not at the top: the CLI reads this module for its flags without torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
