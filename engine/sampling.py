"""Sampling parameters and the sampler: greedy, temperature, top-p, per-request seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.spec_decode import target_probs, verify


SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's convention): dividing logits by less overflows."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 is greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    speculative: bool = True
    """Let an engine with speculative decoding (``--speculative``) draft for this request."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:  # logits / 1e-45 overflow: as good as greedy, and taken as such
            object.__setattr__(self, "temperature", 0.0)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            raise ValueError(f"seed must be None or a 64-bit integer, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__") \
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Sampler:
    """Picks one token per row of logits; keeps one generator per seeded request."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> list[int]:
        """Samples one token per row.

        Args:
            logits: ``[n, vocab]`` float32.
            params: one per row.
            seq_ids: one per row (keys of the per-request generators).
        """
        out = logits.argmax(dim=-1).tolist()
        for i, (p, sid) in enumerate(zip(params, seq_ids)):
            if p.temperature == 0:
                continue
            probs = target_probs(logits[i], p.temperature, p.top_p)
            out[i] = int(torch.multinomial(probs, 1, generator=self.generator(sid, p, logits.device)))
        return out

    def generator(self, seq_id: int, p: SamplingParams, device: torch.device) -> torch.Generator:
        """The request's generator, made (seeded) on first use."""
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(p.seed if p.seed is not None else torch.seed())
            self._generators[seq_id] = gen
        return gen

    def verify(self, logits: torch.Tensor, draft: list[int], p: SamplingParams, seq_id: int) -> list[int]:
        """The tokens a verification step emits (engine/spec_decode.py ``verify``)."""
        gen = self.generator(seq_id, p, logits.device) if p.temperature > 0 else None
        return verify(logits, draft, p.temperature, p.top_p, gen)
