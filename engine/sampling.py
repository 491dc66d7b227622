"""Sampling parameters and the sampler: greedy, temperature, min-p, top-k, top-p, penalties, logit bias,
allowed and banned tokens, a minimum length, per-request seed, log-probabilities."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.spec_decode import target_probs, verify
from engine.structured import bitmask_words, check_spec, unpack
from kernels.host import to_device


SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's convention): dividing logits by less overflows."""

MAX_LOGPROBS = 20
"""Most alternatives a request may ask log-probabilities for (vLLM's default ``max_logprobs``)."""

MAX_LOGIT_BIAS = 100.0
"""Largest bias, either sign, a request may add to a token's logit (OpenAI's range)."""

LOGPROB_FLOOR = -9999.0
"""Log-probabilities below this (``-inf`` included) are reported as this: JSON has no infinity."""


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability and the ``k`` most likely tokens at its position, most
    likely first, as ``(token id, log-probability)``. Of the model's own distribution: the log-softmax
    of the logits, before temperature, min-p, top-k and top-p (what vLLM reports by default)."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None
    """The token's rank in the distribution (1: the likeliest; ties count the tokens strictly more
    likely), where asked for (prompt tokens' logprobs, as vLLM reports them)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 is greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the ``top_k`` likeliest tokens (0 or -1: all)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the likeliest (0: none)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already has (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output has it (OpenAI's, in [-2, 2])."""
    repetition_penalty: float = 1.0
    """A token in the prompt or the output has its logit divided by this when positive, multiplied
    when negative (1: none; > 1 discourages repeats)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    speculative: bool = True
    """Let an engine with speculative decoding (``--speculative``) draft for this request."""
    logprobs: int | None = None
    """Report each generated token's log-probability and those of the ``logprobs`` most likely
    tokens at its position (0: the generated token's only; None: nothing), ``TokenLogprobs``."""
    prompt_logprobs: int | None = None
    """The same for each prompt token after the first (what the model predicted there). The whole
    prompt is then computed: its KV is neither loaded from the store nor shared from local pages."""
    min_tokens: int = 0
    """Tokens generated before a stop token (EOS unless ``ignore_eos``, ``stop_token_ids``) may be:
    they are masked until then."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs (a dict is taken too): the bias, in [-100, 100], is added to the
    token's logit."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be generated (None: all)."""
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never generated: a sequence's last token is masked wherever the output ends
    with the ones before it (a one-token sequence: always)."""
    structured: tuple[str, str] | None = None
    """``(kind, spec)``: the output follows a grammar (engine/structured.py: ``"json"`` and a JSON
    schema, ``"json_object"``, ``"regex"``, ``"choice"`` and a JSON list of strings, ``"grammar"``
    and EBNF) and ends, with EOS, where the grammar does."""
    structured_after: tuple[int, ...] = ()
    """The grammar applies only once the output holds these tokens, to what follows them (a
    reasoning model's end of thinking, ``</think>``); empty: from the first token."""
    priority: int = 0
    """Scheduling priority, lower first (vLLM's), on an engine with ``scheduling_policy="priority"``
    (others refuse anything but 0); equal priorities go first come, first served."""

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalty."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def has_processors(self) -> bool:
        """Its logits are changed before sampling: a grammar, penalties, a bias, allowed or banned
        tokens or a minimum length."""
        return self.structured is not None or self._has_row_processors

    @property
    def _has_row_processors(self) -> bool:
        """Processing besides a grammar (``Sampler.processed``)."""
        return bool(self.has_penalties or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words_ids)

    @property
    def needs_history(self) -> bool:
        """Its logits depend on which tokens came before (penalties, banned sequences of several
        tokens, a grammar), not only on how many: no drafts, and async steps wait for its tokens."""
        return self.has_penalties or self.structured is not None or any(len(w) > 1 for w in self.bad_words_ids)

    @property
    def speculable(self) -> bool:
        """Drafts may be proposed for it: its processing is applied row by row in a verification
        (a grammar's matcher follows each row's drafts and rolls back the rejected ones), which
        the penalties' running counts and banned sequences of several tokens are not."""
        return self.speculative and not self.has_penalties and not any(len(w) > 1 for w in self.bad_words_ids) \
            and not self.structured_after

    def is_stop(self, tok: int, num_output: int, eos) -> bool:
        """Whether ``tok``, the ``num_output``-th token of the output, stops it (``eos``: the model's
        EOS ids). A structured output ends at EOS even with ``ignore_eos``: it is where its grammar ends."""
        return num_output > self.min_tokens and (tok in self.stop_token_ids or (
            (not self.ignore_eos or self.structured is not None) and tok in eos))

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:  # logits / 1e-45 overflow: as good as greedy, and taken as such
            object.__setattr__(self, "temperature", 0.0)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0: all tokens), got {self.top_k!r}")
        object.__setattr__(self, "top_k", max(0, self.top_k))
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {getattr(self, name)!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be a number in (0, 10], got {self.repetition_penalty!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            raise ValueError(f"seed must be None or a 64-bit integer, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__") \
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        try:
            given = list(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
            bias = tuple((t, float(b)) for t, b in given if _is_int(t) and t >= 0 and _is_real(b)
                         and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS)
        except (TypeError, ValueError):
            given, bias = (), None
        if bias is None or len(bias) != len(given):
            raise ValueError(f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not _token_ids(self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be None or a non-empty sequence of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words_ids, (str, bytes)) or not hasattr(self.bad_words_ids, "__iter__") \
                or not all(_token_ids(w) for w in self.bad_words_ids):
            raise ValueError(f"bad_words_ids must be a sequence of non-empty token id sequences, "
                             f"got {self.bad_words_ids!r}")
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in self.bad_words_ids))
        if self.structured is not None:
            object.__setattr__(self, "structured", check_spec(self.structured))
            if self.min_tokens:  # (a complete grammar allows only EOS, which min_tokens masks)
                raise ValueError("min_tokens cannot be combined with structured outputs")
        if self.structured_after and (self.structured is None or not _token_ids(self.structured_after)):
            raise ValueError(f"structured_after must be a sequence of token ids, with structured, "
                             f"got {self.structured_after!r}")
        object.__setattr__(self, "structured_after", tuple(self.structured_after))
        if not _is_int(self.priority) or not -(1 << 31) <= self.priority < 1 << 31:
            raise ValueError(f"priority must be a 32-bit integer, got {self.priority!r}")

    def token_ids(self):
        """Every token id the request names (to check against a vocabulary)."""
        yield from self.stop_token_ids
        yield from (t for t, _ in self.logit_bias)
        yield from self.allowed_token_ids or ()
        yield from self.structured_after
        for w in self.bad_words_ids:
            yield from w


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _token_ids(v) -> bool:
    """``v`` is a non-empty sequence (list or tuple) of token ids."""
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_int(t) and t >= 0 for t in v)


class SampledTokens:
    """Tokens sampled on the device, on their way to the host (page-locked, asynchronous on CUDA),
    with the log-probabilities of the rows that asked for them."""

    def __init__(self, tokens: torch.Tensor, logprobs: _RowLogprobs | None = None) -> None:
        self.device_tokens = tokens
        """``[n]`` int64 where they were sampled (the next step's input ids, without a round trip)."""
        self._logprobs = logprobs
        self._event = None
        if tokens.is_cuda:
            self._host = _to_host(tokens)
            if logprobs is not None:
                logprobs.to_host()
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))
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

    def logprobs(self) -> list[TokenLogprobs | None]:
        """One per row: its token's ``TokenLogprobs``, or None where the request asked for none.
        Call after ``tolist`` (which waits for the device)."""
        n = len(self._host)
        return self._logprobs.tolist(n) if self._logprobs is not None else [None] * n


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Starts ``t``'s copy into page-locked host memory (complete once the stream gets there)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _RowLogprobs:
    """The log-probabilities of some rows of a step's logits: the chosen token's and the top ``k``'s,
    computed on the logits' device."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int],
                 ranks: bool = False) -> None:
        self.rows, self.ks = rows, ks
        idx = to_device(rows, torch.int64, logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        self.chosen = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)
        k = min(max(ks), lp.shape[-1])
        self.top_lp, self.top_ids = lp.topk(k, dim=-1) if k else (None, None)
        self.ranks = (lp > self.chosen.unsqueeze(1)).sum(dim=-1).add_(1) if ranks else None

    def to_host(self) -> None:
        self.chosen = _to_host(self.chosen)
        if self.top_lp is not None:
            self.top_lp, self.top_ids = _to_host(self.top_lp), _to_host(self.top_ids)
        if self.ranks is not None:
            self.ranks = _to_host(self.ranks)

    def tolist(self, n: int) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * n
        chosen = self.chosen.clamp_min(LOGPROB_FLOOR).tolist()
        top_lp = self.top_lp.clamp_min(LOGPROB_FLOOR).tolist() if self.top_lp is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        ranks = self.ranks.tolist() if self.ranks is not None else [None] * len(self.rows)
        for i, (r, k) in enumerate(zip(self.rows, self.ks)):
            out[r] = TokenLogprobs(chosen[i], tuple(zip(top_ids[i][:k], top_lp[i][:k])) if k else (), ranks[i])
        return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int, ranks: bool = False) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of ``tokens[i]`` under row ``i`` of ``logits`` (a verification's rows, a
    prompt's; ``ranks``: with the tokens' ranks); waits for the device."""
    return _RowLogprobs(logits, torch.tensor(tokens, device=logits.device), list(range(len(tokens))),
                        [k] * len(tokens), ranks).tolist(len(tokens))


class _Masks(NamedTuple):
    """A request's token lists on the device, made once (``Sampler._masks_of``)."""

    allowed: torch.Tensor | None
    banned: torch.Tensor | None  # one-token bad words
    stops: torch.Tensor | None  # masked while the output is shorter than min_tokens
    bias_ids: torch.Tensor | None
    bias: torch.Tensor | None


class Sampler:
    """Picks one token per row of logits; keeps one generator per seeded request.

    Args:
        eos: the model's EOS token ids (masked, with ``stop_token_ids``, before ``min_tokens``).
        grammars: compiles structured outputs' grammars (``engine.structured.Grammars``).
    """

    def __init__(self, eos=(), grammars=None) -> None:
        self.eos = frozenset(eos)
        self.grammars = grammars
        self._matchers: dict = {}  # seq_id: its structured output's Matcher
        self._grammar_from: dict[int, list] = {}  # seq_id: [where its grammar starts (None: not yet), scanned]
        self._generators: dict[int, torch.Generator] = {}
        self._penalty_state: dict[int, list] = {}  # seq_id: [seen in prompt or output, output counts, outputs counted]
        self._masks: dict[int, _Masks] = {}

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self._penalty_state.pop(seq_id, None)
        self._masks.pop(seq_id, None)
        self._matchers.pop(seq_id, None)
        self._grammar_from.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> list[int]:
        """Samples one token per row (``sample_async(...).tolist()``).

        Args:
            logits: ``[n, vocab]`` float32.
            params: one per row.
            seq_ids: one per row (keys of the per-request generators).
        """
        return self.sample_async(logits, params, seq_ids).tolist()

    def sample_async(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int],
                     history: list | None = None) -> SampledTokens:
        """``sample`` without waiting: the tokens are drawn on the logits' device and start their
        copy to the host (the next step can be launched before they arrive).

        A sampled row draws by the exponential race: ``argmax(probs / q)``, ``q ~ Exp(1)`` from
        the request's generator, picks token ``i`` with probability ``probs[i]`` exactly, with
        no host synchronisation (``torch.multinomial`` waits for the device). Rows whose request
        asks for ``logprobs`` get them computed beside (``SampledTokens.logprobs``), from the logits
        as the model gave them. ``history``: for each row whose request changes its logits
        (``SamplingParams.has_processors``), its ``(prompt, output)`` tokens (``processed``), applied
        before greedy and sampled picks.
        """
        raw = logits
        if history is not None and any(h is not None for h in history):
            logits = logits.to(torch.float32, copy=True)
            grammar = [(i, out) for i, (p, h, sid) in enumerate(zip(params, history, seq_ids))
                       if h is not None and p.structured is not None
                       and (out := self.grammar_output(sid, p, h[1])) is not None]
            if grammar:
                self._mask_grammars(logits, [i for i, _ in grammar], [seq_ids[i] for i, _ in grammar],
                                    [params[i] for i, _ in grammar], [out for _, out in grammar])
            for i, (p, sid, h) in enumerate(zip(params, seq_ids, history)):
                if h is not None and p._has_row_processors:
                    logits[i] = self.processed(logits[i], sid, p, h[0], h[1], grammar=False)
        out = logits.argmax(dim=-1)
        for i, (p, sid) in enumerate(zip(params, seq_ids)):
            if p.temperature == 0:
                continue
            probs = target_probs(logits[i], p.temperature, p.top_p, p.top_k, p.min_p)
            q = torch.empty_like(probs).exponential_(generator=self.generator(sid, p, logits.device))
            out[i] = (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        lps = _RowLogprobs(raw, out, want, [params[i].logprobs for i in want]) if want else None
        return SampledTokens(out, lps)

    def grammar_output(self, seq_id: int, p: SamplingParams, output: list[int]) -> list[int] | None:
        """The part of ``output`` request ``p``'s grammar follows: all of it, or with
        ``structured_after`` what follows the first occurrence of those tokens (None before it)."""
        after = p.structured_after
        if not after:
            return output
        st = self._grammar_from.setdefault(seq_id, [None, 0])
        if st[0] is None:
            n = len(after)
            for k in range(max(0, st[1] - n + 1), len(output) - n + 1):
                if tuple(output[k:k + n]) == after:
                    st[0] = k + n
                    break
            st[1] = len(output)
        return None if st[0] is None else output[st[0]:]

    def valid_draft(self, seq_id: int, p: SamplingParams, output: list[int], draft: list[int]) -> list[int]:
        """``draft`` cut where the request's grammar stops allowing it (all of it without one)."""
        return self._matcher(seq_id, p).valid_draft(output, draft) if p.structured is not None and draft else draft

    def _matcher(self, seq_id: int, p: SamplingParams):
        g = self._matchers.get(seq_id)
        if g is None:
            if self.grammars is None:
                raise ValueError("this sampler has no grammars for structured outputs")
            g = self._matchers[seq_id] = self.grammars.matcher(p.structured)
        return g

    def _mask_grammars(self, logits: torch.Tensor, rows: list[int], seq_ids: list[int], params: list[SamplingParams],
                       outputs: list[list[int]]) -> None:
        """Masks what each row's grammar does not allow next, for all of them at once: their
        bitmasks (a bit a token) filled on the host, copied to the device packed (page-locked,
        asynchronously on CUDA), unpacked and applied there."""
        vocab = logits.shape[-1]
        bitmask = torch.empty((len(rows), bitmask_words(vocab)), dtype=torch.int32, pin_memory=logits.is_cuda)
        for j, (sid, p, out) in enumerate(zip(seq_ids, params, outputs)):
            g = self._matcher(sid, p)
            g.follow(out)
            g.fill(bitmask, j, self.eos)
        allowed = unpack(bitmask.to(logits.device, non_blocking=True), vocab)
        if len(rows) == len(logits):
            logits.masked_fill_(~allowed, -math.inf)
        else:
            idx = to_device(rows, torch.int64, logits.device)
            logits[idx] = logits.index_select(0, idx).masked_fill_(~allowed, -math.inf)

    def processed(self, logits: torch.Tensor, seq_id: int, p: SamplingParams, prompt: list[int],
                  output: list[int], grammar: bool = True) -> torch.Tensor:
        """One row of logits (float32, changed in place) as request ``p`` samples from them after
        ``output``, in vLLM's order: the tokens its grammar does not allow next (a structured
        output), tokens outside ``allowed_token_ids`` and banned ones masked,
        stop tokens masked before ``min_tokens``, the logit bias added, then the penalties. Only the
        grammar, the penalties and banned sequences of several tokens look at which tokens ``output``
        has (under async scheduling its last ones may still be ``PENDING``, which counts their number
        only: those requests' steps wait for their tokens)."""
        followed = self.grammar_output(seq_id, p, output) if grammar and p.structured is not None else None
        if followed is not None:  # (``sample_async`` masks all its rows' grammars at once)
            g = self._matcher(seq_id, p)
            g.follow(followed)
            logits.masked_fill_(~g.allowed(self.eos, logits.device), -math.inf)
        m = self._masks.get(seq_id)
        if m is None:
            m = self._masks[seq_id] = self._masks_of(p, logits.device)
        if m.allowed is not None:
            keep = logits.index_select(0, m.allowed)
            logits.fill_(-math.inf).index_copy_(0, m.allowed, keep)
        if m.banned is not None:
            logits.index_fill_(0, m.banned, -math.inf)
        ends = [w[-1] for w in p.bad_words_ids if 1 < len(w) <= len(output) + 1
                and tuple(output[len(output) - len(w) + 1:]) == w[:-1]]
        if ends:
            logits.index_fill_(0, to_device(ends, torch.int64, logits.device), -math.inf)
        if m.stops is not None and len(output) < p.min_tokens:
            logits.index_fill_(0, m.stops, -math.inf)
        if m.bias is not None:
            logits.index_add_(0, m.bias_ids, m.bias)
        return self._penalised(logits, seq_id, prompt, output, p) if p.has_penalties else logits

    def _masks_of(self, p: SamplingParams, device: torch.device) -> _Masks:
        def ids(xs):
            return to_device(sorted(set(xs)), torch.int64, device) if xs else None

        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos) if p.min_tokens else ()
        return _Masks(ids(p.allowed_token_ids), ids([w[0] for w in p.bad_words_ids if len(w) == 1]), ids(stops),
                      to_device([t for t, _ in p.logit_bias], torch.int64, device) if p.logit_bias else None,
                      torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32).to(device)
                      if p.logit_bias else None)

    def _penalised(self, logits: torch.Tensor, seq_id: int, prompt: list[int], output: list[int],
                   p: SamplingParams) -> torch.Tensor:
        """One row of logits with ``p``'s penalties, as vLLM applies them: the repetition penalty
        over the tokens of prompt and output (a positive logit divided, a negative one multiplied),
        then the frequency penalty times each token's count in the output and the presence penalty
        for each token the output has. From per-request device state updated with the tokens output
        since the last step (a step costs its new tokens, not the whole prompt and output again)."""
        st = self._penalty_state.get(seq_id)
        if st is None or st[2] > len(output):
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[to_device(sorted(set(prompt)), torch.int64, logits.device)] = True
            st = [seen, torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device), 0]
            self._penalty_state[seq_id] = st
        seen, counts, n = st
        if n < len(output):
            new = to_device(output[n:], torch.int64, logits.device)
            seen[new] = True
            counts.index_add_(0, new, torch.ones(len(output) - n, device=logits.device))
            st[2] = len(output)
        if p.repetition_penalty != 1.0:
            logits = torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty,
                                                   logits * p.repetition_penalty), logits)
        return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)

    def generator(self, seq_id: int, p: SamplingParams, device: torch.device) -> torch.Generator:
        """The request's generator, made (seeded) on first use."""
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(p.seed if p.seed is not None else torch.seed())
            self._generators[seq_id] = gen
        return gen

    def verify(self, logits: torch.Tensor, draft: list[int], p: SamplingParams, seq_id: int,
               history: tuple[list[int], list[int]] | None = None) -> list[int]:
        """The tokens a verification step emits (engine/spec_decode.py ``verify``). ``history``: the
        request's ``(prompt, output)`` when it changes its logits (``processed``: row ``j`` follows
        the output and the first ``j`` drafts)."""
        if history is not None and p.has_processors:
            logits = logits.to(torch.float32, copy=True)
            prompt, output = history
            for j in range(len(logits)):
                logits[j] = self.processed(logits[j], seq_id, p, prompt, output + draft[:j])
        gen = self.generator(seq_id, p, logits.device) if p.temperature > 0 else None
        return verify(logits, draft, p.temperature, p.top_p, gen, p.top_k, p.min_p)
