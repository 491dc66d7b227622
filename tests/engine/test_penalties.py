"""Presence, frequency and repetition penalties: a penalised request's tokens are those of a plain
loop over the model (the whole sequence's logits each time, the penalties applied by a twin written
token by token, greedy argmax), on every path of the engine: chunked prefill, async scheduling
(its steps then wait for the launched token), the graphs' static buffers, beside speculation
(no drafts for a penalised request) and beside unpenalised requests."""

import random
from collections import Counter

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import Sampler, SamplingParams
from tests.engine.reference import all_logits

MODEL = "random:tiny"


def _twin(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def _reference(prompt: list[int], p: SamplingParams) -> list[int]:
    out = []
    for _ in range(p.max_tokens):
        logits = all_logits(MODEL, prompt + out)[-1]
        out.append(int(_twin(logits, prompt, out, p).argmax()))
    return out


def test_the_penalties_are_their_twins():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=g) * 3
    prompt, output = [1, 5, 5, 9], [5, 7, 7, 7, 250]
    s = Sampler()
    for sid, p in enumerate((SamplingParams(repetition_penalty=1.7), SamplingParams(frequency_penalty=0.6),
                             SamplingParams(presence_penalty=-1.1),
                             SamplingParams(repetition_penalty=0.8, frequency_penalty=1.5, presence_penalty=0.4))):
        for n in (0, 2, len(output)):  # the state built from a prefix, then brought up to date
            got = s._penalised(logits, sid, prompt, output[:n], p)
            assert torch.allclose(got, _twin(logits, prompt, output[:n], p)), (p, n)
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties


PENALTIES = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, presence_penalty=0.5),
             dict(repetition_penalty=1.3, frequency_penalty=-0.5)]


def _requests():
    r = random.Random(3)
    reqs = []
    for i in range(6):
        prompt = [r.randrange(3, 60) for _ in range(r.randrange(5, 40))]  # small ids: repeats in the prompt
        pen = PENALTIES[i % 3] if i % 2 == 0 else {}
        reqs.append((prompt, SamplingParams(max_tokens=12 if pen else 24, ignore_eos=True, **pen)))
    return reqs


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 8, "max_num_batched_tokens": 24}, {"async_scheduling": True},
                                {"async_scheduling": True, "static_buffers": True},
                                {"speculative": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "chunked-prefill", "async", "async-static-buffers", "ngram"])
def test_penalised_greedy_requests_give_the_tokens_of_a_plain_loop(kw):
    reqs = _requests()
    kw = dict(kw)
    static = kw.pop("static_buffers", False)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=200, max_num_seqs=8, enforce_eager=static,
                                 **kw))
    if static:
        eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    seqs = [eng.add_request(p, params) for p, params in reqs]
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
    for seq, (prompt, params) in zip(seqs, reqs):
        assert seq.output == _reference(prompt, params), (params, kw)
    if kw.get("async_scheduling"):  # once the penalised requests are done, the others' steps overlap
        assert eng.num_overlapped_steps > 0
    if kw.get("speculative"):
        assert eng.num_spec_steps > 0  # drafts for the others only
        assert all(s.num_draft_tokens == 0 for s, (_, p) in zip(seqs, reqs) if p.has_penalties)


def test_a_repetition_penalty_changes_a_repetitive_greedy_output():
    """random:tiny repeats itself greedily; the penalty breaks the loops (a check that it acts)."""
    prompt = [5, 6, 7]
    plain = _reference(prompt, SamplingParams(max_tokens=20))
    penal = _reference(prompt, SamplingParams(max_tokens=20, repetition_penalty=2.0))
    assert len(set(penal)) > len(set(plain))


def test_sampled_with_penalties_draws_from_the_penalised_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0]])
    p = SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.0, presence_penalty=0.5)
    history = [([3], [0, 0])]  # token 0 twice in the output: 2 - 2 * 1.0 - 0.5 = -0.5
    want = torch.softmax(torch.tensor([-0.5, 1.5, 1.0, 0.0]), -1)
    s, n = Sampler(), 20_000
    counts = torch.bincount(torch.tensor([s.sample_async(logits, [p], [0], history).tolist()[0]
                                          for _ in range(n)]), minlength=4)
    assert torch.allclose(counts / n, want, atol=0.015), (counts / n, want)
