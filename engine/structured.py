"""Structured outputs: a request's output held to a grammar (a JSON schema, any JSON, a regular
expression, one of a list of strings, or an EBNF grammar).

Before each of the request's tokens is sampled, the grammar's matcher (xgrammar, as in vLLM and
SGLang; optional: ``pip install 'crescent[structured]'``) says which tokens of the vocabulary may
come next, as a bitmask, and every other token's logit is set to -inf. The matcher advances with
each token the request outputs; once the grammar is complete only EOS is allowed, so the request
ends there (``finish_reason`` "stop", even with ``ignore_eos``). Grammars are compiled once per
tokenizer and cached by content: many requests with one schema compile it once.
"""

from __future__ import annotations

import json
import logging
import re
import threading

import torch

log = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""``SamplingParams.structured`` is ``(kind, spec)``: a JSON schema (its JSON text), any JSON object
(spec ignored), a regular expression, a JSON list of the strings allowed, or an EBNF (GBNF) grammar."""


MAX_JSON_WHITESPACE = 16
"""Longest run of whitespace a JSON output may have between its tokens (indentation fits; a model
that would pad forever cannot: unbounded whitespace is the known way for constrained JSON to run
to ``max_tokens`` without ending)."""


def check_spec(spec) -> tuple[str, str]:
    """``spec`` as ``(kind, text)``; ValueError naming what is wrong (before any compilation)."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 2 or spec[0] not in KINDS \
            or not isinstance(spec[1], str):
        raise ValueError(f"structured must be None or (kind, spec) with kind one of {', '.join(KINDS)} "
                         f"and spec a string, got {spec!r}")
    kind, text = spec
    if kind != "json_object" and not text:
        raise ValueError(f"structured {kind!r} needs a non-empty spec")
    if kind == "choice":
        try:
            choices = json.loads(text)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("structured 'choice' needs a JSON list of non-empty strings")
    return kind, text


def _ebnf_string(s: str) -> str:
    """``s`` as an EBNF string literal."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _reason(exc: Exception) -> str:
    """xgrammar's error without its C++ source location and check expression."""
    lines = str(exc).strip().splitlines()
    msg = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0] if lines else type(exc).__name__)
    return re.sub(r"^Check failed: .*? is false: ", "", msg)


class Grammars:
    """Compiles requests' grammars for one tokenizer (xgrammar, imported on first use; compiled
    grammars cached by content) and makes their matchers. Safe to call from several threads:
    the engine's callers compile while validating a request, so the engine's own thread finds it
    compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos)
        self._compiler = None
        self._lock = threading.Lock()

    def _xgr(self):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("structured outputs need the xgrammar package "
                             "(pip install 'crescent[structured]')") from None
        return xgrammar

    def _info(self, xgr):
        from engine.tokenizer import ByteTokenizer

        if isinstance(self.tokenizer, ByteTokenizer):  # bytes 0..255; BOS, EOS and the rest special
            vocab = [bytes([i]) for i in range(256)] + [b""] * (self.vocab_size - 256)
            return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.eos)
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self.eos)

    def compile(self, spec: tuple[str, str]):
        """The compiled grammar of ``spec`` (cached). ValueError for a spec that does not compile."""
        kind, text = check_spec(spec)
        xgr = self._xgr()
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._info(xgr), max_threads=2, cache_limit_bytes=256 << 20)
            c = self._compiler
            try:
                if kind in ("json", "json_object"):
                    return c.compile_json_schema(text if kind == "json" else '{"type": "object"}',
                                                 any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
                if kind == "regex":
                    return c.compile_regex(text)
                if kind == "choice":
                    return c.compile_grammar("root ::= " + " | ".join(map(_ebnf_string, json.loads(text))))
                return c.compile_grammar(text)
            except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from these
                raise ValueError(f"structured {kind!r} does not compile: {_reason(exc)}") from None

    def matcher(self, spec: tuple[str, str]) -> Matcher:
        return Matcher(self._xgr().GrammarMatcher(self.compile(spec)), self.vocab_size, self.eos)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[k, vocab]`` bool from a ``[k, words]`` int32 bitmask (bit ``t % 32`` of word ``t // 32``
    is token ``t``), on the bitmask's device."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher:
    """One request's place in its grammar, following its output."""

    def __init__(self, matcher, vocab_size: int, eos=()) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos = frozenset(eos)
        self.tokens: list[int] = []
        """The tokens the matcher has accepted: the output, and during a verification the drafts
        of the row at hand."""
        self.failed = False
        """A token the grammar does not allow was output (it cannot be sampled; a token given
        from outside, such as another engine's first token, can): only EOS is allowed from then."""

    @property
    def num_accepted(self) -> int:
        return len(self.tokens)

    def follow(self, output: list[int]) -> None:
        """Moves to the end of ``output``: rolls back what it accepted past their common prefix (the
        drafts a verification rejected), then accepts the rest."""
        common = min(len(self.tokens), len(output))
        while common and self.tokens[common - 1] != output[common - 1]:  # (they differ in the last few only)
            common -= 1
        if common < len(self.tokens):
            self._m.rollback(len(self.tokens) - common)
            del self.tokens[common:]
        for t in output[common:]:
            if self.failed or not self._m.accept_token(t):
                if not self.failed:
                    log.warning("structured output: token %d is not allowed by the request's grammar", t)
                self.failed = True
                break
            self.tokens.append(t)

    def valid_draft(self, output: list[int], draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar allows after ``output``, up to (not
        including) an EOS; the matcher is left at the end of ``output``."""
        self.follow(output)
        if self.failed:
            return []
        n = 0
        for t in draft:
            if t in self.eos or not self._m.accept_token(t):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return draft[:n]

    def fill(self, bitmask: torch.Tensor, row: int, eos) -> None:
        """Writes the tokens the grammar allows next into row ``row`` of ``bitmask`` (``[k, words]``
        int32 on the host; only EOS once the grammar has failed)."""
        if not self.failed:
            self._m.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row].zero_()
        for e in eos:
            bit = 1 << (e % 32)
            bitmask[row, e // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # (int32: bit 31 is the sign)

    def allowed(self, eos, device) -> torch.Tensor:
        """``[vocab]`` bool on ``device``: the tokens the grammar allows next."""
        buf = torch.empty((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
        self.fill(buf, 0, eos)
        return unpack(buf.to(device), self.vocab_size)[0]
