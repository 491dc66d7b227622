"""Decode steps through the static buffers of CUDA graphs: padding rows never touch a sequence's
pages, and tokens are those of the plain path. On CPU the buffers run eagerly (no graph exists
there); on a GPU (``pytest -m gpu``) the captured graphs replay."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import batch_buckets
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")


def _prompts(n: int) -> list[list[int]]:
    r = random.Random(n)
    return [[r.randrange(3, 500) for _ in range(r.randrange(5, 90))] for _ in range(n)]


def _generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    seqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while not all(s.is_finished for s in seqs):
        eng.step()
    return [list(s.output) for s in seqs]


def _engine(**kw) -> LLMEngine:
    kw.setdefault("model", "random:tiny")
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(num_pages=96, max_num_seqs=kw.pop("max_num_seqs", 8), enable_prefix_caching=False,
                                  **kw))


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_static_decode_buffers_give_the_plain_paths_tokens_and_touch_no_sequence_page(batch):
    """Batches of 3 and 5 run padded to 4 and 8: the padding rows write only the scratch page."""
    prompts = _prompts(batch)
    plain = _engine(enforce_eager=True)
    want = _generate(plain, prompts)
    static = _engine(enforce_eager=True)
    runner = static.runner
    runner.decode_graphs = graphs = runner.make_decode_graphs(capture=False)
    scratch = runner.scratch_page
    for k in runner.k_caches:
        k[scratch] = float("nan")  # a padding row that read anything but its own slot would spread NaN
    assert _generate(static, prompts) == want
    assert graphs.steps >= 23  # every step after the prefill went through the buffers
    for mine, theirs in zip(runner.k_caches + runner.v_caches, plain.runner.k_caches + plain.runner.v_caches):
        # The sequences' pages as the plain path left them. NOTE: not bit for bit: a batch padded
        # from 3 rows to 4 takes another BLAS kernel (1-ulp differences, as any other batching);
        # a padding row's K/V written there would differ by ~0.1.
        torch.testing.assert_close(mine[:scratch], theirs[:scratch], rtol=0, atol=1e-5)
    if batch in (3, 5):
        assert not torch.isnan(runner.k_caches[0][scratch, 0]).all()  # padding rows wrote there


def test_sequences_longer_than_the_table_or_batches_larger_than_the_buffers_run_eagerly():
    def run(eng):
        prompts = _prompts(6)
        return [_generate(eng, [p[:20] for p in prompts[:2]], max_tokens=6),  # fits: 2 rows, 2 pages each
                _generate(eng, [prompts[2][:1] * 60], max_tokens=6),  # 5 pages > 3
                _generate(eng, [p[:20] for p in prompts], max_tokens=6)]  # 6 rows > 4

    eng = _engine(enforce_eager=True, max_num_seqs=6)
    graphs = eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    graphs.max_batch, graphs.max_pages = 4, 3  # as if captured for 4 rows, a model of 48 positions
    got = run(eng)
    assert graphs.steps == 5 and graphs.fallbacks == 10
    assert got == run(_engine(enforce_eager=True, max_num_seqs=6))


def test_a_draft_models_passes_through_the_buffers_feed_its_drafted_tokens():
    """A draft model drafts token by token: its one-token passes sit past the sequence's real
    tokens (the last drafted token is the input), and go through its runner's buffers. Wrong
    inputs would not change the output (verification keeps it exact) but would the drafts."""
    def engine():
        # the target itself as the draft model: every draft is accepted, if its inputs are right
        return _engine(enforce_eager=True, speculative="draft", draft_model="random:tiny")

    prompts = _prompts(3)
    plain = engine()
    want = _generate(plain, prompts)
    eng = engine()
    draft_runner = eng.drafter.runner
    draft_runner.decode_graphs = graphs = draft_runner.make_decode_graphs(capture=False)
    assert _generate(eng, prompts) == want
    assert graphs.steps > 0 and eng.num_draft_tokens > 0
    assert (eng.num_draft_tokens, eng.num_accepted_tokens) == (plain.num_draft_tokens, plain.num_accepted_tokens)
    assert eng.num_accepted_tokens > 0.9 * eng.num_draft_tokens


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("batch", [1, 3, 13])
def test_captured_decode_graphs_give_the_eager_tokens(batch):
    prompts = _prompts(batch)
    eager = _engine(device="cuda", enforce_eager=True, max_num_seqs=16)
    graphed = _engine(device="cuda", max_num_seqs=16)
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and graphs.captured and graphs.buckets == [1, 2, 4, 8, 16]
    assert _generate(graphed, prompts) == _generate(eager, prompts)
    assert graphs.steps >= 23


def test_block_table_rows_follow_every_change_of_the_page_lists():
    """The host mirror writes only a row's new pages when it holds the same page list, longer;
    every other change (another sequence in the row, a list replaced or shortened, a row turned
    padding) rewrites the row. After any mix of them each row is exactly its table, then scratch."""
    eng = _engine(enforce_eager=True, max_num_seqs=8)
    graphs = eng.runner.make_decode_graphs(capture=False)
    scratch, width = graphs.scratch_page, graphs.max_pages
    r = random.Random(7)
    lists = [[r.randrange(scratch) for _ in range(r.randrange(1, 4))] for _ in range(12)]
    order = list(range(len(lists)))
    rows_rewritten = appended = 0
    for _ in range(400):
        op = r.random()
        k = r.randrange(len(lists))
        if op < 0.4 and len(lists[k]) < width:  # grows in place, as the scheduler does
            lists[k] += [r.randrange(scratch) for _ in range(r.randrange(1, 3))][: width - len(lists[k])]
            appended += 1
        elif op < 0.55:  # shortened into a new list (spec decode's trim), then maybe regrown to the same length
            n = len(lists[k])
            lists[k] = lists[k][: r.randrange(1, n + 1)]
            lists[k] += [r.randrange(scratch) for _ in range(n - len(lists[k]))]
        elif op < 0.6 and len(lists[k]) > 1:  # shortened in place: rewritten all the same
            del lists[k][-1]
        elif op < 0.65:  # replaced (preempted, readmitted with other pages)
            lists[k] = [r.randrange(scratch) for _ in range(r.randrange(1, width + 1))]
        if r.random() < 0.2:  # rows change owners now and then; batches grow and shrink
            r.shuffle(order)
        batch = r.randrange(1, 9)
        tables = [lists[i] for i in order[:batch]]
        held = [h[0] if h else None for h in graphs._rows[:batch]]
        rows_rewritten += sum(h is not t for h, t in zip(held, tables))
        graphs.run([0] * batch, [0] * batch, [scratch * graphs.page_size] * batch, tables)
        bucket = graphs.buckets[next(i for i, b in enumerate(graphs.buckets) if b >= batch)]
        mirror = graphs._host_i32[:bucket, 1:].tolist()
        for b in range(bucket):
            want = tables[b] if b < batch else []
            assert mirror[b] == want + [scratch] * (width - len(want)), (b, batch)
        assert (graphs._dev_i32[:bucket] == graphs._host_i32[:bucket]).all()
    assert rows_rewritten > 50 and appended > 50  # both paths taken


def test_static_buffers_keep_the_plain_tokens_while_batches_shift_and_sequences_are_preempted():
    """Sequences of different lengths finish at different steps (rows change owners), and a pool
    too small for all of them preempts and readmits some (their page lists replaced)."""
    r = random.Random(3)
    prompts = [[r.randrange(3, 500) for _ in range(r.randrange(5, 40))] for _ in range(8)]
    lengths = [r.randrange(4, 40) for _ in prompts]

    def generate(eng):
        seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        while not all(s.is_finished for s in seqs):
            eng.step()
        return [list(s.output) for s in seqs], sum(s.num_preemptions for s in seqs)

    def engine():
        return LLMEngine(EngineConfig(model="random:tiny", dtype="float32", num_pages=20, max_num_seqs=8,
                                      enforce_eager=True, enable_prefix_caching=False))

    want, preempted = generate(engine())
    eng = engine()
    graphs = eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    assert generate(eng) == (want, preempted)
    assert preempted > 0 and graphs.steps > 20


def test_static_buffers_keep_the_plain_tokens_under_ngram_speculation():
    """Verification steps run eagerly and free the pages of rejected drafts; the decode steps
    between them go through the buffers, whose rows must follow those trimmed page lists."""
    r = random.Random(5)
    # repetitive prompts, so that prompt lookup drafts often (and is often wrong: random weights)
    prompts = [[r.randrange(3, 30) for _ in range(r.randrange(20, 60))] for _ in range(3)]

    def engine():
        return _engine(enforce_eager=True, speculative="ngram", num_speculative_tokens=4, ngram_max=3, ngram_min=3)

    plain = engine()
    want = _generate(plain, prompts, max_tokens=40)
    eng = engine()
    graphs = eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    assert _generate(eng, prompts, max_tokens=40) == want
    assert graphs.steps > 5 and eng.num_draft_tokens > eng.num_accepted_tokens > 0
