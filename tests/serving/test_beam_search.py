"""vLLM's ``use_beam_search`` through the gateway, over real engines on loopback: the choices are the
hypotheses of ``LLM.beam_search`` in this process (itself checked against a plain search over a
plain forward, tests/engine/test_beam_search.py), whichever engine runs the steps. And OpenAI's
``best_of``: the ``n`` likeliest per token of ``best_of`` sampled candidates."""

import json

import pytest

from engine.beam_search import MAX_BEAM_WIDTH
from engine.llm import LLM
from tests.serving.test_gateway import MODEL, Setup, request

openai = pytest.importorskip("openai")

PROMPTS = [[61, 194, 204, 210, 194, 43, 49, 66, 64, 21, 13, 220], [5, 9, 100, 301, 7]]


@pytest.fixture(scope="module")
def offline():
    with LLM(MODEL, dtype="float32", num_pages=400) as llm:
        yield llm


@pytest.fixture(scope="module")
def disagg():
    s = Setup(with_store=True)
    yield s
    s.close()


def _beam(c, prompt, n, stream=False, **kw):
    """(texts, finish reasons, the response or chunks) of a beam-search completion."""
    kw = {"model": MODEL, "prompt": prompt, "n": n, "max_tokens": 6, **kw}
    kw["extra_body"] = {"use_beam_search": True, **kw.get("extra_body", {})}
    if not stream:
        r = c.completions.create(**kw)
        return [ch.text for ch in r.choices], [ch.finish_reason for ch in r.choices], r
    texts, reasons = [""] * n, [None] * n
    chunks = list(c.completions.create(stream=True, **kw))
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons, chunks


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefill", [True, False])
def test_the_choices_are_the_engines_beam_search_best_first(disagg, offline, prefill, stream):
    s = disagg if prefill else Setup(with_store=False, prefill=False)
    try:
        for prompt, lp in zip(PROMPTS, (1.0, 0.0)):
            want, = offline.beam_search(prompt, beam_width=3, max_tokens=6, length_penalty=lp, ignore_eos=True)
            texts, reasons, _ = _beam(s.client(), prompt, 3, stream, temperature=0.0,
                                      extra_body={"length_penalty": lp, "ignore_eos": True})
            assert texts == [w.text for w in want]
            assert reasons == [w.finish_reason for w in want] == ["length"] * 3
    finally:
        if not prefill:
            s.close()


def test_stop_tokens_finish_hypotheses_and_logprobs_are_each_tokens(disagg, offline):
    prompt = PROMPTS[0]
    probe, = offline.beam_search(prompt, beam_width=4, max_tokens=3, ignore_eos=True)
    for stop in dict.fromkeys(t for b in probe for t in b.token_ids):  # a stop token some best hypotheses end on
        want, = offline.beam_search(prompt, beam_width=2, max_tokens=5, stop_token_ids=[stop], ignore_eos=True,
                                    logprobs=2, length_penalty=0.0)
        if "stop" in [w.finish_reason for w in want]:
            break
    texts, reasons, r = _beam(disagg.client(), prompt, 2, max_tokens=5, logprobs=2,
                              extra_body={"stop_token_ids": [stop], "ignore_eos": True, "length_penalty": 0.0})
    assert "stop" in reasons
    assert texts == [w.text for w in want] and reasons == [w.finish_reason for w in want]
    for choice, w in zip(r.choices, want):
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(w.cum_logprob, abs=1e-4)
        assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)  # (the token itself too)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert r.usage.prompt_tokens == len(prompt)


def test_chat_beam_search_answers_the_rendered_conversation(disagg, offline):
    msgs = [{"role": "user", "content": "hello there"}]
    ids = offline.tokenizer.encode_chat(msgs)
    want, = offline.beam_search(ids, beam_width=2, max_tokens=4, ignore_eos=True)
    r = disagg.client().chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=4,
                                                extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.message.content for c in r.choices] == [w.text for w in want]


def test_the_decode_engine_goes_on_when_the_prefill_engine_is_down(offline):
    s = Setup(with_store=False)
    try:
        s.prefill.stop()
        want, = offline.beam_search(PROMPTS[1], beam_width=2, max_tokens=4, ignore_eos=True)
        texts, _, _ = _beam(s.client(), PROMPTS[1], 2, max_tokens=4, extra_body={"ignore_eos": True})
        assert texts == [w.text for w in want]
    finally:
        s.close()


def test_the_gateway_learns_the_engines_eos_tokens(disagg):
    eos, context, vocab = disagg.gw._model(disagg.decode.address)
    engine = disagg.decode.engine
    assert eos == frozenset(engine.eos) and context == engine.model_config.max_position_embeddings
    assert vocab == engine.model_config.vocab_size


@pytest.mark.parametrize("body,field", [
    ({"n": MAX_BEAM_WIDTH + 1}, "n"), ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"), ({"min_p": 0.1}, "min_p"),
    ({"presence_penalty": 1}, "presence_penalty"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"min_tokens": 2}, "min_tokens"),
    ({"guided_regex": "a+"}, "response_format"), ({"length_penalty": 11}, "length_penalty"),
    ({"length_penalty": 2, "use_beam_search": False}, "length_penalty"), ({"max_tokens": 10 ** 6}, "max_tokens"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"stop_token_ids": [99_999]}, "stop_token_ids"),  # (beyond the vocabulary: no engine sees the search's stops)
])
def test_what_a_beam_search_cannot_honour_is_a_400_naming_it(disagg, body, field):
    body = {"model": MODEL, "prompt": "abc", "use_beam_search": True, "n": 2, **body}
    status, data = request(disagg.url, "POST", "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("prefill", [True, False])
def test_echo_and_prompt_logprobs_are_those_of_a_plain_request(disagg, offline, prefill):
    s = disagg if prefill else Setup(with_store=False, prefill=False)
    try:
        c = s.client()
        kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=3, echo=True, logprobs=1, temperature=0.0,
                  extra_body={"ignore_eos": True, "prompt_logprobs": 2})
        plain = c.completions.create(**kw).model_dump()
        beam = c.completions.create(n=2, **{**kw, "extra_body": {**kw["extra_body"], "use_beam_search": True}})
        beam = beam.model_dump()
        want, = offline.beam_search(PROMPTS[1], beam_width=2, max_tokens=3, ignore_eos=True)
        prompt_text = offline.tokenizer.decode(PROMPTS[1])
        n = len(PROMPTS[1])
        for choice, w in zip(beam["choices"], want):
            assert choice["text"] == prompt_text + w.text
            lp, ref = choice["logprobs"], plain["choices"][0]["logprobs"]
            assert lp["token_logprobs"][:n] == pytest.approx(ref["token_logprobs"][:n], abs=1e-5, nan_ok=True)
            assert len(choice["prompt_logprobs"]) == n and choice["prompt_logprobs"] == plain["choices"][0]["prompt_logprobs"]
            assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    finally:
        if not prefill:
            s.close()


# ---- best_of (OpenAI's completions) --------------------------------------------------------------

def test_best_of_answers_the_n_candidates_likeliest_per_token(disagg, offline):
    """Choice ``i`` of a seeded request draws from ``seed + i``: the same request with ``n=best_of``
    shows every candidate, whose mean logprobs say which ``n`` best_of must answer."""
    c = disagg.client()
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    every = c.completions.create(n=5, logprobs=0, **kw)
    means = [sum(ch.logprobs.token_logprobs) / len(ch.logprobs.token_logprobs) for ch in every.choices]
    assert len(set(means)) == 5
    order = sorted(range(5), key=lambda i: means[i], reverse=True)
    best = c.completions.create(n=2, best_of=5, **kw)
    assert [ch.text for ch in best.choices] == [every.choices[i].text for i in order[:2]]
    assert [ch.index for ch in best.choices] == [0, 1] and all(ch.logprobs is None for ch in best.choices)
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate was generated
    one = c.completions.create(best_of=5, logprobs=1, echo=True, **kw)
    assert one.choices[0].text == offline.tokenizer.decode(PROMPTS[1]) + every.choices[order[0]].text
    assert one.choices[0].logprobs.token_logprobs[len(PROMPTS[1]):] == pytest.approx(
        every.choices[order[0]].logprobs.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("chat,body", [
    (False, {"n": 3, "best_of": 2}), (False, {"best_of": 2, "stream": True}), (True, {"best_of": 2}),
    (False, {"best_of": 3, "use_beam_search": True}), (False, {"best_of": 17}),
    (False, {"best_of": 16, "prompt": ["a"] * 17}),
])
def test_best_of_it_cannot_serve_is_a_400_naming_it(disagg, chat, body):
    base = {"model": MODEL, **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "abc"})}
    status, data = request(disagg.url, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                           json.dumps({**base, **body}).encode(), {"Content-Type": "application/json"})
    assert status == 400, data
    assert json.loads(data)["error"]["param"] == "best_of"
