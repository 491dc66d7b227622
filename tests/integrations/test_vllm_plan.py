"""The vLLM connector's scheduler-side plans (kvstore/integrations/vllm_plan.py), fed the way the
connector feeds them from vLLM's scheduler (no vLLM needed): which chunks each step saves, with
the tokens and blocks they hold; generated tokens' chunks with ``save_decode``, each looked up once
in a real store node first. tests/integrations/test_vllm.py runs the same through real vLLM."""

import random

import pytest

from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.integrations.storelink import StoreLink, StoreLinkConfig
from kvstore.integrations.vllm_plan import ChunkPlanner
from kvstore.keys import ModelFingerprint, chunk_keys, make_namespace
from kvstore.server import StoreNode

C, BLOCK = 64, 32
NS = make_namespace(ModelFingerprint("plan-test", "float32", num_layers=2, num_kv_heads=2, head_dim=64,
                                     chunk_tokens=C, tp_rank=0, tp_size=1))


def keys_for(tokens, salt):
    return [chunk_keys(tokens, NS, C)]


@pytest.fixture(scope="module")
def store():
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram=16 << 20)).start()
    yield node
    node.stop(grace=0)


class Lookups:
    """A real store's lookup through the connector's StoreLink, counted."""

    def __init__(self, address: str) -> None:
        self.link = StoreLink(StoreLinkConfig(address, 10.0))
        self.calls = 0

    def __call__(self, keys) -> int:
        self.calls += 1
        return self.link.lookup(keys)


def _serve(planner: ChunkPlanner, prompt: list[int], outputs: list[int], req_id: str = "r",
           preempt_at: int | None = None) -> list[tuple]:
    """One request through prefill (one step) and decode steps, as vLLM schedules it: blocks
    allocated as the tokens need them, each decode step computing the last sampled token. Returns
    the saves of every step as (chunk index, its tokens, its blocks)."""
    saves = []
    next_block = iter(range(1000))
    blocks = [next(next_block) for _ in range(-(-len(prompt) // BLOCK))]
    planner.on_alloc(req_id, prompt, None, True, 0)
    op = planner.on_new(req_id, list(blocks), 0, len(prompt))
    saves += [(s.index, s.tokens, s.block_ids) for s in (op.saves if op else ())]
    tokens = list(prompt)
    for i, tok in enumerate(outputs):
        tokens.append(tok)  # sampled by the last step; this step computes its KV
        computed = len(tokens) - 1
        new = []
        resumed = preempt_at is not None and i == preempt_at
        if resumed:  # preempted and resumed: every block again, fresh ids, everything recomputed
            blocks = [next(next_block) for _ in range(-(-len(tokens) // BLOCK))]
            new, computed = list(blocks), 0
        elif len(tokens) > len(blocks) * BLOCK:
            new = [next(next_block)]
            blocks += new
        op = planner.on_cached(req_id, new or None, resumed, computed, len(tokens) - computed, list(tokens))
        saves += [(s.index, s.tokens, s.block_ids) for s in (op.saves if op else ())]
    planner.on_finished(req_id)
    return saves, blocks


def _expected(tokens: list[int], blocks: list[int], chunks) -> list[tuple]:
    per = C // BLOCK
    return [(j, tuple(tokens[j * C:(j + 1) * C]), tuple(blocks[j * per:(j + 1) * per])) for j in chunks]


def test_the_prompts_full_chunks_are_saved_and_with_save_decode_the_generated_ones_too():
    r = random.Random(1)
    prompt = [r.randrange(1000) for _ in range(150)]
    outputs = [r.randrange(1000) for _ in range(120)]  # KV computed for 150 + 119 tokens: chunks 0-3
    plain, _ = _serve(ChunkPlanner(C, BLOCK, keys_for), prompt, outputs)
    assert plain == _expected(prompt, list(range(5)), [0, 1])
    both, blocks = _serve(ChunkPlanner(C, BLOCK, keys_for, save_decode=True), prompt, outputs)
    assert both == _expected(prompt + outputs, blocks, [0, 1, 2, 3])


def test_a_generated_chunk_the_store_holds_is_looked_up_once_and_not_saved_again(store):
    r = random.Random(2)
    prompt = [r.randrange(1000) for _ in range(100)]
    outputs = [r.randrange(1000) for _ in range(160)]  # chunks 0-3 computed
    tokens = prompt + outputs
    keys = chunk_keys(tokens, NS, C)
    with StoreClient(store.address) as c:  # another request answered the same: chunks 0-2 stored
        for k in keys[:3]:
            c.put(k, b"x" * 64)
    lookups = Lookups(store.address)
    saves, blocks = _serve(ChunkPlanner(C, BLOCK, keys_for, save_decode=True, lookup=lookups), prompt, outputs)
    # chunk 0 (the prompt's) is the prompt lookup's business, not this one's; 1-2 held; 3 new
    assert saves == _expected(tokens, blocks, [0, 3])
    assert lookups.calls == 3  # once for each chunk reaching past the prompt (1, 2, 3)


def test_a_preempted_request_saves_its_later_chunks_from_its_new_blocks():
    r = random.Random(3)
    prompt = [r.randrange(1000) for _ in range(70)]
    outputs = [r.randrange(1000) for _ in range(140)]
    saves, blocks = _serve(ChunkPlanner(C, BLOCK, keys_for, save_decode=True), prompt, outputs, preempt_at=30)
    # chunk 0 from the prefill; after the preemption (101 tokens recomputed into fresh blocks) chunk 0
    # again from those (a save may have been dropped: it is planned whenever computed), then chunks 1-2
    tokens = prompt + outputs
    assert [s[0] for s in saves] == [0, 0, 1, 2]
    assert saves[1:] == _expected(tokens, blocks, [0, 1, 2])


def test_a_resumed_request_loads_the_chunks_it_generated_before_its_preemption():
    """vLLM frees a preempted request's blocks and recomputes it when it resumes: with the
    chunks it saved as it generated, the resume's lookup covers its tokens so far and the load
    writes them into the new blocks, past the prompt; nothing loaded is saved again."""
    r = random.Random(5)
    prompt = [r.randrange(1000) for _ in range(70)]
    tokens = prompt + [r.randrange(1000) for _ in range(150)]  # 220 known: chunks 0-2 computed and saved
    planner = ChunkPlanner(C, BLOCK, keys_for, save_decode=True)
    planner.on_alloc("r", prompt, None, True, 0)
    planner.on_new("r", list(range(3)), 0, 70)
    assert planner.num_loadable_chunks(len(tokens)) == 3
    planner.matched_tokens("r", 0, 3)  # (the resume's lookup: all three held)
    planner.on_alloc("r", tokens, None, True, 3 * C)
    blocks = list(range(100, 107))
    op = planner.on_cached("r", blocks, True, 3 * C, len(tokens) - 3 * C, tokens)
    assert [(j.index, j.tokens, j.block_ids) for j in op.loads] == _expected(tokens, blocks, [0, 1, 2])
    assert op.saves == ()
    assert planner.num_resumed_hit_tokens == 3 * C
    assert planner.num_resumed_output_hit_tokens == 3 * C - 70
    # the next chunk is saved from the new blocks once computed
    tokens = tokens + [r.randrange(1000) for _ in range(40)]
    op = planner.on_cached("r", [107], False, 259, 1, tokens)
    assert [(j.index, j.tokens, j.block_ids) for j in op.saves] == _expected(tokens, blocks + [107], [3])


def test_a_waiting_requests_lookup_is_reused_for_lookup_ttl_s(store):
    """vLLM asks for a waiting request's hit at every step it cannot be given blocks: the store is
    asked once per ``lookup_ttl_s`` for the same tokens, again when they change, when the time is
    up, and after the request was admitted (a resume after a preemption asks afresh)."""
    r = random.Random(6)
    tokens = [r.randrange(1000) for _ in range(200)]
    with StoreClient(store.address) as c:
        for k in chunk_keys(tokens, NS, C)[:2]:
            c.put(k, b"x" * 64)
    lookups = Lookups(store.address)
    planner = ChunkPlanner(C, BLOCK, keys_for, lookup=lookups, lookup_ttl_s=1.0)
    assert [planner.hit_chunks("w", tokens, None, now=t) for t in (10.0, 10.2, 10.9)] == [2, 2, 2]
    assert lookups.calls == 1
    assert planner.hit_chunks("w", tokens, None, now=11.0) == 2 and lookups.calls == 2  # (expired)
    assert planner.hit_chunks("w", tokens[:150], None, now=11.1) == 2 and lookups.calls == 3  # other tokens
    assert planner.hit_chunks("v", tokens, None, now=11.1) == 2 and lookups.calls == 4  # another request
    planner.matched_tokens("w", 0, 2)
    planner.on_alloc("w", tokens, None, True, 2 * C)
    assert planner.hit_chunks("w", tokens, None, now=11.2) == 2 and lookups.calls == 5  # admitted since
    planner.on_finished("v")
    assert planner.hit_chunks("v", tokens, None, now=11.2) == 2 and lookups.calls == 6
    never = ChunkPlanner(C, BLOCK, keys_for, lookup=lookups)  # (lookup_ttl_s 0: every time)
    assert [never.hit_chunks("w", tokens, None, now=20.0) for _ in range(3)] == [2, 2, 2]
    assert lookups.calls == 9


def test_tokens_that_do_not_extend_the_request_are_ignored():
    """A token list that is not the request's own continuation (never from vLLM) is not saved."""
    planner = ChunkPlanner(C, BLOCK, keys_for, save_decode=True)
    prompt = list(range(100))
    planner.on_alloc("r", prompt, None, True, 0)
    planner.on_new("r", [0, 1, 2, 3], 0, 100)
    op = planner.on_cached("r", [4], False, 127, 1, [7] * 128)
    assert op is None


def test_under_async_scheduling_a_chunk_is_saved_once_its_tokens_are_known():
    """vLLM's async scheduling computes a token's KV before the token reaches the request: the
    tokens lag the computed range by one. A generated chunk is then saved a step late, whole."""
    r = random.Random(4)
    prompt = [r.randrange(1000) for _ in range(100)]
    outputs = [r.randrange(1000) for _ in range(100)]
    planner = ChunkPlanner(C, BLOCK, keys_for, save_decode=True)
    planner.on_alloc("r", prompt, None, True, 0)
    blocks = list(range(4))
    saves = [(s.index, s.tokens, s.block_ids) for s in planner.on_new("r", list(blocks), 0, 100).saves]
    tokens = list(prompt)
    for tok in outputs:
        computed = len(tokens)  # this step computes the KV of a token the request does not show yet
        new = None
        if computed + 1 > len(blocks) * BLOCK:
            new = [len(blocks)]
            blocks += new
        op = planner.on_cached("r", new, False, computed, 1, list(tokens))
        saves += [(s.index, s.tokens, s.block_ids) for s in (op.saves if op else ())]
        tokens.append(tok)
    assert saves == _expected(prompt + outputs, blocks, [0, 1, 2])


def test_an_asynchronous_load_is_planned_alone_then_the_request_saves_past_it():
    """``load_kv_async``: the hit's chunks are planned as an async load into the blocks vLLM
    allocated (the local hit's blocks left alone); when vLLM schedules the request afterwards,
    with the loaded tokens computed, it loads nothing more and saves from the hit's end on."""
    r = random.Random(5)
    prompt = [r.randrange(1000) for _ in range(300)]
    planner = ChunkPlanner(C, BLOCK, keys_for)
    # local prefix-cache hit: the first 32 tokens (one block); the store: chunks 0-2 (192 tokens)
    assert planner.matched_tokens("r", 32, 3) == 160
    planner.on_alloc("r", prompt, None, True, 160)
    blocks = list(range(10, 16))  # 6 blocks of 32: tokens 0-191
    op = planner.on_async_load("r", blocks)
    assert op.async_load and not op.saves
    assert [(o.index, o.block_ids, o.first_block) for o in op.loads] == [
        (0, (10, 11), 1), (1, (12, 13), 0), (2, (14, 15), 0)]
    assert [o.tokens for o in op.loads] == [tuple(prompt[j * C:(j + 1) * C]) for j in range(3)]
    assert planner.num_hit_tokens == 160
    assert planner.on_async_load("r", blocks) is None  # planned once
    # done: vLLM allocates the rest and schedules the prompt's remaining 108 tokens as a new request
    planner.on_alloc("r", prompt, None, True, 0)
    blocks += list(range(16, 20))
    op = planner.on_new("r", blocks, 192, 108)
    assert not op.loads and [s.index for s in op.saves] == [3]
    assert op.saves[0].block_ids == (16, 17)


def test_a_sliding_window_load_writes_only_the_blocks_vllm_holds():
    """A sliding-window group (vLLM's SlidingWindowManager) holds, after a load of 256 tokens with a
    window of 72, only the blocks of tokens 185 on (blocks 5, 6, 7): chunk 2 is loaded from its
    second block, chunk 3 whole, chunks 0 and 1 not at all."""
    p = ChunkPlanner(C, BLOCK, keys_for, window=72)
    prompt = list(range(300))
    assert p.matched_tokens("r", 0, 4) == 256
    p.on_alloc("r", prompt, None, True, 256)
    op = p.on_new("r", list(range(10, 20)), 256, 300 - 256)
    assert [(o.index, o.first_block, o.block_ids[o.first_block:]) for o in op.loads] == \
        [(2, 1, (15,)), (3, 0, (16, 17))]
    full = ChunkPlanner(C, BLOCK, keys_for)  # (the same without a window: every chunk)
    full.matched_tokens("r", 0, 4)
    full.on_alloc("r", prompt, None, True, 256)
    assert [o.index for o in full.on_new("r", list(range(10, 20)), 256, 44).loads] == [0, 1, 2, 3]


def test_a_sliding_window_chunk_whose_blocks_were_freed_is_not_saved():
    """Chunked prefill, chunks of 128 tokens, a window of 64: chunk 0 is completed by the step from
    96 to 200, when vLLM has freed its first block (tokens before 33 are out of the window): not
    saved. Chunk 1 is completed by the next step, its blocks all held: saved."""
    c = 128
    keys = lambda tokens, salt: [chunk_keys(tokens, NS, c)]  # noqa: E731
    prompt = list(range(300))
    saved = {}
    for window in (64, None):
        p = ChunkPlanner(c, BLOCK, keys, window=window)
        p.on_alloc("r", prompt, None, True, 0)
        blocks = list(range(10))
        ops = [p.on_new("r", blocks[:3], 0, 96), p.on_cached("r", blocks[3:7], False, 96, 104),
               p.on_cached("r", blocks[7:], False, 200, 100)]
        saved[window] = [s.index for op in ops if op for s in op.saves]
        if window:
            assert p.num_unsaved_chunks == 1
    assert saved == {64: [1], None: [0, 1]}


def test_a_step_loads_layer_by_layer_only_where_vllm_runs_every_layers_hook():
    """vLLM replays some steps as full CUDA graphs, in which no ``wait_for_layer_load`` runs: under
    FULL every step, under FULL_DECODE_ONLY / FULL_AND_PIECEWISE a uniform decode batch (every
    request its decode query length: 1, or 1 + the speculative tokens)."""
    from kvstore.integrations.vllm_plan import layerwise_step

    prefill = {"a": 1, "b": 200}
    assert layerwise_step("none", 1, {"a": 1, "b": 1}) and layerwise_step("none", 1, prefill)
    assert not layerwise_step("all", 1, prefill)
    assert layerwise_step("decode", 1, prefill)
    assert not layerwise_step("decode", 1, {"a": 1, "b": 1})
    assert not layerwise_step("decode", 4, {"a": 4}) and layerwise_step("decode", 4, {"a": 1})
