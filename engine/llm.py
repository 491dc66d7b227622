"""Offline generation: ``LLM(...).generate(prompts)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

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
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (str, list, tuple)) for p in prompts):
            raise ValueError("prompts must be a string, a list of token ids, or a list of those")
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    min_p=min_p, seed=seed, ignore_eos=ignore_eos, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs)
        salt = tenant_salt if tenant_salt is not None else self.config.tenant_salt
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"tenant_salt must be a string, got {type(salt).__name__}")
        encoded = [self.tokenizer.encode(p, add_bos=True) if isinstance(p, str) else list(p) for p in prompts]
        for ids in encoded:  # all or nothing: a bad prompt queues none of the batch
            self.engine.validate(ids, params)
        seqs = [self.engine.add_request(ids, params, cache_salt=salt) for ids in encoded]
        try:
            while any(not s.is_finished for s in seqs):
                self.engine.step()
        except BaseException:
            for s in seqs:  # a failed step leaves none of them queued (the next call would fail the same way)
                self.engine.abort(s.seq_id)
            raise
        if self.engine.connector is not None:
            self.engine.connector.flush()
        return [RequestOutput(prompt_token_ids=s.prompt, token_ids=list(s.output),
                              text=self.tokenizer.decode(s.output), num_cached_tokens=s.num_store_tokens,
                              num_local_cached_tokens=s.num_local_tokens, ttft_s=s.ttft_s or 0.0,
                              finish_reason=s.finish_reason or "",
                              logprobs=list(s.logprobs) if params.logprobs is not None else None,
                              prompt_logprobs=list(s.prompt_logprobs) if params.prompt_logprobs is not None else None)
                for s in seqs]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
