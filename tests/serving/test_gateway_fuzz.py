"""Bad requests get a 400 naming what is wrong, never a crash: request bodies drawn at random from
the fields the gateway reads (and others), each holding any JSON value — nulls, bools, huge
integers, NaN and infinities (Python's json reads them), strings, lists, objects shaped like
tools, response formats and messages — are parsed (``parse_request``: a request or BadRequest,
nothing else) and sent to a real gateway over HTTP: with its engine unreachable every answer is a
400, or the 503 of a request that parsed, rendered and tokenized and found no engine (the
Responses API's bodies, its input items drawn too, likewise); over real
engines, a 400 or a whole answer (a JSON body, or a stream that ends with ``[DONE]`` and holds no
error)."""

import http.client
import json

import pytest

from engine.serve.engine_server import EngineNode
from engine.serve.gateway import Gateway, GatewayServer
from engine.serve.openai_protocol import BadRequest, parse_request

hypothesis = pytest.importorskip("hypothesis")  # a dev dependency: the module skips without it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.serving.test_gateway import MODEL, engine_cfg  # noqa: E402
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
          "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
          "logit_bias", "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p",
          "min_tokens", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "allowed_token_ids",
          "bad_words", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "tools", "tool_choice", "parallel_tool_calls", "cache_salt", "truncate_prompt_tokens",
          "speculative", "include_reasoning", "chat_template_kwargs", "add_generation_prompt",
          "continue_final_message", "documents", "best_of", "suffix", "logits_processors", "use_beam_search",
          "length_penalty", "unknown_field"]
KEYS = FIELDS + ["type", "function", "name", "parameters", "role", "content", "json_schema", "schema", "regex",
                 "choice", "json", "grammar", "text", "include_usage", "tool_calls", "arguments", "id", "strict"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2 ** 31, 2 ** 63, -2 ** 64, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "x", MODEL, "auto", "none", "required", "json_object", "json_schema", "text", "\x00",
                     "{", "user", "assistant", "function", "<think>", "<tool_call>"]),
    st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", "x y"]), "parameters": inner})}),
    st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "function", "text"]),
                           "json_schema": inner}),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                    "content": inner}), min_size=1, max_size=2)), max_leaves=12)


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    body = {"model": MODEL, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    body.update(draw(st.dictionaries(st.sampled_from(FIELDS), values, min_size=1, max_size=4)))
    return chat, body


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_parse_request_gives_a_request_or_a_bad_request_for_any_body(case):
    chat, body = case
    try:
        parse_request(body, chat, MODEL)
    except BadRequest as exc:
        assert exc.body()["error"]["message"]


@pytest.fixture(scope="module")
def gateway():
    gw = Gateway(MODEL, [], ["127.0.0.1:1"], timeout_s=30, tool_parser="hermes", reasoning_parser="qwen3")
    srv = GatewayServer(gw, "127.0.0.1:0").start()
    yield srv
    srv.stop()


def _post(server, chat: bool, body: dict, path: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request("POST", path or ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(bodies())
def test_the_gateway_answers_any_body_with_a_400_or_no_engine(gateway, case):
    status, raw = _post(gateway, *case)
    out = json.loads(raw)
    assert status in (400, 503), (status, out)
    assert out["error"]["message"]
    if status == 503:  # (it parsed, rendered and tokenized; then found no engine)
        assert "engine unavailable" in out["error"]["message"], out


RESPONSES_FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "store",
                    "previous_response_id", "metadata", "reasoning", "truncation", "include", "background",
                    "temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed", "structured_outputs"]
items = st.one_of(values, st.lists(st.fixed_dictionaries({
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "image"]),
    "role": st.sampled_from(["user", "assistant", "developer", "tool"]), "content": values, "call_id": values,
    "name": values, "arguments": values, "output": values}), max_size=3))


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(items, st.dictionaries(st.sampled_from(RESPONSES_FIELDS), values, max_size=4))
def test_the_responses_api_answers_any_body_with_a_400_or_no_engine(gateway, input_, fields):
    status, raw = _post(gateway, True, {"model": MODEL, "input": input_, **fields}, "/v1/responses")
    out = json.loads(raw)
    assert status in (400, 503), (status, out)
    assert out["error"]["message"]
    if status == 503:
        assert "engine unavailable" in out["error"]["message"], out


@pytest.fixture(scope="module")
def served():
    parts = []
    try:
        for role in ("prefill", "decode"):
            parts.append(EngineNode(role, engine_cfg()).start())
        gw = Gateway(MODEL, [parts[0].address], [parts[1].address], timeout_s=300, tool_parser="hermes",
                     reasoning_parser="qwen3")
        srv = GatewayServer(gw, "127.0.0.1:0").start()
        yield srv
        srv.stop()
    finally:
        for p in reversed(parts):
            p.stop()


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(bodies())
def test_over_real_engines_any_body_gets_a_400_or_a_whole_answer(served, case):
    chat, body = case
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 32:  # (short answers: a fast test)
        body["max_tokens"] = 8
    status, raw = _post(served, chat, body)
    assert status in (200, 400), (status, raw[:500])
    if status == 200 and body.get("stream") is True:
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw, raw[-500:]
    else:
        out = json.loads(raw)
        assert out["choices"] if status == 200 else out["error"]["message"], out
