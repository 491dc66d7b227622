"""Priority scheduling (``scheduling_policy="priority"``, vLLM's): the most urgent requests are
admitted first and preempted last, and every request still gets exactly the tokens it gets alone."""

import random

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

MODEL = "random:tiny"


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, dtype="float32", **kw))


def _drain(eng: LLMEngine) -> None:
    for _ in range(100_000):
        if not eng.has_work():
            return
        eng.step()
    raise AssertionError("the engine never finished")


def test_short_of_pages_the_least_urgent_are_preempted_and_every_output_is_exact():
    r = random.Random(5)
    reqs = [([r.randrange(3, 500) for _ in range(r.randrange(40, 70))], (2, 0, 1)[i % 3]) for i in range(9)]
    tight = _engine(num_pages=30, scheduling_policy="priority", max_num_seqs=8)  # 16-token pages: not enough
    seqs = [tight.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True, priority=pr)) for p, pr in reqs]
    _drain(tight)
    ample = _engine(num_pages=400)
    alone = [ample.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p, _ in reqs]
    _drain(ample)
    assert [s.output for s in seqs] == [s.output for s in alone]
    preempted = {s.params.priority for s in seqs if s.num_preemptions}
    assert preempted and 0 not in preempted  # the most urgent never lost their pages
    assert sum(s.num_preemptions for s in seqs if s.params.priority == 2) > 0


def test_a_later_urgent_request_is_admitted_before_earlier_waiting_ones():
    eng = _engine(num_pages=200, scheduling_policy="priority", max_num_seqs=1)
    params = dict(max_tokens=4, ignore_eos=True)
    first = eng.add_request([5] * 20, SamplingParams(**params, priority=3))
    eng.step()  # first runs alone (one sequence at a time)
    later = [eng.add_request([6 + i] * 20, SamplingParams(**params, priority=p)) for i, p in enumerate((3, 3, 0))]
    _drain(eng)
    done = sorted([first, *later], key=lambda s: s.first_token_time)
    assert done == [first, later[2], later[0], later[1]]


def test_an_fcfs_engine_refuses_a_priority_by_name():
    eng = _engine(num_pages=50)
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        eng.add_request([1, 2, 3], SamplingParams(priority=1))
    eng.add_request([1, 2, 3], SamplingParams(priority=0))  # the default is everyone's


@pytest.mark.parametrize("bad", [1.5, True, 1 << 31, "1"])
def test_a_priority_beyond_32_bits_or_not_an_integer_is_refused(bad):
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=bad)
