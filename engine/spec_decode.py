"""Speculative decoding: draft a few tokens cheaply, verify them in one target forward.

Decode is memory-bound: a step reads every weight and the whole KV once, whatever the number of query
tokens, so checking ``k`` drafted tokens costs about one step. The engine (engine/llm_engine.py) asks a
drafter for up to ``k`` tokens per decoding sequence, schedules the last real token plus the drafts as
one multi-token query over the sequence's paged KV (the chunked-prefill path), and ``verify`` turns the
``k + 1`` rows of logits into the tokens to emit: the accepted prefix of the draft plus one token of the
target's own. The KV written for rejected drafts is never counted as computed: the next step writes
over it.

- Greedy (temperature 0): a draft token is accepted while it equals the target's argmax, then the
  target's argmax follows, so the output is token for token what decoding one token a step gives.
- Sampling: the rejection rule of Leviathan et al. / Chen et al. with the drafter's distribution a point
  mass ``q = δ(d)``: ``d`` is accepted with probability ``min(1, p(d) / q(d)) = p(d)``; a rejection
  samples from the residual ``max(0, p - q)`` normalised, which is ``p`` with ``d`` removed; after ``k``
  acceptances one more token comes from ``p``. Every emitted token is distributed as the target's
  (temperature and top-p applied), whatever the drafter proposed.
"""

from __future__ import annotations

import torch


class NgramDrafter:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the sequence's
    last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``), in its own prompt and output. Strong
    where outputs copy their context (RAG, code edits, multi-turn chat); no model, no state.

    With ``history``, when a sequence's own tokens have no match, the drafter looks in the last
    ``history`` finished sequences (``remember``), most recent first, for its last ``max_n`` tokens:
    requests that share a prompt prefix (a document, a system prompt) often go on alike.

    Args:
        max_n, min_n: the n-gram sizes tried, longest first.
        window: how many trailing tokens are searched (bounds the per-step cost).
        history: finished sequences kept to draft from (0: none).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 4096, history: int = 0) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram_min ({min_n}) <= ngram_max ({max_n})")
        self.max_n, self.min_n, self.window = max_n, min_n, window
        import collections

        self.history: collections.deque[list[int]] = collections.deque(maxlen=history)
        self.num_history_drafts = 0
        """Drafts that came from another sequence."""

    def remember(self, tokens: list[int]) -> None:
        """Keeps a finished sequence's tokens to draft from (with ``history``)."""
        if self.history.maxlen:
            self.history.append(tokens[-self.window:])

    @staticmethod
    def _lookup(toks: list[int], suffix: list[int], end: int, k: int) -> list[int]:
        """What followed the last occurrence of ``suffix`` starting before ``end`` in ``toks``."""
        n, first = len(suffix), suffix[0]
        for start in range(end - 1, -1, -1):  # the most recent occurrence first
            if toks[start] == first and toks[start:start + n] == suffix:
                return toks[start + n:start + n + k]
        return []

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``; empty when no n-gram recurs."""
        if k <= 0:
            return []
        toks = tokens[-self.window:]
        n_tokens = len(toks)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            if out := self._lookup(toks, toks[n_tokens - n:], n_tokens - n, k):
                return out
        if self.history and n_tokens >= self.max_n:
            suffix = toks[n_tokens - self.max_n:]
            for other in reversed(self.history):
                if out := self._lookup(other, suffix, len(other) - self.max_n, k):
                    self.num_history_drafts += 1
                    return out
        return []


class DraftModelDrafter:
    """A small model sharing the target's vocabulary drafts greedily, all drafting sequences batched per
    pass. Its KV lives in a cache of its own with the target's page ids, so a sequence's block table
    serves both; ``seq.num_draft_computed`` says how far its KV of the sequence reaches. The first pass
    catches up on what the draft model has not seen (the prompt, or tokens the target accepted); each
    further pass feeds the token just drafted. A greedy drafter is a point mass, so ``verify`` keeps the
    target's distribution for it as for the n-gram drafter.
    """

    def __init__(self, runner) -> None:
        self.runner = runner

    def draft(self, wanted: list[tuple[object, int]]) -> None:
        """Sets ``seq.draft`` to ``k`` drafted tokens for each ``(seq, k)``; the sequences' pages must
        already cover ``num_tokens + k`` tokens."""
        from engine.scheduler import ScheduledSeq

        for seq, _ in wanted:
            seq.draft = []
            # its KV past the last real token is of drafts never verified (the budget left them out)
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_tokens - 1)
        for _ in range(max((k for _, k in wanted), default=0)):
            batch = [seq for seq, k in wanted if len(seq.draft) < k]
            sched = [ScheduledSeq(seq, seq.num_tokens + len(seq.draft) - seq.num_draft_computed,
                                  start=seq.num_draft_computed) for seq in batch]
            for seq, tok in zip(batch, self.runner.run(sched).argmax(dim=-1).tolist()):
                seq.num_draft_computed = seq.num_tokens + len(seq.draft)
                seq.draft.append(tok)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0) -> torch.Tensor:
    """The distribution sampling draws from for one row of logits: softmax at ``temperature``; then,
    in vLLM's order, tokens below ``min_p`` times the likeliest's probability dropped, the ``top_k``
    likeliest kept (0: all; tokens tied with the k-th too), and the nucleus of ``top_p`` (the smallest
    set of tokens whose probability reaches it; the top one always), renormalised at each step."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if min_p > 0.0:
        probs = probs * (probs >= min_p * probs.max())
        probs = probs / probs.sum()
    if 0 < top_k < probs.shape[-1]:
        probs = probs * (probs >= probs.topk(top_k).values[-1])
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        # (no boolean indexing: its shape depends on the data, so the host would wait for the device)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p * keep)
        probs = probs / probs.sum()
    return probs


def verify(logits: torch.Tensor, draft: list[int], temperature: float, top_p: float,
           generator: torch.Generator | None, top_k: int = 0, min_p: float = 0.0) -> list[int]:
    """The tokens to emit after a verification forward: the accepted prefix of ``draft``, then one
    token of the target's (a correction, or the bonus after a fully accepted draft).

    Args:
        logits: ``[len(draft) + 1, vocab]``: row ``i`` predicts the token after draft token ``i - 1``
            (row 0: after the last real token).
        generator: the request's generator (sampling only).
    """
    k = len(draft)
    if temperature == 0:
        target = logits[:k + 1].argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(draft):
            out.append(target[i])
            if target[i] != d:
                return out
        out.append(target[k])
        return out
    out = []
    for i, d in enumerate(draft):
        probs = target_probs(logits[i], temperature, top_p, top_k, min_p)
        if torch.rand((), generator=generator, device=probs.device) < probs[d]:
            out.append(d)
            continue
        residual = probs.clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs(logits[k], temperature, top_p, top_k, min_p), 1,
                                     generator=generator)))
    return out
