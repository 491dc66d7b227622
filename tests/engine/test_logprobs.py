"""Log-probabilities (``SamplingParams.logprobs``): each generated token's, and the top ``k`` of
its position, are the log-softmax of the logits a plain forward of the whole sequence gives there
(``tests/engine/reference.py``, itself checked against transformers by ``test_hf_parity``), whatever
path computed them: chunked prefill, decode, async scheduling, graphs' static buffers, speculative
verification, or KV loaded from the store."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling import LOGPROB_FLOOR, MAX_LOGPROBS, SamplingParams, TokenLogprobs
from tests.engine.reference import all_logits

MODEL = "random:tiny"


def _engine(**kw) -> LLMEngine:
    kw.setdefault("num_pages", 200)
    kw.setdefault("max_num_seqs", 8)
    static = kw.pop("static_buffers", False)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", enforce_eager=static, **kw))
    if static:  # the CUDA graphs' host path, run eagerly (CPU has no graphs)
        eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    return eng


def _requests(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and sampled requests, some asking for no logprobs, some for 0 or several alternatives."""
    r = random.Random(seed)
    reqs = []
    for i in range(8):
        prompt = [r.randrange(3, 500) for _ in range(r.randrange(3, 60))]
        reqs.append((prompt, SamplingParams(max_tokens=r.randrange(1, 14), temperature=(0.0, 0.9)[i % 2],
                                            top_p=(1.0, 0.8)[i % 3 == 2], seed=i, ignore_eos=True,
                                            logprobs=(None, 0, 3, MAX_LOGPROBS)[i % 4],
                                            prompt_logprobs=(None, 2, None, 0, 5)[i % 5])))
    return reqs


def _run(eng: LLMEngine, reqs, stats: dict | None = None) -> list[tuple[list[int], list[TokenLogprobs], list]]:
    """Serves ``reqs``; checks that each streamed output carries its token's logprobs (or none).
    Returns (output, its logprobs, prompt logprobs) per request; ``stats["preemptions"]``: how many."""
    seqs = [eng.add_request(p, params) for p, params in reqs]
    streamed = {s.seq_id: [] for s in seqs}
    for _ in range(10_000):
        if not eng.has_work():
            break
        for o in eng.step():
            assert (o.logprobs is None) == (o.seq.params.logprobs is None)
            streamed[o.seq.seq_id].append(o.logprobs)
    assert all(s.is_finished for s in seqs)
    if stats is not None:
        stats["preemptions"] = sum(s.num_preemptions for s in seqs)
    for s in seqs:
        if s.params.logprobs is not None:
            assert streamed[s.seq_id] == s.logprobs and len(s.logprobs) == len(s.output)
        else:
            assert s.logprobs == []
        if s.params.prompt_logprobs is not None:
            assert len(s.prompt_logprobs) == len(s.prompt) and s.prompt_logprobs[0] is None
            if not s.num_preemptions:  # (recomputed after a preemption, with them all: reuse allowed)
                assert s.num_store_tokens == s.num_local_tokens == 0  # computed whole
        else:
            assert s.prompt_logprobs == []
    return [(list(s.output), list(s.logprobs), list(s.prompt_logprobs)) for s in seqs]


def _check_against_reference(model: str, prompt: list[int], output: list[int], lps: list[TokenLogprobs],
                             k: int, atol: float = 1e-4, prompt_lps: list | None = None, pk: int = 0) -> None:
    """``lps`` (and ``prompt_lps``, top ``pk``) against the log-softmax of a plain forward."""
    every = torch.log_softmax(all_logits(model, prompt + output), dim=-1)
    if prompt_lps is not None:
        assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
        _check_rows(every[:len(prompt) - 1], prompt[1:], prompt_lps[1:], pk, atol, ranked=True)
    _check_rows(every[len(prompt) - 1:-1], output, lps, k, atol)


def _check_rows(ref: torch.Tensor, tokens: list[int], lps: list[TokenLogprobs], k: int, atol: float,
                ranked: bool = False) -> None:
    """``ranked``: each token's rank too (prompt tokens'), within the reference's near-ties."""
    assert len(lps) == len(tokens)
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=atol), f"token {i}"
        v = ref[i, tok].item()
        if ranked:
            assert int((ref[i] > v + atol).sum()) + 1 <= lp.rank <= int((ref[i] >= v - atol).sum()), f"token {i}"
        else:
            assert lp.rank is None
        assert len(lp.top) == k
        want_v, want_i = ref[i].topk(k)
        assert [t for t, _ in lp.top] == want_i.tolist(), f"token {i}: top ids"
        assert [v for _, v in lp.top] == pytest.approx(want_v.tolist(), abs=atol)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_logprobs_of_every_path_are_those_of_a_plain_forward():
    reqs = _requests(seed=1)
    base = _run(_engine(), reqs)
    for (prompt, params), (out, lps, plps) in zip(reqs, base):
        if params.logprobs is not None:
            _check_against_reference(MODEL, prompt, out, lps, params.logprobs,
                                     prompt_lps=plps if params.prompt_logprobs is not None else None,
                                     pk=params.prompt_logprobs)
    # a greedy request's token is its position's most likely: the first of its top list
    for (_, params), (out, lps, _) in zip(reqs, base):
        if params.temperature == 0 and params.logprobs:
            assert [lp.top[0][0] for lp in lps] == out and all(lp.logprob == lp.top[0][1] for lp in lps)
    for kw in ({"chunk_size": 16, "max_num_batched_tokens": 40}, {"async_scheduling": True},
               {"async_scheduling": True, "static_buffers": True}, {"async_scheduling": True, "chunk_size": 16},
               {"enable_prefix_caching": True, "chunk_size": 16}, {"num_pages": 12, "chunk_size": 16}):
        eng = _engine(**kw)
        if kw.get("enable_prefix_caching"):  # every prompt's pages already in the local cache
            _run(eng, [(p, SamplingParams(max_tokens=1)) for p, _ in reqs])
        stats = {}
        got = _run(eng, reqs, stats)
        if "num_pages" in kw:  # pages for a few sequences at a time: some are preempted and recomputed
            assert stats["preemptions"] > 0, kw
        for (want_out, want_lps, want_plps), (out, lps, plps) in zip(base, got):
            assert out == want_out, kw
            for a, b in zip(lps + plps[1:], want_lps + want_plps[1:]):
                assert [t for t, _ in a.top] == [t for t, _ in b.top], kw
                assert [a.logprob, *(v for _, v in a.top)] == pytest.approx([b.logprob, *(v for _, v in b.top)],
                                                                           abs=1e-5), kw


def test_a_speculative_verification_reports_the_logprobs_of_each_token_it_emits():
    """A verification step emits several tokens from one forward: each gets the logprobs of its own row."""
    reqs = [(p * 3, SamplingParams(max_tokens=24, ignore_eos=True, temperature=t, seed=7, logprobs=4))
            for (p, _), t in zip(_requests(seed=2)[:4], (0.0, 0.0, 0.8, 0.8))]
    eng = _engine(speculative="ngram", num_speculative_tokens=3)
    got = _run(eng, reqs)
    assert eng.num_accepted_tokens > 0  # several tokens a step
    for (prompt, params), (out, lps, _) in zip(reqs, got):
        _check_against_reference(MODEL, prompt, out, lps, params.logprobs)
    assert [g[0] for g in got[:2]] == [g[0] for g in _run(_engine(), reqs[:2])]  # greedy: the plain tokens


@pytest.fixture
def nodes(tmp_path):
    from tests.helpers import store_nodes

    yield from store_nodes(tmp_path, with_disk=False)


def test_kv_loaded_from_the_store_gives_the_logprobs_of_recompute_and_prompt_logprobs_recompute(nodes):
    node = nodes()
    prompt = [random.Random(3).randrange(3, 500) for _ in range(100)]
    params = SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True)
    with LLM(MODEL, store=node.address, chunk_tokens=32, dtype="float32") as saver:
        saver.generate(prompt, max_tokens=1)
    with LLM(MODEL, store=node.address, chunk_tokens=32, dtype="float32") as loader:
        got, = loader.generate(prompt, max_tokens=params.max_tokens, logprobs=5, ignore_eos=True)
    assert got.num_cached_tokens == 96
    _check_against_reference(MODEL, prompt, got.token_ids, got.logprobs, 5)
    # prompt logprobs need every prompt position's logits: the prompt is computed, not loaded
    with LLM(MODEL, store=node.address, chunk_tokens=32, dtype="float32") as engine:
        whole, = engine.generate(prompt, max_tokens=2, logprobs=1, prompt_logprobs=3, ignore_eos=True)
        again, = engine.generate(prompt, max_tokens=2, ignore_eos=True)
    assert whole.num_cached_tokens == whole.num_local_cached_tokens == 0
    assert again.num_cached_tokens + again.num_local_cached_tokens == 96  # the others still reuse it
    _check_against_reference(MODEL, prompt, whole.token_ids, whole.logprobs, 1, prompt_lps=whole.prompt_logprobs, pk=3)


def test_logprobs_zero_reports_the_tokens_own_and_none_is_nothing():
    with LLM(MODEL, dtype="float32") as llm:
        zero, = llm.generate([5, 6, 7], max_tokens=3, logprobs=0)
        none, = llm.generate([5, 6, 7], max_tokens=3)
    assert len(zero.logprobs) == 3 and all(lp.top == () and lp.logprob <= 0 for lp in zero.logprobs)
    assert none.logprobs is None and none.token_ids == zero.token_ids


def test_an_impossible_token_reports_the_floor_not_minus_infinity():
    from engine.sampling import token_logprobs

    logits = torch.tensor([[0.0, -float("inf"), 1.0]])
    lp, = token_logprobs(logits, [1], 3)
    assert lp.logprob == LOGPROB_FLOOR and lp.top[-1] == (1, LOGPROB_FLOOR)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True, "3"])
def test_bad_logprobs_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_the_host_bench_runs_with_logprobs(capsys):
    """bench/engine_host_bench.py --logprobs: its table, each configuration run both ways."""
    from bench.engine_host_bench import CONFIGS, main

    main(["--logprobs", "2", "--steps", "3", "--reps", "1"])
    out = capsys.readouterr().out
    assert out.count("logprobs None host") == out.count("logprobs 2 host") == len(CONFIGS)
    assert "| batch | context | host µs/step, no logprobs | with 2 |" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")
def test_logprobs_on_the_gpu_with_captured_graphs_and_async_scheduling():
    """On CUDA the logprobs are computed on the device and reach the host with the tokens (pinned,
    after the step's event): through replayed decode graphs, async scheduling and a prompt's chunks
    they are the log-softmax of a plain forward on the same device."""
    reqs = _requests(seed=4)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", device="cuda", num_pages=200, max_num_seqs=8,
                                 chunk_size=16, async_scheduling=True))
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.captured
    got = _run(eng, reqs)
    assert eng.num_overlapped_steps > 0
    for (prompt, params), (out, lps, plps) in zip(reqs, got):
        if params.logprobs is not None:
            every = torch.log_softmax(all_logits(MODEL, prompt + out, device="cuda"), dim=-1)
            for i, (tok, lp) in enumerate(zip(out, lps)):
                assert lp.logprob == pytest.approx(every[len(prompt) - 1 + i, tok].item(), abs=1e-3)
            if params.prompt_logprobs is not None:
                assert [lp.logprob for lp in plps[1:]] == pytest.approx(
                    every[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist(), abs=1e-3)
