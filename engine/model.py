"""Llama-family decoder over a paged KV cache (Llama, Qwen2, Mistral layouts).

RMSNorm, RoPE (plain and Llama-3 scaled), grouped-query attention, SwiGLU,
tied or untied embeddings, optional q/k/v bias (Qwen2). Module names follow
Hugging Face's, so checkpoints load by name. Attention goes through the
kernels' dispatch layer: Triton on CUDA, the PyTorch twins on CPU.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import kernels
from engine.config import ModelConfig


@dataclass
class AttnMetadata:
    """Where this step's tokens sit. ``T`` tokens of ``B`` sequences."""

    positions: torch.Tensor
    """``[T]`` int64 absolute position of each token."""
    slot_mapping: torch.Tensor
    """``[T]`` int64 cache slot (``page * page_size + offset``) each token's K/V goes to."""
    block_tables: torch.Tensor
    """``[B, max_pages]`` int32."""
    cu_q_lens: torch.Tensor
    """``[B + 1]`` int32 offsets of each sequence's tokens."""
    context_lens: torch.Tensor
    """``[B]`` int32 tokens already cached before this step's tokens."""
    is_decode: bool
    """Every sequence has exactly one token this step."""
    max_q_len: int
    kv_ready: Callable[[int], None] | None = None
    """Called with ``l`` before layer ``l`` computes: a load landing layer by layer beside the
    step (``PendingLoad.wait_layer``) has that layer's KV in the pages then."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """``[head_dim / 2]`` inverse frequencies, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type") == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                             cfg.head_dim)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, hidden]``; caches ``[num_pages, page_size, KVH, D]`` (written in place)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = k
        v_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = v
        if meta.is_decode:
            o = kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens + 1,
                                               self.scale)
        else:
            o = kernels.chunked_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_q_lens,
                                                  meta.context_lens, self.scale, max_q_len=meta.max_q_len)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its LM head; ``forward`` runs one engine step."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Runs the step's tokens through every layer, writing their K/V to the caches.

        Args:
            input_ids: ``[T]`` int64.
            meta: positions and page layout of the step.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_pages, page_size, KVH, D]``.

        Returns:
            ``[T, hidden]`` final hidden states (after the last norm).
        """
        x = self.model.embed_tokens(input_ids)
        freqs = meta.positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
            if meta.kv_ready is not None:
                meta.kv_ready(i)
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` → ``[n, vocab]`` float32."""
        return self.lm_head(hidden).float()


def random_model(cfg: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """A seeded random model: the same seed gives the same weights on every host with the
    same kind of device.

    On CPU the weights are drawn in float32 by one CPU generator, parameter by parameter
    (the small presets' exact weights). On a GPU they are drawn there, in the model's
    dtype, by a generator of that device: a Llama-3-8B-shaped model is ready in seconds
    instead of minutes of CPU sampling and a host copy.
    """
    with torch.device("meta"):
        model = CausalLM(cfg)
    on_cpu = device.type == "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.empty(p.shape, dtype=torch.float32 if on_cpu else dtype, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                # NOTE: std 0.05 rather than HF's 0.02: greedy output of a random
                # model then varies token to token instead of settling into a
                # loop, which makes exactness tests sharper.
                t.normal_(0.0, 0.05, generator=gen)
            state[name] = t.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)  # a tied lm_head is the embedding's
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device=device).eval()


def _layer_index(name: str) -> int:
    """i of a ``model.layers.{i}.…`` tensor name; -1 for the others."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def load_checkpoint(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Loads ``*.safetensors`` from a Hugging Face folder by parameter name.

    Raises:
        ValueError: no safetensors files, or missing / unexpected tensors.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors files")
    with torch.device("meta"):
        model = CausalLM(cfg)
    params = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if _layer_index(name) >= cfg.num_hidden_layers:
                    continue  # a model cut by hf_overrides={"num_hidden_layers": N} keeps the first N
                if name not in params:
                    if cfg.tie_word_embeddings and name == "lm_head.weight":
                        continue
                    raise ValueError(f"unexpected tensor {name} in {f}")
                state[name] = sf.get_tensor(name).to(dtype)
    missing = [n for n in params if n not in state and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device=device).eval()
