"""OpenAI's Responses API over real engines on loopback, driven by the official client: text,
structured text, function calls (named, required, and read by the tool-call parser), reasoning
items, a conversation of earlier calls and their outputs, streamed (the events, in order, joined)
and not; kept responses (previous_response_id, GET and DELETE /v1/responses/{id}, per tenant, the
ones used last); and what this server refuses."""

import json

import pytest

from tests.serving.test_gateway import MODEL
from tests.serving.test_tools import TIME, WEATHER, _literal, _meets, engines_with_gateways

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

FLAT_TIME = {"type": "function", **TIME["function"]}  # (Responses tools are flat)
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


KEYS = {"acme": "sk-acme-0000", "globex": "sk-globex-00"}


@pytest.fixture(scope="module")
def cluster():
    import hashlib

    from engine.serve.gateway import ApiTenant

    keys = {hashlib.sha256(k.encode()).digest(): ApiTenant(t, t) for t, k in KEYS.items()}
    yield from engines_with_gateways({"plain": {}, "parsers": {"tool_parser": "hermes", "reasoning_parser": "qwen3"},
                                      "two": {"max_stored_responses": 2}, "none": {"max_stored_responses": 0},
                                      "tenants": {"api_keys": keys}})


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _items(resp) -> list[tuple]:
    """A Response's output as (type, text or (name, arguments))."""
    out = []
    for o in resp.output:
        if o.type == "message":
            out.append(("message", "".join(p.text for p in o.content)))
        elif o.type == "reasoning":
            out.append(("reasoning", "".join(p.text for p in o.content)))
        else:
            assert o.call_id.startswith("call_") and o.id.startswith("fc_")
            out.append(("function_call", (o.name, o.arguments)))
    return out


def _both(server, **kw):
    """(the unstreamed Response, the streamed one as its last event carries it, the events)."""
    c = _client(server)
    kw = {"model": MODEL, "temperature": 0, "max_output_tokens": 300, **kw}
    whole = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[-1].response
    # the deltas join to the items the last event holds
    for i, item in enumerate(streamed.output):
        deltas = "".join(e.delta for e in events if getattr(e, "output_index", None) == i and e.type.endswith(".delta"))
        if item.type == "function_call":
            assert deltas == item.arguments
        else:
            assert deltas == "".join(p.text for p in item.content)
        kinds = [e.type for e in events if getattr(e, "output_index", None) == i]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done", kinds
    return whole, streamed, events


def test_text_streamed_and_not_with_its_status_and_usage(cluster):
    whole, streamed, events = _both(cluster["plain"], input="Say hello.",
                                    extra_body={"structured_outputs": {"regex": "Hello, world"}})
    assert whole.status == streamed.status == "completed" and whole.incomplete_details is None
    assert whole.output_text == streamed.output_text == "Hello, world" and _items(whole) == _items(streamed)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.usage.output_tokens == streamed.usage.output_tokens == len("Hello, world") + 1  # (and EOS)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert sum(e.type == "response.output_text.delta" for e in events) > 1  # (in pieces, as generated)
    # cut by max_output_tokens: incomplete, saying why
    whole, streamed, _ = _both(cluster["plain"], input="Say hello.", max_output_tokens=5,
                               extra_body={"ignore_eos": True})
    for r in (whole, streamed):
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 5
    assert whole.output_text == streamed.output_text


def test_instructions_and_input_items_are_the_chat_conversation(cluster):
    """``instructions``, messages, an earlier function call and its output make the prompt the
    same chat messages make (the usage's input tokens, and the answer, are the chat's)."""
    c = _client(cluster["plain"])
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text",
                                                                                  "text": "tomorrow?"}]}]
    r = c.responses.create(model=MODEL, instructions="Be brief.", input=items, tools=[FLAT_WEATHER], tool_choice="none",
                           max_output_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(model=MODEL, max_tokens=32, temperature=0, tools=[WEATHER], tool_choice="none",
                                     extra_body={"ignore_eos": True}, messages=[
        {"role": "system", "content": "Be brief."}, items[0],
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content
    from engine.serve.responses import to_chat

    assert to_chat({"model": MODEL, "instructions": "Be brief.", "input": items})["messages"] == [
        {"role": "system", "content": "Be brief."}, items[0],
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "And tomorrow?"}]


def test_structured_text_follows_its_schema(cluster):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    whole, streamed, _ = _both(cluster["plain"], input="A number.", max_output_tokens=200,
                               text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}})
    assert whole.status == "completed" and whole.output_text == streamed.output_text
    assert 0 <= json.loads(whole.output_text)["n"] <= 9


def test_function_calls_named_required_and_read_by_the_parser(cluster):
    # named: the call's arguments follow its schema
    whole, streamed, events = _both(cluster["plain"], input="Time?", tools=[FLAT_WEATHER, FLAT_TIME],
                                    tool_choice={"type": "function", "name": "get_time"})
    assert _items(whole) == _items(streamed) and [t for t, _ in _items(whole)] == ["function_call"]
    name, args = _items(whole)[0][1]
    assert name == "get_time" and _meets(name, json.loads(args))
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 1
    # required, one call
    whole, streamed, _ = _both(cluster["plain"], input="Weather?", tools=[FLAT_WEATHER, FLAT_TIME],
                               tool_choice="required", parallel_tool_calls=False, temperature=1.0, max_output_tokens=600,
                               extra_body={"seed": 1})
    assert _items(whole) == _items(streamed) and len(whole.output) == 1 and whole.status == "completed"
    assert _meets(*(lambda n, a: (n, json.loads(a)))(*_items(whole)[0][1]))
    # auto: the model's text, read by the gateway's parser: content, then the call
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    whole, streamed, _ = _both(cluster["parsers"], input="Time?", tools=[FLAT_TIME],
                               extra_body={"structured_outputs": {"regex": _literal(text)}})
    assert _items(whole) == _items(streamed) == [("message", "Let me check."),
                                                 ("function_call", ("get_time", '{"zone": "cet"}'))]


def test_reasoning_comes_as_its_own_item(cluster):
    text = "<think>Two and two.</think>Four."
    whole, streamed, events = _both(cluster["parsers"], input="2+2?",
                                    extra_body={"structured_outputs": {"regex": _literal(text)}})
    assert _items(whole) == _items(streamed) == [("reasoning", "Two and two."), ("message", "Four.")]
    assert any(e.type == "response.reasoning_text.delta" for e in events)


@pytest.mark.parametrize("field,value", [
    ("store", "yes"), ("previous_response_id", "resp_1"), ("previous_response_id", 5), ("tools", [{"type": "web_search"}]),
    ("input", []), ("input", [{"type": "image", "url": "x"}]), ("input", [{"role": "robot", "content": "x"}]),
    ("reasoning", {"effort": "extreme"}), ("reasoning", {"summary": "auto"}), ("include", ["reasoning.encrypted_content"]), ("background", True),
    ("truncation", "auto"), ("instructions", 5), ("prompt_cache_key", "k"), ("top_logprobs", 21),
    ("include", "message.output_text.logprobs"), ("max_output_tokens", -1), ("max_output_tokens", "5")])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_it(cluster, field, value):
    body = {"model": MODEL, "input": "hi", field: value}
    with pytest.raises(openai.BadRequestError) as e:
        _client(cluster["plain"]).post("/responses", body=body, cast_to=object)
    assert e.value.body["param"] == field, e.value.body


# ---- logprobs -------------------------------------------------------------------------------------

def _logprobs(item) -> list[tuple]:
    return [(lp.token, lp.logprob, len(lp.top_logprobs)) for lp in item.content[0].logprobs]


@pytest.mark.parametrize("server,text,content", [("plain", "Hello there.", "Hello there."),
                                                 ("parsers", "<think>Two and two.</think>Four.", "Four.")])
def test_the_messages_logprobs_are_its_own_tokens_streamed_and_not(cluster, server, text, content):
    whole, streamed, events = _both(cluster[server], input="say it", include=["message.output_text.logprobs"],
                                    top_logprobs=2, extra_body={"structured_outputs": {"regex": _literal(text)}})
    for resp in (whole, streamed):
        message = next(o for o in resp.output if o.type == "message")
        assert "".join(p.text for p in message.content) == content
        lps = _logprobs(message)
        assert "".join(t for t, _, _ in lps) == content and all(k == 2 for _, _, k in lps)
        assert all(v <= 0 for _, v, _ in lps)
    message = [o for o in streamed.output if o.type == "message"][0]
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(d.token, d.logprob) for d in deltas] == [(t, v) for t, v, _ in _logprobs(message)]
    assert [t for t, _, _ in _logprobs(message)] == [t for t, _, _ in _logprobs(
        next(o for o in whole.output if o.type == "message"))]
    plain = _client(cluster[server]).responses.create(model=MODEL, input="say it", max_output_tokens=50,
                                                      extra_body={"structured_outputs": {"regex": _literal(text)}})
    assert next(o for o in plain.output if o.type == "message").content[0].logprobs == []


# ---- kept responses ------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_conversation_it_ends(cluster, stream):
    """Three turns, each continuing the last by id, answer as the whole conversation sent at once."""
    c = _client(cluster["plain"])
    kw = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
    r1 = c.responses.create(input="first question", instructions="be brief", **kw)
    assert r1.store is True and r1.previous_response_id is None
    if stream:
        r2 = list(c.responses.create(input="second", previous_response_id=r1.id, stream=True, **kw))[-1].response
    else:
        r2 = c.responses.create(input="second", previous_response_id=r1.id, **kw)
    assert r2.previous_response_id == r1.id
    r3 = c.responses.create(input="third", previous_response_id=r2.id, **kw)
    whole = [{"role": "user", "content": "first question"}, *[o.model_dump() for o in r1.output],
             {"role": "user", "content": "second"}, *[o.model_dump() for o in r2.output],
             {"role": "user", "content": "third"}]
    stateless = c.responses.create(input=whole, store=False, **kw)  # (earlier instructions are not carried over)
    assert _items(r3) == _items(stateless) and stateless.store is False
    assert c.responses.retrieve(r2.id).model_dump() == r2.model_dump()


def test_a_kept_response_is_read_back_and_deleted(cluster):
    c = _client(cluster["plain"])
    r = c.responses.create(model=MODEL, input="keep me", max_output_tokens=5, temperature=0)
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    c.responses.delete(r.id)
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unkept = c.responses.create(model=MODEL, input="forget me", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)


def test_only_the_responses_used_last_are_kept(cluster):
    c = _client(cluster["two"])
    kw = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    a = c.responses.create(input="a", **kw)
    b = c.responses.create(input="b", **kw)
    c.responses.retrieve(a.id)  # a used last: b goes first
    third = c.responses.create(input="c", **kw)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(b.id)
    assert c.responses.retrieve(a.id).id == a.id and c.responses.retrieve(third.id).id == third.id
    d = c.responses.create(input="d", previous_response_id=a.id, **kw)  # (continuing a uses it: third goes)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(third.id)
    c.responses.delete(a.id)
    assert _stored(cluster["two"]) == 1  # (d alone: the gauge counts what is kept)
    with pytest.raises(openai.BadRequestError) as e:  # d continues a, which is gone
        c.responses.create(input="e", previous_response_id=d.id, **kw)
    assert "no longer kept" in e.value.body["message"]


def _stored(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.serving.test_gateway import request

    status, data = request(server.url, "GET", "/metrics")
    return next(s.value for f in text_string_to_metric_families(data.decode()) for s in f.samples
                if s.name == "crescent_gateway_stored_responses")


def test_a_gateway_that_keeps_nothing_refuses_store_and_previous_response_id(cluster):
    c = _client(cluster["none"])
    r = c.responses.create(model=MODEL, input="x", max_output_tokens=3)  # (store left out: not kept)
    assert r.store is False
    for field, value in (("store", True), ("previous_response_id", r.id)):
        with pytest.raises(openai.BadRequestError) as e:
            c.post("/responses", body={"model": MODEL, "input": "x", field: value}, cast_to=object)
        assert e.value.body["param"] == field


def test_a_tenant_reaches_only_its_own_kept_responses(cluster):
    server = cluster["tenants"]
    acme, globex = (openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[t], max_retries=0, timeout=300)
                    for t in ("acme", "globex"))
    r = acme.responses.create(model=MODEL, input="secret", max_output_tokens=4)
    assert acme.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError):
        globex.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    with pytest.raises(openai.AuthenticationError):
        _client(server).responses.retrieve(r.id)
    assert acme.responses.retrieve(r.id).id == r.id  # (still there)
