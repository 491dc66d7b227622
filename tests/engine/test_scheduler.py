"""Scheduler and page allocator: exact page ids, sharing, eviction order, budgets, preemption."""

import pytest

from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_allocation_is_coldest_first_and_hashes_survive_until_reuse():
    bm = BlockManager(num_pages=4, page_size=16)
    a = bm.allocate(2)
    assert a == [0, 1]
    bm.register(0, h(10))
    bm.register(1, h(11))
    bm.free(a)  # tail first: page 1 is colder than page 0 afterwards? no: reversed order frees 1 then 0
    assert list(bm._free) == [2, 3, 1, 0]
    assert bm.match_prefix([h(10), h(11), h(12)]) == [0, 1]  # pulled back out of the free list
    assert bm.ref[0] == bm.ref[1] == 1 and bm.num_free == 2
    bm.free([0, 1])
    assert bm.allocate(3) == [2, 3, 1]  # page 1's hash is dropped on reuse
    assert h(11) not in bm.cached and bm.cached[h(10)] == 0
    assert bm.match_prefix([h(10), h(11)]) == [0]


def test_shared_pages_are_ref_counted():
    bm = BlockManager(num_pages=3, page_size=16)
    p = bm.allocate(1)
    bm.register(p[0], h(1))
    assert bm.match_prefix([h(1)]) == p
    assert bm.ref[p[0]] == 2
    bm.free(p)
    assert bm.num_free == 2  # still held by the other sequence
    bm.free(p)
    assert bm.num_free == 3


def _sched(num_pages=64, chunk_size=32, budget=64, max_seqs=8, policy="fcfs"):
    bm = BlockManager(num_pages, 16)
    return bm, Scheduler(bm, chunk_size=chunk_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                         chunk_tokens=64, policy=policy)


def _run(sched, out):
    """What the engine does after the model runs: advance, and emit a token when a sequence is caught up."""
    for s in out.scheduled:
        s.seq.num_computed += s.num_new_tokens
        if s.seq.num_computed == s.seq.num_tokens:
            s.seq.output.append(1)
            if len(s.seq.output) >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")


def test_decodes_go_first_and_a_long_prompt_is_chunked():
    bm, sched = _sched(num_pages=80, chunk_size=32, budget=40)
    short = Sequence(list(range(10)), SamplingParams(max_tokens=50))
    sched.add(short)
    out = sched.schedule(lambda s: [])
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(short, 10)]
    assert short.pages == [0]
    _run(sched, out)
    long = Sequence(list(range(1000)), SamplingParams(max_tokens=1))
    sched.add(long)
    for step in range(40):
        out = sched.schedule(lambda s: [])
        # the running decode is always served, first, every step
        assert out.scheduled[0].seq is short and out.scheduled[0].num_new_tokens == 1
        assert all(s.num_new_tokens <= 32 for s in out.scheduled)
        assert out.num_tokens <= 40
        _run(sched, out)
        if long.is_finished:
            break
    assert long.is_finished and step == 1000 // 32  # 32 chunks of 32 tokens (the last one 8)


def test_two_prefills_short_of_pages_do_not_deadlock():
    bm, sched = _sched(num_pages=10, chunk_size=32, budget=64)
    a = Sequence(list(range(150)), SamplingParams(max_tokens=2))
    b = Sequence(list(range(150)), SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    for _ in range(100):
        out = sched.schedule(lambda s: [])
        _run(sched, out)
        if a.is_finished and b.is_finished:
            break
    assert a.is_finished and b.is_finished
    assert b.num_preemptions >= 1 and bm.num_free == 10


def test_admission_takes_shared_pages_and_leaves_the_last_token_to_compute():
    bm, sched = _sched(chunk_size=64)
    first = Sequence(list(range(64)), SamplingParams(max_tokens=1))
    sched.add(first)
    out = sched.schedule(lambda s: [])
    assert first.pages == [0, 1, 2, 3]
    for i, p in enumerate(first.pages):
        bm.register(p, h(i))
    _run(sched, out)
    assert first.is_finished
    second = Sequence(list(range(64)), SamplingParams(max_tokens=1))
    sched.add(second)
    out = sched.schedule(lambda s: [h(0), h(1), h(2), h(3)])
    # all 4 pages are cached, but the last token must be computed: 3 shared + 1 fresh page
    assert second.pages[:3] == [0, 1, 2] and second.pages[3] != 3
    assert second.num_local_tokens == 48 and second.num_computed == 48
    assert out.scheduled[0].num_new_tokens == 16


def test_store_hits_are_planned_as_computed_in_private_pages():
    bm, sched = _sched()
    seq = Sequence(list(range(200)), SamplingParams(max_tokens=1))
    seq.store_hit_chunks = 3  # the store holds 192 tokens
    sched.add(seq)
    out = sched.schedule(lambda s: [])
    assert seq.num_computed == 192 and seq.num_store_tokens == 192
    assert out.scheduled[0].num_new_tokens == 8
    assert len(seq.pages) == 13


def test_whole_prompt_in_store_still_computes_its_last_token():
    bm, sched = _sched()
    seq = Sequence(list(range(128)), SamplingParams(max_tokens=1))
    seq.store_hit_chunks = 2
    sched.add(seq)
    out = sched.schedule(lambda s: [])
    assert seq.num_store_tokens == 64  # the last chunk holds the last token: recomputed
    assert out.scheduled[0].num_new_tokens == 32 and seq.num_computed == 64


def test_preemption_frees_the_newest_sequence_and_requeues_it_first():
    bm, sched = _sched(num_pages=4, chunk_size=64, budget=128)
    a = Sequence(list(range(31)), SamplingParams(max_tokens=40))
    b = Sequence(list(range(31)), SamplingParams(max_tokens=40))
    sched.add(a)
    sched.add(b)
    out = sched.schedule(lambda s: [])
    assert a.pages == [0, 1] and b.pages == [2, 3]
    _run(sched, out)
    for _ in range(3):  # a and b grow to 33 tokens: both need a third page, one is free... none is
        out = sched.schedule(lambda s: [])
        _run(sched, out)
        if b.status is SeqStatus.WAITING:
            break
    assert b.status is SeqStatus.WAITING and b.num_preemptions == 1 and b.pages == []
    assert sched.waiting[0] is b and b.num_computed == 0
    assert len(a.pages) == 3


def test_priority_orders_the_queue_then_first_come_first_served():
    _, sched = _sched(policy="priority")
    seqs = [Sequence([1, 2], SamplingParams(priority=p)) for p in (2, 0, 1, 0, -5, 2)]
    for s in seqs:
        sched.add(s)
    assert list(sched.waiting) == [seqs[4], seqs[1], seqs[3], seqs[2], seqs[0], seqs[5]]
    _, fcfs = _sched()
    for s in seqs:
        fcfs.add(s)
    assert list(fcfs.waiting) == seqs  # (priorities ignored: the engine refuses them there)


def test_priority_admits_the_most_urgent_first_and_preempts_the_least_urgent():
    """Pages for two sequences: the two most urgent run, the more urgent first in the step; when
    they grow, the least urgent running one is preempted, though it came first, and goes back to
    its place in the queue."""
    bm, sched = _sched(num_pages=4, chunk_size=64, budget=128, policy="priority")
    low = Sequence(list(range(31)), SamplingParams(max_tokens=40, priority=5))
    sched.add(low)
    out = sched.schedule(lambda s: [])  # low runs alone
    _run(sched, out)
    high = Sequence(list(range(31)), SamplingParams(max_tokens=40, priority=1))
    waiting = Sequence(list(range(31)), SamplingParams(max_tokens=40, priority=9))
    sched.add(waiting)
    sched.add(high)
    assert list(sched.waiting) == [high, waiting]
    out = sched.schedule(lambda s: [])
    assert [s.seq for s in out.scheduled] == [low, high] and sched.running == [low, high]
    _run(sched, out)
    for _ in range(3):  # low (a step ahead) needs a third page first: it is the least urgent, so it goes
        out = sched.schedule(lambda s: [])
        _run(sched, out)
        if low.status is SeqStatus.WAITING:
            break
    assert low.status is SeqStatus.WAITING and low.num_preemptions == 1 and high.num_preemptions == 0
    assert list(sched.waiting) == [low, waiting]
    _run(sched, sched.schedule(lambda s: []))
    assert len(high.pages) == 3 and sched.running[0] is high


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_running_sequences_take_the_steps_budget_in_priority_order(policy):
    _, sched = _sched(num_pages=64, chunk_size=64, budget=128, policy=policy)
    low = Sequence(list(range(20)), SamplingParams(max_tokens=40, priority=5 if policy == "priority" else 0))
    sched.add(low)
    _run(sched, sched.schedule(lambda s: []))
    high = Sequence(list(range(20)), SamplingParams(max_tokens=40))
    sched.add(high)
    _run(sched, sched.schedule(lambda s: []))
    assert sched.running == [low, high]
    sched.budget = 1  # one decode fits: the more urgent's (under fcfs: the first come's)
    out = sched.schedule(lambda s: [])
    assert [s.seq for s in out.scheduled] == [high if policy == "priority" else low]


def test_fcfs_preempts_the_newest_even_when_it_is_more_urgent():
    """(the same sequences under fcfs: priority plays no part)"""
    bm, sched = _sched(num_pages=4, chunk_size=64, budget=128)
    low = Sequence(list(range(31)), SamplingParams(max_tokens=40))
    high = Sequence(list(range(31)), SamplingParams(max_tokens=40))
    sched.add(low)
    sched.add(high)
    for _ in range(4):
        _run(sched, sched.schedule(lambda s: []))
    assert high.num_preemptions == 1 and low.num_preemptions == 0


def test_token_range_is_the_slice_of_prompt_output_and_draft():
    seq = Sequence([10, 11, 12, 13], SamplingParams(), output=[20, 21, 22], draft=[30, 31])
    whole = seq.tokens + seq.draft
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.token_range(start, end) == whole[start:end], (start, end)
    seq.output.clear()
    seq.draft.clear()
    assert seq.token_range(2, 4) == [12, 13] and seq.token_range(4, 4) == []
