"""Sampling parameters and the sampler: greedy, temperature, top-p, per-request seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.spec_decode import target_probs, verify


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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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
