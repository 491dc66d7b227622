"""Beam search (engine/beam_search.py): the engine's answer is that of a plain search over a plain
forward (every position's logits of the whole sequence, ``tests/engine/reference.py``, no cache, no
pruning), and on small synthetic models that of enumerating every hypothesis."""

import itertools
import math
import random
import sys

import pytest
import torch

from engine.beam_search import MAX_BEAM_WIDTH, Beam, BeamSearch, BeamSearchParams, beam_search
from engine.llm import LLM
from engine.sampling import TokenLogprobs
from tests.engine.reference import all_logits
from tests.helpers import run_in_own_session

MODEL = "random:tiny"


def _score(cum: float, n: int, lp: float) -> float:
    return cum / max(1, n) ** lp


def _reference(prompt: list[int], width: int, max_tokens: int, lp: float, stops: set[int]) -> list[tuple]:
    """The search as documented, written plainly: every step to ``max_tokens``, each live beam's
    ``2 * width`` likeliest next tokens from a plain forward of prompt + beam. Returns (tokens,
    cum_logprob, finish_reason) of the best ``width``."""
    live, done = [([], 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in live:
            row = torch.log_softmax(all_logits(MODEL, prompt + toks)[-1], dim=-1)
            vals, ids = row.topk(2 * width)
            for t, v in zip(ids.tolist(), vals.tolist()):
                (done if t in stops else cands).append((toks + [t], cum + v))
        live = sorted(cands, key=lambda c: _score(c[1], len(c[0]), lp), reverse=True)[:width]
        if not live:
            break
    scored = [(t, c, "stop", _score(c, len(t) - 1, lp)) for t, c in done] + \
             [(t, c, "length", _score(c, len(t), lp)) for t, c in live]
    return [s[:3] for s in sorted(scored, key=lambda s: s[3], reverse=True)[:width]]


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, dtype="float32", num_pages=600, max_num_seqs=64, enable_prefix_caching=True) as llm:
        yield llm


@pytest.mark.parametrize("width,lp,max_tokens", [(1, 1.0, 6), (2, 1.0, 6), (4, 0.0, 5), (3, 2.0, 5), (4, -0.5, 4)])
def test_the_engines_search_is_a_plain_search_over_a_plain_forward(llm, width, lp, max_tokens):
    r = random.Random(width * 100 + max_tokens)
    prompts = [[r.randrange(3, 500) for _ in range(r.randrange(2, 40))] for _ in range(2)]
    # a stop token among each prompt's first candidates, so that hypotheses finish early too
    stops = {int(torch.log_softmax(all_logits(MODEL, p)[-1], -1).topk(3).indices[1 + width % 2]) for p in prompts}
    got = llm.beam_search(prompts, beam_width=width, max_tokens=max_tokens, length_penalty=lp,
                          stop_token_ids=sorted(stops), ignore_eos=True)
    for prompt, outs in zip(prompts, got):
        want = _reference(prompt, width, max_tokens, lp, stops)
        assert [o.token_ids for o in outs] == [w[0] for w in want]
        assert [o.cum_logprob for o in outs] == pytest.approx([w[1] for w in want], abs=1e-4)
        assert [o.finish_reason for o in outs] == [w[2] for w in want]
        assert all(o.score == pytest.approx(_score(o.cum_logprob, len(o.token_ids) - (o.finish_reason == "stop"), lp))
                   for o in outs)
        assert all(o.prompt_token_ids == prompt and o.text == llm.tokenizer.decode(o.token_ids) for o in outs)


def test_width_one_is_greedy_decoding(llm):
    prompt = list(range(7, 60))
    greedy = llm.generate(prompt, max_tokens=10, ignore_eos=True)[0]
    (beam,), = llm.beam_search(prompt, beam_width=1, max_tokens=10, ignore_eos=True)
    assert beam.token_ids == greedy.token_ids and beam.finish_reason == "length"


def test_logprobs_are_each_tokens_with_its_positions_alternatives(llm):
    prompt = [11, 12, 13, 14, 15]
    outs, = llm.beam_search(prompt, beam_width=2, max_tokens=4, logprobs=3, ignore_eos=True)
    for o in outs:
        every = torch.log_softmax(all_logits(MODEL, prompt + o.token_ids), -1)[len(prompt) - 1:-1]
        assert len(o.logprobs) == len(o.token_ids)
        for row, tok, lp in zip(every, o.token_ids, o.logprobs):
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert sum(lp.logprob for lp in o.logprobs) == pytest.approx(o.cum_logprob, abs=1e-5)
    assert all(o.logprobs is None for o in llm.beam_search(prompt, beam_width=2, max_tokens=2)[0])


def test_later_steps_reuse_the_cached_prompt(llm):
    """Each step's requests are the last step's plus a token: the local prefix cache holds the
    prompt, so a second search of the same prompt starts from cached pages."""
    prompt = [r % 400 + 3 for r in range(100)]
    llm.beam_search(prompt, beam_width=2, max_tokens=3)
    outs, = llm.beam_search(prompt, beam_width=2, max_tokens=3)
    assert outs[0].num_cached_tokens >= 96


# -- the search alone, over synthetic models --------------------------------------------------------

def _markov(seed: int, vocab: int):
    """A random model whose next-token distribution depends on the whole prefix (hashed), exact."""
    def expand(beams: list[list[int]]) -> list[TokenLogprobs]:
        out = []
        for toks in beams:
            g = random.Random(hash((seed, tuple(toks))))
            logits = [g.gauss(0, 2) for _ in range(vocab)]
            z = math.log(sum(math.exp(x) for x in logits))
            top = sorted(((t, x - z) for t, x in enumerate(logits)), key=lambda p: -p[1])
            out.append(TokenLogprobs(top[0][1], tuple(top)))
        return out
    return expand


def _enumerate(expand, vocab: int, max_tokens: int, stops: set[int], lp: float) -> list[tuple]:
    """Every hypothesis: each sequence of non-stop tokens, then a stop token or ``max_tokens``."""
    hyps = []
    for n in range(max_tokens + 1):
        for seq in itertools.product([t for t in range(vocab) if t not in stops], repeat=n):
            seq = list(seq)
            rows = [dict(expand([seq[:i]])[0].top) for i in range(n + 1)]
            cum = sum(rows[i][t] for i, t in enumerate(seq))
            if n == max_tokens:
                hyps.append((seq, cum, "length", _score(cum, n, lp)))
            else:
                hyps += [(seq + [s], cum + rows[n][s], "stop", _score(cum + rows[n][s], n, lp)) for s in stops]
    return sorted(hyps, key=lambda h: h[3], reverse=True)


@pytest.mark.parametrize("seed", range(60))
def test_a_search_wide_enough_to_keep_every_beam_finds_the_best_hypotheses_of_all(seed):
    """Vocabulary 4 with one stop token, 3 steps: at most 9 live beams, so a width of 10 drops none
    and the answer must be the 10 best of every hypothesis there is (the bound's early stop included)."""
    r = random.Random(seed)
    vocab, max_tokens, lp = 4, 3, r.choice([1.0, 0.0, 0.7, 2.0, -1.0])
    expand = _markov(seed, vocab)
    stops = {r.randrange(vocab)}
    got = beam_search(expand, BeamSearchParams(beam_width=MAX_BEAM_WIDTH, max_tokens=max_tokens, length_penalty=lp),
                      stop_ids=stops)
    want = _enumerate(expand, vocab, max_tokens, stops, lp)[:MAX_BEAM_WIDTH]
    assert [(b.tokens, b.finish_reason) for b in got] == [(w[0], w[2]) for w in want]
    assert [b.score(lp) for b in got] == pytest.approx([w[3] for w in want])


def test_the_search_stops_once_no_live_beam_can_win_with_the_same_answer():
    """Length penalty 0: a hypothesis only loses by growing, so once ``width`` have finished better
    than every live beam the search ends; searching on to ``max_tokens`` gives the same answer."""
    stopped = 0
    for seed in range(40):
        expand = _markov(seed, 6)
        params = BeamSearchParams(beam_width=2, max_tokens=12, length_penalty=(0.0, 1.0, -0.5)[seed % 3])
        runs = []
        for prune in (True, False):
            search = BeamSearch(params, {0, 1}, prune=prune)
            while beams := search.pending():
                search.advance(expand(beams))
            runs.append(search)
        pruned, full = runs
        assert [(b.tokens, b.finish_reason) for b in pruned.result()] == \
            [(b.tokens, b.finish_reason) for b in full.result()]
        assert full.steps == params.max_tokens or not full.live
        stopped += pruned.steps < full.steps
    assert stopped >= 10


@pytest.mark.parametrize("bad", [dict(beam_width=0), dict(beam_width=MAX_BEAM_WIDTH + 1), dict(beam_width=2.0),
                                 dict(max_tokens=0), dict(length_penalty=math.nan),
                                 dict(length_penalty=11), dict(logprobs=21)])
def test_bad_parameters_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        BeamSearchParams(**bad)


def test_the_bench_runs_and_finds_the_same_answer_with_and_without_the_prefix_cache():
    rc, out = run_in_own_session([sys.executable, "bench/beam_search_bench.py", "--model", MODEL,
                                  "--prompt-tokens", "40", "--reps", "1", "--max-tokens", "3", "--width", "2"])
    assert rc == 0, out[-4000:]
    row = next(line for line in out.splitlines() if line.startswith("| 40 |"))
    computed_cached, computed_plain = (int(c.strip().replace(",", "")) for c in row.split("|")[3:5])
    assert computed_cached < computed_plain, row
