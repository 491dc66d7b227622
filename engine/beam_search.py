"""Beam search over any engine that reports log-probabilities.

Each step asks for the next token's top ``2 * beam_width`` log-probabilities after every live beam
(one request per beam of one token, ``max_tokens=1``), keeps the ``beam_width`` likeliest
continuations, and sets aside every continuation that ends in a stop token (EOS, ``stop_token_ids``)
as a finished hypothesis; the answer is the ``beam_width`` best of the finished hypotheses and the
beams still live at ``max_tokens``. The requests of step ``t + 1`` share all but their last token
with those of step ``t``, so an engine with a prefix cache (pages shared by content hash, or the
store) computes one token per beam per step, whatever the prompt's length: the scheme vLLM's
``LLM.beam_search`` uses, which needs nothing of the engine beyond logprobs.

A hypothesis's score is its summed log-probability over its length to the power ``length_penalty``
(the length counts generated tokens, a final stop token not included; at least 1). The search stops
as soon as no live beam can still reach the best ``beam_width`` finished hypotheses (a bound, so the
answer is the same as searching to ``max_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.sampling import MAX_LOGPROBS, TokenLogprobs

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""Widest search: each step asks for ``2 * beam_width`` alternatives, at most ``MAX_LOGPROBS``."""
MAX_LENGTH_PENALTY = 10.0
"""Largest ``length_penalty``, either sign (a length to this power stays a float)."""


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    """Generated tokens (the prompt not included)."""
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Each token's log-probability and its position's alternatives (as many as were asked for)."""
    finish_reason: str | None = None
    """``stop`` (its last token is a stop token), ``length`` (``max_tokens``), None (live)."""

    def score(self, length_penalty: float) -> float:
        n = max(1, len(self.tokens) - (self.finish_reason == "stop"))
        return self.cum_logprob / n ** length_penalty


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    """Scores are divided by length ** length_penalty: > 0 favours longer hypotheses, < 0 shorter."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that finish a hypothesis besides EOS."""
    ignore_eos: bool = False
    """EOS is an ordinary token (``stop_token_ids`` still finish)."""
    logprobs: int | None = None
    """Alternatives reported with each token of the answer (None: no logprobs), at most ``2 * beam_width``
    unless more are asked for each step."""

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                             f"got {self.length_penalty!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def alternatives(self) -> int:
        """The top-k each step asks for: twice the width (so that ``beam_width`` continuations remain
        when up to half of them stop), or what the answer's logprobs show, if more."""
        return min(MAX_LOGPROBS, max(2 * self.beam_width, self.logprobs or 0))


Expand = Callable[[list[list[int]]], Sequence[TokenLogprobs]]
"""Given the generated tokens of each live beam, the next token's log-probabilities after each (the
prompt is the caller's): ``TokenLogprobs.top`` holds the ``alternatives`` likeliest, likeliest first."""


class BeamSearch:
    """One search, stepped by its caller: ``pending()`` gives the live beams' tokens, ``advance()``
    takes the next token's log-probabilities after each; done when ``pending()`` is empty. (Several
    searches step together, their requests batched: ``LLM.beam_search``.)"""

    def __init__(self, params: BeamSearchParams, stop_ids=frozenset(), prune: bool = True) -> None:
        self.params = params
        self.prune = prune  # end once no live beam can reach the answer (the same answer either way)
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_ids))
        self.live, self.done = [Beam()], []
        self.steps = 0

    def _key(self, b: Beam) -> float:
        return b.score(self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        return [b.tokens for b in self.live]

    def advance(self, tops: Sequence[TokenLogprobs]) -> None:
        p, shown = self.params, self.params.logprobs
        if len(tops) != len(self.live):
            raise RuntimeError(f"{len(tops)} distributions for {len(self.live)} beams")
        candidates = []
        for beam, top in zip(self.live, tops):
            alts = tuple(top.top[:shown]) if shown is not None else ()
            for tok, logprob in top.top[:p.alternatives]:
                nb = Beam(beam.tokens + [tok], beam.cum_logprob + logprob,
                          beam.logprobs + [TokenLogprobs(logprob, alts)] if shown is not None else beam.logprobs)
                if tok in self.stops:
                    nb.finish_reason = "stop"
                    self.done.append(nb)
                else:
                    candidates.append(nb)
        self.steps += 1
        # (stable sorts: among equal scores the earlier beam, and its likelier token, first)
        self.live = sorted(candidates, key=self._key, reverse=True)[:p.beam_width]
        self.done = sorted(self.done, key=self._key, reverse=True)[:p.beam_width]
        if self.steps == p.max_tokens:
            for b in self.live:
                b.finish_reason = "length"
            self.done = sorted(self.done + self.live, key=self._key, reverse=True)[:p.beam_width]
            self.live = []
        elif self.prune and self.live and len(self.done) == p.beam_width \
                and self._key(self.done[-1]) > max(_best_reachable(b, p, self.steps) for b in self.live):
            self.live = []  # none of them can still make the answer

    def result(self) -> list[Beam]:
        """The ``beam_width`` best hypotheses, best first (once ``pending()`` is empty)."""
        if self.live:
            raise RuntimeError("the search is not done")
        return self.done


def beam_search(expand: Expand, params: BeamSearchParams, stop_ids=frozenset()) -> list[Beam]:
    """The ``beam_width`` best hypotheses, best first. ``stop_ids``: the model's EOS tokens (those and
    ``params.stop_token_ids`` finish a hypothesis; ``ignore_eos`` drops the former)."""
    search = BeamSearch(params, stop_ids)
    while beams := search.pending():
        search.advance(expand(beams))
    return search.result()


def _best_reachable(beam: Beam, params: BeamSearchParams, length: int) -> float:
    """The highest score any hypothesis grown from ``beam`` (``length`` tokens, live) can have: its
    log-probability only falls, and its scored length is between ``length`` and ``max_tokens``."""
    lp, c = params.length_penalty, beam.cum_logprob
    # c <= 0: c / n**lp is largest at the largest n when lp > 0, at the smallest when lp < 0
    n = params.max_tokens if lp > 0 else length
    return c / n ** lp
