"""Structured outputs: what the engine generates under a grammar is checked by Python itself (json,
re), and greedy outputs are those of a plain loop over the model with the grammar's mask from a
fresh matcher fed the output so far, on every path of the engine (chunked prefill, async
scheduling, the graphs' static buffers, beside speculation)."""

import json
import math
import re
import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.structured import MAX_JSON_WHITESPACE, Grammars, check_spec
from engine.tokenizer import ByteTokenizer, HFTokenizer
from tests.engine.reference import all_logits

xgr = pytest.importorskip("xgrammar")

MODEL = "random:tiny"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "ok": {"type": "boolean"},
                                           "kind": {"enum": ["a", "bb", "ccc"]}},
          "required": ["name", "ok", "kind"], "additionalProperties": False}
REGEX = r"[a-z]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "<" item ("," item)* ">"\nitem ::= [a-c] | "zz"'
GRAMMAR_RE = r"<([a-c]|zz)(,([a-c]|zz))*>"


def _meets(spec: tuple[str, str], text: str) -> bool:
    """Whether ``text`` is what ``spec`` asks for, by Python's json and re."""
    kind, s = spec
    if kind in ("json", "json_object"):
        try:
            v = json.loads(text, strict=False)  # (control characters inside strings are let through)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(v, dict)
        return (isinstance(v, dict) and set(v) == {"name", "ok", "kind"} and isinstance(v["name"], str)
                and re.fullmatch("[a-z]{1,6}", v["name"]) is not None and isinstance(v["ok"], bool)
                and v["kind"] in ("a", "bb", "ccc"))
    if kind == "regex":
        return re.fullmatch(s, text) is not None
    if kind == "choice":
        return text in json.loads(s)
    return re.fullmatch(GRAMMAR_RE, text) is not None


SPECS = [("json", json.dumps(SCHEMA)), ("regex", REGEX), ("choice", json.dumps(CHOICES)), ("grammar", GRAMMAR)]


def _requests() -> list[tuple[list[int], SamplingParams]]:
    reqs = []
    for i, spec in enumerate(SPECS * 2):
        prompt = [(7 * i + 3 * j) % 250 + 3 for j in range(5 + 4 * i)]
        reqs.append((prompt, SamplingParams(max_tokens=400, structured=spec)))
    reqs.append(([5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True)))  # unconstrained, beside and after them
    return reqs


def _reference(prompt: list[int], p: SamplingParams, eos, device: str = "cpu") -> tuple[list[int], str]:
    """Greedy under the grammar: a fresh matcher fed the output so far gives each step's mask
    (with ``structured_after``, the output after the first occurrence of those tokens; none before)."""
    grammars = Grammars(ByteTokenizer(), 512, eos)
    out: list[int] = []
    n = len(p.structured_after)
    while True:
        logits = all_logits(MODEL, prompt + out, device=device)[-1].cpu()
        start = next((k + n for k in range(len(out) - n + 1) if tuple(out[k:k + n]) == p.structured_after), None) \
            if n else 0
        if p.structured is not None and start is not None:
            m = grammars.matcher(p.structured)
            m.follow(out[start:])
            logits = logits.masked_fill(~m.allowed(eos, "cpu"), -math.inf)
        out.append(int(logits.argmax()))
        if p.is_stop(out[-1], len(out), eos):
            return out, "stop"
        if len(out) == p.max_tokens:
            return out, "length"


@pytest.fixture(scope="module")
def wants():
    eos = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=8)).eos
    return eos, [_reference(prompt, p, eos) for prompt, p in _requests()]


def _run(eng: LLMEngine, reqs) -> list:
    seqs = [eng.add_request(prompt, p) for prompt, p in reqs]
    for _ in range(5000):
        if not eng.has_work():
            break
        eng.step()
    return seqs


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 8, "max_num_batched_tokens": 24}, {"async_scheduling": True},
                                {"async_scheduling": True, "static_buffers": True},
                                {"speculative": "ngram", "num_speculative_tokens": 3},
                                {"speculative": "draft", "draft_model": MODEL, "num_speculative_tokens": 3}],
                         ids=["plain", "chunked-prefill", "async", "async-static-buffers", "ngram", "draft-model"])
def test_greedy_structured_outputs_are_the_grammars_and_those_of_a_plain_loop(wants, kw):
    eos, want = wants
    reqs = _requests()
    kw = dict(kw)
    static = kw.pop("static_buffers", False)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=400, max_num_seqs=16, enforce_eager=static,
                                 **kw))
    if static:
        eng.runner.decode_graphs = eng.runner.make_decode_graphs(capture=False)
    seqs = _run(eng, reqs)
    tok = ByteTokenizer()
    for seq, (prompt, p), w in zip(seqs, reqs, want):
        assert (seq.output, seq.finish_reason) == w, (p.structured, kw)
        if p.structured is not None:
            assert seq.finish_reason == "stop" and seq.output[-1] in eos
            assert _meets(p.structured, tok.decode(seq.output)), (p.structured, tok.decode(seq.output))
    if kw.get("async_scheduling"):  # once the structured requests are done, the other's steps overlap
        assert eng.num_overlapped_steps > 0
    if kw.get("speculative"):  # drafts cut to what the grammar allows, verified row by row against it
        drafted = [s for s, (_, p) in zip(seqs, reqs) if p.structured and s.num_draft_tokens]
        assert len(drafted) >= 2 and sum(s.num_accepted_tokens for s in drafted) > 0
        assert seqs[-1].num_draft_tokens > 0


@pytest.mark.parametrize("kw", [{"async_scheduling": True}, {"speculative": "ngram", "num_speculative_tokens": 4}],
                         ids=["async", "ngram"])
def test_sampled_structured_outputs_meet_their_grammar(kw):
    """Sampling at temperature 1 from a random model: whatever it draws, the output is the grammar's
    (with speculation, drafts accepted by the rejection rule over the grammar's rows)."""
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=600, max_num_seqs=32, **kw))
    reqs = [([3 + i, 40, 41], SamplingParams(max_tokens=500, temperature=1.0, seed=i, structured=spec))
            for i, spec in enumerate(SPECS * 4)]
    seqs = _run(eng, reqs)
    texts = [ByteTokenizer().decode(s.output) for s in seqs]
    for seq, (_, p), text in zip(seqs, reqs, texts):
        assert seq.finish_reason == "stop" and _meets(p.structured, text), (p.structured, text)
    assert len(set(texts)) > len(SPECS)  # (draws differ)
    runs = [len(r) for t in texts for r in re.findall(r"[ \t\n\r]+", t)]
    assert max(runs, default=0) <= MAX_JSON_WHITESPACE


def test_json_object_is_an_object_and_any_object():
    """Any JSON object (OpenAI's ``json_object``): its strings are unbounded, so a random model is
    steered to close it (a bias on "}", which the grammar allows only where an object may end)."""
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=64))
    seqs = _run(eng, [([9, i], SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=("json_object", ""),
                                              logit_bias={ord("}"): 8.0})) for i in range(4)])
    for seq in seqs:
        text = ByteTokenizer().decode(seq.output)
        assert seq.finish_reason == "stop" and _meets(("json_object", ""), text), text


def test_a_structured_output_ends_where_its_grammar_does_even_with_ignore_eos():
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=64))
    seq, = _run(eng, [([9, 9, 9], SamplingParams(max_tokens=50, ignore_eos=True, structured=("choice", '["ok"]')))])
    assert ByteTokenizer().decode(seq.output) == "ok" and seq.finish_reason == "stop"


def test_a_token_from_outside_that_breaks_the_grammar_ends_the_output(caplog):
    """Another engine's first token (``output_prefix``) is not sampled here: if the grammar does
    not allow it, only EOS is allowed after it."""
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=64))
    seq = eng.add_request([9, 9, 9], SamplingParams(max_tokens=50, structured=("regex", "[0-9]+")),
                          output_prefix=[ord("x")])
    _run(eng, [])
    assert seq.output[0] == ord("x") and len(seq.output) == 2 and seq.output[1] in eng.eos
    assert "not allowed by the request's grammar" in caplog.text


@pytest.mark.parametrize("spec,msg", [
    (("json", '{"type": "object"'), "does not compile: Failed to parse JSON"),
    (("json", '{"type": "nonsense"}'), "does not compile: Unsupported type"),
    (("regex", "[a-"), "does not compile: Regex parsing error"),
    (("grammar", "root ::= x"), "does not compile: EBNF parser error"),
])
def test_a_spec_that_does_not_compile_is_refused_naming_why(spec, msg):
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=16))
    with pytest.raises(ValueError, match=msg):
        eng.add_request([1, 2], SamplingParams(structured=spec))
    assert not eng.has_work()


@pytest.mark.parametrize("spec,msg", [
    (("yaml", "x"), "kind one of"), ("json", "kind one of"), (("regex", ""), "non-empty spec"),
    (("choice", '"a"'), "JSON list"), (("choice", "[]"), "JSON list"), (("choice", '["a", ""]'), "JSON list")])
def test_malformed_specs_are_refused(spec, msg):
    with pytest.raises(ValueError, match=msg):
        check_spec(spec)
    with pytest.raises(ValueError, match=msg):
        SamplingParams(structured=spec)
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(structured=("regex", "a+"), min_tokens=1)


def test_choices_with_quotes_backslashes_and_newlines_are_taken_literally():
    spec = ("choice", json.dumps(['say "hi"', "a\\b", "x\ny"]))
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=200, max_num_seqs=16))
    seqs = _run(eng, [([i, 8], SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured=spec))
                      for i in range(12)])
    texts = {ByteTokenizer().decode(s.output) for s in seqs}
    assert texts <= {'say "hi"', "a\\b", "x\ny"} and len(texts) > 1


def test_without_xgrammar_structured_requests_get_a_clear_error(monkeypatch):
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=16))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (import xgrammar then raises ImportError)
    with pytest.raises(ValueError, match="need the xgrammar package"):
        eng.add_request([1, 2], SamplingParams(structured=("regex", "a+")))


def test_a_byte_level_bpe_tokenizer_json_output_decodes_to_the_schemas_json(tmp_path):
    """A Hugging Face tokenizer (byte-level BPE, trained here: multi-byte tokens, "Ġ" spaces): its
    vocabulary as xgrammar sees it, and random logits under the mask decode to valid JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "ann", "ok": true, "kind": "bb"}', "hello world, the quick brown fox", "[1, 2, 3]"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    hf = HFTokenizer(str(tmp_path))
    vocab = tok.get_vocab_size() + 20  # (a model's vocabulary padded past the tokenizer's)
    eos = {hf.eos_token_id}
    assert any(len(t) > 2 for t in tok.get_vocab())  # (merged multi-byte tokens)
    g = Grammars(hf, vocab, eos)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        m = g.matcher(("json", json.dumps(SCHEMA)))
        out = []
        while not out or out[-1] not in eos:
            m.follow(out)
            logits = torch.randn(vocab, generator=gen).masked_fill(~m.allowed(eos, "cpu"), -math.inf)
            out.append(int(logits.argmax()))
            assert len(out) < 500
        assert _meets(("json", ""), hf.decode(out[:-1])), hf.decode(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")
def test_structured_outputs_on_the_gpu_with_captured_graphs_and_async_scheduling():
    """The bitmask crosses to the device packed and is unpacked there: through replayed decode
    graphs and async scheduling, greedy outputs are those of the plain loop on the same device."""
    reqs = _requests()
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", device="cuda", num_pages=400, max_num_seqs=16,
                                 async_scheduling=True))
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.captured
    seqs = _run(eng, reqs)
    for seq, (prompt, p) in zip(seqs, reqs):
        assert (seq.output, seq.finish_reason) == _reference(prompt, p, eng.eos, "cuda"), p.structured


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True}, {"speculative": "ngram"}])
def test_a_grammar_after_given_tokens_leaves_the_output_free_until_them(kw):
    """``structured_after`` (a reasoning model's ``</think>``): the output is the model's own until
    those tokens, then held to the grammar from there. The tokens are taken from the unconstrained
    greedy output itself (a random model writes no ``</think>``), so both halves are seen."""
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_pages=256, max_num_seqs=4, **kw))
    prompts = [[(5 * i + 11 * j) % 250 + 3 for j in range(6 + 3 * i)] for i in range(3)]
    free = [s.output for s in _run(eng, [(q, SamplingParams(max_tokens=12, ignore_eos=True)) for q in prompts])]
    reqs = [(q, SamplingParams(max_tokens=120, structured=spec, structured_after=tuple(f[4:6])))
            for q, f, spec in zip(prompts, free, SPECS)]
    for seq, (prompt, p) in zip(_run(eng, reqs), reqs):
        want = _reference(prompt, p, eng.eos)
        assert (seq.output, seq.finish_reason) == want, p.structured
        start = next(k + 2 for k in range(len(want[0])) if tuple(want[0][k:k + 2]) == p.structured_after)
        assert start <= 6 and seq.output[:start] == free[reqs.index((prompt, p))][:start]
        assert _meets(p.structured, bytes(t for t in seq.output[start:] if t < 256).decode(errors="replace")) \
            or seq.finish_reason == "length"
    assert not SamplingParams(max_tokens=5, structured=SPECS[1], structured_after=(1,)).speculable
    with pytest.raises(ValueError, match="structured_after"):
        SamplingParams(max_tokens=5, structured_after=(1,))


def test_the_structured_bench_prints_its_tables(capsys):
    """bench/structured_bench.py end to end at a toy size (its figures are in docs/benchmarks.md)."""
    from bench.structured_bench import SPECS, main

    main(["--vocab", "600", "--batch", "1,2", "--steps", "3", "--spec-model", "random:tiny", "--spec-requests", "2"])
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in SPECS)
    assert out.count("json schema") >= 3 and "| 2 |" in out and "structured.png" in out
    assert "| no drafts |" in out and "| n-gram, k=4 |" in out
