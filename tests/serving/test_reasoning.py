"""Reasoning outputs through the gateway (``--reasoning-parser``), over real engines on loopback,
driven by the official client: the reasoning between ``<think>`` and ``</think>`` comes apart from
the content, streamed and not alike; the prompt tells where the output begins; tool calls are read
from the content; a grammar waits for the end of the reasoning."""

import json
import random

import pytest

from engine.serve.gateway import Gateway
from engine.serve.reasoning import Stream, opened, split
from tests.serving.test_gateway import MODEL
from tests.serving.test_tools import _literal, engines_with_gateways

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize("text,is_open,want", [
    ("<think>Let me see.</think>It is 4.", False, ("Let me see.", "It is 4.")),
    ("\n<think>\nhm\n</think>\n\nIt is 4.", False, ("\nhm\n", "\n\nIt is 4.")),
    ("It is 4.", False, (None, "It is 4.")),
    ("It is <think>4</think>.", False, (None, "It is <think>4</think>.")),
    ("<think>cut before the end", False, ("cut before the end", None)),
    ("<think></think>4", False, (None, "4")),
    ("<thin", False, (None, "<thin")),
    ("", False, (None, None)),
    ("Let me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
    ("<think>Let me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
    ("thinking, cut", True, ("thinking, cut", None)),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("<", True, ("<", None)),
])
def test_split_and_every_streaming_of_it_agree(text, is_open, want):
    assert split(text, is_open) == want
    rng = random.Random(0)
    for _ in range(50):  # any cut into pieces streams the same two parts
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s, r, c = Stream(is_open), "", ""
        for k, piece in enumerate(pieces):
            dr, dc = s.feed(piece, final=k == len(pieces) - 1)
            assert not (dr and c), "reasoning after content"
            r, c = r + dr, c + dc
            assert "</think>" not in r
        assert (r or None, c or None) == want and s.content == c


def test_reasoning_tokens_run_through_the_one_that_closes_it():
    from engine.serve.reasoning import reasoning_tokens
    from engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    def count(text, is_open):
        return reasoning_tokens(tok.encode(text), tok.decode, is_open)

    assert count("<think>ab</think>cd", False) == len("<think>ab</think>")
    assert count("ab</think>cd", True) == len("ab</think>")
    assert count("cut short", True) == len("cut short") and count("<think>cut", False) == len("<think>cut")
    assert count("no thinking</think>", False) == 0 and count("", False) == 0


def test_held_back_text_is_only_what_may_begin_a_tag():
    s = Stream(True)
    assert s.feed("a</th") == ("a", "")  # (the tail may begin </think>)
    assert s.feed("ing") == ("</thing", "")
    s = Stream(False)
    assert s.feed(" <th") == ("", "")  # (may still begin with <think>)
    assert s.feed("e") == ("", " <the")
    assert opened("<|Assistant|><think>\n") and not opened("<think>\n\n</think>\n\n") and not opened("Hello")


@pytest.fixture(scope="module")
def cluster():
    yield from engines_with_gateways({"plain": {}, "r1": {"reasoning_parser": "deepseek_r1"},
                                      "r1+hermes": {"reasoning_parser": "deepseek_r1", "tool_parser": "hermes"}})


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _chat(server, stream: bool, **kw):
    """(reasoning, content, tool calls, finish reason, reasoning pieces) of one chat completion."""
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, **kw}
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    if not stream:
        r = c.chat.completions.create(**kw).choices[0]
        m = r.message.model_dump()
        assert m.get("reasoning") == m.get("reasoning_content")
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in r.message.tool_calls or []]
        return m.get("reasoning"), r.message.content, calls, r.finish_reason, None
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [ch.delta.model_dump() for ch in chunks]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    pieces = [d["reasoning"] for d in deltas if d.get("reasoning")]
    assert not any(d.get("content") for d in deltas[:max((i for i, d in enumerate(deltas) if d.get("reasoning")),
                                                          default=0)]), "content before the reasoning's end"
    joined = {}  # a call's first delta names it, the next ones carry the rest of its arguments
    for t in (t for ch in chunks for t in ch.delta.tool_calls or []):
        joined.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments or ""
    calls = [(name, json.loads(args)) for _, (name, args) in sorted(joined.items())]
    return "".join(pieces) or None, "".join(ch.delta.content or "" for ch in chunks) or None, calls, \
        chunks[-1].finish_reason, pieces


@pytest.mark.parametrize("text,want", [
    ("<think>Two and two, so four.</think>It is 4.", ("Two and two, so four.", "It is 4.")),
    ("It is 4, no thinking.", (None, "It is 4, no thinking.")),
    ("<think>I ran out of room and never fin", ("I ran out of room and never fin", None)),
])
def test_reasoning_comes_apart_from_the_content_streamed_and_not(cluster, text, want):
    """The output is forced (a regex; the prompt did not open the reasoning, so the grammar holds
    from the first token) to a reasoning model's: its reasoning and content come apart, the same
    streamed, where the reasoning arrives in pieces before any content."""
    body = {"extra_body": {"structured_outputs": {"regex": _literal(text)}}}
    if want[1] is None:
        body["max_tokens"] = len(text.encode())  # (cut by max_tokens)
    for stream in (False, True):
        r, content, calls, reason, pieces = _chat(cluster["r1"], stream, **body)
        assert (r, content, calls) == (*want, []), stream
        assert reason == ("length" if want[1] is None else "stop")
        if stream and want[0]:
            assert len(pieces) > 1
    use = _client(cluster["r1"]).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                          max_tokens=body.get("max_tokens", 200),
                                                          extra_body=body["extra_body"]).usage
    closes = text.find("</think>") + len("</think>") if "</think>" in text else len(text)
    assert use.completion_tokens_details.reasoning_tokens == (len(text[:closes].encode()) if want[0] else 0)
    body["extra_body"]["include_reasoning"] = False  # (vLLM's: the reasoning is left out, the content stays)
    for stream in (False, True):
        assert _chat(cluster["r1"], stream, **body)[:3] == (None, want[1], []), stream
    del body["extra_body"]["include_reasoning"]
    plain = _chat(cluster["plain"], False, **body)  # without a parser: all of it is the content
    assert plain[:2] == (None, text)


def test_a_prompt_that_opens_the_reasoning_makes_the_output_reasoning_until_it_closes(cluster):
    """An assistant message ``<think>`` continued (``continue_final_message``) opens the reasoning
    in the prompt: the output is reasoning from its first token (a random model never closes it);
    a grammar then waits for ``</think>``, so the reasoning is the model's own, as without one."""
    msgs = MESSAGES + [{"role": "assistant", "content": "<think>"}]
    kw = {"messages": msgs, "max_tokens": 24, "extra_body": {"continue_final_message": True,
                                                             "add_generation_prompt": False}}
    free = _chat(cluster["r1"], False, **kw)
    assert free[0] and free[1] is None and free[3] == "length"
    assert _chat(cluster["r1"], True, **kw)[:4] == free[:4]
    assert _chat(cluster["plain"], False, **kw)[1] == free[0]  # (the same tokens, all content there)
    held = {**kw, "extra_body": {**kw["extra_body"], "structured_outputs": {"regex": "[0-9]"}}}
    for stream in (False, True):
        assert _chat(cluster["r1"], stream, **held)[:4] == free[:4], stream


def test_tool_calls_are_read_from_the_content_after_the_reasoning(cluster):
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    text = '<think>I should add. <tool_call> is how.</think><tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}' \
           '</tool_call>'
    for stream in (False, True):
        r, content, calls, reason, _ = _chat(cluster["r1+hermes"], stream, tools=[tool],
                                             extra_body={"structured_outputs": {"regex": _literal(text)}})
        assert (r, content, calls, reason) == ("I should add. <tool_call> is how.", None, [("add", {"a": 2, "b": 2})],
                                               "tool_calls"), stream


def test_the_gateway_refuses_an_unknown_reasoning_parser():
    from engine.serve.cli import REASONING_PARSERS
    from engine.serve.reasoning import PARSERS

    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        Gateway(MODEL, [], ["127.0.0.1:1"], reasoning_parser="o1")
    assert set(REASONING_PARSERS) == set(PARSERS)


def test_the_gateway_sends_a_grammar_with_the_tokens_it_waits_for():
    from engine.serve.openai_protocol import parse_request

    gw = Gateway(MODEL, [], ["127.0.0.1:1"], reasoning_parser="qwen3")
    held = {"structured_outputs": {"regex": "[0-9]"}}
    for msgs, extra, is_open in (
            (MESSAGES + [{"role": "assistant", "content": "<think>"}],
             {"continue_final_message": True, "add_generation_prompt": False}, True),
            (MESSAGES, {}, False)):
        req = parse_request({"model": MODEL, "messages": msgs, **extra, **held}, True, MODEL)
        req = gw.with_reasoning(req, gw.encode(req))
        assert req.reasoning is is_open
        assert req.structured_after == (tuple(gw.tokenizer.encode("</think>")) if is_open else ())
        sent = gw._sampling(req).structured
        assert (sent.kind, sent.spec, tuple(sent.after)) == ("regex", "[0-9]", req.structured_after)
    completion = parse_request({"model": MODEL, "prompt": "<think>", **held}, False, MODEL)
    assert gw.with_reasoning(completion, gw.encode(completion)).reasoning is None  # (chat only)


def test_logprobs_cover_the_reasoning_and_the_content_streamed_and_not(cluster):
    text = "<think>Two and two.</think>It is 4."
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "logprobs": True,
          "top_logprobs": 2, "extra_body": {"structured_outputs": {"regex": _literal(text)}}}
    c = openai.OpenAI(base_url=cluster["r1"].url + "/v1", api_key="unused", timeout=300, max_retries=0)
    whole = [(t.token, t.logprob) for t in c.chat.completions.create(**kw).choices[0].logprobs.content]
    chunks = [ch for ch in c.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs]
    streamed = [(t.token, t.logprob) for ch in chunks for t in ch.choices[0].logprobs.content]
    assert "".join(t for t, _ in whole) == text and [t for t, _ in streamed] == [t for t, _ in whole]
    # (the second request may reuse the first's cached pages: the same values to float rounding)
    assert [v for _, v in streamed] == pytest.approx([v for _, v in whole], abs=1e-4)
