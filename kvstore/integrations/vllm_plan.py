"""Scheduler-side policy of the vLLM connector: which chunks to load and save.

Plain Python, no vLLM and no tensors: the connector feeds it what vLLM's
scheduler says (matched tokens, allocated blocks, scheduled token counts) and
ships the resulting ``RequestOps`` to the workers.

Rules:
- Only full chunks are stored (``chunk_tokens`` tokens, a multiple of vLLM's
  block size); a partial tail is recomputed. With ``save_decode`` the chunks
  that generated tokens complete are stored too (the request's tokens are fed
  in as they come): a later turn whose prompt repeats this answer loads them.
- A load never covers the prompt's last token: vLLM needs to compute at least
  one token to sample from. A request resumed after a preemption (vLLM frees its
  blocks and recomputes it) looks up every token it has, and with
  ``save_decode`` loads the chunks it generated before too.
- Chunk ``j`` is saved in the step whose computed range first reaches its end,
  unless the store already held it when the request arrived (a chunk past the
  prompt: when it became due, one lookup). A step that loads
  and fails is rerun by vLLM from the first failed block, and the chunks that
  step would have saved are planned again by the rerun (their ends fall in its
  range once more), so nothing computed on top of a failed load is ever saved.
- A sliding-window model whose cache group frees the blocks behind the window
  (vLLM's ``SlidingWindowSpec``; ``window``): a load writes only the blocks
  vLLM holds for it (the last window before its end; chunks wholly behind it
  are not fetched), and a chunk is saved only if none of its blocks has been
  freed by the step that completes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.keys import ROOT_KEY, ChunkKey


@dataclass(frozen=True, slots=True)
class ChunkOp:
    """One chunk to move between the store and a request's blocks."""

    index: int
    """Chunk index in the sequence (chunk ``j`` covers tokens ``[j*C, (j+1)*C)``)."""
    keys: tuple[ChunkKey, ...]
    """The chunk's key under each tensor-parallel rank's namespace."""
    parents: tuple[ChunkKey, ...]
    """The previous chunk's key under each rank's namespace (``ROOT_KEY`` for chunk 0)."""
    tokens: tuple[int, ...]
    """The chunk's ``chunk_tokens`` token ids."""
    block_ids: tuple[int, ...]
    """The request's vLLM blocks holding this chunk, in token order."""
    first_block: int = 0
    """Loads only: blocks before this index already hold the engine's own KV."""


@dataclass(frozen=True, slots=True)
class RequestOps:
    """What the workers do for one request in one step."""

    req_id: str
    scope: Scope
    loads: tuple[ChunkOp, ...] = ()
    saves: tuple[ChunkOp, ...] = ()
    async_load: bool = False
    """The loads run beside the steps (vLLM holds the request until the worker reports them done)."""


def layerwise_step(full_graphs: str, decode_query_len: int, num_scheduled: Mapping[str, int]) -> bool:
    """Whether a step may load layer by layer: every attention layer's hook
    (``wait_for_layer_load``) runs unless vLLM replays the step as a full CUDA graph.

    Args:
        full_graphs: which batches vLLM replays as full graphs: ``none``, ``decode`` (uniform
            decode batches: FULL_DECODE_ONLY, FULL_AND_PIECEWISE) or ``all`` (FULL).
        decode_query_len: tokens per request of a uniform decode batch (1 + speculative tokens).
        num_scheduled: the step's tokens per request.
    """
    if full_graphs == "none":
        return True
    if full_graphs == "all":
        return False
    return any(n != decode_query_len for n in num_scheduled.values())


@dataclass
class _Req:
    tokens: tuple[int, ...]
    """The prompt, then (``save_decode``) the generated tokens known so far."""
    scope: Scope
    eligible: bool
    num_prompt_tokens: int = 0
    num_stored_chunks: int = 0
    pending_load: tuple[int, int] | None = None
    block_ids: list[int] = field(default_factory=list)
    loaded_blocks: dict[int, int] = field(default_factory=dict)
    """block id -> chunk index, for the blocks of this request's last load."""
    planned: int | None = None
    """Chunks before this one were planned (saved or found stored) since the request was (re)scheduled
    from ``computed // chunk_tokens``; None: from the next step's computed tokens."""


Scope = Hashable
"""What a request's chunk keys are namespaced by, opaque here: the connector's (its tenant salt,
``cache_salt``, and for a LoRA request its adapter)."""
KeyFn = Callable[[Sequence[int], Scope], list[list[ChunkKey]]]
"""(tokens, scope) -> per rank, the keys of every full chunk."""
LookupFn = Callable[[Sequence[ChunkKey]], int]
"""keys -> how many of them, from the first, the store holds (0 when it cannot be asked)."""


class ChunkPlanner:
    """Load and save plans per request (scheduler side; one per vLLM scheduler).

    Args:
        chunk_tokens: tokens per chunk, a multiple of ``block_size``.
        block_size: vLLM's KV block size.
        keys_for: computes per-rank chunk keys of tokens under a request's scope.
        load: plan loads at all.
        save: plan saves at all.
        save_decode: save the chunks generated tokens complete too (``on_cached`` is given the
            request's tokens).
        lookup: asks the store which leading keys it holds (a chunk past the prompt that it
            holds is not saved again); None: never asked.
        window: the sliding window (tokens) of a model whose cache group frees the blocks behind
            it, as vLLM's ``SlidingWindowManager`` does; None: every block is held until the
            request ends.
        lookup_ttl_s: how long a waiting request's lookup (``hit_chunks``) is reused.
    """

    def __init__(self, chunk_tokens: int, block_size: int, keys_for: KeyFn, *, load: bool = True,
                 save: bool = True, save_decode: bool = False, lookup: LookupFn | None = None,
                 window: int | None = None, lookup_ttl_s: float = 0.0) -> None:
        if chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of block_size {block_size}")
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self._keys_for = keys_for
        self.load = load
        self.save = save
        self.save_decode = save_decode
        self._lookup = lookup
        self.window = window
        self.num_unsaved_chunks = 0
        """Chunks not saved because the window had freed some of their blocks."""
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, int] = {}
        self._keys: dict[str, list[list[ChunkKey]]] = {}
        self.lookup_ttl_s = lookup_ttl_s
        self._asked: dict[str, tuple[int, int, float]] = {}
        """A waiting request's last lookup: (tokens looked up, chunks held, when)."""
        self.num_hit_tokens = 0
        """Tokens promised to vLLM as loadable from the store (sum over requests)."""
        self.num_resumed_hit_tokens = 0
        """Of them, tokens of requests resumed after a preemption (which vLLM would recompute)."""
        self.num_resumed_output_hit_tokens = 0
        """Of those, tokens past the prompt: what the request had generated before its preemption."""

    # ---- matching ------------------------------------------------------------

    def num_loadable_chunks(self, num_prompt_tokens: int) -> int:
        """Full chunks of a request's first ``num_prompt_tokens`` tokens that may be loaded: never
        the last one (vLLM computes at least one token to sample from)."""
        return max(0, num_prompt_tokens - 1) // self.chunk_tokens

    def keys(self, req_id: str, tokens: Sequence[int], scope: Scope) -> list[list[ChunkKey]]:
        """Per rank, the keys of every full chunk of ``tokens`` (cached per request; computed again
        when the tokens have grown by a chunk)."""
        keys = self._keys.get(req_id)
        if keys is None or len(keys[0]) < len(tokens) // self.chunk_tokens:
            keys = self._keys[req_id] = self._keys_for(tokens, scope)
        return keys

    def hit_chunks(self, req_id: str, tokens: Sequence[int], scope: Scope, now: float | None = None) -> int:
        """How many of the loadable chunks of ``tokens``, from the first, the store holds under every
        rank's keys. vLLM asks at every step a request waits for blocks (under memory pressure,
        hundreds of times): an answer for the same tokens is reused for ``lookup_ttl_s`` (a chunk
        evicted meanwhile fails its load and is recomputed)."""
        now = time.monotonic() if now is None else now
        n = self.num_loadable_chunks(len(tokens))
        last = self._asked.get(req_id)
        if last is not None and last[0] == len(tokens) and now - last[2] < self.lookup_ttl_s:
            return last[1]
        num_hit = n if self._lookup is not None else 0
        for rank_keys in self.keys(req_id, tokens, scope):
            if num_hit == 0:
                break
            num_hit = min(num_hit, self._lookup(rank_keys[:num_hit]))
        self._asked[req_id] = (len(tokens), num_hit, now)
        return num_hit

    def matched_tokens(self, req_id: str, num_computed_tokens: int, num_hit_chunks: int) -> int:
        """Records a lookup's hit and returns the tokens to load beyond the local hit."""
        self._hits[req_id] = num_hit_chunks
        return max(0, num_hit_chunks * self.chunk_tokens - num_computed_tokens)

    def on_alloc(self, req_id: str, tokens: Sequence[int], scope: Scope, eligible: bool,
                 num_external_tokens: int) -> None:
        """vLLM allocated blocks for a request leaving the waiting queue: new (``tokens``: its
        prompt), or resumed after a preemption (its tokens so far: with ``save_decode`` the chunks
        it completed before it may be loaded rather than recomputed)."""
        self._asked.pop(req_id, None)
        st = self._reqs.get(req_id)
        resumed = st is not None
        if st is None:
            st = self._reqs[req_id] = _Req(tuple(tokens), scope, eligible, len(tokens))
        elif len(tokens) > len(st.tokens) and tuple(tokens[:len(st.tokens)]) == st.tokens:
            st.tokens = tuple(tokens)
        num_hit = self._hits.pop(req_id, 0)
        st.num_stored_chunks = max(st.num_stored_chunks, num_hit) if st.eligible else 0
        if num_external_tokens > 0:
            end = num_hit * self.chunk_tokens
            assert 0 < num_external_tokens <= end, (num_external_tokens, end)
            assert (end - num_external_tokens) % self.block_size == 0
            st.pending_load = (end - num_external_tokens, end)
            if resumed:
                self.num_resumed_hit_tokens += num_external_tokens
                self.num_resumed_output_hit_tokens += max(0, end - max(end - num_external_tokens,
                                                                       st.num_prompt_tokens))

    # ---- per step ------------------------------------------------------------

    def on_new(self, req_id: str, block_ids: Iterable[int], num_computed_tokens: int,
               num_scheduled_tokens: int) -> RequestOps | None:
        st = self._reqs.get(req_id)
        if st is None:
            return None
        st.block_ids = list(block_ids)
        return self._ops(req_id, st, num_computed_tokens, num_scheduled_tokens)

    def on_async_load(self, req_id: str, block_ids: Iterable[int]) -> RequestOps | None:
        """A request whose load vLLM lets run beside the steps (``load_kv_async``): its loads alone,
        into the blocks allocated for it; it is scheduled (``on_new``) once they are done."""
        st = self._reqs.get(req_id)
        if st is None or st.pending_load is None:
            return None
        st.block_ids = list(block_ids)
        return RequestOps(req_id, st.scope, self._loads(req_id, st), async_load=True)

    def on_cached(self, req_id: str, new_block_ids: Iterable[int] | None, resumed: bool,
                  num_computed_tokens: int, num_scheduled_tokens: int,
                  tokens: Sequence[int] | None = None) -> RequestOps | None:
        """A running (or resumed) request's next step; ``tokens``: all of its tokens known now,
        the prompt and those generated (with ``save_decode``)."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        if self.save_decode and tokens is not None and len(tokens) >= len(st.tokens) + self.chunk_tokens - \
                len(st.tokens) % self.chunk_tokens:  # (only when a chunk more is known)
            grown = tuple(tokens)
            if grown[:len(st.tokens)] == st.tokens:
                st.tokens = grown
        if resumed:
            st.block_ids = list(new_block_ids or ())
            st.planned = None  # (recomputed into new blocks: saved from them again)
        elif new_block_ids:
            st.block_ids.extend(new_block_ids)
        return self._ops(req_id, st, num_computed_tokens, num_scheduled_tokens)

    def on_load_errors(self, invalid_block_ids: set[int]) -> None:
        """Blocks failed to load: the chunks they held are re-saved when recomputed."""
        for st in self._reqs.values():
            failed = [j for b, j in st.loaded_blocks.items() if b in invalid_block_ids]
            if failed:
                st.num_stored_chunks = min(st.num_stored_chunks, min(failed))
                st.loaded_blocks.clear()
                st.planned = None  # (the rerun plans the chunks from the failed one on again)

    def on_finished(self, req_id: str) -> None:
        self._asked.pop(req_id, None)
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._keys.pop(req_id, None)

    def _chunk(self, req_id: str, st: _Req, j: int, first_block: int = 0) -> ChunkOp:
        keys = self.keys(req_id, st.tokens, st.scope)
        c, m = self.chunk_tokens, self.blocks_per_chunk
        blocks = tuple(st.block_ids[j * m:(j + 1) * m])
        assert len(blocks) == m, f"request {req_id} has no blocks for chunk {j}"
        return ChunkOp(index=j, keys=tuple(k[j] for k in keys),
                       parents=tuple(k[j - 1] if j else ROOT_KEY for k in keys),
                       tokens=st.tokens[j * c:(j + 1) * c], block_ids=blocks, first_block=first_block)

    def freed_blocks(self, computed: int) -> int:
        """Leading blocks of a request a sliding-window cache group has freed (handed back, in
        its block table a null block) once ``computed`` tokens are computed: vLLM's
        ``SlidingWindowManager.get_num_skipped_tokens`` in blocks."""
        if self.window is None:
            return 0
        return max(0, computed - self.window + 1) // self.block_size

    def _loads(self, req_id: str, st: _Req) -> tuple[ChunkOp, ...]:
        """The request's pending load as chunk ops (none pending: none)."""
        if st.pending_load is None:
            return ()
        c = self.chunk_tokens
        start, end = st.pending_load
        st.pending_load = None
        st.loaded_blocks.clear()
        loads = []
        freed = self.freed_blocks(end)
        for j in range(start // c, end // c):
            first = max(max(0, start - j * c) // self.block_size, freed - j * self.blocks_per_chunk)
            if first >= self.blocks_per_chunk:
                continue  # (wholly behind the window: vLLM holds no block for it)
            op = self._chunk(req_id, st, j, first)
            loads.append(op)
            st.loaded_blocks.update((b, j) for b in op.block_ids[op.first_block:])
        self.num_hit_tokens += end - start
        return tuple(loads)

    def _ops(self, req_id: str, st: _Req, computed: int, scheduled: int) -> RequestOps | None:
        c = self.chunk_tokens
        loads = self._loads(req_id, st)
        saves: list[ChunkOp] = []
        if self.save and st.eligible:
            # (a chunk whose tokens were not all known when its end was computed, under vLLM's async
            # scheduling, is planned in a later step, from the same blocks)
            last = min(computed + scheduled, len(st.tokens)) // c
            if st.planned is None:
                st.planned = computed // c
            first = max(st.planned, st.num_stored_chunks)
            if self._lookup is not None and first < last and (first + 1) * c > st.num_prompt_tokens:
                # chunks the prompt's lookup did not cover (generated tokens): the store may hold them
                # already (another request answered the same); saved only when it does not
                keys = self.keys(req_id, st.tokens, st.scope)
                held = min(self._lookup(k[:last]) for k in keys)
                st.num_stored_chunks = max(st.num_stored_chunks, held)
                first = max(first, held)
            intact = -(-self.freed_blocks(computed) // self.blocks_per_chunk)  # (first chunk with every block)
            if intact > first:
                self.num_unsaved_chunks += max(0, min(intact, last) - first)
                first = intact
            for j in range(first, last):
                saves.append(self._chunk(req_id, st, j))
            st.planned = max(st.planned, last)
        if not loads and not saves:
            return None
        return RequestOps(req_id, st.scope, loads, tuple(saves))
