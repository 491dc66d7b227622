"""A logit bias, allowed tokens, banned token sequences (bad words) and a minimum length: a request
with them gets the tokens of a plain loop over the model (the whole sequence's logits each time, the
processing done by a twin written token by token, greedy argmax, the stop rule applied by hand), on
every path of the engine: chunked prefill, async scheduling, the graphs' static buffers and beside
speculation (whose verification applies them row by row)."""

import math
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import Sampler, SamplingParams
from tests.engine.reference import all_logits

MODEL = "random:tiny"


def _twin(logits: torch.Tensor, output: list[int], p: SamplingParams, eos) -> torch.Tensor:
    """The processing, a token at a time (no penalties: test_penalties has theirs)."""
    out = logits.clone()
    if p.allowed_token_ids is not None:
        for t in range(len(out)):
            if t not in p.allowed_token_ids:
                out[t] = -math.inf
    for w in p.bad_words_ids:
        if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == list(w[:-1])):
            out[w[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[t] = -math.inf
    for t, b in p.logit_bias:
        out[t] += b
    return out


def _reference(prompt: list[int], p: SamplingParams, eos, device: str = "cpu") -> tuple[list[int], str]:
    out: list[int] = []
    while True:
        logits = all_logits(MODEL, prompt + out, device=device)[-1]
        out.append(int(_twin(logits, out, p, eos).argmax()))
        if p.is_stop(out[-1], len(out), eos):
            return out, "stop"
        if len(out) == p.max_tokens:
            return out, "length"


def _eos() -> set[int]:
    return LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=8)).eos


def test_the_processing_is_its_twin():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=g) * 3
    eos = {299}
    output = [5, 7, 9, 7]
    s = Sampler(eos)
    cases = [SamplingParams(logit_bias={3: 5.0, 250: -100, 7: 0.5}),
             SamplingParams(allowed_token_ids=(1, 2, 3, 200)),
             SamplingParams(bad_words_ids=[[4], [9, 7, 11], [7, 12], [5, 6]]),
             SamplingParams(min_tokens=5, stop_token_ids=(17,)),
             SamplingParams(min_tokens=5, ignore_eos=True, stop_token_ids=(17,)),
             SamplingParams(min_tokens=4, logit_bias={299: 100.0}, allowed_token_ids=(299, 17, 20),
                            bad_words_ids=[[7, 20]])]
    for sid, p in enumerate(cases):
        for n in range(len(output) + 1):
            got = s.processed(logits.clone(), sid, p, [1, 2], output[:n])
            assert torch.equal(got, _twin(logits, output[:n], p, eos)), (p, n)
    assert not SamplingParams().has_processors and not SamplingParams(logit_bias={}).has_processors
    assert SamplingParams(min_tokens=1).has_processors and not SamplingParams(min_tokens=1).needs_history
    assert not SamplingParams(bad_words_ids=[[3]]).needs_history
    assert SamplingParams(bad_words_ids=[[3, 4]]).needs_history


def _requests(eos) -> list[tuple[list[int], SamplingParams]]:
    """Requests whose processing changes their greedy tokens (each checked against the plain ones)."""
    r = random.Random(5)
    reqs = []
    for kind in range(7):
        prompt = [r.randrange(3, 200) for _ in range(r.randrange(5, 40))]
        plain, _ = _reference(prompt, SamplingParams(max_tokens=12, ignore_eos=True), eos)
        if kind == 0:  # a bias that pushes a token in, one that keeps the first plain token out
            p = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={77: 6.0, plain[0]: -100.0})
        elif kind == 1:
            p = SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=tuple(range(100, 140)))
        elif kind == 2:  # a pair banned where the output would have it: the same tokens until then
            # (shorter: no step overlaps while it runs, its next logits depending on its last token)
            p = SamplingParams(max_tokens=8, ignore_eos=True, bad_words_ids=[[plain[2], plain[3]]])
        elif kind == 3:  # EOS pushed to the top: the minimum length alone holds it back
            p = SamplingParams(max_tokens=12, min_tokens=5, logit_bias={min(eos): 100.0})
        elif kind == 4:  # a stop token id pushed to the top, after a minimum length
            p = SamplingParams(max_tokens=12, min_tokens=3, stop_token_ids=(plain[1],), logit_bias={plain[1]: 50.0})
        elif kind == 5:  # one token banned outright
            p = SamplingParams(max_tokens=12, ignore_eos=True, bad_words_ids=[[plain[4]]])
        else:  # nothing: beside the others
            p = SamplingParams(max_tokens=12, ignore_eos=True)
        want = _reference(prompt, p, eos)
        assert kind == 6 or want[0] != plain, (kind, p)
        if kind == 2:
            assert want[0][:3] == plain[:3]
        reqs.append((prompt, p, want))
    return reqs


@pytest.fixture(scope="module")
def requests_and_wants():
    eos = _eos()
    return eos, _requests(eos)


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 8, "max_num_batched_tokens": 24}, {"async_scheduling": True},
                                {"async_scheduling": True, "static_buffers": True},
                                {"speculative": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "chunked-prefill", "async", "async-static-buffers", "ngram"])
def test_processed_greedy_requests_give_the_tokens_of_a_plain_loop(requests_and_wants, kw):
    eos, reqs = requests_and_wants
    kw = dict(kw)
    static = kw.pop("static_buffers", False)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=200, max_num_seqs=8, enforce_eager=static,
                                 **kw))
    if static:
        eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    seqs = [eng.add_request(prompt, p) for prompt, p, _ in reqs]
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
    for seq, (prompt, p, (tokens, reason)) in zip(seqs, reqs):
        assert (seq.output, seq.finish_reason) == (tokens, reason), (p, kw)
    min_len = [(s, p) for s, (_, p, _) in zip(seqs, reqs) if p.min_tokens]
    assert all(len(s.output) == p.min_tokens + 1 for s, p in min_len)  # (held back exactly that long)
    if kw.get("async_scheduling"):
        assert eng.num_overlapped_steps > 0
    if kw.get("speculative"):
        assert eng.num_spec_steps > 0
        banned_pairs = [s for s, (_, p, _) in zip(seqs, reqs) if p.needs_history]
        assert banned_pairs and all(s.num_draft_tokens == 0 for s in banned_pairs)


def test_verification_masks_stop_tokens_row_by_row_before_the_minimum_length():
    """Drafts are checked against the processed rows: the rows before ``min_tokens`` have EOS
    masked (their drafts accepted), the row after does not (EOS emitted there)."""
    eos = 3
    logits = torch.tensor([[0.0, 2.0, 0.0, 9.0]] * 3)
    s = Sampler({eos})
    p = SamplingParams(max_tokens=8, min_tokens=2)
    assert s.verify(logits, [1, 1], p, seq_id=0, history=([0], [])) == [1, 1, 3]
    assert s.verify(logits, [1, 1], SamplingParams(max_tokens=8), seq_id=1, history=([0], [])) == [3]
    assert s.verify(logits, [1, 1], p, seq_id=2, history=([0], [2])) == [1, 3]  # one output already


def test_sampled_draws_follow_the_biased_distribution_within_the_allowed_tokens():
    logits = torch.zeros(1, 6)
    p = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=(0, 1, 2, 5), logit_bias={0: math.log(3)})
    want = torch.tensor([3, 1, 1, 0, 0, 1]) / 6
    s, n = Sampler(), 20_000
    counts = torch.bincount(torch.tensor([s.sample_async(logits, [p], [0], [([4], [])]).tolist()[0]
                                          for _ in range(n)]), minlength=6)
    assert counts[3] == counts[4] == 0
    assert torch.allclose(counts / n, want, atol=0.015), (counts / n, want)


@pytest.mark.parametrize("kw,msg", [
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias={-3: 1}), "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"), (dict(logit_bias=[(3, "x")]), "logit_bias"),
    (dict(allowed_token_ids=()), "allowed_token_ids"), (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words_ids=[[]]), "bad_words_ids"), (dict(bad_words_ids="ab"), "bad_words_ids"),
    (dict(bad_words_ids=[[1, True]]), "bad_words_ids")])
def test_bad_values_are_refused_by_name(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_the_engine_refuses_token_ids_beyond_its_vocabulary_and_an_impossible_minimum():
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=16))
    vocab = eng.model_config.vocab_size
    for kw in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=(1, vocab)), dict(bad_words_ids=[[1, vocab]]),
               dict(stop_token_ids=(vocab,))):
        with pytest.raises(ValueError, match=f"in \\[0, {vocab}\\)"):
            eng.add_request([1, 2], SamplingParams(**kw))
    eos = min(eng.eos)
    with pytest.raises(ValueError, match="allowed_token_ids is a stop token"):
        eng.add_request([1, 2], SamplingParams(min_tokens=2, allowed_token_ids=(eos,)))
    eng.add_request([1, 2], SamplingParams(min_tokens=2, allowed_token_ids=(eos,), ignore_eos=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")
def test_processed_requests_on_the_gpu_with_captured_graphs_and_async_scheduling(requests_and_wants):
    """On CUDA (the masks and biases kept on the device, decode graphs replayed, steps launched
    ahead) the tokens are those of the plain loop over a forward on the same device."""
    eos, reqs = requests_and_wants
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", device="cuda", num_pages=200, max_num_seqs=8,
                                 async_scheduling=True))
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.captured
    seqs = [eng.add_request(prompt, p) for prompt, p, _ in reqs]
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
    assert eng.num_overlapped_steps > 0
    for seq, (prompt, p, _) in zip(seqs, reqs):
        assert (seq.output, seq.finish_reason) == _reference(prompt, p, eos, "cuda"), p
