"""Sampling: greedy, seeded temperature sampling, top-p; the engine's request validation."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling import Sampler
from engine.spec_decode import target_probs
from engine.tokenizer import ByteTokenizer


def test_greedy_is_argmax_and_seeded_sampling_repeats():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler()
    assert s.sample(logits, [SamplingParams()] * 4, [0, 1, 2, 3]) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler().sample(logits[:1], [p], [0])[0] for _ in range(3)]
    assert len(set(a)) == 1


def test_the_exponential_race_samples_the_nucleus_distribution():
    """The sampler draws token i with probability probs[i] (after temperature, min-p, top-k and top-p)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    for top_p, temperature, top_k, min_p in ((1.0, 1.0, 0, 0.0), (0.7, 0.8, 0, 0.0), (1.0, 1.0, 3, 0.0),
                                             (1.0, 1.0, 0, 0.2), (0.95, 1.3, 4, 0.05)):
        probs = target_probs(logits[0], temperature, top_p, top_k, min_p)
        s, n = Sampler(), 20_000
        p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=11)
        counts = torch.bincount(torch.tensor([s.sample(logits, [p], [0])[0] for _ in range(n)]), minlength=6)
        freq = counts / n
        assert torch.allclose(freq, probs, atol=0.015), (freq, probs)  # ~4 sigma at n = 20k
        assert not counts[probs == 0].any()


def test_top_k_and_min_p_keep_the_likeliest_tokens_renormalised():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])
    full = torch.softmax(logits, -1)
    k2 = target_probs(logits, 1.0, 1.0, top_k=2)
    assert (k2 > 0).tolist() == [True, True, True, False, False]  # the tie at the 2nd place is kept
    assert torch.allclose(k2[:3], full[:3] / full[:3].sum())
    assert torch.equal(target_probs(logits, 1.0, 1.0, top_k=0), target_probs(logits, 1.0, 1.0, top_k=99))
    m = target_probs(logits, 1.0, 1.0, min_p=0.3)  # e^-1 = 0.37 of the top: tokens 1, 2 stay; e^-2 does not
    assert (m > 0).tolist() == [True, True, True, False, False] and m.sum().item() == pytest.approx(1.0)
    assert (target_probs(logits, 1.0, 1.0, min_p=1.0) > 0).tolist() == [True, False, False, False, False]
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "all"


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0, -10.0]])
    s = Sampler()
    picks = {s.sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=i)], [i])[0] for i in range(30)}
    assert picks == {0}  # the top token alone holds > 50%
    picks = {s.sample(logits, [SamplingParams(temperature=1.0, top_p=0.99, seed=i)], [100 + i])[0]
             for i in range(60)}
    assert picks == {0, 1}


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(max_tokens=None), dict(max_tokens="3"), dict(temperature="0.5"),
                                 dict(seed=1.5), dict(seed=1 << 64), dict(stop_token_ids=5),
                                 dict(stop_token_ids="ab"), dict(stop_token_ids=None), dict(top_k=-2),
                                 dict(top_k=1.5), dict(top_k=True), dict(min_p=-0.1), dict(min_p=1.5),
                                 dict(min_p="0.1")])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_bad_request_is_refused_whole_and_the_engine_stays_usable():
    """Before, a request whose bad field surfaced inside a step (a non-string salt, float token
    ids) stayed queued: every later generate() failed the same way, and a seed beyond 64 bits
    left a sequence holding its pages for good."""
    from engine.config import EngineConfig

    with LLM("random:tiny", dtype="float32") as llm:
        want = llm.generate([[5, 6, 7]], max_tokens=2)[0].token_ids
        for kw, why in ((dict(prompts=[1, 2], tenant_salt=5), "tenant_salt"),
                        (dict(prompts=[[1.5, 2]]), "integers"), (dict(prompts=[[1, None]]), "integers"),
                        (dict(prompts=None), "prompts must be"), (dict(prompts=[[1, 2]], seed=1 << 64), "seed")):
            with pytest.raises(ValueError, match=why):
                llm.generate(**kw)
        assert llm.generate([[5, 6, 7]], max_tokens=2)[0].token_ids == want
        assert llm.generate((5, 6, 7), max_tokens=2)[0].token_ids == want  # a tuple is a prompt too
        assert not llm.engine.seqs and not llm.engine.has_work()
        real = llm.engine.step
        llm.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("a step failed"))
        with pytest.raises(RuntimeError, match="a step failed"):
            llm.generate([[5, 6, 7]], max_tokens=2)
        llm.engine.step = real
        assert not llm.engine.seqs and llm.generate([[5, 6, 7]], max_tokens=2)[0].token_ids == want
    for kw in (dict(dtype="float8"), dict(device="tpu"), dict(num_pages=-3), dict(model=None),
               dict(chunk_check="md5"), dict(kv_cache_memory=0)):
        with pytest.raises(ValueError, match=next(iter(kw)) if "model" not in kw else "model"):
            EngineConfig(**kw)


def test_engine_seeded_sampling_and_bad_requests():
    with LLM("random:tiny", dtype="float32") as llm:
        a = llm.generate("hello", max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)[0]
        b = llm.generate("hello", max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[]])
        with pytest.raises(ValueError, match="token ids"):
            llm.generate([[1, 2, 100000]])
        with pytest.raises(ValueError, match="context"):
            llm.generate([[1] * 10], max_tokens=10**6)


def test_byte_tokenizer_round_trip():
    t = ByteTokenizer()
    ids = t.encode("héllo", add_bos=True)
    assert ids[0] == t.bos_token_id and t.decode(ids) == "héllo"
    assert t.decode([104, 300, 105, t.eos_token_id]) == "h<|300|>i"


def test_a_model_path_without_a_tokenizer_is_refused_where_text_is_encoded(tmp_path, caplog):
    """The gateway turns text into ids: a typo in --model (it used bytes for ids, silently, in
    front of a real model) or a folder without tokenizer.json is an error there; an engine,
    which gets ids, warns and encodes text as bytes."""
    from engine.serve.gateway import Gateway
    from engine.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="neither a random:\\* preset nor a checkpoint folder"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Gateway(str(tmp_path), [], ["127.0.0.1:1"])
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer) and "no tokenizer.json" in caplog.text
    assert isinstance(load_tokenizer("random:tiny", require=True), ByteTokenizer)
