"""Sampling parameters and the sampler: greedy, temperature, top-p, per-request seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.spec_decode import target_probs, verify
from kernels.host import to_device


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


class SampledTokens:
    """Tokens sampled on the device, on their way to the host (page-locked, asynchronous on CUDA)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.device_tokens = tokens
        """``[n]`` int64 where they were sampled (the next step's input ids, without a round trip)."""
        self._event = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def rows(self, rows: list[int]) -> torch.Tensor:
        """Those rows of the tokens, on the device (no host synchronisation)."""
        if rows == list(range(len(rows))):
            return self.device_tokens[: len(rows)]
        return self.device_tokens.index_select(0, to_device(rows, torch.int64, self.device_tokens.device))

    def tolist(self) -> list[int]:
        """The tokens on the host; waits for the device to have sampled them."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


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
        return self.sample_async(logits, params, seq_ids).tolist()

    def sample_async(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> SampledTokens:
        """``sample`` without waiting: the tokens are drawn on the logits' device and start their
        copy to the host (the next step can be launched before they arrive).

        A sampled row draws by the exponential race: ``argmax(probs / q)``, ``q ~ Exp(1)`` from
        the request's generator, picks token ``i`` with probability ``probs[i]`` exactly, with
        no host synchronisation (``torch.multinomial`` waits for the device).
        """
        out = logits.argmax(dim=-1)
        for i, (p, sid) in enumerate(zip(params, seq_ids)):
            if p.temperature == 0:
                continue
            probs = target_probs(logits[i], p.temperature, p.top_p)
            q = torch.empty_like(probs).exponential_(generator=self.generator(sid, p, logits.device))
            out[i] = (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax()
        return SampledTokens(out)

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
