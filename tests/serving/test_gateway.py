"""The gateway over real engines (in-process gRPC servers on loopback) and a real store node:
stop strings, partial UTF-8, 404s, the body limit, /health, prefill fallback, no route."""

import http.client
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import urllib.parse

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.sampling import MAX_LOGPROBS
from engine.serve.engine_server import EngineNode
from engine.serve.gateway import MAX_BODY, Gateway, GatewayServer
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.config import StoreConfig
from kvstore.server import StoreNode
from proto.crescent.v1 import engine_pb2 as epb
from proto.crescent.v1 import engine_pb2_grpc as epb_grpc
from tests.helpers import ROOT, wait_for

openai = pytest.importorskip("openai")  # the official client drives the gateway

MODEL = "random:tiny"
# Prompts (token ids) whose greedy outputs from random:tiny have the shape a test needs;
# each test first checks that they still do.
STOP_PROMPT = [61, 194, 204, 210, 194, 43, 49, 66, 64, 21, 13, 220]  # → "g^??<|274|>)^..."
UTF8_PROMPT = [146, 63, 227, 129, 150, 235, 241, 178, 230, 184, 15, 103]  # → bytes d5 80 ("Հ"), then <|454|>


def engine_cfg(store: str | None = None, **kw) -> EngineConfig:
    return EngineConfig(model=MODEL, dtype="float32", chunk_tokens=64, kv_cache_memory="16MiB", store=store, **kw)


class Setup:
    """Engines (and optionally a store node) plus a gateway serving on 127.0.0.1:0; ``close`` stops all."""

    def __init__(self, with_store: bool, prefill: bool = True, api_keys=None, **decode_cfg) -> None:
        self.parts = []
        self.store = None
        if with_store:
            self.store = StoreNode(StoreConfig(listen="127.0.0.1:0", dram=64 << 20)).start()
            self.parts.append(lambda: self.store.stop(grace=0))
        addr = self.store.address if self.store else None
        self.prefill = EngineNode("prefill", engine_cfg(addr)).start() if prefill else None
        if self.prefill:
            self.parts.append(self.prefill.stop)
        self.decode = EngineNode("decode", engine_cfg(addr, **decode_cfg)).start()
        self.parts.append(self.decode.stop)
        self.gw = Gateway(MODEL, [self.prefill.address] if self.prefill else [], [self.decode.address],
                          timeout_s=300, api_keys=api_keys)
        self.server = GatewayServer(self.gw, "127.0.0.1:0").start()
        self.parts.append(self.server.stop)
        self.url = self.server.url

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=300, max_retries=0)

    def close(self) -> None:
        for stop in reversed(self.parts):
            stop()


@pytest.fixture(scope="module")
def disagg():
    s = Setup(with_store=True)
    yield s
    s.close()


@pytest.fixture
def fresh():
    """A store-less prefill + decode pair of its own, for tests that stop an engine."""
    s = Setup(with_store=False)
    yield s
    s.close()


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    status, data = request(url, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(data.decode()) for s in fam.samples}


def counted(url: str, key: tuple[str, tuple], n: float, base: dict | None = None) -> dict:
    """The gateway's metrics once ``key`` has reached ``n`` (above ``base``'s value). A request is
    counted as its handler ends, just after the client has read its answer: a scrape right then
    may not see it yet (the count is then checked exactly by the caller)."""
    box = []

    def scraped() -> bool:
        box[:] = [metrics(url)]
        return box[0].get(key, 0.0) - (base or {}).get(key, 0.0) >= n

    wait_for(scraped, timeout_s=60, what=f"{key} to reach {n}")
    return box[0]


def completion(c: openai.OpenAI, prompt, stream: bool, **kw):
    """(text, finish reason, per-chunk texts) of one completion."""
    kw = {"model": MODEL, "prompt": prompt, "temperature": 0, "extra_body": {"ignore_eos": True}, **kw}
    if not stream:
        r = c.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, None
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
    reasons = [ch.finish_reason for ch in chunks if ch.finish_reason]
    assert len(reasons) == 1 and chunks[-1].finish_reason == reasons[0]
    return "".join(ch.text for ch in chunks), reasons[0], [ch.text for ch in chunks]


# ---- stop strings and incremental detokenization ----------------------------------------


def test_stop_strings_cut_the_text_streamed_and_not(disagg):
    c = disagg.client()
    full, reason, _ = completion(c, STOP_PROMPT, False, max_tokens=12)
    assert full.startswith("g^??<|274|>") and reason == "length"
    # "??<" spans three tokens ("?", "?", "<|274|>"): none of it may be sent, not even the "?"s
    for stream in (False, True):
        text, reason, _ = completion(c, STOP_PROMPT, stream, max_tokens=12, stop=["zzzz", "??<"])
        assert (text, reason) == ("g^", "stop"), stream
    # a stop string that never occurs changes nothing
    for stream in (False, True):
        text, reason, _ = completion(c, STOP_PROMPT, stream, max_tokens=12, stop="zzzz")
        assert (text, reason) == (full, "length"), stream


def test_chat_stop_string_streamed_and_not(disagg):
    c = disagg.client()
    msgs = [{"role": "user", "content": "hi"}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = c.chat.completions.create(**kw).choices[0].message.content
    assert full.startswith("<|353|><|353|><|353|><|415|>")
    stop = "|><|415|>"  # the end of the third token's text and the whole fourth's
    want = "<|353|><|353|><|353"
    r = c.chat.completions.create(stop=[stop], **kw)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stop=[stop], stream=True, **kw) if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == want
    assert chunks[-1].finish_reason == "stop"


def test_top_k_min_p_stop_token_ids_and_the_stop_string_kept(disagg):
    """vLLM's sampling extensions: top_k 1 and min_p 1 leave only the likeliest token (greedy at any
    temperature); a stop token id ends the choice with it; include_stop_str_in_output keeps the stop
    string, streamed and not."""
    c = disagg.client()
    greedy, _, _ = completion(c, STOP_PROMPT, False, max_tokens=8)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        text, reason, _ = completion(c, STOP_PROMPT, False, max_tokens=8, temperature=1.5, seed=1, extra_body={
            "ignore_eos": True, **extra})
        assert (text, reason) == (greedy, "length"), extra
    ids = _engine_reference(STOP_PROMPT, 8, 0).token_ids
    stop_id = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    n = ids.index(stop_id) + 1
    for stream in (False, True):
        text, reason, _ = completion(c, STOP_PROMPT, stream, max_tokens=8,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
        assert (text, reason) == (disagg.gw.tokenizer.decode(ids[:n]), "stop"), stream
        text, reason, _ = completion(c, STOP_PROMPT, stream, max_tokens=12, stop=["zzzz", "??<"],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        assert (text, reason) == ("g^??<", "stop"), stream


def test_penalties_reach_both_engines_and_give_the_engines_tokens(disagg):
    """The prefill engine samples the first token with the penalties over the prompt, the decode
    engine the rest over prompt and output: the tokens of one engine doing both."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    prompt = [40 + i % 7 for i in range(30)]
    pen = {"repetition_penalty": 1.6, "frequency_penalty": 0.7, "presence_penalty": 0.2}
    with LLM(MODEL, dtype="float32") as llm:
        want, = llm.generate(prompt, params=SamplingParams(max_tokens=10, ignore_eos=True, **pen))
        plain, = llm.generate(prompt, max_tokens=10, ignore_eos=True)
    assert want.token_ids != plain.token_ids  # (the penalties act on this prompt)
    for stream in (False, True):
        text, _, _ = completion(disagg.client(), prompt, stream, max_tokens=10, extra_body={"ignore_eos": True, **pen})
        assert text == disagg.gw.tokenizer.decode(want.token_ids), stream


def test_logit_bias_allowed_tokens_bad_words_and_min_tokens_give_the_engines_tokens(disagg):
    """Each option reaches both engines (the prefill engine's first token obeys it too) and the
    answer is one engine's doing it all: OpenAI's logit_bias (string token ids), vLLM's
    allowed_token_ids, bad_words (a string: the gateway bans the tokens spelling it) and min_tokens
    (EOS pushed to the top by a bias is held back until then; the first token included)."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.serve.openai_protocol import bad_words_ids

    tok = disagg.gw.tokenizer
    eos = tok.eos_token_id
    with LLM(MODEL, dtype="float32") as llm:
        def ref(**kw):
            out, = llm.generate(STOP_PROMPT, params=SamplingParams(max_tokens=8, **kw))
            return tok.decode(out.token_ids), out.finish_reason

        plain = llm.generate(STOP_PROMPT, max_tokens=8, ignore_eos=True)[0].token_ids
        assert tok.decode(plain[:4]) == "g^??"  # (the bytes a bad word spells below)
        assert bad_words_ids(("^?",), tok) == ((ord("^"), ord("?")),)  # (bytes: no second spelling)
        cases = [({"logit_bias": {"77": 6, str(plain[0]): -100}, "ignore_eos": True},
                  dict(logit_bias={77: 6.0, plain[0]: -100.0}, ignore_eos=True)),
                 ({"allowed_token_ids": list(range(100, 140)), "ignore_eos": True},
                  dict(allowed_token_ids=tuple(range(100, 140)), ignore_eos=True)),
                 ({"bad_words": ["^?"], "ignore_eos": True}, dict(bad_words_ids=[[ord("^"), ord("?")]], ignore_eos=True)),
                 ({"min_tokens": 3, "logit_bias": {str(eos): 100}}, dict(min_tokens=3, logit_bias={eos: 100.0}))]
        wants = [ref(**kw) for _, kw in cases]
    assert all(w[0] != tok.decode(plain) for w in wants)  # (each option changes the answer)
    assert wants[3] == (tok.decode(plain[:3]), "stop")  # three tokens, then EOS
    for (body, _), want in zip(cases, wants):
        for stream in (False, True):
            got = completion(disagg.client(), STOP_PROMPT, stream, max_tokens=8, extra_body=body)[:2]
            assert got == want, (body, stream)
    for field, value in (("logit_bias", {"512": 1}), ("allowed_token_ids", [3, 512]), ("stop_token_ids", [512])):
        status, data = request(disagg.url, "POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}).encode(), {"Content-Type": "application/json"})
        assert status == 400 and "in [0, 512)" in json.loads(data)["error"]["message"], (field, data)


def test_min_tokens_holds_back_stop_strings_ending_in_the_first_tokens(disagg):
    """As vLLM: before min_tokens tokens are out no stop string is looked for, and after only one
    that ends past their text counts ("g^?" has a "^"; the next one ends the text)."""
    c = disagg.client()
    for stream in (False, True):
        assert completion(c, STOP_PROMPT, stream, max_tokens=12, stop="^")[:2] == ("g", "stop")
        assert completion(c, STOP_PROMPT, stream, max_tokens=12, stop="^",
                          extra_body={"ignore_eos": True, "min_tokens": 3})[:2] == ("g^??<|274|>)", "stop")
        assert completion(c, STOP_PROMPT, stream, max_tokens=12, stop="^?",
                          extra_body={"ignore_eos": True, "min_tokens": 2})[:2] == ("g", "stop")


def test_structured_outputs_through_both_engines_are_the_engines_and_meet_their_grammar(disagg):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and
    guided_* reach the prefill engine (its first token is the grammar's) and the decode engine
    (its matcher follows that token): greedy answers are one engine's doing it all, streamed and not;
    chat answers meet the schema."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from tests.engine.test_structured import GRAMMAR, SCHEMA, _meets

    pytest.importorskip("xgrammar")
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
              ("json", json.dumps(SCHEMA))),
             ({"structured_outputs": {"regex": "[a-z]{2,4}-[0-9]{2}"}}, ("regex", "[a-z]{2,4}-[0-9]{2}")),
             ({"guided_choice": ["yes", "no", "maybe so"]}, ("choice", json.dumps(["yes", "no", "maybe so"]))),
             ({"guided_grammar": GRAMMAR}, ("grammar", GRAMMAR)),
             ({"response_format": {"type": "json_object"}, "logit_bias": {str(ord("}")): 8}}, ("json_object", ""))]
    with LLM(MODEL, dtype="float32") as llm:
        wants = []
        for body, spec in cases:
            bias = {int(k): float(v) for k, v in body.get("logit_bias", {}).items()}
            out, = llm.generate(STOP_PROMPT, params=SamplingParams(max_tokens=300, structured=spec, logit_bias=bias))
            assert out.finish_reason == "stop" and _meets(spec, out.text), (spec, out.text)
            wants.append(out.text)
    for (body, spec), want in zip(cases, wants):
        for stream in (False, True):
            got = completion(disagg.client(), STOP_PROMPT, stream, max_tokens=300, extra_body=body)[:2]
            assert got == (want, "stop"), (body, stream)
    c = disagg.client()
    for stream in (False, True):
        kw = {"model": MODEL, "messages": [{"role": "user", "content": "a record, please"}], "max_tokens": 300,
              "temperature": 1.0, "seed": 3, "response_format": cases[0][0]["response_format"]}
        if stream:
            chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
            text, reason = "".join(ch.delta.content or "" for ch in chunks), chunks[-1].finish_reason
        else:
            r = c.chat.completions.create(**kw)
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert reason == "stop" and _meets(cases[0][1], text), text
    status, data = request(disagg.url, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "hi", "guided_regex": "[a-"}).encode(), {"Content-Type": "application/json"})
    assert status == 400 and "does not compile: Regex parsing error" in json.loads(data)["error"]["message"], data


def test_tokenize_and_detokenize_are_the_gateways_own_encoding(disagg):
    """vLLM's /tokenize (a prompt, with or without BOS, or chat messages rendered as a chat
    request's) and /detokenize."""
    tok = disagg.gw.tokenizer

    def post(path, body):
        status, data = request(disagg.url, "POST", path, json.dumps({"model": MODEL, **body}).encode(),
                               {"Content-Type": "application/json"})
        return status, json.loads(data)

    assert post("/tokenize", {"prompt": "héllo"}) == (200, {"count": 7, "tokens": tok.encode("héllo", add_bos=True)})
    status, out = post("/tokenize", {"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})
    assert (status, out) == (200, {"count": 2, "tokens": [104, 105], "token_strs": ["h", "i"]})
    msgs = [{"role": "user", "content": "hi"}]
    assert post("/tokenize", {"messages": msgs})[1]["tokens"] == tok.encode_chat(msgs)
    assert post("/detokenize", {"tokens": tok.encode("héllo")}) == (200, {"prompt": "héllo"})
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens"), ("/tokenize", {"model": "x"}, "model")):
        status, out = post(path, body)
        assert status == 400 and out["error"]["param"] == param, (path, body)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(disagg):
    c = disagg.client()
    text = "abc " * 10 + "the end"
    for prompt, last in (([7] * 30 + STOP_PROMPT, STOP_PROMPT), (text, disagg.gw.tokenizer.encode(text)[-9:])):
        want, _, _ = completion(c, last, False, max_tokens=6)
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True, "truncate_prompt_tokens": len(last)})
        assert r.choices[0].text == want and r.usage.prompt_tokens == len(last)


def test_continue_final_message_goes_on_with_the_assistants_text(disagg):
    """The chat prompt ends inside the assistant's message: the answer is what a completion of
    that prompt gives."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "g^"}]
    ids = disagg.gw.tokenizer.encode_chat(msgs, continue_final_message=True)
    assert disagg.gw.tokenizer.decode(ids).endswith("<|assistant|>\ng^")
    want, _, _ = completion(disagg.client(), ids, False, max_tokens=5)
    r = disagg.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                extra_body={"ignore_eos": True, "continue_final_message": True})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)


def test_a_character_split_across_tokens_is_never_sent_half(disagg):
    c = disagg.client()
    # the prefill engine's first token is the lead byte d5 and the decode engine's first is 80:
    # the gateway sees them in two separate messages
    text, reason, _ = completion(c, UTF8_PROMPT, False, max_tokens=3)
    assert (text, reason) == ("\u0540<|454|>", "length")
    text, reason, pieces = completion(c, UTF8_PROMPT, True, max_tokens=3)
    assert (text, reason) == ("\u0540<|454|>", "length")
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "\u0540" in [p[:1] for p in pieces if p]


# ---- log-probabilities ----------------------------------------------------------------------


def _engine_reference(prompt: list[int], max_tokens: int, k: int):
    from engine.llm import LLM

    with LLM(MODEL, dtype="float32") as llm:
        out, = llm.generate(prompt, max_tokens=max_tokens, logprobs=k, ignore_eos=True)
    return out


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill-engine-first", "decode-engine-alone"])
def test_completion_logprobs_are_the_engines_streamed_and_not(disagg, prefill):
    """The first token's come from the prefill engine, the rest from the decode engine (or all from
    a decode engine prefilling alone); streamed or not, one entry per completion token."""
    setup = disagg if prefill else Setup(with_store=False, prefill=False)
    try:
        c = setup.client()
        ref = _engine_reference(STOP_PROMPT, 6, 3)
        kw = {"model": MODEL, "prompt": STOP_PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3,
              "extra_body": {"ignore_eos": True}}
        r = c.completions.create(**kw)
        lp = r.choices[0].logprobs
        tok = [disagg.gw.tokenizer.decode([t]) for t in ref.token_ids]
        assert lp.tokens == tok and "".join(tok) == r.choices[0].text
        assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
        for top, x, t in zip(lp.top_logprobs, ref.logprobs, tok):
            want = {disagg.gw.tokenizer.decode([i]): v for i, v in x.top}
            assert top == pytest.approx({**want, t: x.logprob}, abs=1e-5)
        assert lp.text_offset == [sum(map(len, tok[:i])) for i in range(len(tok))]
        chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
        streamed = [ch.logprobs for ch in chunks if ch.logprobs is not None]
        assert sum((x.tokens for x in streamed), []) == lp.tokens
        assert sum((x.token_logprobs for x in streamed), []) == lp.token_logprobs
        assert sum((x.text_offset for x in streamed), []) == lp.text_offset
        # cut by a stop string: the tokens generated up to it, the one completing it included
        for stream in (False, True):
            kw_stop = {**kw, "max_tokens": 12, "stop": ["??<"]}
            if stream:
                got = [ch for ch in c.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kw_stop)]
                n = got[-1].usage.completion_tokens
                entries = sum((ch.choices[0].logprobs.tokens for ch in got if ch.choices), [])
                text = "".join(ch.choices[0].text for ch in got if ch.choices)
            else:
                got = c.completions.create(**kw_stop)
                n, entries, text = got.usage.completion_tokens, got.choices[0].logprobs.tokens, got.choices[0].text
            assert text == "g^" and len(entries) == n and "".join(entries).startswith("g^??"), stream
    finally:
        if not prefill:
            setup.close()


def test_chat_logprobs_list_each_token_with_its_bytes_and_top_alternatives(disagg):
    c = disagg.client()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
          "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert bytes(e.bytes) == e.token.encode() and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6  # greedy: the token is the most likely
        assert e.token == e.top_logprobs[0].token
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    streamed = sum((ch.logprobs.content for ch in chunks if ch.logprobs is not None), [])
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # logprobs off: null, as before
    r = c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill-engine", "decode-engine-alone"])
def test_echo_returns_the_prompt_and_its_logprobs_before_the_completion(disagg, prefill):
    """lm-evaluation-harness scores a continuation this way (``echo``, ``logprobs``, ``max_tokens=1``).
    The prefill engine computes the whole prompt for it; the decode engine, asked for no prompt
    logprobs, still loads the prompt's KV from the store."""
    setup = disagg if prefill else Setup(with_store=False, prefill=False)
    try:
        c = setup.client()
        prompt = [(7 * i) % 250 + 3 for i in range(150)]  # two full 64-token chunks
        ref = _engine_reference_prompt(prompt, 3)
        loaded = setup.decode.engine.connector.stats.chunks_loaded if prefill else 0
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 3, "echo": True,
              "extra_body": {"ignore_eos": True}}
        r = c.completions.create(**kw)
        lp, tok = r.choices[0].logprobs, setup.gw.tokenizer
        assert r.choices[0].text == tok.decode(prompt + ref.token_ids)
        assert lp.tokens == [tok.decode([t]) for t in prompt + ref.token_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(prompt)] == pytest.approx([x.logprob for x in ref.prompt_logprobs[1:]], abs=1e-5)
        for top, x, t in zip(lp.top_logprobs[1:], ref.prompt_logprobs[1:], prompt[1:]):
            assert top == pytest.approx({**{tok.decode([i]): v for i, v in x.top}, tok.decode([t]): x.logprob},
                                        abs=1e-5)
        assert lp.token_logprobs[len(prompt):] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 2
        if prefill:  # the prompt's logprobs came from the prefill engine; the decode engine loaded its chunks
            assert setup.decode.engine.connector.stats.chunks_loaded == loaded + 2
        streamed = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
        assert "".join(ch.text for ch in streamed) == r.choices[0].text
        assert sum((ch.logprobs.token_logprobs for ch in streamed if ch.logprobs), []) == lp.token_logprobs
        assert sum((ch.logprobs.text_offset for ch in streamed if ch.logprobs), []) == lp.text_offset
        # max_tokens 0: the prompt scored alone, nothing generated (streamed and not)
        for stream in (False, True):
            zero = {**kw, "max_tokens": 0}
            if stream:
                got = [ch for ch in c.completions.create(stream=True, stream_options={"include_usage": True}, **zero)]
                choices = [ch.choices[0] for ch in got if ch.choices]
                text, n = "".join(ch.text for ch in choices), got[-1].usage.completion_tokens
                entries = sum((ch.logprobs.token_logprobs for ch in choices if ch.logprobs), [])
                reason = choices[-1].finish_reason
            else:
                got = c.completions.create(**zero)
                text, n, reason = got.choices[0].text, got.usage.completion_tokens, got.choices[0].finish_reason
                entries = got.choices[0].logprobs.token_logprobs
            assert (text, n, reason) == (tok.decode(prompt), 0, "length"), stream
            assert entries == lp.token_logprobs[:len(prompt)], stream
        # echo alone: the prompt's text, no logprobs; a string prompt comes back as it was sent
        r = c.completions.create(**{**kw, "logprobs": None, "prompt": "Hello", "max_tokens": 2})
        assert r.choices[0].text.startswith("Hello") and r.choices[0].logprobs is None
    finally:
        if not prefill:
            setup.close()


# ---- n choices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill-engine", "decode-engine-alone"])
def test_n_choices_are_each_sampled_on_their_own_from_one_prefill(disagg, prefill):
    setup = disagg if prefill else Setup(with_store=False, prefill=False)
    try:
        c = setup.client()
        prompt = [(11 * i) % 250 + 3 for i in range(150)]  # two full 64-token chunks
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
        one = c.completions.create(temperature=0, **kw).choices[0].text
        before = (setup.prefill.loop.num_requests if prefill else 0, setup.decode.loop.num_requests)
        r = c.completions.create(temperature=0, n=3, **kw)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert [ch.text for ch in r.choices] == [one] * 3  # greedy: every choice the same
        assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(prompt)
        if prefill:  # the prompt prefilled once; each choice a decode stream (the others from its saved KV)
            assert setup.prefill.loop.num_requests == before[0] + 1
        assert setup.decode.loop.num_requests == before[1] + 3
        # sampled: each choice its own draw (seed + i), the same again with the same seed
        r1 = c.completions.create(temperature=1.0, seed=5, n=3, **kw)
        r2 = c.completions.create(temperature=1.0, seed=5, n=3, **kw)
        texts = [ch.text for ch in r1.choices]
        assert texts == [ch.text for ch in r2.choices] and len(set(texts)) == 3
        chunks = [ch.choices[0] for ch in c.completions.create(temperature=1.0, seed=5, n=3, stream=True, **kw)
                  if ch.choices]
        streamed = ["".join(ch.text for ch in chunks if ch.index == i) for i in range(3)]
        assert streamed == texts
        assert sorted(ch.index for ch in chunks if ch.finish_reason) == [0, 1, 2]
        # a stop string ends each choice where its own text has it; echo and logprobs per choice
        r = c.completions.create(temperature=0, n=2, stop=[one[2:4]], **kw)
        assert [(ch.text, ch.finish_reason) for ch in r.choices] == [(one[:2], "stop")] * 2
        r = c.completions.create(temperature=0, n=2, echo=True, logprobs=1, **{**kw, "max_tokens": 2})
        a, b = (ch.logprobs for ch in r.choices)
        assert a.token_logprobs[0] is None and len(a.tokens) == len(prompt) + 2
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5) and a.tokens == b.tokens
    finally:
        if not prefill:
            setup.close()


def test_a_batch_of_prompts_is_answered_prompt_by_prompt_in_one_response(disagg):
    """OpenAI's batched completions (a list of prompts, as evaluation harnesses send): prompt
    ``b``'s choice ``i`` is choice ``b * n + i``, each the answer the prompt alone gets; streamed,
    the same; usage adds them up; a stop string ends one choice while the others go on."""
    c = disagg.client()
    prompts = ["The cat", [(7 * i) % 250 + 3 for i in range(90)], STOP_PROMPT, "x"]
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [c.completions.create(prompt=p, **kw) for p in prompts]
    r = c.completions.create(prompt=prompts, n=2, **kw)
    assert [ch.index for ch in r.choices] == list(range(8))
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 8 * 6
    chunks = [ch.choices[0] for ch in c.completions.create(prompt=prompts, n=2, stream=True, **kw) if ch.choices]
    assert ["".join(ch.text for ch in chunks if ch.index == i) for i in range(8)] == [ch.text for ch in r.choices]
    assert sorted(ch.index for ch in chunks if ch.finish_reason) == list(range(8))
    stop = alone[2].choices[0].text[1:3]  # (STOP_PROMPT's own output has it: that choice stops, the rest run)
    got = c.completions.create(prompt=prompts, stop=[stop], **kw).choices
    for a, ch in zip(alone, got):
        text = a.choices[0].text
        want = (text[:text.index(stop)], "stop") if stop in text else (text, "length")
        assert (ch.text, ch.finish_reason) == want
    assert got[2].finish_reason == "stop"
    echo = c.completions.create(prompt=["ab", "cde"], echo=True, **{**kw, "max_tokens": 1}).choices
    assert [ch.text[:len(p)] for ch, p in zip(echo, ["ab", "cde"])] == ["ab", "cde"]


@pytest.mark.parametrize("prompt,n,match", [
    (["ok", ""], 1, "non-empty"), (["ok", [1, -2]], 1, "non-negative"), (["ok", 5], 1, "non-empty"),
    (["p"] * 257, 1, "up to 256 prompts"), (["p"] * 17, 16, "at most 256"),
    (["ok", [5] * 9000], 1, "exceeds the model's context")])  # (the engine says so)
def test_a_bad_prompt_in_a_batch_is_a_400_for_the_whole_request(disagg, prompt, n, match):
    status, data = request(disagg.server.url, "POST", "/v1/completions",
                           json.dumps({"model": MODEL, "prompt": prompt, "n": n, "max_tokens": 2}).encode(),
                           {"Content-Type": "application/json"})
    err = json.loads(data)["error"]
    assert status == 400 and match in err["message"], err
    assert request(disagg.server.url, "GET", "/health")[0] == 200  # (and the engines serve on)


def test_a_streamed_batch_with_a_refused_prompt_is_a_400_or_ends_with_an_error_event(disagg):
    """The engines refuse one prompt of a streamed batch (longer than the context): before any
    token went out, the answer is a 400; after another prompt's tokens (the order is the threads'),
    the stream ends with the error as an event, its framing intact, never a second response."""
    body = json.dumps({"model": MODEL, "prompt": ["ok"] * 7 + [[5] * 9000], "max_tokens": 8,
                       "stream": True}).encode()
    for _ in range(8):
        status, data = request(disagg.server.url, "POST", "/v1/completions", body,
                               {"Content-Type": "application/json"})
        if status == 400:
            assert "exceeds the model's context" in json.loads(data)["error"]["message"]
            continue
        assert status == 200
        events = [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]
        assert "exceeds the model's context" in events[-1]["error"]["message"], data[-500:]
        assert all("choices" in e for e in events[:-1]) and b"[DONE]" not in data
    assert request(disagg.server.url, "GET", "/health")[0] == 200


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill-engine", "decode-engine-alone"])
def test_prompt_logprobs_are_vllms_each_prompt_token_with_its_rank_and_the_likeliest(disagg, prefill):
    """vLLM's ``prompt_logprobs`` extension: per choice (chat: per response), None for the first
    prompt token, then each token's own logprob, rank and text with the ``k`` likeliest, keyed by
    token id; the engine's reference values, whichever engine computed the prompt."""
    setup = disagg if prefill else Setup(with_store=False, prefill=False)
    try:
        c, tok = setup.client(), setup.gw.tokenizer
        prompt = [(11 * i) % 250 + 3 for i in range(100)]
        ref = _engine_reference_prompt(prompt, 3)

        def check(plps, prompt, ref, k):
            assert len(plps) == len(prompt) and plps[0] is None
            for place, x, t in zip(plps[1:], ref.prompt_logprobs[1:], prompt[1:]):
                assert list(place)[0] == str(t) and place[str(t)]["decoded_token"] == tok.decode([t])
                assert place[str(t)]["logprob"] == pytest.approx(x.logprob, abs=1e-5)
                assert place[str(t)]["rank"] == x.rank >= 1
                assert set(place) == {str(t)} | {str(j) for j, _ in x.top[:k]}
                for rank, (j, v) in enumerate(x.top[:k], 1):
                    assert place[str(j)]["logprob"] == pytest.approx(v, abs=1e-5)
                    assert place[str(j)]["rank"] == (x.rank if j == t else rank)
                    if j == t:
                        assert x.rank == rank  # (a token among the likeliest is ranked where it stands)

        kw = {"model": MODEL, "max_tokens": 2, "temperature": 0,
              "extra_body": {"ignore_eos": True, "prompt_logprobs": 3}}
        r = c.completions.create(prompt=prompt, **kw)
        check(r.choices[0].model_extra["prompt_logprobs"], prompt, ref, 3)
        assert r.choices[0].logprobs is None and r.choices[0].text == tok.decode(ref.token_ids)
        # 0: each token's own alone; beside echo asking for 1 alternative, the echo shows 1
        r = c.completions.create(prompt=prompt, logprobs=1, echo=True, **{**kw, "extra_body": {"prompt_logprobs": 0}})
        plps = r.choices[0].model_extra["prompt_logprobs"]
        assert all(list(place) == [str(t)] for place, t in zip(plps[1:], prompt[1:]))
        r = c.completions.create(prompt=prompt, logprobs=1, echo=True, **kw)
        check(r.choices[0].model_extra["prompt_logprobs"], prompt, ref, 3)
        assert all(len(top) <= 2 for top in r.choices[0].logprobs.top_logprobs[1:])  # (1 and the token itself)
        # a batch of prompts with n=2: each choice its own prompt's
        other = prompt[::-1]
        r = c.completions.create(prompt=[prompt, other], n=2, **kw)
        check(r.choices[1].model_extra["prompt_logprobs"], prompt, ref, 3)
        check(r.choices[3].model_extra["prompt_logprobs"], other, _engine_reference_prompt(other, 3), 3)
        # chat: the response's, over the templated prompt
        msgs = [{"role": "user", "content": "score me"}]
        r = c.chat.completions.create(messages=msgs, **kw)
        plps = r.model_extra["prompt_logprobs"]
        assert plps[0] is None and len(plps) == r.usage.prompt_tokens
        assert all(place[min(place, key=lambda j: place[j]["rank"])]["rank"] == 1 for place in plps[1:])
        # not asked for: not there; streamed or out of range: a 400 naming the field
        plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert "prompt_logprobs" not in plain.choices[0].model_extra
        for bad in ({"stream": True}, {"extra_body": {"prompt_logprobs": -1}},
                    {"extra_body": {"prompt_logprobs": MAX_LOGPROBS + 1}}, {"extra_body": {"prompt_logprobs": "3"}}):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(**{**kw, "prompt": prompt, **bad})
            assert e.value.body["param"] == "prompt_logprobs", bad
    finally:
        if not prefill:
            setup.close()


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(disagg):
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk with choices carries the usage
    so far (its completion tokens growing to the final count); ``stream_options`` without a
    stream, or holding what this server does not do, is a 400 naming it."""
    c = disagg.client()
    kw = {"model": MODEL, "prompt": "count", "max_tokens": 6, "temperature": 0, "n": 2,
          "extra_body": {"ignore_eos": True}}
    got = list(c.completions.create(stream=True, stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True}, **kw))
    counts = [ch.usage.completion_tokens for ch in got[:-1]]
    assert all(ch.choices and ch.usage.prompt_tokens == got[-1].usage.prompt_tokens for ch in got[:-1])
    assert counts == sorted(counts) and counts[-1] == got[-1].usage.completion_tokens == 12
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in got)
    plain = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == 12
    for bad in ({"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": {"usage": True}},
                {"stream": True, "stream_options": {"include_usage": "yes"}}, {"stream": True, "stream_options": []},
                {"stream": True, "stream_options": {"include_obfuscation": True}}):
        status, data = request(disagg.url, "POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x", **bad}).encode(), {"Content-Type": "application/json"})
        assert status == 400 and json.loads(data)["error"]["param"] == "stream_options", (bad, data)


def test_chat_echo_begins_each_choice_with_the_final_assistant_message(disagg):
    """vLLM's chat ``echo``: with the assistant's message last (here continued), each choice's
    content begins with its text, streamed (in the choice's first chunk) and not; with another
    message last, echo changes nothing."""
    c = disagg.client()
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0, "n": 2,
          "extra_body": {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}}
    plain = c.chat.completions.create(**kw).choices[0].message.content
    echoed = c.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    assert [ch.message.content for ch in echoed.choices] == ["The colour is" + plain] * 2
    chunks = [ch.choices[0] for ch in c.chat.completions.create(
        stream=True, **{**kw, "extra_body": {**kw["extra_body"], "echo": True}}) if ch.choices]
    for i in range(2):
        mine = [ch.delta.content for ch in chunks if ch.index == i]
        assert mine[0] == "The colour is" and "".join(m or "" for m in mine) == "The colour is" + plain
    user_last = {"model": MODEL, "messages": msgs[:1], "max_tokens": 4, "temperature": 0}
    assert c.chat.completions.create(**user_last, extra_body={"echo": True}).choices[0].message.content == \
        c.chat.completions.create(**user_last).choices[0].message.content


def test_a_request_brings_its_chat_template_only_to_a_gateway_that_trusts_them(disagg):
    """The request's template renders the prompt (the tokens ``/tokenize`` and the usage count are
    its text's; the answer is the engine's for those tokens); a template that does not parse or
    raises is a 400 naming ``chat_template``; an untrusting gateway refuses any."""
    gw = Gateway(MODEL, [disagg.prefill.address], [disagg.decode.address], trust_request_chat_template=True)
    srv = GatewayServer(gw, "127.0.0.1:0").start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)
        template = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
        msgs = [{"role": "user", "content": "hi"}]
        want = "[USER] hi\n[ASSISTANT]"
        status, data = request(srv.url, "POST", "/tokenize", json.dumps(
            {"model": MODEL, "messages": msgs, "chat_template": template}).encode(), {})
        assert status == 200 and json.loads(data)["tokens"] == gw.tokenizer.encode(want), data
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                      extra_body={"chat_template": template, "ignore_eos": True})
        ref = c.completions.create(model=MODEL, prompt=gw.tokenizer.encode(want), max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == ref.choices[0].text and r.usage.prompt_tokens == len(want)
        for bad, why in (("{% for %}", "does not parse"), ("{{ raise_exception('no users here') }}", "no users here"),
                         ("{{ messages.__class__.__mro__ }}", "failed on these messages")):  # (the sandbox's refusal)
            with pytest.raises(openai.BadRequestError, match=why) as e:
                c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"chat_template": bad})
            assert e.value.body["param"] == "chat_template", bad
    finally:
        srv.stop()
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        disagg.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                extra_body={"chat_template": template})


def test_chat_n_choices_streamed_and_not(disagg):
    c = disagg.client()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.9,
          "seed": 3, "n": 2, "extra_body": {"ignore_eos": True}}
    r = c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1] and texts[0] != texts[1]
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    assert ["".join(ch.delta.content or "" for ch in chunks if ch.index == i) for i in range(2)] == texts
    assert [ch.delta.role for ch in chunks if ch.delta.role] == ["assistant"] * 2  # each choice's first chunk


def _engine_reference_prompt(prompt: list[int], k: int):
    from engine.llm import LLM

    with LLM(MODEL, dtype="float32") as llm:
        out, = llm.generate(prompt, max_tokens=2, logprobs=k, prompt_logprobs=k, ignore_eos=True)
    return out


def test_a_byte_of_a_multibyte_character_is_its_own_bytes_in_chat_logprobs():
    from engine.sampling import TokenLogprobs
    from engine.serve.openai_protocol import logprobs_body, parse_request
    from engine.tokenizer import ByteTokenizer

    req = parse_request({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                         "top_logprobs": 1}, True, MODEL)
    body = logprobs_body(req, [0xD5, 0x80], [TokenLogprobs(-1.0, [(0xD5, -1.0)]), TokenLogprobs(-0.5, [(0x80, -0.5)])],
                         ByteTokenizer())
    assert [e["bytes"] for e in body["content"]] == [[0xD5], [0x80]]
    assert bytes(sum((e["bytes"] for e in body["content"]), [])).decode() == "\u0540"
    assert body["content"][0]["top_logprobs"] == [{"token": "\ufffd", "logprob": -1.0, "bytes": [0xD5]}]


@pytest.mark.parametrize("chat,field,value", [
    (False, "logprobs", MAX_LOGPROBS + 1), (False, "logprobs", True), (True, "top_logprobs", 3),
    (True, "logprobs", 2), (False, "presence_penalty", 2.5), (False, "frequency_penalty", "1"), (False, "repetition_penalty", 0),
    (False, "logit_bias", {"5": 101}), (False, "logit_bias", {"x": 1}), (True, "logit_bias", [5]),
    (False, "min_tokens", 3), (True, "min_tokens", -1), (False, "allowed_token_ids", []),
    (True, "allowed_token_ids", [-1]), (False, "bad_words", [""]), (True, "bad_words", "x"), (False, "best_of", 0), (True, "best_of", 2), (True, "echo", "yes"), (False, "top_k", -2), (False, "min_p", 1.5),
    (False, "stop_token_ids", [-1]), (True, "stop_token_ids", 5), (False, "include_stop_str_in_output", 1),
    (True, "response_format", {"type": "json_schema"}), (False, "response_format", {"type": "xml"}),
    (True, "response_format", "json"), (False, "structured_outputs", {"regex": "a", "choice": ["a"]}),
    (False, "structured_outputs", {"structural_tag": "x"}), (False, "structured_outputs", {"json_object": 1}),
    (True, "guided_choice", []), (False, "guided_json", "not json"), (False, "guided_regex", 5),
    (True, "tool_choice", "required"), (True, "tools", [{"type": "function"}]),
    (False, "tools", [{"type": "function", "function": {"name": "f"}}]), (False, "truncate_prompt_tokens", 0),
    (True, "continue_final_message", True), (True, "continue_final_message", "yes"),
    (False, "max_tokens", 0), (False, "n", 0), (True, "n", 17), (False, "chat_template", "{{ x }}"),
    (True, "chat_template", ""), (True, "chat_template", 5), (False, "guided_decoding_backend", "outlines"),
    (True, "chat_template", "{{ messages[0].content }}")])  # (max_tokens 0 only with echo; templates need trust)
def test_options_the_server_does_not_implement_are_400_by_name_never_ignored(disagg, chat, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value,
            **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
    status, data = request(disagg.url, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                           json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field


def test_one_way_of_structuring_the_output_at_a_time(disagg):
    body = {"model": MODEL, "prompt": "x", "guided_regex": "a+", "response_format": {"type": "json_object"}}
    status, data = request(disagg.url, "POST", "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"]["param"] == "guided_regex", data


def test_the_off_values_of_unimplemented_options_are_served():
    """Clients that send every option with its default (``presence_penalty: 0``, ``logit_bias: {}``)
    are served as if they had left them out."""
    from engine.serve.openai_protocol import parse_request

    body = {"model": MODEL, "prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "best_of": 1, "echo": False, "top_k": -1, "logprobs": None, "suffix": None,
            "guided_decoding_backend": "xgrammar"}
    assert parse_request(body, False, MODEL).logprobs is None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"},
            "tools": [], "logprobs": False}
    assert parse_request(chat, True, MODEL).logprobs is None


# ---- errors: 404, body limit ------------------------------------------------------------


@pytest.mark.parametrize("method,path", [("GET", "/nope"), ("GET", "/v1/models/other"), ("GET", "/v1"),
                                         ("POST", "/v1/nope"), ("POST", "/v1/completions/x"),
                                         ("POST", "/health")])
def test_unknown_paths_are_404_with_an_openai_error(disagg, method, path):
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode() if method == "POST" else None
    status, data = request(disagg.url, method, path, body, {"Content-Type": "application/json"})
    assert status == 404
    err = json.loads(data)["error"]
    assert err["code"] == "not_found" and path in err["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_unknown_model_is_an_invalid_request_naming_the_served_model(disagg, chat):
    body = {"model": "gpt-17", **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
    status, data = request(disagg.url, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                           json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400
    err = json.loads(data)["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and MODEL in err["message"]


def test_bodies_over_8_mib_get_400_and_8_mib_is_served(disagg):
    # a client sending the whole body still gets the answer (the body is read, then dropped)
    u = urllib.parse.urlparse(disagg.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=b" " * (MAX_BODY + 1),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        assert r.status == 400 and r.getheader("Connection") == "close"
    finally:
        conn.close()
    err = json.loads(data)["error"]
    assert err["type"] == "invalid_request_error" and str(MAX_BODY) in err["message"]
    with pytest.raises(openai.BadRequestError, match=str(MAX_BODY)):
        disagg.client().completions.create(model=MODEL, prompt="x" * (MAX_BODY + 10), max_tokens=2)
    # exactly the limit: read and served (ignore_eos: the random model may sample EOS first)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
    body += b" " * (MAX_BODY - len(body))
    assert len(body) == MAX_BODY
    status, data = request(disagg.url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2


def raw_exchange(url: str, data: bytes) -> tuple[int, dict, bytes]:
    """Sends ``data`` as is and reads one response: (status, headers, body)."""
    u = urllib.parse.urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=300) as sock:
        sock.sendall(data)
        r = http.client.HTTPResponse(sock)
        r.begin()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


@pytest.mark.parametrize("field,value", [("max_tokens", 1 << 40), ("seed", 1 << 70), ("prompt", [-1, 5]),
                                         ("prompt", [1 << 40]), ("stream", "false"), ("ignore_eos", 1)])
def test_values_beyond_what_the_engines_take_are_400_naming_the_field(disagg, field, value):
    """Before, numbers outside the protobuf fields' range dropped the connection unanswered."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    status, data = request(disagg.url, "POST", "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field


def test_malformed_http_gets_an_openai_error_and_never_desyncs_the_connection(disagg):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for extra, payload, why in (("Content-Length: abc\r\n", body, "Content-Length"),
                                ("Content-Length: -5\r\n", body, "Content-Length"),
                                ("Transfer-Encoding: chunked\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
                                 "chunked")):
        status, headers, data = raw_exchange(disagg.url, (head + extra + "\r\n").encode() + payload)
        assert status == 400 and why in json.loads(data)["error"]["message"] and headers["connection"] == "close"
    deep = b"[" * 100_000 + b"]" * 100_000
    status, data = request(disagg.url, "POST", "/v1/completions", deep, {"Content-Type": "application/json"})
    assert status == 400 and "nested too deeply" in json.loads(data)["error"]["message"]
    status, headers, data = raw_exchange(disagg.url, b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 405 and json.loads(data)["error"]["code"] == "method_not_allowed"
    status, headers, data = raw_exchange(disagg.url, b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 501 and json.loads(data)["error"]["type"] == "server_error"
    # a request line too garbled to name its version, and HTTP/2's preface: a status line and headers
    # (before, HTTP/0.9's bare body), the 505 a client's error
    for line, want in ((b"garbage\r\n\r\n", 400), (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505)):
        status, headers, data = raw_exchange(disagg.url, line)
        assert status == want and json.loads(data)["error"]["type"] == "invalid_request_error", (line, data)
    u = urllib.parse.urlparse(disagg.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:  # HEAD: a 405 as for PUT, and no body (a HEAD response has none)
        conn.request("HEAD", "/v1/models")
        r = conn.getresponse()
        assert r.status == 405 and r.read() == b""
    finally:
        conn.close()
    # a POST to an unknown path: its body is read, not taken for the connection's next request
    u = urllib.parse.urlparse(disagg.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        for path, want in (("/v1/embeddings", 404), ("/v1/completions", 200)):
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            assert r.status == want, data
    finally:
        conn.close()



def test_a_content_length_of_non_ascii_digits_is_answered_not_dropped(disagg):
    """``"²".isdigit()`` holds and ``int("²")`` raises: before, a GET (or a POST sent with
    ``Expect: 100-continue``) with that length lost its connection, unanswered, to a traceback."""
    status, headers, data = raw_exchange(disagg.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Length: \xb2\r\n\r\n")
    assert status == 200 and headers["connection"] == "close" and json.loads(data)["data"]
    status, headers, data = raw_exchange(disagg.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                         b"Expect: 100-continue\r\nContent-Length: \xb2\r\n\r\n")
    assert status == 400 and "Content-Length" in json.loads(data)["error"]["message"]


@pytest.mark.parametrize("body,param", [
    (b'{"model": "%s", "prompt": "hi", "max_tokens": 1%s}' % (MODEL.encode(), b"1" * 5000), None),
    (b'{"model": "%s", "prompt": "hi\\ud800", "max_tokens": 2}' % MODEL.encode(), None),
    (b'{"model": "%s", "prompt": "hi", "cache_salt": "\\udfff", "max_tokens": 2}' % MODEL.encode(), None),
    (b'{"model": "%s", "prompt": "hi", "logit_bias": {"1%s": 1}, "max_tokens": 2}' % (MODEL.encode(), b"0" * 5000),
     "logit_bias"),
    (b'{"model": "%s", "prompt": "hi", "use_beam_search": true, "n": 2, "length_penalty": NaN}' % MODEL.encode(),
     "length_penalty")], ids=["5000-digit-number", "lone-surrogate-prompt", "lone-surrogate-salt",
                              "5000-digit-logit-bias-key", "nan-length-penalty"])
def test_json_no_handler_can_use_is_a_400_not_a_500(disagg, body, param):
    """Valid JSON (or what Python's reader takes) that no field can hold: before, each was a 500 and a
    traceback in the gateway's log (int's 4,300-digit limit, a string that is no UTF-8 text, NaN
    passing every range check)."""
    status, data = request(disagg.url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    err = json.loads(data)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param, err
    status, data = request(disagg.url, "POST", "/tokenize", b'{"model": "%s", "prompt": "\\ud83d"}' % MODEL.encode(),
                           {"Content-Type": "application/json"})
    assert status == 400, data
    # a surrogate pair is one character: served
    status, data = request(disagg.url, "POST", "/tokenize", b'{"model": "%s", "prompt": "\\ud83d\\ude00"}'
                           % MODEL.encode(), {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["tokens"], data


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_streamed_request_longer_than_the_context_is_a_400_before_any_token(disagg, chat):
    """The prefill engine computes the first token only, and used to check only that: a streamed
    request whose max_tokens overran the context was sent its 200 and a token before the decode
    engine refused it (and its prefill was computed and saved for nothing)."""
    body = {"model": MODEL, "max_tokens": 1_000_000, "stream": True,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    status, data = request(disagg.url, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                           json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400 and "exceeds the model's context" in json.loads(data)["error"]["message"], data[:300]

# ---- metrics ----------------------------------------------------------------------------


def test_metrics_count_what_the_requests_did(disagg):
    c = disagg.client()
    before = metrics(disagg.url)
    n_tokens = 0
    for i in range(3):
        r = c.completions.create(model=MODEL, prompt=f"metrics {i}", max_tokens=4 + i, temperature=0,
                                 extra_body={"ignore_eos": True})
        n_tokens += r.usage.completion_tokens
    text, _, _ = completion(c, "metrics streamed", True, max_tokens=5)
    n_tokens += 5
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    after = counted(disagg.url, ("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "200"))),
                    4, before)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("crescent_gateway_requests_total", endpoint="completions", status="200") == 4
    assert delta("crescent_gateway_requests_total", endpoint="completions", status="400") == 1
    assert delta("crescent_gateway_ttft_seconds_count") == 4
    assert delta("crescent_gateway_tokens_total", kind="completion") == n_tokens
    assert delta("crescent_gateway_itl_seconds_count") >= 4  # at least one gap per request after the first token
    assert delta("crescent_gateway_prefill_fallbacks_total") == 0


# ---- engines down: /health, prefill fallback, no route --------------------------------


def engine_stats(address: str) -> epb.EngineStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return epb_grpc.EngineStub(ch).Stats(epb.EngineStatsRequest(), timeout=60)


def test_prefill_engine_down_health_is_503_and_the_decode_engine_prefills(fresh):
    c = fresh.client()
    status, data = request(fresh.url, "GET", "/health")
    assert status == 200 and json.loads(data) == {"status": "ok", "engines": {fresh.prefill.address: True,
                                                                                fresh.decode.address: True}}
    prompt = STOP_PROMPT + list(range(40, 140))
    want, _, _ = completion(c, prompt, False, max_tokens=8)
    assert engine_stats(fresh.decode.address).num_local_prefills == 0
    fresh.prefill.stop()
    status, data = request(fresh.url, "GET", "/health")
    assert status == 503 and json.loads(data) == {"status": "degraded",
                                                  "engines": {fresh.prefill.address: False,
                                                              fresh.decode.address: True}}
    for stream in (False, True):
        text, reason, _ = completion(c, prompt, stream, max_tokens=8)
        assert (text, reason) == (want, "length"), stream
    assert engine_stats(fresh.decode.address).num_local_prefills == 2
    m = counted(fresh.url, ("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "200"))), 3)
    assert m[("crescent_gateway_prefill_fallbacks_total", ())] == 2
    assert m[("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "200")))] == 3


def test_decode_engine_down_is_503_not_a_hang(fresh):
    c = fresh.client()
    fresh.decode.stop()
    status, data = request(fresh.url, "GET", "/health")
    assert status == 503 and json.loads(data)["engines"][fresh.decode.address] is False
    with pytest.raises(openai.InternalServerError, match="engine unavailable") as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"


def test_a_decode_engine_lost_mid_stream_ends_the_stream_with_an_error_event(fresh):
    stream = fresh.client().completions.create(model=MODEL, prompt="a long one", max_tokens=4000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError, match="engine unavailable mid-stream"):
        for ch in stream:
            got.append(ch)
            if len(got) == 3:
                fresh.decode.stop()
    assert 3 <= len(got) < 4000
    m = counted(fresh.url, ("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "503"))), 1)
    assert m[("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "503")))] == 1


def test_https_gateway_serves_clients_that_trust_its_ca_and_refuses_plaintext(tmp_path):
    from engine.serve.gateway import https_context
    from kvstore import tls

    paths = tls.init_dir(str(tmp_path / "tls"), ["127.0.0.1"])
    decode = EngineNode("decode", engine_cfg()).start()
    gw = Gateway(MODEL, [], [decode.address], timeout_s=300)
    server = GatewayServer(gw, "127.0.0.1:0", https_context(paths["node"], paths["node_key"])).start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0,
                          http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=paths["ca"])))
        text, reason, _ = completion(c, "over TLS", stream=True, max_tokens=5)
        assert reason == "length" and text == completion(c, "over TLS", stream=False, max_tokens=5)[0]
        with pytest.raises(openai.APIConnectionError):  # its CA is not the system's
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0).models.list()
        with pytest.raises((http.client.HTTPException, OSError)):  # plaintext to the HTTPS port
            request(server.url.replace("https", "http"), "GET", "/v1/models")
        assert c.models.list().data[0].id == MODEL  # still serving
    finally:
        server.stop()
        decode.stop()
    with pytest.raises(ValueError, match="--https-cert"):
        https_context(str(tmp_path / "missing.pem"), paths["node_key"])


def _responses_on(port: int, data: bytes, expect: int) -> tuple[list[bytes], bool]:
    """Sends ``data`` on one connection; the status lines of every response read back (however they are
    framed) until the server closes the connection, or until ``expect`` came and 2 s more passed; and
    whether it closed."""
    status = re.compile(rb"HTTP/1\.1 \d{3} [^\r]*")
    with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
        s.sendall(data)
        out = b""
        while True:
            if len(status.findall(out)) >= expect:
                s.settimeout(2)
            try:
                piece = s.recv(65536)
            except socket.timeout:
                return status.findall(out), False
            if not piece:
                return status.findall(out), True
            out += piece


def test_a_body_sent_with_a_request_that_takes_none_is_never_read_as_the_next_request():
    """A GET (or DELETE, or an unsupported method) carrying a body that holds another request: before, the
    body was left on the connection and answered as a request of its own (a request smuggled behind the
    first, e.g. by a client sharing a proxy's pooled connection). Now the body is dropped and the
    connection closed after the one answer; requests without a body still share a kept-alive connection."""
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0").start()
    inner = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        for line in (b"GET /health", b"GET /v1/models", b"GET /metrics", b"GET /nope", b"GET /v1/responses/r1",
                     b"DELETE /v1/responses/r1", b"DELETE /nope", b"PUT /v1/completions", b"OPTIONS /v1/models"):
            for framing, body in ((b"Content-Length: %d" % len(inner), inner),
                                  (b"Transfer-Encoding: chunked", b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner))):
                got, closed = _responses_on(server.port, line + b" HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n"
                                            + body, expect=1)
                assert len(got) == 1 and closed, (line, framing, got)
        # no body (or an empty one): the connection is kept and both requests are answered
        got, closed = _responses_on(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                                    + inner, expect=2)
        assert [g.split()[1] for g in got] == [b"200", b"200"] and not closed
    finally:
        server.stop()


def test_framing_a_proxy_could_read_another_way_is_a_400_on_a_closed_connection():
    """Each request below carries a second one that a proxy in front may read as part of the body, or the
    other way round: before, two Content-Length headers were read by the first one, and a header name
    with a space ended the headers, so the rest was answered as a request of its own. Now each (and a
    header folded over lines) is one 400 and the connection closes; the same bytes framed plainly are
    two answers."""
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0").start()
    inner = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\n"
    n, m = len(body), len(body) + len(inner)
    try:
        for framing in (b"Content-Length: %d\r\nContent-Length: %d\r\n" % (n, m),
                        b"Content-Length: %d\r\nContent-Length: %d\r\n" % (m, n),
                        b"Content-Length : %d\r\n" % n, b"Content-Length\t: %d\r\n" % n,
                        b" Content-Length: %d\r\n" % n, b"Content-Length:\r\n %d\r\n" % n,
                        b"X-Pad: a\r\n Content-Length: %d\r\n" % n):
            got, closed = _responses_on(server.port, head + framing + b"\r\n" + body + inner, expect=1)
            assert [g.split()[1] for g in got] == [b"400"] and closed, (framing, got)
        # the same bytes framed plainly, twice the same length included: the tokenized body, then the models
        for framing in (b"Content-Length: %d\r\n" % n, b"Content-Length: %d\r\nContent-Length: %d\r\n" % (n, n)):
            got, closed = _responses_on(server.port, head + framing + b"\r\n" + body + inner, expect=2)
            assert [g.split()[1] for g in got] == [b"200", b"200"] and not closed, (framing, got)
    finally:
        server.stop()


@pytest.mark.parametrize("flags, says", [
    (["--decode", "nohost"], "--decode must be host:port"),
    (["--decode", "127.0.0.1:70000"], "--decode must be host:port"),
    (["--decode", "127.0.0.1:1", "--prefill", "x"], "--prefill must be host:port"),
    (["--conductor", "127.0.0.1:5,bad"], "--conductor must be host:port"),
    (["--etcd", "nohost"], "--etcd"),
])
def test_an_engine_or_conductor_address_that_is_not_host_port_is_a_one_line_error(flags, says):
    """Before, ``crescent gateway --decode nohost`` served, and every request it routed failed."""
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "gateway", "--model", MODEL, "--listen", "127.0.0.1:0",
                        *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)  # (serving: a failure)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_request_head_trickled_a_header_at_a_time_is_cut_off():
    """A client that sends a byte of a header every 0.3 s never stays silent for the idle timeout (here
    3 s), but its request head must be whole within that time: the gateway shuts the connection (before,
    it waited as long as the client went on: a thread per such client, the slowloris attack)."""
    import select

    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0", idle_s=3.0).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Trickle: ")
            out, closed = b"", False
            for _ in range(400):  # up to 120 s of trickling: a bound against hangs, not a speed test
                try:
                    s.sendall(b"a")
                    if select.select([s], [], [], 0.3)[0]:
                        piece = s.recv(65536)
                        out += piece
                        if not piece:
                            closed = True
                            break
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            assert closed and b"HTTP/1.1 200" not in out, out
        assert request(server.url, "GET", "/v1/models")[0] == 200  # and it serves on
    finally:
        server.stop()


def test_a_decode_engine_that_refuses_or_is_gone_is_passed_over_before_the_first_token():
    """Two decode engines, round robin, the first gone (as one that is stopping refuses new calls:
    UNAVAILABLE): every request, streamed or not, is answered whole by the other, each refused call sent
    again and counted. Before, every other request was a 503."""
    decode = EngineNode("decode", engine_cfg()).start()
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1", decode.address], timeout_s=300), "127.0.0.1:0").start()
    try:
        for stream in (False, True, False, True):
            status, data = request(server.url, "POST", "/v1/completions",
                                   json.dumps({"model": MODEL, "prompt": "either", "max_tokens": 5, "ignore_eos": True,
                                               "stream": stream, "stream_options": {"include_usage": True}}
                                              if stream else {"model": MODEL, "prompt": "either", "max_tokens": 5,
                                                              "ignore_eos": True}).encode(),
                                   {"Content-Type": "application/json"})
            assert status == 200, data
            usage = json.loads([line for line in data.split(b"\n") if line.startswith(b"data: {")][-1][6:])["usage"] \
                if stream else json.loads(data)["usage"]
            assert usage["completion_tokens"] == 5
        assert metrics(server.url)[("crescent_gateway_decode_retries_total", ())] == 4
    finally:
        server.stop()
        decode.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_of_a_request_with_n_is_passed_over_to_another_decode_engine(stream):
    """n=2 against two decode engines, the first the router names gone: each choice's refused call is
    sent again on its own (two retries), and both choices are answered whole. Before, the retry was for
    n=1 only: a request with n > 1 routed to a stopping engine was a 503."""
    decode = EngineNode("decode", engine_cfg()).start()
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1", decode.address], timeout_s=300), "127.0.0.1:0").start()
    try:
        body = {"model": MODEL, "prompt": "either", "max_tokens": 5, "ignore_eos": True, "n": 2, "seed": 7}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        status, data = request(server.url, "POST", "/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
        assert status == 200, data
        if stream:
            events = [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]
            usage = events[-1]["usage"]
            texts = {}
            for e in events[:-1]:
                for c in e["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        else:
            out = json.loads(data)
            usage, texts = out["usage"], {c["index"]: c["text"] for c in out["choices"]}
        assert usage["completion_tokens"] == 10 and sorted(texts) == [0, 1]
        assert metrics(server.url)[("crescent_gateway_decode_retries_total", ())] == 2
    finally:
        server.stop()
        decode.stop()


def test_a_beam_search_whose_decode_engine_is_gone_runs_on_another_with_the_same_hypotheses():
    """use_beam_search, decode engines [gone, live]: the search (its state the gateway's, nothing sent
    before it ends) moves to the live engine at its first refused call, one retry, and answers what the
    live engine alone answers. Before, it was a 503."""
    decode = EngineNode("decode", engine_cfg()).start()
    body = json.dumps({"model": MODEL, "prompt": "either", "max_tokens": 4, "n": 2, "use_beam_search": True,
                       "ignore_eos": True, "temperature": 0.0}).encode()
    texts = []
    try:
        for engines in (["127.0.0.1:1", decode.address], [decode.address]):
            server = GatewayServer(Gateway(MODEL, [], engines, timeout_s=300), "127.0.0.1:0").start()
            try:
                status, data = request(server.url, "POST", "/v1/completions", body,
                                       {"Content-Type": "application/json"})
                assert status == 200, data
                texts.append([c["text"] for c in json.loads(data)["choices"]])
                assert metrics(server.url)[("crescent_gateway_decode_retries_total", ())] == len(engines) - 1
            finally:
                server.stop()
        assert texts[0] == texts[1] and len(texts[0]) == 2
    finally:
        decode.stop()


def test_connections_past_the_limit_get_a_503_with_retry_after_and_the_limit_frees_as_they_close():
    """--max-connections 2: two clients hold their connections; a third is answered 503 (Retry-After,
    an OpenAI error) and closed without a thread of its own; once one of the two leaves, a new client is
    served. Before, each connection got a thread, however many came."""
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0", max_connections=2).start()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=120) for _ in range(2)]
    try:
        wait_for(lambda: server.httpd.num_open == 2, timeout_s=60, what="both connections taken")
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            r = http.client.HTTPResponse(s)
            r.begin()
            assert r.status == 503 and r.getheader("Retry-After") == "1" and r.getheader("Connection") == "close"
            assert json.loads(r.read())["error"]["code"] == "too_many_connections"
        held.pop().close()
        wait_for(lambda: request(server.url, "GET", "/v1/models")[0] == 200, timeout_s=60, what="a freed place")
        # That request's connection is closed by the client when its answer is read; the server's handler thread
        # lets go of its place a moment later. Wait for it, so the metrics scrape (a connection too) fits.
        wait_for(lambda: server.httpd.num_open == 1, timeout_s=60, what="the served connection let go")
        m = metrics(server.url)
        assert m[("crescent_gateway_connections_refused_total", ())] >= 1
        assert 1 <= m[("crescent_gateway_open_connections", ())] <= 2
    finally:
        for h in held:
            h.close()
        server.stop()


def test_stopping_lets_the_requests_in_flight_finish_and_closes_the_idle_connections():
    """A drain (SIGTERM's, through ``serve``): no new connection is taken, a kept-alive idle one is closed
    at once, and a stream in flight gets every token and its [DONE] before ``stop`` returns. Before, the
    process ended with the stream cut mid-way."""
    decode = EngineNode("decode", engine_cfg()).start()
    server = GatewayServer(Gateway(MODEL, [], [decode.address], timeout_s=300), "127.0.0.1:0").start()
    stopping = None
    try:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=120)
        idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        r = http.client.HTTPResponse(idle)
        r.begin()
        assert r.status == 200 and r.read() and not r.will_close  # answered, and kept alive
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        resp, first = _start_stream(server.port)
        result = {}
        stopping = threading.Thread(target=lambda: result.update(left=server.stop(grace_s=300)))
        stopping.start()
        assert idle.recv(65536) == b""  # the idle connection is closed (a hang fails at 120 s)
        wait_for(lambda: not _accepts(server.port), timeout_s=60, what="the listener to close")
        _assert_whole(first + resp.read())
        stopping.join(timeout=300)
        assert result == {"left": 0}
    finally:
        if stopping is None:
            server.stop()
        decode.stop()


DRAIN_TOKENS = 48


def _start_stream(port: int):
    """A streamed completion of DRAIN_TOKENS tokens, under way: (the response, its first line)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": MODEL, "prompt": "drain me", "max_tokens": DRAIN_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    assert resp.status == 200 and first.startswith(b"data: "), first
    return resp, first


def _assert_whole(stream: bytes) -> None:
    """Every token of the stream came, then its end."""
    events = [json.loads(line[6:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]
    assert stream.rstrip().endswith(b"data: [DONE]"), stream[-300:]
    assert events[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


def test_sigterm_lets_a_stream_in_flight_finish_before_the_gateway_process_exits():
    """The same through a real ``crescent gateway`` process: SIGTERM mid-stream, and the stream still
    gets every token before the process exits 0 (before, it exited at once, cutting the stream)."""
    import signal
    import sys

    from tests.helpers import Proc

    decode = EngineNode("decode", engine_cfg()).start()
    gw = Proc([sys.executable, "-m", "kvstore.cli", "gateway", "--listen", "127.0.0.1:0", "--model", MODEL,
               "--decode", decode.address], "serving")
    try:
        port = int(re.search(r":(\d+)/v1", gw.line).group(1))
        resp, first = _start_stream(port)
        os.kill(gw.pid, signal.SIGTERM)
        _assert_whole(first + resp.read())
        assert gw.proc.wait(timeout=120) == 0
        assert "1 requests in flight" in gw.proc.stdout.read()
    finally:
        gw.stop()
        decode.stop()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        return True
    except OSError:
        return False


def test_a_tls_handshake_trickled_a_byte_at_a_time_is_cut_off(tmp_path):
    """HTTPS: the handshake is due within the idle timeout too (here 3 s; Python's ssl takes a socket's
    timeout as the handshake's deadline, not each read's). A client that announces a ClientHello record
    and then sends it a byte every 0.3 s is shut out, and the gateway serves on."""
    import select

    from engine.serve.gateway import https_context
    from kvstore import tls

    paths = tls.init_dir(str(tmp_path / "tls"), ["127.0.0.1"])
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0",
                           https_context(paths["node"], paths["node_key"]), idle_s=3.0).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            # a handshake record of 512 bytes, a ClientHello of 508 begins it (TLS reads a record whole)
            s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc")
            closed = False
            for _ in range(400):  # up to 120 s of trickling: a bound against hangs, not a speed test
                try:
                    s.sendall(b"\x00")
                    if select.select([s], [], [], 0.3)[0] and not s.recv(65536):
                        closed = True
                        break
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            assert closed
        ctx = ssl.create_default_context(cafile=paths["ca"])
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:  # and it serves on
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_expect_100_continue_refuses_a_body_it_would_drop_before_it_is_sent():
    """curl asks ``Expect: 100-continue`` before a body over 1 MiB. A body over 8 MiB, or to a path not
    served, is now refused at once (before, the gateway said 100 Continue and read up to 64 MiB only to
    drop it); a body it takes is asked for and served."""
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0").start()
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    try:
        for path, length, status in (("/v1/completions", MAX_BODY + 1, b"400"), ("/nope", 10, b"404")):
            got, closed = _responses_on(server.port, b"POST %s HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                        b"Content-Length: %d\r\n\r\n" % (path.encode(), length), expect=1)
            assert [g.split()[1] for g in got] == [status] and closed, (path, got)
        with socket.create_connection(("127.0.0.1", server.port), timeout=300) as s:
            s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                      % len(body))
            assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")
            s.sendall(body)
            r = http.client.HTTPResponse(s)
            r.begin()
            assert r.status == 200 and json.loads(r.read())["count"] > 0
    finally:
        server.stop()


def test_a_silent_connection_is_closed_after_the_idle_timeout_and_its_thread_freed():
    """Kept alive with no next request, stalled inside its headers, or inside its body: each connection
    is closed once silent for idle_s (here 1 s), so that idle or slow clients cannot hold the gateway's
    threads for good. Before, each waited forever."""
    import threading

    before = set(threading.enumerate())  # (other servers' connection threads, if any)
    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0", idle_s=1.0).start()
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    try:
        for sent, answers in ((b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 1),
                              (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Le", 0),
                              (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                               % (len(body), body[:5]), 0)):
            with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
                s.sendall(sent)
                out = b""
                while piece := s.recv(65536):  # (until the server closes: within 120 s, or a timeout fails)
                    out += piece
            assert out.count(b"HTTP/1.1 200") == answers, (sent, out)
        wait_for(lambda: not any("process_request" in t.name for t in set(threading.enumerate()) - before),
                 timeout_s=60, what="the connections' threads to end")
        assert request(server.url, "GET", "/v1/models")[0] == 200  # and it serves on
    finally:
        server.stop()


def test_a_client_that_resets_its_kept_alive_connection_is_one_debug_line_not_a_traceback(capfd, caplog):
    import struct

    server = GatewayServer(Gateway(MODEL, [], ["127.0.0.1:1"]), "127.0.0.1:0").start()
    try:
        with caplog.at_level(logging.DEBUG, logger="engine.serve.gateway"):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset while the server waits for the next request on it
            wait_for(lambda: any("dropped" in r.getMessage() for r in caplog.records), what="the debug line")
        assert request(server.url, "GET", "/v1/models")[0] == 200  # (and it serves on)
    finally:
        server.stop()
    assert "Traceback" not in capfd.readouterr().err


def test_no_route_is_503_and_health_says_why():
    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0")).start()
    stopped = False
    gw = Gateway(MODEL, [], [], conductor=conductor.address, timeout_s=60)
    server = GatewayServer(gw, "127.0.0.1:0").start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
        # a conductor with no engine registered
        status, data = request(server.url, "GET", "/health")
        assert status == 503 and json.loads(data) == {"status": "degraded", "engines": {}}
        with pytest.raises(openai.InternalServerError, match="no live prefill engine") as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert e.value.status_code == 503
        # no conductor at all
        conductor.stop(grace=0)
        stopped = True
        status, data = request(server.url, "GET", "/health")
        body = json.loads(data)
        assert status == 503 and body["status"] == "degraded" and body["conductor"].startswith("unreachable")
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError, match="the conductor cannot schedule") as e:
                c.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=stream)
            assert e.value.status_code == 503
        m = metrics(server.url)
        assert m[("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "503")))] == 3
    finally:
        server.stop()
        if not stopped:
            conductor.stop(grace=0)


def test_a_prefill_engine_whose_saves_fail_names_no_chunks_and_requests_still_complete():
    """The store goes away: the prefill engine's next saves fail, after which its Prefill names no chunk
    keys (the decode engine would only wait its fetch timeout for chunks that never arrive); the request
    is still answered with the same tokens."""
    s = Setup(with_store=True)
    try:
        c = s.client()
        prompt = STOP_PROMPT + list(range(40, 200))
        want, _, _ = completion(c, prompt, False, max_tokens=6)
        stub = epb_grpc.EngineStub(grpc.insecure_channel(s.prefill.address))
        req = epb.PrefillRequest(prompt_token_ids=list(range(50, 250)), sampling=epb.SamplingOptions(max_tokens=4))
        assert len(stub.Prefill(req, timeout=120).chunk_keys) == 3
        conn = s.prefill.engine.connector
        assert conn.saves_reach_store
        s.parts.pop(0)()  # stops the store node (and takes it off the teardown list)
        stub.Prefill(epb.PrefillRequest(prompt_token_ids=list(range(60, 260)),
                                        sampling=epb.SamplingOptions(max_tokens=4)), timeout=120)
        assert conn.flush(timeout_s=120)
        assert not conn.saves_reach_store and conn.stats.save_failures > 0
        assert list(stub.Prefill(req, timeout=120).chunk_keys) == []
        got, _, _ = completion(c, prompt, False, max_tokens=6)
        assert got == want
    finally:
        s.close()


def test_a_speculating_decode_engine_streams_the_plain_tokens_and_counts_them():
    """Disaggregated: the decode engine loads the prompt's KV from the store and drafts (n-gram) what
    it copies; the client sees exactly the tokens and counts of a store-less, non-speculative pair."""
    spec, plain = Setup(with_store=True, speculative="ngram", num_speculative_tokens=4), Setup(with_store=False)
    try:
        prompt = [17, 250, 3, 88, 140, 9, 301, 77, 45, 260, 12, 199] * 6
        c, ref_c = spec.client(), plain.client()
        for stream in (False, True):
            text, reason, _ = completion(c, prompt, stream, max_tokens=48)
            assert (text, reason) == completion(ref_c, prompt, stream, max_tokens=48)[:2]
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 48 and r.usage.prompt_tokens == len(prompt)
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 48
        eng = spec.decode.engine
        assert eng.num_accepted_tokens > 0 and eng.num_spec_steps > 0
        exported = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(
            generate_latest(spec.decode.metrics.registry).decode()) for s in fam.samples}
        assert exported[("crescent_engine_spec_tokens_total", (("kind", "accepted"), ("role", "decode")))] \
            == eng.num_accepted_tokens
        assert exported[("crescent_engine_spec_steps_total", (("role", "decode"),))] == eng.num_spec_steps
        drafted = eng.num_draft_tokens
        # a request that opts out is not drafted for
        text, _, _ = completion(c, prompt, False, max_tokens=24, extra_body={"ignore_eos": True, "speculative": False})
        assert text == completion(ref_c, prompt, False, max_tokens=24)[0] and eng.num_draft_tokens == drafted
    finally:
        spec.close()
        plain.close()


def test_api_keys_bind_each_request_to_its_tenant_and_cache_salt(tmp_path):
    """With --api-keys: no key or an unknown one is a 401 (the client's AuthenticationError); each key's
    tenant salts its chunk keys whatever the request says, so tenants never reuse each other's prefixes,
    except those the file lets share; outputs stay the store-less pair's."""
    from engine.serve.gateway import load_api_keys

    keys = {"acme": "sk-acme-000000", "globex": "sk-globex-0000", "c": "sk-shared-c-000", "d": "sk-shared-d-000"}
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": keys["acme"], "tenant": "acme"},
                                         {"key": keys["globex"], "tenant": "globex"},
                                         {"key": keys["c"], "tenant": "c", "share_prefixes": True},
                                         {"key": keys["d"], "tenant": "d", "share_prefixes": True}]}))
    for bad, why in (('{"keys": []}', "needs"), ('{"keys": [{"key": "short", "tenant": "x"}]}', "at least 8")):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_api_keys(str(tmp_path / "bad.json"))
    s, plain = Setup(with_store=True, api_keys=load_api_keys(str(path))), Setup(with_store=False)
    try:
        prompt = list(range(3, 203))  # 200 tokens: 3 chunks of 64

        def cached(tenant: str) -> int:
            r = s.client(keys[tenant]).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                          extra_body={"ignore_eos": True, "cache_salt": "acme"})
            assert r.choices[0].text == completion(plain.client(), prompt, False, max_tokens=4)[0]
            return r.usage.prompt_tokens_details.cached_tokens

        status, body = request(s.url, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                               {"Content-Type": "application/json"})  # no Authorization header at all
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        # a stranger learns nothing of what is served: not from a wrong model's error, not from /v1/models
        status, body = request(s.url, "POST", "/v1/completions", json.dumps({"model": "x", "prompt": "hi"}).encode(),
                               {"Content-Type": "application/json"})
        assert status == 401 and MODEL not in body.decode()
        status, body = request(s.url, "GET", "/v1/models")
        assert status == 401 and MODEL not in body.decode()
        assert [m.id for m in s.client(keys["acme"]).models.list()] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            s.client("sk-unknown-000").completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert cached("acme") == 0 and cached("acme") > 0  # its own prefix, reused
        assert cached("globex") == 0  # the same prompt, another tenant (its "cache_salt": "acme" ignored)
        assert cached("c") == 0 and cached("d") > 0  # the two sharing tenants reuse each other's
        assert metrics(s.url)[("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "401")))] == 3
    finally:
        s.close()
        plain.close()



def test_a_tenant_over_its_concurrency_quota_gets_429_with_retry_after_and_others_do_not(tmp_path):
    from engine.serve.gateway import load_api_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "sk-acme-000000", "tenant": "acme", "max_concurrent": 1},
                                         {"key": "sk-acme-111111", "tenant": "acme", "max_concurrent": 1},
                                         {"key": "sk-globex-0000", "tenant": "globex"}]}))
    for bad, why in (({"key": "sk-x-00000000", "tenant": "x", "max_concurrent": 0}, "positive integer"),
                     ({"key": "sk-acme-222222", "tenant": "acme", "max_concurrent": 2}, "different max_concurrent")):
        (tmp_path / "bad.json").write_text(json.dumps({"keys": [json.loads(path.read_text())["keys"][0], bad]}))
        with pytest.raises(ValueError, match=why):
            load_api_keys(str(tmp_path / "bad.json"))
    s = Setup(with_store=False, prefill=False, api_keys=load_api_keys(str(path)))
    try:
        held = s.client("sk-acme-000000").completions.create(model=MODEL, prompt="hold on", max_tokens=400,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
        next(iter(held))  # acme now has one request in flight
        with pytest.raises(openai.RateLimitError) as e:  # its other key shares the quota
            s.client("sk-acme-111111").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "tenant_quota_exceeded"
        assert s.client("sk-globex-0000").completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        held.close()  # the client goes away mid-stream: the gateway counts the request done
        wait_for(lambda: s.gw._inflight["acme"] == 0, what="acme's stream to end")
        assert s.client("sk-acme-111111").completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    finally:
        s.close()


def test_an_engine_refuses_a_bad_first_token_alone_and_takes_tiny_temperatures_as_greedy(fresh):
    """A first_token beyond the vocabulary reached the model and failed the whole step, so every
    request running beside it died (with INVALID_ARGUMENT, not their fault); a temperature of
    1e-45 overflowed the logits the same way. A first_token that already ends the request ends it."""
    import threading

    stub = epb_grpc.EngineStub(grpc.insecure_channel(fresh.decode.address))
    beside = {}

    def long_request():
        toks = []
        for m in stub.Generate(epb.GenerateRequest(prompt_token_ids=list(range(1, 300)),
                                                   sampling=epb.SamplingOptions(max_tokens=40, ignore_eos=True)),
                               timeout=300):
            toks += m.token_ids
        beside["tokens"] = len(toks)

    t = threading.Thread(target=long_request)
    t.start()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(epb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=epb.SamplingOptions(max_tokens=4),
                                               first_token=1 << 20), timeout=300))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "first_token" in e.value.details()
    tiny = list(stub.Generate(epb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=epb.SamplingOptions(
        max_tokens=3, temperature=1e-45, ignore_eos=True)), timeout=300))
    greedy = list(stub.Generate(epb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=epb.SamplingOptions(
        max_tokens=3, ignore_eos=True)), timeout=300))
    assert [x for m in tiny for x in m.token_ids] == [x for m in greedy for x in m.token_ids]
    done = list(stub.Generate(epb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=epb.SamplingOptions(max_tokens=1),
                                                  first_token=9), timeout=300))
    assert [(list(m.token_ids), m.finished, m.finish_reason) for m in done] == [([], True, "length")]
    t.join(timeout=300)
    assert beside == {"tokens": 40}


def test_a_long_prompts_logprobs_pass_the_4_mib_grpc_default():
    """34,000 prompt tokens with 20 top logprobs each: the engine's answer carrying them is ~4.4 MB,
    over gRPC's default message limit of 4 MiB, at which the gateway failed the request (a 503 from
    the engine's RESOURCE_EXHAUSTED). Now it is answered whole."""
    n = 34_000
    decode = EngineNode("decode", EngineConfig(model=MODEL, dtype="float32", chunk_tokens=4096, kv_cache_memory="64MiB",
                                               hf_overrides={"max_position_embeddings": 40_000})).start()
    server = GatewayServer(Gateway(MODEL, [], [decode.address], timeout_s=600), "127.0.0.1:0").start()
    try:
        prompt = [(7 * i) % 250 + 3 for i in range(n)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": MAX_LOGPROBS}
        status, data = request(server.url, "POST", "/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
        assert status == 200, data[:300]
        shown = json.loads(data)["choices"][0]["prompt_logprobs"]
        assert len(shown) == n and shown[0] is None
        assert all(len(d) >= MAX_LOGPROBS for d in shown[1:])  # (its own token too, when not in the top)
    finally:
        server.stop()
        decode.stop()
