"""Async scheduling: a decode step is launched before the tokens of the one before it are on the
host (they are fed to it where they were sampled). Whatever the mix of requests, the tokens, the
order they stream in, the finish reasons, the local prefix cache and the chunks saved to the store
are those of the engine that waits for every step. On CPU the device is synchronous, so this
checks the bookkeeping; ``pytest -m gpu`` checks it with captured graphs on CUDA."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import PENDING, LLMEngine
from engine.sampling import SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")


def _engine(async_scheduling: bool, static_buffers: bool = False, **kw) -> LLMEngine:
    kw.setdefault("model", "random:tiny")
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_pages", 200)
    kw.setdefault("max_num_seqs", 8)
    eng = LLMEngine(EngineConfig(async_scheduling=async_scheduling, enforce_eager=static_buffers, **kw))
    if static_buffers:  # the CUDA graphs' host path, run eagerly (CPU has no graphs)
        eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    return eng


def _requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded temperature and top-p requests of mixed lengths, some with a stop token."""
    r = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [r.randrange(3, 500) for _ in range(r.randrange(3, 70))]
        kind = i % 3
        params = SamplingParams(max_tokens=r.randrange(1, 40), temperature=(0.0, 0.9, 1.3)[kind],
                                top_p=(1.0, 1.0, 0.8)[kind], seed=1000 + i,
                                stop_token_ids=(r.randrange(3, 500),) if i % 4 == 0 else ())
        reqs.append((prompt, params))
    return reqs


def _start(eng: LLMEngine, reqs, overlapped: int):
    """Adds ``reqs`` and steps until ``overlapped`` steps went first; returns their sequences and
    the outputs streamed so far."""
    seqs = [eng.add_request(p, params) for p, params in reqs]
    streamed = []
    for _ in range(10_000):
        if eng.num_overlapped_steps >= overlapped:
            break
        streamed += eng.step()
    return seqs, streamed


def _drain(eng: LLMEngine) -> list:
    """Steps until the engine has no work (a bounded number of steps: a stuck engine fails)."""
    outs = []
    for _ in range(10_000):
        if not eng.has_work():
            return outs
        outs += eng.step()
    raise AssertionError("the engine still has work after 10,000 steps")


def _serve(eng: LLMEngine, reqs, arrivals: dict[int, int] | None = None):
    """Runs ``reqs`` to the end, request ``i`` added before step ``arrivals.get(i, 0)``; checks the
    streamed outputs against each sequence's tokens. Returns (tokens, finish reasons) per request."""
    arrivals = arrivals or {}
    seqs: dict[int, object] = {}
    streamed: dict[int, list[int]] = {}
    finished: set[int] = set()
    step = 0
    while len(seqs) < len(reqs) or eng.has_work():
        for i, (prompt, params) in enumerate(reqs):
            if i not in seqs and arrivals.get(i, 0) <= step:
                seqs[i] = eng.add_request(prompt, params)
                streamed[seqs[i].seq_id] = []
        for o in eng.step():
            assert o.seq.seq_id not in finished, "a token after the sequence's last"
            streamed[o.seq.seq_id].append(o.token)
            if o.finished:
                finished.add(o.seq.seq_id)
                assert o.seq.is_finished
        step += 1
        assert step < 10_000
    out = []
    for i in range(len(reqs)):
        seq = seqs[i]
        assert seq.is_finished and seq.seq_id in finished
        assert PENDING not in seq.output
        assert streamed[seq.seq_id] == seq.output  # every token streamed once, in order
        out.append((list(seq.output), seq.finish_reason))
    return out


@pytest.mark.parametrize("static_buffers,chunk_size", [(False, 512), (True, 512), (False, 16), (True, 16)],
                         ids=["eager", "static-buffers", "eager-chunked-prefill", "static-buffers-chunked-prefill"])
def test_async_scheduling_gives_the_tokens_of_waiting_for_every_step(static_buffers, chunk_size):
    reqs = _requests(14, seed=1)
    arrivals = {i: (i % 5) * 7 for i in range(len(reqs))}  # requests arrive while others decode
    want = _serve(_engine(False, chunk_size=chunk_size), reqs, arrivals)
    eng = _engine(True, static_buffers, chunk_size=chunk_size)
    got = _serve(eng, reqs, arrivals)
    assert got == want
    assert {reason for _, reason in want} == {"length", "stop"}
    assert eng.num_overlapped_steps > 20  # steady decoding did overlap
    if static_buffers:
        assert eng.runner.decode_graphs.steps > 20  # (overlapped decode steps take their inputs there)


def test_a_request_arriving_during_steady_decoding_is_admitted_at_the_next_step():
    reqs = [(p, SamplingParams(max_tokens=25, ignore_eos=True)) for p, _ in _requests(4, seed=8)]
    want = _serve(_engine(False), reqs, {3: 12})
    eng = _engine(True)
    seqs, _ = _start(eng, reqs[:3], 4)
    late = eng.add_request(*reqs[3])
    k = eng.num_overlapped_steps
    eng.step()
    assert late.num_computed == len(late.prompt)  # admitted and prefilled by that step,
    assert eng.num_overlapped_steps == k + 1  # launched beside the decodes before their tokens were known
    _drain(eng)
    assert [s.output for s in seqs + [late]] == [w[0] for w in want]


def test_a_long_prompt_is_prefilled_chunk_by_chunk_beside_the_decodes(nodes):
    """Chunked prefill: each step of a long prompt admitted while others decode is launched before
    the decodes' tokens are known. Its chunks that sample nothing are registered in the local
    prefix cache and saved to the store when their step is resolved; tokens as the waiting engine's."""
    node = nodes()
    kw = dict(chunk_size=16, max_num_batched_tokens=32, enable_prefix_caching=True, page_size=16, chunk_tokens=32)
    decoders = [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p, _ in _requests(3, seed=12)]
    prompt = [random.Random(13).randrange(3, 500) for _ in range(100)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = _serve(_engine(False, **kw), decoders + [(prompt, params)], {3: 6})
    eng = _engine(True, store=node.address, **kw)
    seqs, _ = _start(eng, decoders, 3)
    late = eng.add_request(prompt, params)
    for i in range(7):  # 100 tokens, 16 a step (the budget leaves 29 beside 3 decodes)
        k = eng.num_overlapped_steps
        eng.step()
        assert eng.num_overlapped_steps == k + 1, i
        assert late.num_computed == min(100, 16 * (i + 1))
    assert late.output == [PENDING]  # its first token still on the device
    _drain(eng)
    assert [(s.output, s.finish_reason) for s in seqs + [late]] == want
    assert eng.connector.flush(timeout_s=120)
    # the prompt's 3 full chunks (and more of the decoders') went to the store, keyed by the real tokens
    assert eng.connector.lookup(prompt, None) == 3
    again = eng.add_request(prompt[:99] + [7], SamplingParams(max_tokens=1))
    _drain(eng)
    assert again.num_local_tokens == 6 * 16  # the 6 full pages of the prompt, registered locally
    eng.close()


def test_a_prompt_whose_last_token_is_computed_alone_comes_after_the_launched_decodes():
    """A 33-token prompt in chunks of 16 is left with one token to compute: the scheduler takes it
    among the decodes (one token each), ahead of a launched one; its token is on the host, theirs
    on the device."""
    reqs = [([11] * 33, SamplingParams(max_tokens=6, ignore_eos=True)),
            ([12] * 5, SamplingParams(max_tokens=6, ignore_eos=True))]
    want = _serve(_engine(False, chunk_size=16), reqs)
    eng = _engine(True, chunk_size=16)
    assert _serve(eng, reqs) == want
    assert eng.num_overlapped_steps >= 4


def test_a_step_whose_prompt_chunk_lacks_a_page_waits_for_the_launched_tokens():
    """A running prompt's next chunk needs a page and none is free: the scheduler will preempt the
    newest sequence, here one whose token is still on the device (it would be recomputed from its
    tokens). So that step waits for the launched tokens first; tokens as the waiting engine's."""
    reqs = [([21] * 40, SamplingParams(max_tokens=2, ignore_eos=True)),  # 16 + 16 + 8 tokens
            ([22] * 20, SamplingParams(max_tokens=5, ignore_eos=True))]  # 16 + 4: samples at step 2
    kw = dict(num_pages=4, chunk_size=16, max_num_batched_tokens=32)
    want = _serve(_engine(False, **kw), reqs)
    eng = _engine(True, **kw)
    long, short = [eng.add_request(p, params) for p, params in reqs]
    eng.step()
    eng.step()
    assert short.output == [PENDING] and eng.blocks.num_free == 0
    eng.step()  # the long prompt's third chunk takes the short one's pages
    assert eng.num_overlapped_steps == 0 and short.num_preemptions == 1 and PENDING not in short.output
    _drain(eng)
    assert [(s.output, s.finish_reason) for s in (long, short)] == want


def test_a_sequence_ending_by_length_is_left_out_instead_of_making_the_step_wait():
    """Which launched token is a sequence's last by length is known before its value: the next
    step leaves that sequence out and still goes first. Only the last step, with nothing left to
    launch, waits."""
    reqs = [(p, SamplingParams(max_tokens=m, ignore_eos=True))
            for (p, _), m in zip(_requests(4, seed=14), (9, 13, 17, 21))]
    want = _serve(_engine(False), reqs)
    eng = _engine(True)
    seqs = [eng.add_request(p, params) for p, params in reqs]
    waited = 0
    for _ in range(100):
        if not eng.has_work():
            break
        launched, k = eng._launched is not None, eng.num_overlapped_steps
        eng.step()
        waited += launched and eng.num_overlapped_steps == k
    assert waited == 1
    assert eng.num_overlapped_steps == 21 - 1
    assert [(s.output, s.finish_reason) for s in seqs] == want
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_pages


def test_a_request_arriving_as_every_running_sequence_ends_is_launched_first():
    reqs = [(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p, _ in _requests(3, seed=15)]
    want = _serve(_engine(False), reqs, {2: 5})
    eng = _engine(True)
    seqs = [eng.add_request(p, params) for p, params in reqs[:2]]
    for _ in range(100):
        if all(len(s.output) == 5 for s in seqs):
            break
        eng.step()
    assert all(s.output[-1] == PENDING for s in seqs)  # both end at the launched step
    late = eng.add_request(*reqs[2])
    k = eng.num_overlapped_steps
    eng.step()
    assert eng.num_overlapped_steps == k + 1 and late.output == [PENDING]
    assert all(s.is_finished for s in seqs)
    _drain(eng)
    assert [(s.output, s.finish_reason) for s in seqs + [late]] == want


def _random_case(seed: int):
    """A random engine configuration (chunk size, token budget, sequences, pages, prefix cache) and
    requests (shared prefixes, lengths, greedy/temperature/top-p, stop tokens, arrival steps)."""
    r = random.Random(seed)
    chunk = r.choice([4, 8, 16, 512])
    kw = dict(chunk_size=chunk, max_num_batched_tokens=max(chunk, r.choice([chunk, 2 * chunk, 3 * chunk + 5, 64])),
              max_num_seqs=r.choice([2, 3, 8]), num_pages=r.choice([12, 20, 200]),
              enable_prefix_caching=r.random() < 0.5)
    shared = [r.randrange(3, 500) for _ in range(40)]
    reqs, arrivals = [], {}
    for i in range(r.randrange(3, 10)):
        prompt = (shared[: r.randrange(0, 40)] + [r.randrange(3, 500) for _ in range(r.randrange(1, 90))])[:100]
        kind = r.randrange(3)
        reqs.append((prompt, SamplingParams(max_tokens=r.randrange(1, 30), temperature=(0.0, 0.8, 1.2)[kind],
                                            top_p=(1.0, 1.0, 0.7)[kind], seed=seed * 100 + i,
                                            stop_token_ids=(r.randrange(3, 500),) if r.random() < 0.3 else ())))
        arrivals[i] = r.choice([0, 0, r.randrange(0, 40)])
    return kw, reqs, arrivals


def test_random_workloads_give_the_tokens_of_waiting_for_every_step():
    """24 random configurations and workloads, each served both ways: the same tokens, streaming
    order and finish reasons, every page back. Across them: preemptions, prompts in several
    chunks, and steps launched first."""
    preempted = chunked = overlapped = 0
    for seed in range(24):
        kw, reqs, arrivals = _random_case(seed)
        want = _serve(_engine(False, **kw), reqs, arrivals)
        eng = _engine(True, **kw)
        seqs = []
        add = eng.add_request
        eng.add_request = lambda *a, **k: seqs.append(add(*a, **k)) or seqs[-1]
        assert _serve(eng, reqs, arrivals) == want, (seed, kw)
        assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_pages, (seed, kw)
        preempted += sum(s.num_preemptions for s in seqs)
        chunked += any(len(p) > kw["chunk_size"] for p, _ in reqs)
        overlapped += eng.num_overlapped_steps
    assert preempted > 0 and chunked > 10 and overlapped > 500, (preempted, chunked, overlapped)


def test_async_scheduling_under_preemption_and_a_tight_token_budget():
    """Pages short (preemptions: steps that wait) and a budget below the batch (decodes left out)."""
    reqs = _requests(10, seed=2)
    for kw in (dict(num_pages=14), dict(max_num_batched_tokens=5, chunk_size=5),
               dict(num_pages=14, max_num_batched_tokens=24, chunk_size=8)):  # (prompt chunks need pages too)
        want = _serve(_engine(False, **kw), reqs)
        eng = _engine(True, **kw)
        assert _serve(eng, reqs) == want, kw
        assert eng.num_overlapped_steps > 0, kw
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_pages  # every page back


def test_an_abort_while_a_step_is_launched_discards_its_row():
    reqs = [(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p, _ in _requests(4, seed=3)]
    want = _serve(_engine(False), reqs)
    eng = _engine(True)
    seqs, _ = _start(eng, reqs, 3)
    victim = seqs[1]
    assert victim.output[-1] == PENDING  # its token is on its way
    eng.abort(victim.seq_id)
    assert victim.finish_reason == "abort" and PENDING not in victim.output
    assert victim.output == want[1][0][: len(victim.output)]
    assert all(o.seq is not victim for o in _drain(eng))
    assert [s.output for s in seqs if s is not victim] == [w[0] for i, w in enumerate(want) if i != 1]
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_pages


def test_switching_async_scheduling_off_between_steps_resolves_the_launched_step():
    reqs = [(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p, _ in _requests(3, seed=4)]
    want = _serve(_engine(False), reqs)
    eng = _engine(True)
    seqs, _ = _start(eng, reqs, 2)
    eng.async_scheduling = False
    outs = eng.step()  # the launched step's tokens, then this step's
    assert len(outs) == 2 * len(seqs) and PENDING not in sum((s.output for s in seqs), [])
    _drain(eng)
    assert [s.output for s in seqs] == [w[0] for w in want]


def test_async_scheduling_beside_ngram_speculation_stays_exact():
    """Drafts need the tokens on the host: every step waits, and steps without drafts (no n-gram
    found) are still launched first and resolved by the next call."""
    reqs = [(p * 3, SamplingParams(max_tokens=30, ignore_eos=True)) for p, _ in _requests(5, seed=9)]
    want = _serve(_engine(False), reqs)
    eng = _engine(True, speculative="ngram", num_speculative_tokens=3)
    assert _serve(eng, reqs) == want
    assert eng.num_spec_steps > 0 and eng.num_overlapped_steps == 0


def test_pages_registered_under_async_scheduling_hold_the_real_tokens():
    """The local prefix cache hashes a page when its KV is computed; under async scheduling the
    token after it may still be on the device. A request repeating prompt + output hits every full
    page and continues as a fresh engine would."""
    prompt = [random.Random(5).randrange(3, 500) for _ in range(37)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    eng = _engine(True, enable_prefix_caching=True, page_size=16)
    (first, _), = _serve(eng, [(prompt, params)])
    assert eng.num_overlapped_steps > 40
    again = prompt + first[:50]  # 87 tokens: 5 full pages, all computed by decode steps but the first 2
    seq = eng.add_request(again, SamplingParams(max_tokens=10, ignore_eos=True))
    _drain(eng)
    assert seq.is_finished and seq.num_local_tokens == 5 * 16
    (want, _), = _serve(_engine(False, enable_prefix_caching=True, page_size=16),
                        [(again, SamplingParams(max_tokens=10, ignore_eos=True))])
    assert seq.output == want


@pytest.fixture
def nodes(tmp_path):
    from tests.helpers import store_nodes

    yield from store_nodes(tmp_path, with_disk=False)


def test_chunks_saved_under_async_scheduling_load_back_exactly(nodes):
    """Chunks completed by decode steps are saved when the step is resolved, keyed by the real
    tokens: another engine loads them and continues with the recomputed tokens."""
    node = nodes()
    chunk = 32
    prompt = [random.Random(6).randrange(3, 500) for _ in range(40)]
    saver = _engine(True, store=node.address, chunk_tokens=chunk)
    (out, _), = _serve(saver, [(prompt, SamplingParams(max_tokens=70, ignore_eos=True))])
    saver.connector.flush()
    assert saver.num_overlapped_steps > 40
    assert saver.connector.stats.chunks_saved == (40 + 70 - 1) // chunk  # 3: two of them by decode steps
    saver.close()
    again = prompt + out  # 110 tokens: three full chunks in the store
    loader = _engine(False, store=node.address, chunk_tokens=chunk)
    (got, _), = _serve(loader, [(again, SamplingParams(max_tokens=8, ignore_eos=True))])
    assert loader.connector.stats.chunks_loaded == 3
    loader.close()
    (want, _), = _serve(_engine(False), [(again, SamplingParams(max_tokens=8, ignore_eos=True))])
    assert got == want


@pytest.mark.parametrize("bad", [None, 1])
def test_an_admission_with_store_hits_overlaps_the_decodes_and_a_bad_chunk_rolls_back(nodes, bad):
    """A decode engine's usual step: a request whose prompt is in the store is admitted while
    others decode. Its chunks land beside that step; a chunk that fails its check where it landed
    (wsum64, after the step) rolls it back to recompute from there, and the step waits for the
    launched tokens before finishing; tokens as a store-less engine's."""
    from kvstore.client import StoreClient

    node = nodes()
    chunk = 32
    prompt = [random.Random(10).randrange(3, 500) for _ in range(4 * chunk + 5)]
    saver = _engine(False, store=node.address, chunk_tokens=chunk, chunk_check="wsum")
    _serve(saver, [(prompt, SamplingParams(max_tokens=1))])
    assert saver.connector.flush(timeout_s=120) and saver.connector.stats.chunks_saved == 4
    keys = saver.connector.keys(prompt, None)
    saver.close()
    if bad is not None:
        with StoreClient(node.address) as c:
            raw = bytearray(c.get(keys[bad]))
            raw[-1] ^= 0x40  # one payload bit
            c.put(keys[bad], raw)
    decoders = [(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p, _ in _requests(3, seed=11)]
    late_params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = _serve(_engine(False), decoders) + _serve(_engine(False), [(prompt, late_params)])
    eng = _engine(True, store=node.address, chunk_tokens=chunk, chunk_check="wsum")
    seqs, streamed = _start(eng, decoders, 3)
    late = eng.add_request(prompt, late_params)
    k = eng.num_overlapped_steps
    streamed += eng.step()
    assert eng.num_overlapped_steps == k + 1  # admitted (and its chunks landed) beside the decodes
    streamed += _drain(eng)
    assert [(s.output, s.finish_reason) for s in seqs + [late]] == want
    assert [[o.token for o in streamed if o.seq is s] for s in seqs + [late]] == [w[0] for w in want]  # in order
    st = eng.connector.stats
    assert late.num_store_tokens == (4 if bad is None else bad) * chunk
    assert st.late_failures == (0 if bad is None else 1)
    assert eng.connector.pool.in_use == 0
    eng.close()


@pytest.mark.gpu
@cuda
def test_async_scheduling_with_captured_graphs_gives_the_eager_tokens():
    reqs = _requests(13, seed=7)
    def engine(**kw):
        return LLMEngine(EngineConfig(model="random:tiny", dtype="float32", device="cuda", num_pages=200,
                                      max_num_seqs=8, **kw))

    want = _serve(engine(enforce_eager=True), reqs)
    eng = engine(async_scheduling=True)
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.captured
    assert _serve(eng, reqs) == want
    assert eng.num_overlapped_steps > 20


def test_in_a_replayed_trace_no_step_with_a_prompt_chunk_waits():
    """bench/engine_host_bench.py --replay, on the Mooncake trace's first 12 requests (long prompts
    prefilled in 512-token chunks beside the decodes): the same steps both ways; waiting for every
    step, the host waits after most of them; with async scheduling after almost none, and never
    after one carrying a prompt chunk."""
    from bench.engine_host_bench import replay

    sync, asy = replay(12, async_scheduling=False, progress=False), replay(12, async_scheduling=True, progress=False)
    assert sync["steps"] == asy["steps"] and asy["chunk_steps"] > 100
    assert sync["in_series"] > sync["steps"] / 2 and sync["chunk_in_series"] > 0
    assert asy["chunk_in_series"] == 0 and asy["in_series"] < asy["steps"] / 50
