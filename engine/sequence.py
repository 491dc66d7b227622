"""A request's state as the scheduler sees it: token ids and page ids, no tensors."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from engine.sampling import SamplingParams

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    """Block table: physical page of each logical page, in token order. Only ever appended to in
    place; any other change assigns a new list (the decode buffers rewrite a row only then)."""
    num_computed: int = 0
    """Leading tokens whose KV is in this sequence's pages."""
    num_store_tokens: int = 0
    """Prompt tokens loaded from the store (not recomputed)."""
    num_local_tokens: int = 0
    """Prompt tokens shared from pages already in this engine (local prefix cache)."""
    store_hit_chunks: int = 0
    """Leading chunks the store reported at admission (a hint: loading may still miss)."""
    num_saved_chunks: int = 0
    """Leading chunks known to be in the store (loaded or saved)."""
    cache_salt: str | None = None
    """Tenant salt of this request's chunk keys (None: shared across tenants)."""
    replicate: bool = False
    """Keep the chunks loaded from other store nodes on this engine's own node too."""
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    draft: list[int] = field(default_factory=list)
    """Speculative tokens proposed for the next step (not part of ``tokens`` until verified)."""
    num_draft_computed: int = 0
    """Leading tokens whose KV the draft model holds (``--speculative draft``), in the same pages."""
    num_draft_tokens: int = 0
    """Speculative tokens verified for this request, and of those accepted."""
    num_accepted_tokens: int = 0
    logprobs: list = field(default_factory=list)
    """With ``params.logprobs``: a ``TokenLogprobs`` for each output token this engine sampled, in
    order (an output prefix handed over by a prefill engine has none)."""
    prompt_logprobs: list = field(default_factory=list)
    """With ``params.prompt_logprobs``: None for the first prompt token, then a ``TokenLogprobs`` for
    each prompt token, filled as the prompt's chunks are computed."""

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt log-probabilities are asked for and not all computed: every prompt position's
        logits are needed (no KV reuse for its prompt)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt, output, then draft, copying only those (decode's hot
        path: ``tokens`` copies the whole context)."""
        np_ = len(self.prompt)
        if end <= np_:
            return self.prompt[start:end]
        rest = self.output + self.draft if end > np_ + len(self.output) else self.output
        if start >= np_:
            return rest[start - np_ : end - np_]
        return self.prompt[start:] + rest[: end - np_]

    def token_at(self, pos: int) -> int:
        """The token at ``pos`` of prompt, output, then draft (no list built: decode's hot path)."""
        if pos < len(self.prompt):
            return self.prompt[pos]
        pos -= len(self.prompt)
        return self.output[pos] if pos < len(self.output) else self.draft[pos - len(self.output)]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time
