"""vLLM's request options through the gateway, over real engines on loopback: ``priority`` (served
by engines that schedule by priority, a 400 saying why from engines that do not) and
``return_token_ids``."""

import json

import pytest

from tests.serving.test_gateway import MODEL, Setup, request

openai = pytest.importorskip("openai")


def _post(url: str, body: dict):
    return _post_to(url, "/v1/completions", body)


def _post_to(url: str, path: str, body: dict):
    status, data = request(url, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(data)


@pytest.mark.parametrize("prefill", [True, False])
def test_engines_that_schedule_by_priority_serve_it_with_the_same_tokens(prefill):
    s = Setup(with_store=False, prefill=False, scheduling_policy="priority") if not prefill else None
    fcfs = Setup(with_store=False, prefill=prefill)
    try:
        body = {"model": MODEL, "prompt": "priority", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        if s is not None:
            status, urgent = _post(s.url, {**body, "priority": -7})
            status2, plain = _post(s.url, body)
            assert status == status2 == 200 and urgent["choices"][0]["text"] == plain["choices"][0]["text"]
        status, err = _post(fcfs.url, {**body, "priority": 1})
        assert status == 400 and "--scheduling-policy priority" in err["error"]["message"]
        status, _ = _post(fcfs.url, {**body, "priority": 0})
        assert status == 200
    finally:
        for x in (s, fcfs):
            if x is not None:
                x.close()


@pytest.mark.parametrize("bad", [1.5, "1", 1 << 31, True])
def test_a_priority_that_is_not_a_32_bit_integer_is_a_400_naming_it(bad):
    from engine.serve.openai_protocol import BadRequest, parse_request

    with pytest.raises(BadRequest) as e:
        parse_request({"model": MODEL, "prompt": "x", "priority": bad}, False, MODEL)
    assert e.value.param == "priority"


# ---- return_token_ids (vLLM's) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    s = Setup(with_store=True)
    yield s
    s.close()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    status, data = request(url, "POST", path, json.dumps({**body, "stream": True}).encode(),
                           {"Content-Type": "application/json"})
    assert status == 200, data
    return [json.loads(line[6:]) for line in data.decode().splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_gives_the_prompts_and_each_choices_tokens_streamed_and_not(served, chat):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "n": 2, "return_token_ids": True,
            **({"messages": [{"role": "user", "content": "tokens"}]} if chat else {"prompt": ["tokens", "ids"]})}
    status, data = request(served.url, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 200, data
    whole = json.loads(data)
    prompts = [tok.encode_chat(body["messages"])] if chat else [tok.encode(p, add_bos=True) for p in body["prompt"]]
    for k, choice in enumerate(whole["choices"]):
        assert len(choice["token_ids"]) == 7
        assert tok.decode(choice["token_ids"]) == (choice["message"]["content"] if chat else choice["text"])
        assert (whole if chat else choice)["prompt_token_ids"] == prompts[k // 2]
    streamed: dict[int, list] = {}
    for chunk in _stream(served.url, path, body):
        for choice in chunk["choices"]:
            first = choice["index"] not in streamed
            streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
            has_prompt = "prompt_token_ids" in (chunk if chat else choice)
            assert has_prompt == first
            if first:
                assert (chunk if chat else choice)["prompt_token_ids"] == prompts[choice["index"] // 2]
    assert [streamed[k] for k in sorted(streamed)] == [c["token_ids"] for c in whole["choices"]]
    status, data = request(served.url, "POST", path, json.dumps({**body, "return_token_ids": False}).encode(),
                           {"Content-Type": "application/json"})
    assert "token_ids" not in data.decode()


def test_skip_special_tokens_false_shows_the_special_tokens_text(served):
    """Only 'A' and EOS may be generated (EOS ignored): EOS's text is in the output only when asked."""
    from engine.config import BYTE_EOS
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    body = {"model": MODEL, "prompt": "special", "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "allowed_token_ids": [BYTE_EOS, ord("A")], "return_token_ids": True}
    texts = {}
    for skip in (True, False):
        status, out = _post(served.url, {**body, "skip_special_tokens": skip})
        assert status == 200, out
        ids = out["choices"][0]["token_ids"]
        texts[skip] = out["choices"][0]["text"]
        assert texts[skip] == tok.decode(ids, skip_special_tokens=skip)
    assert BYTE_EOS in ids and f"<|{BYTE_EOS}|>" in texts[False] and f"<|{BYTE_EOS}|>" not in texts[True]
    status, err = _post(served.url, {**body, "spaces_between_special_tokens": False})
    assert status == 400 and err["error"]["param"] == "spaces_between_special_tokens"


def test_add_special_tokens_puts_bos_before_the_prompts_text_or_not(served):
    from engine.config import BYTE_BOS

    def prompt_ids(path, body):
        status, out = _post_to(served.url, path, {"model": MODEL, "max_tokens": 1, "return_token_ids": True, **body})
        assert status == 200, out
        return out["prompt_token_ids"] if "prompt_token_ids" in out else out["choices"][0]["prompt_token_ids"]

    text = prompt_ids("/v1/completions", {"prompt": "abc"})
    assert text == [BYTE_BOS, 97, 98, 99] and prompt_ids("/v1/completions", {"prompt": "abc", "add_special_tokens": False}) == [97, 98, 99]
    assert prompt_ids("/v1/completions", {"prompt": [5, 6], "add_special_tokens": True}) == [5, 6]  # (ids as given)
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    chat = prompt_ids("/v1/chat/completions", msgs)
    assert prompt_ids("/v1/chat/completions", {**msgs, "add_special_tokens": True}) == [BYTE_BOS, *chat]


def test_reasoning_effort_reaches_the_chat_template():
    """(a gateway object over no engine: only the rendering is looked at)"""
    from engine.serve.gateway import Gateway
    from engine.serve.openai_protocol import BadRequest, parse_request
    from engine.serve.responses import to_chat

    gw = Gateway(MODEL, [], ["127.0.0.1:9"], trust_request_chat_template=True)
    template = "{{ reasoning_effort | default('unset') }}:{{ messages[-1].content }}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "chat_template": template}
    for extra, rendered in (({}, "unset:q"), ({"reasoning_effort": "low"}, "low:q"),
                            ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high:q")):
        assert gw.tokenizer.decode(gw.encode(parse_request({**body, **extra}, True, MODEL))) == rendered
    with pytest.raises(BadRequest) as e:
        parse_request({**body, "reasoning_effort": "max"}, True, MODEL)
    assert e.value.param == "reasoning_effort"
    chat = to_chat({"model": MODEL, "input": "q", "reasoning": {"effort": "medium"}, "chat_template": template})
    assert gw.tokenizer.decode(gw.encode(parse_request(chat, True, MODEL))) == "medium:q"
