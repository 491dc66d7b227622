"""Offline generation: ``LLM(...).generate(prompts)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams, TokenLogprobs


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    """Prompt tokens loaded from the store instead of recomputed."""
    num_local_cached_tokens: int
    """Prompt tokens shared from this engine's own pages (local prefix cache)."""
    ttft_s: float
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    """With ``logprobs``: one per generated token (``TokenLogprobs``)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``prompt_logprobs``: one per prompt token, None for the first."""


@dataclass
class BeamOutput:
    """One hypothesis of ``LLM.beam_search``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    cum_logprob: float
    """Its tokens' summed log-probability."""
    score: float
    """``cum_logprob`` over its length ** ``length_penalty``: what it was ranked by."""
    finish_reason: str
    num_cached_tokens: int
    """Prompt tokens its search's first step did not compute (the store's and the local cache's)."""
    steps: int
    """Steps its search took (at most ``max_tokens``; fewer when no live beam could still win)."""
    logprobs: list[TokenLogprobs] | None = None


class LLM:
    """An engine for offline use.

    Args:
        model: ``random:tiny|small|medium`` or a Hugging Face checkpoint folder.
        store: a store node's ``host:port``, or None.
        chunk_tokens: tokens per stored chunk.
        chunk_size: most prompt tokens prefilled per sequence per step.
        dtype: ``auto``, ``float32``, ``float16`` or ``bfloat16``.
        tenant_salt: default tenant salt of this engine's chunk keys.
        **kwargs: any other ``EngineConfig`` field.
    """

    def __init__(self, model: str = "random:tiny", store: str | None = None, chunk_tokens: int = 256,
                 chunk_size: int = 512, dtype: str = "auto", tenant_salt: str | None = None, **kwargs) -> None:
        kwargs.setdefault("max_num_batched_tokens", max(2048, chunk_size))
        self.config = EngineConfig(model=model, store=store, chunk_tokens=chunk_tokens, chunk_size=chunk_size,
                                   dtype=dtype, tenant_salt=tenant_salt, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]], max_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, top_k: int = 0,
                 min_p: float = 0.0,
                 ignore_eos: bool = False, tenant_salt: str | None = None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generates for every prompt (token-id lists or strings); one output per prompt, in order.
        With ``logprobs`` (0-20) each generated token comes with its log-probability and those of the
        ``logprobs`` most likely tokens at its position (``RequestOutput.logprobs``); with
        ``prompt_logprobs`` each prompt token after the first (the prompt is then computed whole).
        ``params``: a whole ``SamplingParams`` (penalties included) instead of the keyword arguments.

        Saves of newly computed chunks are flushed before returning, so another
        engine can reuse them at once.
        """
        prompts = self._prompts(prompts)
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    min_p=min_p, seed=seed, ignore_eos=ignore_eos, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs)
        salt = self._salt(tenant_salt)
        encoded = self._encode(prompts)
        for ids in encoded:  # all or nothing: a bad prompt queues none of the batch
            self.engine.validate(ids, params)
        seqs = [self.engine.add_request(ids, params, cache_salt=salt) for ids in encoded]
        self._run(seqs)
        if self.engine.connector is not None:
            self.engine.connector.flush()
        return [RequestOutput(prompt_token_ids=s.prompt, token_ids=list(s.output),
                              text=self.tokenizer.decode(s.output), num_cached_tokens=s.num_store_tokens,
                              num_local_cached_tokens=s.num_local_tokens, ttft_s=s.ttft_s or 0.0,
                              finish_reason=s.finish_reason or "",
                              logprobs=list(s.logprobs) if params.logprobs is not None else None,
                              prompt_logprobs=list(s.prompt_logprobs) if params.prompt_logprobs is not None else None)
                for s in seqs]

    @staticmethod
    def _prompts(prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (str, list, tuple)) for p in prompts):
            raise ValueError("prompts must be a string, a list of token ids, or a list of those")
        return list(prompts)

    def _salt(self, tenant_salt: str | None) -> str | None:
        salt = tenant_salt if tenant_salt is not None else self.config.tenant_salt
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"tenant_salt must be a string, got {type(salt).__name__}")
        return salt

    def _encode(self, prompts: list) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_bos=True) if isinstance(p, str) else list(p) for p in prompts]

    def _run(self, seqs) -> None:
        """Steps the engine until every one of ``seqs`` has finished."""
        try:
            while any(not s.is_finished for s in seqs):
                self.engine.step()
        except BaseException:
            for s in seqs:  # a failed step leaves none of them queued (the next call would fail the same way)
                self.engine.abort(s.seq_id)
            raise

    def beam_search(self, prompts: str | list[int] | Seq[str | list[int]], beam_width: int = 4,
                    max_tokens: int = 16, length_penalty: float = 1.0, ignore_eos: bool = False,
                    stop_token_ids: Seq[int] = (), logprobs: int | None = None,
                    tenant_salt: str | None = None) -> list[list[BeamOutput]]:
        """Beam search (engine/beam_search.py) for every prompt: its ``beam_width`` best hypotheses,
        best first, one list per prompt, in order. The searches step together: each step is one
        batch of one-token requests, a request per live beam of every prompt, whose prompts the
        local prefix cache (and the store) already holds but for the last token or so."""
        prompts = self._prompts(prompts)
        params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
                                  stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs)
        salt = self._salt(tenant_salt)
        encoded = self._encode(prompts)
        step = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=params.alternatives)
        for ids in encoded:
            self.engine.validate(ids + [0] * (max_tokens - 1), step)  # (the longest request it will make)
        searches = [BeamSearch(params, self.engine.eos) for _ in encoded]
        cached = [0] * len(encoded)
        while live := [(i, s, beams) for i, s in enumerate(searches) if (beams := s.pending())]:
            seqs = [[self.engine.add_request(encoded[i] + t, step, cache_salt=salt) for t in beams]
                    for i, _, beams in live]
            self._run([q for qs in seqs for q in qs])
            for (i, search, _), qs in zip(live, seqs):
                if not search.steps:  # (the first step's request: the prompt's reuse)
                    cached[i] = qs[0].num_store_tokens + qs[0].num_local_tokens
                search.advance([q.logprobs[0] for q in qs])
        if self.engine.connector is not None:
            self.engine.connector.flush()
        return [[BeamOutput(prompt_token_ids=encoded[i], token_ids=b.tokens, text=self.tokenizer.decode(b.tokens),
                            cum_logprob=b.cum_logprob, score=b.score(length_penalty), finish_reason=b.finish_reason,
                            num_cached_tokens=cached[i], steps=s.steps,
                            logprobs=b.logprobs if logprobs is not None else None)
                 for b in s.result()] for i, s in enumerate(searches)]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
