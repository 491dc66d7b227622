"""Continuous batching with chunked prefill, under a per-step token budget. No tensors.

Each step: running decodes first (one token each, plus its speculative tokens), then prefill chunks of
running sequences, then newly admitted ones, each chunk at most ``chunk_size``
tokens and the step at most ``max_num_batched_tokens``. So a 32k-token prompt
costs the running decodes at most one chunk's worth of delay per step.

When a decode needs a page and none is free, the most recently admitted
running sequence is preempted: its pages are freed and it goes back to the
front of the queue to be recomputed (its output so far is kept).

With ``policy="priority"`` (vLLM's) every order above follows each request's
``priority`` (lower first), then its arrival: the waiting queue is kept in it,
running sequences take the step's budget in it, and the last in it (the least
urgent, newest) is the one preempted, going back to its place in the queue.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step, starting at ``seq.num_computed``."""
    num_draft: int = 0
    """Of them, speculative tokens after the last real one (``seq.draft``), verified by this step."""
    start: int | None = None
    """First position computed (None: ``seq.num_computed``); a draft model's pass starts where its own
    KV of the sequence ends."""
    all_rows: bool = False
    """The logits of every token computed, not only the last (prompt log-probabilities)."""

    @property
    def num_rows(self) -> int:
        """Rows of logits the step returns for this sequence."""
        return self.num_new_tokens if self.all_rows else 1 + self.num_draft


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    """Sequences admitted this step (their store hits still need loading)."""
    num_prefill_tokens: int = 0
    """Of the scheduled tokens: prompt chunks (admissions and running prefills), for the step-time metrics."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, chunk_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, chunk_tokens: int, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        self.by_priority = policy == "priority"
        self.blocks = blocks
        self.chunk_size = chunk_size
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @staticmethod
    def order(seq: Sequence) -> tuple:
        """The priority policy's order: priority (lower first), then arrival."""
        return seq.params.priority, seq.arrival_time, seq.seq_id

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.append(seq)

    def _queue(self, seq: Sequence) -> None:
        """Into the waiting queue at its place in the priority order."""
        self.waiting.insert(bisect.bisect_right(self.waiting, self.order(seq), key=self.order), seq)

    def _in_order(self) -> list[Sequence]:
        """The running sequences in the order they take the step's budget."""
        return sorted(self.running, key=self.order) if self.by_priority else list(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (done, stopped or aborted) and frees its pages."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.pages)
        seq.pages = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.pages += self.blocks.allocate(need)
        return True

    def _pages_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Pages for ``num_tokens`` of a running sequence, preempting the newest others if need be.

        Returns False when ``seq`` itself had to be preempted.
        """
        while not self._ensure_pages(seq, num_tokens):
            victim = max(self.running, key=self.order) if self.by_priority else self.running[-1]
            self._preempt(victim)
            out.scheduled = [s for s in out.scheduled if s.seq is not victim]
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft = []
        seq.num_draft_computed = 0
        self.blocks.free(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_saved_chunks = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.appendleft(seq)

    def schedule(self, local_hashes, skip: Collection[int] = ()) -> SchedulerOutput:
        """Plans one step.

        Args:
            local_hashes: ``seq -> list[bytes]``, hashes of the sequence's full
                prompt pages, for the local prefix cache.
            skip: ids of running sequences not to schedule this step (under async
                scheduling: those that end by length at the step still in flight).
        """
        out = SchedulerOutput()
        budget = self.budget
        # 1. decodes, each with its speculative tokens (``seq.draft``) as far as the budget goes
        for seq in self._in_order():
            if seq.num_tokens - seq.num_computed != 1 or budget == 0 or seq.seq_id in skip:
                continue
            del seq.draft[budget - 1:]
            if not self._pages_or_preempt(seq, seq.num_tokens + len(seq.draft), out):
                continue
            out.scheduled.append(ScheduledSeq(seq, 1 + len(seq.draft), len(seq.draft)))
            budget -= 1 + len(seq.draft)
        # 2. prefill chunks of running sequences
        for seq in self._in_order():
            remaining = seq.num_tokens - seq.num_computed
            if remaining <= 1 or budget == 0 or seq.status is not SeqStatus.RUNNING or seq.seq_id in skip \
                    or any(s.seq is seq for s in out.scheduled):
                continue
            n = min(remaining, self.chunk_size, budget)
            if not self._pages_or_preempt(seq, seq.num_computed + n, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, n, all_rows=seq.needs_prompt_logprobs))
            out.num_prefill_tokens += n
            budget -= n
        # 3. admissions
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, local_hashes(seq)):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            remaining = seq.num_tokens - seq.num_computed
            n = min(remaining, self.chunk_size, budget)
            if self._ensure_pages(seq, seq.num_computed + n):
                out.scheduled.append(ScheduledSeq(seq, n, all_rows=seq.needs_prompt_logprobs))
                out.num_prefill_tokens += n
                budget -= n
        return out

    def _admit(self, seq: Sequence, hashes: list[bytes]) -> bool:
        """Takes shared prefix pages and pages for the store hit; False if pages are short."""
        page = self.blocks.page_size
        # NOTE: at least the last token is computed, to produce the first output's logits; all of
        # the prompt when its log-probabilities are asked for (they need every position's logits).
        max_shared = (seq.num_tokens - 1) // page if not seq.needs_prompt_logprobs else 0
        store_tokens = min(seq.store_hit_chunks * self.chunk_tokens, seq.num_tokens - 1) \
            if not seq.needs_prompt_logprobs else 0
        store_tokens -= store_tokens % self.chunk_tokens
        shared = self.blocks.match_prefix(hashes[:max_shared])
        local_tokens = len(shared) * page
        if store_tokens > local_tokens:
            # NOTE: the store fills whole chunks into private pages: keep only the
            # shared pages of chunks that the store would not load anyway.
            keep = (local_tokens // self.chunk_tokens) * self.chunk_tokens // page
            self.blocks.free(shared[keep:])
            shared = shared[:keep]
            local_tokens = len(shared) * page
        else:
            store_tokens = 0
        need = self.blocks.pages_for(store_tokens) - len(shared) if store_tokens else 0
        first = min(seq.num_tokens - max(local_tokens, store_tokens), self.chunk_size)
        need_total = self.blocks.pages_for(max(local_tokens, store_tokens) + first) - len(shared)
        if not self.blocks.can_allocate(need_total):
            self.blocks.free(shared)
            return False
        seq.pages = shared + (self.blocks.allocate(need) if need > 0 else [])
        # NOTE: store tokens count as computed from here on; the engine loads them
        # before the step runs and rolls num_computed back if a chunk misses.
        seq.num_computed = max(local_tokens, store_tokens)
        seq.num_local_tokens = local_tokens
        seq.num_store_tokens = store_tokens - local_tokens if store_tokens else 0
        seq.num_saved_chunks = seq.num_computed // self.chunk_tokens
        return True
