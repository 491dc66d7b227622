"""Speculative decoding (engine/spec_decode.py): the n-gram drafter, verification (greedy and rejection
sampling, the latter checked statistically against the target distribution), and the engine: greedy
output token for token the same as without speculation, for every K, with chunked prefill beside it,
under preemption, with stop tokens and length limits, per-request opt-out, after a load from a real
store node, and through the gateway with the official client."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling import Sampler, SamplingParams
from engine.spec_decode import NgramDrafter, target_probs, verify
from kvstore.config import StoreConfig
from kvstore.server import StoreNode

MODEL = "random:tiny"


def copy_heavy_prompts(seed: int = 0, n: int = 3) -> list[list[int]]:
    """Prompts that repeat a passage (RAG- or edit-like): outputs of the random model copy from them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.randrange(3, 400) for _ in range(rng.randrange(20, 50))]
        out.append(passage * 3 + [rng.randrange(3, 400) for _ in range(5)])
    return out


def free_prompts(seed: int = 1, n: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(30, 90))] for _ in range(n)]


def generate(prompts, max_tokens=40, model=MODEL, **cfg):
    with LLM(model, dtype="float32", **cfg) as llm:
        outs = llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
        e = llm.engine
        return [o.token_ids for o in outs], (e.num_spec_steps, e.num_draft_tokens, e.num_accepted_tokens)


# ---- the drafter ------------------------------------------------------------------------------------


def test_ngram_drafter_continues_the_most_recent_occurrence_of_the_longest_suffix():
    d = NgramDrafter(max_n=3, min_n=1)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(tokens, 2) == [7, 8]  # "1 2 3" last occurred at 4: 7, 8 followed
    assert d.propose(tokens, 10) == [7, 8, 1, 2, 3]  # up to the end of what is known
    assert d.propose([5, 6, 7, 5], 3) == [6, 7, 5]  # only a 1-gram recurs
    assert d.propose([1, 2, 3, 4], 3) == [] and d.propose([1], 3) == [] and d.propose([1, 1], 0) == []
    assert NgramDrafter(2, 2).propose([5, 6, 7, 5], 3) == []  # 1-grams not tried
    assert NgramDrafter(3, 1, window=4).propose([1, 2, 3, 4, 5, 6, 4], 2) == [5, 6]  # the window holds 4,5,6,4
    assert NgramDrafter(3, 1, window=3).propose([1, 2, 3, 4, 5, 6, 4], 2) == []
    with pytest.raises(ValueError):
        NgramDrafter(1, 2)


def test_ngram_drafter_with_history_drafts_from_finished_sequences():
    d = NgramDrafter(max_n=3, min_n=1, history=2)
    assert d.propose([1, 2, 3, 4], 3) == []
    d.remember([9, 1, 2, 3, 4, 50, 51, 52, 53])
    assert d.propose([7, 7, 2, 3, 4], 3) == [50, 51, 52]  # its own tokens have no "2 3 4" before
    assert d.propose([2, 3, 4, 8, 2, 3, 4], 2) == [8, 2]  # its own tokens come first
    assert d.propose([5, 3, 4], 3) == []  # across sequences only the full max_n-gram counts
    d.remember([2, 3, 4, 60])
    assert d.propose([7, 7, 2, 3, 4], 3) == [60]  # the most recent first
    d.remember([0])
    d.remember([0])  # history=2: the first two are gone
    assert d.propose([7, 7, 2, 3, 4], 3) == [] and d.num_history_drafts == 2
    assert NgramDrafter().history.maxlen == 0


# ---- verification -----------------------------------------------------------------------------------


def onehot_logits(rows: list[int], vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        out[i, t] = 5.0
    return out


def test_greedy_verification_accepts_the_matching_prefix_then_the_targets_token():
    logits = onehot_logits([4, 5, 6, 7])
    assert verify(logits, [4, 5, 6], 0.0, 1.0, None) == [4, 5, 6, 7]  # all accepted, then the bonus
    assert verify(logits, [4, 1, 6], 0.0, 1.0, None) == [4, 5]  # rejected at 1: the target's 5 instead
    assert verify(logits, [0, 5, 6], 0.0, 1.0, None) == [4]
    assert verify(logits[:1], [], 0.0, 1.0, None) == [4]


@pytest.mark.parametrize("top_p,top_k,min_p", [(1.0, 0, 0.0), (0.7, 0, 0.0), (1.0, 3, 0.1)])
def test_rejection_sampling_keeps_the_target_distribution(top_p, top_k, min_p):
    """Whatever the draft, the first emitted token is distributed as the target's p; after an accepted
    draft the second is distributed as the next row's p. 40,000 draws at a fixed seed; every
    probability within 0.015 (about 5 standard errors)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    p0, p1 = (target_probs(logits[i], 0.8, top_p, top_k, min_p) for i in range(2))
    gen = torch.Generator().manual_seed(1234)
    n = 40_000
    for draft in ([int(p0.argmax())], [int(p0.argmin())], [int(p0.argmax()), 3]):
        first = torch.zeros(6)
        second, num_second = torch.zeros(6), 0
        for _ in range(n):
            out = verify(logits, draft, 0.8, top_p, gen, top_k, min_p)
            first[out[0]] += 1
            if out[0] == draft[0] and len(draft) > 1:
                second[out[1]] += 1
                num_second += 1
        assert torch.allclose(first / n, p0, atol=0.015), (draft, first / n, p0)
        if len(draft) > 1:  # the first draft token is p0's likeliest: accepted in a good share of the draws
            assert num_second > 5000
            assert torch.allclose(second / num_second, p1, atol=0.03), (draft, second / num_second, p1)
        # a token outside top-p's nucleus is never emitted
        assert not first[p0 == 0].any()


def test_the_sampler_verifies_with_the_requests_own_seeded_generator():
    logits = torch.randn(3, 10)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler().verify(logits, [1, 2], p, seq_id=0) for _ in range(5)]
    assert len({tuple(x) for x in a}) == 1  # a fresh sampler, the same seed: the same draws


# ---- the engine -------------------------------------------------------------------------------------


def test_greedy_speculation_gives_exactly_the_tokens_of_plain_decoding():
    prompts = copy_heavy_prompts() + free_prompts()
    plain, _ = generate(prompts)
    accepted = {}
    for k in (1, 2, 4, 7):
        out, (steps, drafted, acc) = generate(prompts, speculative="ngram", num_speculative_tokens=k)
        assert out == plain, f"K={k}"
        assert steps > 0 and drafted >= acc
        accepted[k] = acc
    assert accepted[4] > 0.3 * 40 * 3  # the copy-heavy prompts' drafts are accepted often


def test_speculation_beside_chunked_prefill_and_under_preemption_stays_exact():
    prompts = copy_heavy_prompts(seed=3, n=4) + free_prompts(seed=4, n=2) + [free_prompts(seed=5, n=1)[0] * 4]
    plain, _ = generate(prompts, max_tokens=48, chunk_size=32, max_num_batched_tokens=64)
    out, (steps, _, _) = generate(prompts, max_tokens=48, chunk_size=32, max_num_batched_tokens=64,
                                  speculative="ngram", num_speculative_tokens=5)
    assert out == plain and steps > 0
    # few pages: sequences are preempted and recomputed, drafts and all
    small, _ = generate(prompts, max_tokens=48, num_pages=40, speculative="ngram", num_speculative_tokens=5)
    assert small == plain


def test_lengths_stop_tokens_and_the_per_request_opt_out():
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", speculative="ngram", num_speculative_tokens=6))
    prompt = copy_heavy_prompts(seed=6, n=1)[0]
    plain = LLM(MODEL, dtype="float32").generate(prompt, max_tokens=30, ignore_eos=True)[0].token_ids
    stop = plain[17]
    seqs = [eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True)) for n in (1, 2, 13, 30)]
    stopped = eng.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    opted_out = eng.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True, speculative=False))
    events = []
    while eng.has_work():
        events += [(o.seq.seq_id, o.token, o.finished) for o in eng.step()]
    for s, n in zip(seqs, (1, 2, 13, 30)):
        assert s.output == plain[:n] and s.finish_reason == "length"
    assert stopped.output == plain[:plain.index(stop) + 1] and stopped.finish_reason == "stop"
    assert opted_out.output == plain and opted_out.num_draft_tokens == 0
    assert seqs[3].num_accepted_tokens > 0
    # every token was reported once, in order, and only the last as finishing
    for s in seqs + [stopped, opted_out]:
        mine = [(t, f) for sid, t, f in events if sid == s.seq_id]
        assert [t for t, _ in mine] == s.output and [f for _, f in mine] == [False] * (len(mine) - 1) + [True]
    assert eng.blocks.num_free == eng.blocks.num_pages  # no page leaked by the drafts


def test_a_decode_engine_that_loaded_its_prompt_from_the_store_speculates_the_same():
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="64MiB")).start()
    try:
        prompts = copy_heavy_prompts(seed=8, n=2)
        plain, _ = generate(prompts)
        first, _ = generate(prompts, store=node.address, chunk_tokens=32)  # saves
        with LLM(MODEL, dtype="float32", store=node.address, chunk_tokens=32, speculative="ngram") as llm:
            outs = llm.generate(prompts, max_tokens=40, ignore_eos=True)
            assert all(o.num_cached_tokens > 0 for o in outs)
            assert [o.token_ids for o in outs] == plain == first
            assert llm.engine.num_accepted_tokens > 0
    finally:
        node.stop(grace=0)


def test_sampled_speculation_is_reproducible_per_seed():
    prompts = copy_heavy_prompts(seed=9, n=2)

    def run():
        with LLM(MODEL, dtype="float32", speculative="ngram") as llm:
            return [o.token_ids for o in llm.generate(prompts, max_tokens=30, temperature=0.8, seed=5,
                                                      ignore_eos=True)]

    a, b = run(), run()
    assert a == b and all(len(x) == 30 for x in a)


@pytest.mark.parametrize("case", ["llama3-rope-tied", "qwen2-bias", "mistral"])
def test_greedy_speculation_is_exact_for_every_model_family(case, tmp_path):
    """Checkpoints of each family the engine loads (saved by transformers, as in test_hf_parity)."""
    import transformers

    from tests.engine.test_hf_parity import CASES, _save

    model_cls, cfg_cls, kw = CASES[case]
    _save(getattr(transformers, model_cls), getattr(transformers, cfg_cls), tmp_path, **kw)
    rng = random.Random(12)
    passage = [rng.randrange(3, 300) for _ in range(30)]
    prompts = [passage * 3, [rng.randrange(3, 300) for _ in range(50)]]
    folder = str(tmp_path)
    plain, _ = generate(prompts, model=folder)
    for spec in ({"speculative": "ngram"}, {"speculative": "draft", "draft_model": folder}):
        out, (steps, _, accepted) = generate(prompts, model=folder, **spec)
        assert out == plain and steps > 0, spec
    assert accepted > 0


def test_a_draft_model_drafts_with_its_own_paged_kv_and_the_output_stays_exact():
    """The target itself as the draft model: every draft is the target's own greedy continuation, so all
    are accepted only if the draft model's KV (catch-up over the prompt, one pass per drafted token,
    rolled back to what was accepted) is right. A different (1-layer) draft model: few accepted, the
    same tokens."""
    prompts = copy_heavy_prompts(seed=10, n=3) + free_prompts(seed=11, n=2)
    plain, _ = generate(prompts)
    same, (steps, drafted, accepted) = generate(prompts, speculative="draft", draft_model=MODEL)
    assert same == plain and steps > 0 and accepted >= 0.9 * drafted
    other, (_, drafted, accepted) = generate(prompts, speculative="draft", draft_model=MODEL,
                                             draft_hf_overrides={"num_hidden_layers": 1}, num_speculative_tokens=3)
    assert other == plain and drafted > 0 and accepted < drafted
    # beside chunked prefill, and under preemption (the draft model's KV is recomputed with the pages)
    chunked, _ = generate(prompts, speculative="draft", draft_model=MODEL, chunk_size=32, max_num_batched_tokens=64)
    small, (_, drafted, accepted) = generate(prompts, speculative="draft", draft_model=MODEL, num_pages=40)
    assert chunked == plain and small == plain and accepted >= 0.9 * drafted


def test_bad_speculative_settings_are_refused():
    for kw in ({"speculative": "eagle"}, {"speculative": "ngram", "num_speculative_tokens": 0},
               {"ngram_min": 3, "ngram_max": 2}, {"speculative": "draft"}, {"draft_model": MODEL}):
        with pytest.raises(ValueError):
            EngineConfig(model=MODEL, **kw)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(EngineConfig(model=MODEL, speculative="draft", draft_model="random:small"))
