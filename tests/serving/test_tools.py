"""Tool calling through the gateway, over real engines on loopback, driven by the official client:
a named function's arguments follow its schema (the tokens one engine doing it all gives), a
required call is one or more of the tools, auto reads calls out of the text with the configured
parser (and is refused without one), and the hermes parser on texts of every shape."""

import json
import re

import pytest

from engine.serve.engine_server import EngineNode
from engine.serve.gateway import Gateway, GatewayServer
from engine.serve.openai_protocol import BadRequest, parse_request
from engine.serve.tools import ToolRequest, extract
from tests.serving.test_gateway import MODEL, engine_cfg, request

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _meets(name: str, args: dict) -> bool:
    if name == "get_weather":
        return set(args) == {"city", "days"} and re.fullmatch("[a-z]{1,8}", args["city"]) is not None \
            and isinstance(args["days"], int) and 1 <= args["days"] <= 7
    return args == {"zone": "utc"} or args == {"zone": "cet"}


def engines_with_gateways(gateways: dict):
    """A prefill and a decode engine, and over them a gateway per ``{name: Gateway options}``:
    yields ``{name: server}``; all stopped after."""
    parts = []
    try:
        prefill = EngineNode("prefill", engine_cfg()).start()
        parts.append(prefill.stop)
        decode = EngineNode("decode", engine_cfg()).start()
        parts.append(decode.stop)
        servers = {}
        for name, kw in gateways.items():
            gw = Gateway(MODEL, [prefill.address], [decode.address], timeout_s=300, **kw)
            servers[name] = GatewayServer(gw, "127.0.0.1:0").start()
            parts.append(servers[name].stop)
        yield servers
    finally:
        for stop in reversed(parts):
            stop()


@pytest.fixture(scope="module")
def cluster():
    yield from engines_with_gateways({p: {"tool_parser": p} for p in (None, "hermes", "llama3_json", "pythonic")})


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _chat(server, stream: bool, **kw):
    """(content, tool calls as (name, arguments), finish reason) of one chat completion."""
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, **kw}
    c = _client(server)
    if not stream:
        r = c.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in r.message.tool_calls or []]
        assert all(t.id.startswith("call_") and t.type == "function" for t in r.message.tool_calls or [])
        return r.message.content, calls, r.finish_reason
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    content = "".join(ch.delta.content or "" for ch in chunks) or None
    calls = {}  # a call's arguments may come in pieces: its first piece names it
    for t in (t for ch in chunks for t in ch.delta.tool_calls or []):
        if t.index not in calls:
            assert t.id.startswith("call_") and t.type == "function" and t.function.name
            calls[t.index] = [t.function.name, ""]
        else:
            assert t.id is None and t.function.name is None
        calls[t.index][1] += t.function.arguments or ""
    return content, [tuple(v) for _, v in sorted(calls.items())], chunks[-1].finish_reason


def test_a_named_function_gets_arguments_that_follow_its_schema(cluster):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    server = cluster[None]
    tok = Gateway(MODEL, [], ["127.0.0.1:1"]).tokenizer  # (renders the prompt as the gateway does)
    with LLM(MODEL, dtype="float32") as llm:
        want, = llm.generate(tok.encode_chat(MESSAGES, tools=[WEATHER]), params=SamplingParams(
            max_tokens=300, structured=("json", json.dumps(WEATHER["function"]["parameters"]))))
    assert want.finish_reason == "stop"
    for stream in (False, True):
        content, calls, reason = _chat(server, stream, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert (content, reason) == (None, "stop") and [n for n, _ in calls] == ["get_weather"], stream
        assert calls[0][1] == want.text and _meets("get_weather", json.loads(calls[0][1]))
    # streamed, the arguments come as they are generated, with their logprobs
    chunks = [ch.choices[0] for ch in _client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0, stream=True, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, logprobs=True) if ch.choices]
    pieces = [ch.delta.tool_calls[0].function.arguments for ch in chunks if ch.delta.tool_calls]
    assert len(pieces) > 3 and "".join(pieces) == want.text and chunks[-1].finish_reason == "stop"
    assert sum(len(ch.logprobs.content) for ch in chunks if ch.logprobs) == len(want.token_ids)


def test_required_calls_are_tools_each_with_arguments_that_follow_its_schema(cluster):
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 1.0, "max_tokens": 600}
    for seed in range(3):
        got = [_chat(cluster[None], stream, seed=seed, **kw) for stream in (False, True)]
        assert got[0] == got[1], seed  # (the arguments as written, streamed or not)
        content, calls, reason = got[0]
        assert content is None and reason == "tool_calls" and calls, seed
        assert all(_meets(n, json.loads(a)) for n, a in calls), calls
    # streamed, each call is named in its first delta and its arguments follow in pieces, as generated
    chunks = [ch.choices[0] for ch in _client(cluster[None]).chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, seed=0, **kw) if ch.choices]
    deltas = [t for ch in chunks for t in ch.delta.tool_calls or []]
    assert len(deltas) > 2 * len(got[0][1]) and not chunks[-1].delta.tool_calls


def test_auto_needs_a_parser_and_with_one_plain_text_stays_content(cluster):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(cluster[None], False, tools=[WEATHER])
    assert "--tool-call-parser" in str(e.value) and e.value.body["param"] == "tool_choice"
    for stream in (False, True):
        content, calls, reason = _chat(cluster["hermes"], stream, tools=[WEATHER], max_tokens=8)
        assert content and calls == [] and reason == "length", stream
    plain = _chat(cluster[None], False, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert plain[0] == content and plain[1:] == ([], "length")


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function"}]), ("tools", [{"type": "function", "function": {"name": "a b"}}]),
    ("tools", [WEATHER, WEATHER]), ("tools", "x"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": []}}]),
    ("tool_choice", {"type": "function", "function": {"name": "nope"}}), ("tool_choice", "sometimes"),
    ("parallel_tool_calls", "no")])
def test_bad_tools_are_400_naming_the_field(cluster, field, value):
    body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", field: value}
    status, data = request(cluster[None].url, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"]["param"] == field, data


def test_tools_are_for_chat_and_do_not_mix_with_another_structure():
    with pytest.raises(BadRequest, match="for /v1/chat/completions"):
        parse_request({"model": "m", "prompt": "x", "tools": [WEATHER]}, False, "m")
    with pytest.raises(BadRequest, match="needs 'tools'"):
        parse_request({"model": "m", "messages": MESSAGES, "tool_choice": "required"}, True, "m")
    with pytest.raises(BadRequest, match="structures the output already"):
        parse_request({"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
                       "response_format": {"type": "json_object"}}, True, "m")
    # auto leaves the output free: a response format may come with it
    req = parse_request({"model": "m", "messages": MESSAGES, "tools": [WEATHER],
                         "response_format": {"type": "json_object"}}, True, "m")
    assert req.structured == ("json_object", "") and req.tools.choice == "auto"
    req = parse_request({"model": "m", "messages": MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER]}, True, "m")
    assert req.prompt[1]["tool_calls"][0]["function"]["arguments"] == {"city": "paris", "days": 2}
    assert req.prompt[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert req.template_kwargs["tools"] == [WEATHER]


def test_the_hermes_parser_reads_calls_and_leaves_the_rest_as_text():
    auto = ToolRequest((WEATHER, TIME), "auto")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    content, calls = extract(auto, text, "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "paris", "days": 2}), ("get_time", {"zone": "utc"})]
    assert len({c["id"] for c in calls}) == 2
    unclosed = '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}'  # (EOS before the closing tag)
    assert extract(auto, unclosed, "hermes")[0] is None and len(extract(auto, unclosed, "hermes")[1]) == 1
    for bad in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>get_time()</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "get_time", "arguments": "utc"}',
                '<tool_call>{"name": "get_ti', "no calls at all"):
        assert extract(auto, bad, "hermes") == (bad, []), bad
    assert extract(auto, text, None) == (text, [])
    # arguments as written, cut where the output was cut; the name may follow them
    assert _raw(auto, '<tool_call>{"name": "get_time", "arguments": {"zone": "c', "hermes") == (
        None, [("get_time", '{"zone": "c')])
    assert _raw(auto, '<tool_call>{"arguments": {"zone":"cet"}, "name": "get_time"}', "hermes") == (
        None, [("get_time", '{"zone":"cet"}')])
    assert _raw(auto, '<tool_call>{"name": "get_time"}</tool_call>', "hermes") == (None, [("get_time", "{}")])
    assert _raw(auto, '<tool_call>{"name": "get_time", "arguments": {</tool_call>', "hermes") == (
        None, [("get_time", "{")])  # (not JSON from there on: its arguments end where they stopped being)
    # from a call that is not one on, the text is content, a line below the content before the calls
    assert _raw(auto, 'So: <tool_call>{"name": "get_time", "arguments": {}}</tool_call> <tool_call>{"name": "rm"}',
                "hermes") == ('So:\n<tool_call>{"name": "rm"}', [("get_time", "{}")])
    required = ToolRequest((WEATHER, TIME), "required")
    assert _raw(required, '[{"name": "get_time", "parameters": {"zone": "c', None) == (
        None, [("get_time", '{"zone": "c')])  # (cut by max_tokens: its finish reason says so)
    assert _raw(required, '[{"name": "get_t', None) == ('[{"name": "get_t', [])


def _raw(req, text, parser):
    content, calls = extract(req, text, parser)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _parsed(parser: str, text: str):
    """(content, [(name, arguments)]) of ``text`` with "auto" over the weather and time tools."""
    content, calls = extract(ToolRequest((WEATHER, TIME), "auto"), text, parser)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_llama3_json_parser_reads_json_calls_that_are_the_whole_output():
    def got(text):
        return _parsed("llama3_json", text)

    assert got(' {"name": "get_weather", "parameters": {"city": "paris", "days": 2}}\n') == (
        None, [("get_weather", {"city": "paris", "days": 2})])
    assert got('{"name": "get_time", "arguments": {"zone": "utc"}}; {"name": "get_weather", "parameters": '
               '{"city": "rome", "days": 1}}') == (None, [("get_time", {"zone": "utc"}),
                                                   ("get_weather", {"city": "rome", "days": 1})])
    assert got('{"name": "get_time", "parameters": {}}') == (None, [("get_time", {})])
    assert got('{"name": "get_time", "parameters": {"zone": "utc"}} and then') == (
        "and then", [("get_time", {"zone": "utc"})])  # (what follows the calls is content)
    for text in ('It is sunny. {"name": "get_time", "parameters": {}}',  # calls only at the start
                 '{"name": "rm_rf", "parameters": {}}', '{"name": "get_time", "parameters": "utc"}',
                 '{"name": "get_time", "param', '[{"name": "get_time", "parameters": {}}]', '{}', ""):
        assert _parsed("llama3_json", text) == (text, []), text


def test_the_pythonic_parser_reads_a_list_of_calls_of_literals_never_evaluating_them():
    def got(text):
        return _parsed("pythonic", text)

    assert got('[get_weather(city="paris", days=2), get_time(zone=\'utc\')]') == (
        None, [("get_weather", {"city": "paris", "days": 2}), ("get_time", {"zone": "utc"})])
    assert got("\n[get_time()]") == (None, [("get_time", {})])
    assert got('[get_weather(city="x", days=None, extra={"a": [1, 2.5, True]})]') == (
        None, [("get_weather", {"city": "x", "days": None, "extra": {"a": [1, 2.5, True]}})])
    for text in ('[get_weather("paris")]', "[rm_rf()]", "[get_time(zone=__import__('os').getcwd())]",
                 "[os.system(cmd='x')]", "[get_time(zone=x)]", "[]", "[1, 2]",
                 "Sure: [get_time()]", "[get_time(**{'zone': 'utc'})]", "[get_time(zone=float('inf'))]"):
        assert _parsed("pythonic", text) == (text, []), text
    # read as written: the calls before one that is not, and a list the output cut, are calls; what
    # follows them is content
    assert got("[get_time(zone='utc')") == (None, [("get_time", {"zone": "utc"})])
    assert got("[get_time(zone='a,b)c'), rm_rf()]") == ("rm_rf()]", [("get_time", {"zone": "a,b)c"})])
    assert got("[get_time(zone='''it's'''),] done") == ("done", [("get_time", {"zone": "it's"})])
    # a call is one once its first keyword is read: a later one that is not ends it, as written so far
    assert _raw(ToolRequest((WEATHER, TIME), "auto"), "[get_weather(city='a', days=x)]", "pythonic") == (
        "days=x)]", [("get_weather", '{"city": "a"')])


def test_parallel_tool_calls_false_keeps_one_call():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "rome", "days": 3}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>')
    one = parse_request({"model": "m", "messages": MESSAGES, "tools": [WEATHER, TIME],
                         "parallel_tool_calls": False}, True, "m").tools
    assert [c["function"]["name"] for c in extract(one, text, "hermes")[1]] == ["get_weather"]
    assert [c["function"]["name"] for c in extract(ToolRequest(one.tools, "auto"), text, "hermes")[1]] == [
        "get_weather", "get_time"]
    req = parse_request({"model": "m", "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required",
                         "parallel_tool_calls": False}, True, "m")
    assert json.loads(req.structured[1])["maxItems"] == 1
    assert "maxItems" not in json.loads(parse_request({"model": "m", "messages": MESSAGES, "tools": [WEATHER],
                                                       "tool_choice": "required"}, True, "m").structured[1])


def test_required_without_parallel_calls_is_one_call(cluster):
    for seed in range(3):
        for stream in (False, True):
            content, calls, reason = _chat(cluster[None], stream, tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=600, parallel_tool_calls=False)
            assert content is None and reason == "tool_calls" and len(calls) == 1, (seed, stream, calls)
            assert _meets(calls[0][0], json.loads(calls[0][1]))


def test_the_gateway_refuses_an_unknown_parser():
    from engine.serve.cli import TOOL_PARSERS
    from engine.serve.tools import PARSERS

    with pytest.raises(ValueError, match="unknown tool-call parser 'json'"):
        Gateway(MODEL, [], ["127.0.0.1:1"], tool_parser="json")
    assert set(TOOL_PARSERS) == set(PARSERS)  # what the CLIs offer


def _literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch for ch in text)


@pytest.mark.parametrize("text,content,calls,parser", [
    ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
     "Let me check.", [("get_time", '{"zone": "utc"}')], "hermes"),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "rome", "days": 3}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>',
     None, [("get_weather", '{"city": "rome", "days": 3}'), ("get_time", '{"zone": "cet"}')], "hermes"),
    ("a <tool is not a <tool_cal", "a <tool is not a <tool_cal", [], "hermes"),
    ('so <tool_call>{"name": "nope"}</tool_call>', 'so <tool_call>{"name": "nope"}</tool_call>', [], "hermes"),
    ('{"name": "get_weather", "parameters": {"city": "oslo", "days": 1}}; '
     '{"name": "get_time", "parameters": {"zone": "utc"}}',
     None, [("get_weather", '{"city": "oslo", "days": 1}'), ("get_time", '{"zone": "utc"}')], "llama3_json"),
    ('It is {"name": "get_time"}', 'It is {"name": "get_time"}', [], "llama3_json"),
    ('{"name": "get_time", "parameters": {"zone"', None, [("get_time", '{"zone"')], "llama3_json"),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', [], "llama3_json"),
    ('[get_weather(city="oslo", days=2), get_time(zone="cet")]',
     None, [("get_weather", '{"city": "oslo", "days": 2}'), ("get_time", '{"zone": "cet"}')], "pythonic"),
    ("Try [get_time()] later", "Try [get_time()] later", [], "pythonic"),
], ids=["content-then-call", "two-calls", "tag-prefixes", "unknown-tool", "llama3-two-calls", "llama3-text",
        "llama3-cut", "llama3-unknown-tool", "pythonic-two-calls", "pythonic-text"])
def test_auto_calls_in_the_models_text_stream_as_content_then_calls(cluster, text, content, calls, parser):
    """The model's text is forced (a regex: auto leaves room for a response format) to a given
    output in the parser's format: the content streams up to where a call begins, never a piece
    of the call; the JSON formats' calls stream as they are written (arguments in pieces, as the
    model wrote them, the pythonic ones a keyword at a time); streamed and not alike."""
    want = (content, calls, "tool_calls" if calls else "stop")
    for stream in (False, True):
        assert _chat(cluster[parser], stream, tools=[WEATHER, TIME],
                     extra_body={"structured_outputs": {"regex": _literal(text)}}) == want, stream
    c = _client(cluster[parser])
    chunks = [ch.choices[0] for ch in c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0, tools=[WEATHER, TIME], stream=True,
        extra_body={"structured_outputs": {"regex": _literal(text)}}) if ch.choices]
    pieces = [ch.delta.content for ch in chunks if ch.delta.content]
    if calls:
        assert not any("<" in p for p in pieces), pieces
        deltas = [t for ch in chunks for t in ch.delta.tool_calls or []]
        # NOTE: how many pieces the calls come in is the engine's pace against this reader's: a reader
        # slower than the engine (a loaded machine) gets tokens batched, up to a call whole in one delta
        # (CI once saw '{"zone"' in two pieces where three were asserted). That the parser streams what
        # it is given as it comes, however cut, is test_streamed_calls_join_to_the_unstreamed_answer_...
        assert len(deltas) >= len(calls), deltas
        assert {t.index for t in deltas if t.id} == set(range(len(calls))), deltas
    if content is not None and content.startswith(("{", "[")) and parser != "hermes":
        assert pieces == [content]  # (it began as a call: held to the end, where it did not parse)
    else:
        assert "".join(pieces) == (content or "")  # (in pieces as the engine's pace gives them: see above)


_SHAPES = {
    "hermes": ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
               '<tool_call>{"name": "get_time", "arguments": {</tool_call>', "no calls at all  ",
               '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "a <tool is not a <tool_cal",
               'so <tool_call>{"name": "get_time", "arguments": {"zone": "c\\"e}t"}}</tool_call> <tool_call>'
               '{"name":"x"}</tool_call>', '<tool_call>{"arguments": {"x": ["}"]}, "name": "get_time"}',
               '<tool_call>{"name": "get_weather", "arguments": {"city": "ro',
               '<tool_call>{"name": "get_time", "arguments": {"zone": "a\\\\", "x": ["\\"}", 1.5e3, true]}}'
               '</tool_call><tool_call>{"name": "get_time", "arguments": {}}'],
    "llama3_json": [' {"name": "get_weather", "parameters": {"city": "paris", "days": 2}}\n',
                    '{"name": "get_time", "arguments": {"zone": "utc"}}; {"name": "get_weather", "parameters": '
                    '{"city": "rome", "days": 1}}', '{"name": "get_time", "parameters": {}}',
                    'It is sunny. {"name": "get_time", "parameters": {}}', '{"name": "get_time", "parameters": 1}',
                    '{"name": "get_time", "parameters": {"zone": "utc"}} and then', '{"name": "get_time", "param'],
    "pythonic": ['[get_weather(city="paris", days=2), get_time(zone=\'utc\')]', "Try [get_time()]", "[get_time(x=y)]",
                 ' [get_weather(city="a, (b)", days=-3), get_time(zone="x\\"y")] and more', "[get_weather(city='r",
                 "[get_time(zone='''u,t)c'''), rm_rf(x=1)]", "[get_weather(city=\"x\", days=[1, {'k': (2, 3)}])]",
                 "[]", "[get_time(),]", "[get_weather(city='a', days=x)] so", "[get_weather(city='a', city='b')]",
                 "[get_time(zone='a\\'b,)'), get_weather(city=\"\"\"x\"\"y'''\"\"\", days=1)]", "[get_time(zone='')]",
                 "[get_time(zone=''''''), get_time(zone=\"\")]"],
    None: ['[{"name": "get_time", "parameters": {"zone": "cet"}}', '[{"name": "get_ti',
           '[{"name": "get_time", "parameters": {"zone": "cet"}}, {"name": "get_weather", "parameters": '
           '{"city": "a", "days": 1, "x": [1, {"b": "]}"}]}}]'],
}


@pytest.mark.parametrize("parser", list(_SHAPES), ids=[str(p) for p in _SHAPES])
def test_streamed_calls_join_to_the_unstreamed_answer_however_the_text_is_cut(parser):
    """``CallStream`` fed a text in pieces (every cutting a tokenizer could make, sampled) sends
    content and call deltas that join to exactly what ``extract`` reads from the whole text, each
    call named in its first delta and never again."""
    import random

    from engine.serve.tools import CallStream

    rng = random.Random(0)
    req = ToolRequest((WEATHER, TIME), "required" if parser is None else "auto")
    for text in _SHAPES[parser]:
        want = _raw(req, text, parser)
        for _ in range(60):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 20))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            stream, content, calls = CallStream(req, parser), "", {}
            for k, piece in enumerate(pieces):
                out, deltas = stream.feed(piece, final=k == len(pieces) - 1)
                content += out
                for d in deltas:
                    if d["index"] not in calls:
                        assert d["id"].startswith("call_") and d["function"]["name"], d
                        calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
                    else:
                        assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
                        calls[d["index"]][1] += d["function"]["arguments"]
            assert (content or None, [tuple(v) for _, v in sorted(calls.items())]) == want, (text, pieces)


def test_the_tool_stream_bench_prints_its_table(monkeypatch, capsys):
    """bench/tool_stream_bench.py at a toy size (its figures are in docs/benchmarks.md): both ways
    send exactly the call's arguments (the bench fails otherwise), one row per format and size."""
    import sys

    from bench.tool_stream_bench import main

    monkeypatch.setattr(sys, "argv", ["tool_stream_bench.py", "--quick"])
    assert main() == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("| ") and line.endswith("× |") for line in out.splitlines()) == 4, out
