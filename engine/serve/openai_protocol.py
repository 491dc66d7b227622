"""OpenAI request parsing and response shapes for the gateway (completions and chat)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass

from engine.beam_search import MAX_BEAM_WIDTH, MAX_LENGTH_PENALTY
from engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, TokenLogprobs


class BadRequest(Exception):
    """An invalid request: answered 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


@dataclass
class ParsedRequest:
    chat: bool
    prompt: str | list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    stop: list[str]
    ignore_eos: bool
    cache_salt: str | None
    speculative: bool
    user: str | None
    logprobs: int | None = None
    """Log-probabilities asked for: the number of alternatives per token (None: none)."""
    n: int = 1
    """Completions (choices) for the prompt, each sampled on its own."""
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    echo: bool = False
    """Completions: the prompt comes back before the completion (with its logprobs, if asked for)."""
    prompt_logprobs: int | None = None
    """The prompt tokens' log-probabilities are needed, with this many alternatives (``echo`` with
    ``logprobs``, ``show_prompt_logprobs``)."""
    continuous_usage: bool = False
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    beam_search: bool = False
    """vLLM's ``use_beam_search``: the ``n`` choices are the ``n`` best hypotheses of a beam search
    of width ``n`` (engine/beam_search.py)."""
    length_penalty: float = 1.0
    """Beam search: hypotheses are ranked by log-probability over length ** ``length_penalty``."""
    add_special_tokens: bool = False
    """vLLM's: the tokenizer's special tokens (BOS) go before the prompt's text (completions' default;
    a chat's template writes its own, so there the default is false). Token-id prompts are as given."""
    skip_special_tokens: bool = True
    """vLLM's: special tokens' text is left out of the output (false: it is in)."""
    return_token_ids: bool = False
    """vLLM's: the answer carries the prompt's token ids and each choice's generated ones (streamed:
    each chunk's, the prompt's in a choice's first chunk)."""
    priority: int = 0
    """vLLM's: scheduling priority, lower first, on engines started with ``--scheduling-policy priority``."""
    best_of: int | None = None
    """OpenAI's (completions): this many choices are sampled and the ``n`` with the highest mean
    log-probability per token are answered."""
    chat_echo: str | None = None
    """Chat ``echo`` (vLLM's): the final assistant message's text, which each choice's content
    begins with (None: no echo, or the last message is not the assistant's)."""
    chat_template: str | None = None
    """vLLM's per-request ``chat_template`` (Jinja source), for gateways that trust requests' templates."""
    show_prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: the response shows the prompt tokens' log-probabilities, with
    this many alternatives each."""
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    """Words never generated (tokenized by the gateway, alone and after a space)."""
    structured: tuple[str, str] | None = None
    """The grammar the output follows (``SamplingParams.structured``)."""
    template_kwargs: dict | None = None
    """Chat: what the chat template is rendered with besides the messages."""
    tools: object = None
    """Chat: the ``ToolRequest`` (engine/serve/tools.py), or None."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this many tokens (vLLM's)."""
    reasoning: bool | None = None
    """Chat with a reasoning parser: whether the prompt opened the reasoning
    (engine/serve/reasoning.py); None: no parser."""
    structured_after: tuple[int, ...] = ()
    """The tokens after which ``structured`` applies (``SamplingParams.structured_after``)."""
    include_reasoning: bool = True
    """Chat with a reasoning parser: the reasoning comes back (vLLM's ``include_reasoning``)."""
    prompts: tuple | None = None
    """Completions given a batch of prompts (``prompt`` is the first): each is its own request,
    whose choices come in the answer in prompt order (prompt ``b``'s choice ``i`` at ``b * n + i``)."""

    def split(self) -> list[ParsedRequest]:
        """One request per prompt of a batch (this one alone otherwise)."""
        return [dataclasses.replace(self, prompt=p, prompts=None) for p in self.prompts] if self.prompts else [self]


# Sampling options of the OpenAI API (and vLLM's extensions) that this gateway does not implement,
# each with the values that mean "off": anything else is refused by name, never silently ignored.
UNSUPPORTED = {
    "suffix": ("",),
    "logits_processors": (), "guided_decoding_backend": ("xgrammar", "auto"),
    "spaces_between_special_tokens": (True,),
    "guided_whitespace_pattern": (),
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
"""OpenAI's ``reasoning_effort``: passed to the chat template (``reasoning_effort``), as vLLM does."""
STREAM_OPTIONS = {"include_usage", "include_obfuscation", "continuous_usage_stats"}
"""OpenAI's ``stream_options`` (``include_usage``; ``include_obfuscation`` only false) and vLLM's
(``continuous_usage_stats``)."""
MAX_CHAT_TEMPLATE = 1 << 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 64
INT32_MAX = (1 << 31) - 1
MAX_N = 16
"""Most choices (``n``) one request may ask for."""
MAX_PROMPTS = 256
"""Most prompts of one completions request (a batch); ``n`` times their number is at most ``MAX_N**2``."""
UINT32_MAX = (1 << 32) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def tag_tail(text: str, tag: str, end: int | None = None) -> int:
    """The length of the longest tail of ``text[:end]`` that begins ``tag`` (short of all of it):
    what a stream holds back, since the next tokens may complete the tag."""
    end = len(text) if end is None else end
    return max((n for n in range(1, min(len(tag), end + 1)) if text.endswith(tag[:n], 0, end)), default=0)


def _check_prompt(prompt) -> None:
    """One prompt of a completions request: a non-empty string or list of token ids."""
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise BadRequest("'prompt' must be a non-empty string or list of token ids, or a list of those "
                             "(a batch)", "prompt")
        if not all(0 <= t <= UINT32_MAX for t in prompt):
            raise BadRequest("token ids in 'prompt' must be non-negative (and below the vocabulary size)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string or list of token ids, or a list of those (a batch)",
                         "prompt")


def flag(body: dict, name: str, default: bool) -> bool:
    """A JSON boolean option (absent or null: ``default``); BadRequest for anything else."""
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _num(body: dict, name: str, default, lo=None, hi=None, integer=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{name}' must be a{'n integer' if integer else ' number'}", name)
    if isinstance(v, float) and not math.isfinite(v):  # (NaN passes every comparison below)
        raise BadRequest(f"'{name}' must be a finite number, got {v}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
    return v


def check_model(body, model_name: str) -> None:
    """BadRequest unless ``body`` is a JSON object naming the served model."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' is required", "model")
    if model != model_name:
        raise BadRequest(f"The model '{model}' does not exist; this gateway serves '{model_name}'", "model",
                         "model_not_found")


def parse_request(body, chat: bool, model_name: str) -> ParsedRequest:
    check_model(body, model_name)
    prompts = None
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        prompt: str | list[int] = [_message(m) for m in msgs]  # rendered by the gateway's tokenizer
    else:
        prompt = body.get("prompt")
        batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
            else [prompt]  # (a list of strings or of token-id lists: a batch, one prompt each)
        if len(batch) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' may hold up to {MAX_PROMPTS} prompts, got {len(batch)}", "prompt")
        for p in batch:
            _check_prompt(p)
        prompt = batch[0]
        if len(batch) > 1:
            prompts = tuple(batch)
    n = _num(body, "n", 1, 1, MAX_N, integer=True)
    if prompts is not None and n * len(prompts) > MAX_N * MAX_N:
        raise BadRequest(f"a batch of {len(prompts)} prompts with n={n} asks for {n * len(prompts)} choices; "
                         f"at most {MAX_N * MAX_N}", "n")
    for name, off in UNSUPPORTED.items():
        if body.get(name) is not None and not any(body[name] == v and type(body[name]) is type(v) for v in off):
            raise BadRequest(f"'{name}' is not supported by this server (leave it out"
                             f"{' or ' + repr(off[0]) if off else ''})", name)
    if chat:  # a flag, and how many alternatives
        logprobs = _num(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True) \
            if flag(body, "logprobs", False) else None
        if logprobs is None and body.get("top_logprobs") is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = _num(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    echo = flag(body, "echo", False)
    chat_echo = prompt[-1]["content"] if chat and echo and prompt[-1]["role"] == "assistant" else None
    echo = echo and not chat
    template = body.get("chat_template")
    if template is not None and (not chat or not isinstance(template, str) or not template
                                 or len(template) > MAX_CHAT_TEMPLATE):
        raise BadRequest(f"'chat_template' is a chat request's Jinja template: a string of up to "
                         f"{MAX_CHAT_TEMPLATE} characters", "chat_template")
    stream = flag(body, "stream", False)
    shown = _num(body, "prompt_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if shown is not None and stream:
        raise BadRequest("'prompt_logprobs' are not available when streaming (as in vLLM)", "prompt_logprobs")
    needed = [k for k in (logprobs if echo else None, shown) if k is not None]
    tools = _tools(body, chat)
    structured = _structured(body)
    if tools is not None and tools.structured() is not None:
        if structured is not None:
            raise BadRequest(f"tool_choice {tools.choice!r} structures the output already: leave out the other "
                             "ways of structuring it", "tool_choice")
        structured = tools.structured()
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in stop_ids):
        raise BadRequest(f"'stop_token_ids' must be a list of up to {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    # (with echo, max_tokens 0 scores the prompt alone: its logprobs, no completion)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    limit_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _num(body, limit_name, 16, 0 if echo else 1, UINT32_MAX, integer=True)
    min_tokens = _num(body, "min_tokens", 0, 0, UINT32_MAX, integer=True)
    if min_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' ({min_tokens}) must not exceed '{limit_name}' ({max_tokens})", "min_tokens")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - STREAM_OPTIONS or not all(
            isinstance(opts[k], bool) or opts[k] is None for k in opts)):
        raise BadRequest("'stream_options' is for a stream (\"stream\": true): an object of "
                         f"{', '.join(sorted(STREAM_OPTIONS))}, each true or false", "stream_options")
    opts = opts or {}
    if opts.get("include_obfuscation"):
        raise BadRequest("'stream_options.include_obfuscation' (random padding of the chunks) is not supported by "
                         "this server (leave it out or false)", "stream_options")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", "cache_salt")
    req = ParsedRequest(
        chat=chat, prompt=prompt, prompts=prompts,
        max_tokens=max_tokens, min_tokens=min_tokens, logit_bias=_logit_bias(body),
        allowed_token_ids=_allowed(body), bad_words=_bad_words(body), structured=structured,
        template_kwargs=_template_kwargs(body, tools) if chat else None, tools=tools,
        include_reasoning=flag(body, "include_reasoning", True),
        truncate_prompt_tokens=_num(body, "truncate_prompt_tokens", None, 1, UINT32_MAX, integer=True),
        temperature=float(_num(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_num(body, "top_p", 1.0, 1e-9, 1.0)),
        seed=_num(body, "seed", None, INT64_MIN, INT64_MAX, integer=True),
        stream=stream, include_usage=bool(opts.get("include_usage")),
        continuous_usage=bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
        stop=stop, ignore_eos=flag(body, "ignore_eos", False), cache_salt=salt,
        speculative=flag(body, "speculative", True),
        user=body.get("user") if isinstance(body.get("user"), str) else None, logprobs=logprobs, echo=echo,
        prompt_logprobs=max(needed) if needed else None, show_prompt_logprobs=shown, n=n, chat_echo=chat_echo,
        chat_template=template,
        top_k=_num(body, "top_k", 0, -1, INT32_MAX, integer=True), min_p=float(_num(body, "min_p", 0.0, 0.0, 1.0)),
        stop_token_ids=tuple(stop_ids),
        presence_penalty=float(_num(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(_num(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        repetition_penalty=float(_num(body, "repetition_penalty", 1.0, 0.01, 10.0)),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output", False),
        beam_search=flag(body, "use_beam_search", False),
        priority=_num(body, "priority", 0, -(1 << 31), INT32_MAX, integer=True),
        return_token_ids=flag(body, "return_token_ids", False),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
        add_special_tokens=flag(body, "add_special_tokens", not chat),
        length_penalty=float(_num(body, "length_penalty", 1.0, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)))
    _check_beam_search(req)
    req.best_of = _best_of(body, req)
    return req


def _best_of(body: dict, req: ParsedRequest) -> int | None:
    best_of = _num(body, "best_of", None, 1, MAX_N, integer=True)
    if best_of is None or best_of == req.n:
        return None
    if req.chat:
        raise BadRequest("'best_of' is for /v1/completions", "best_of")
    if best_of < req.n:
        raise BadRequest(f"'best_of' ({best_of}) must be at least 'n' ({req.n})", "best_of")
    if req.stream:
        raise BadRequest("'best_of' answers once every candidate is done: it cannot be streamed", "best_of")
    if req.beam_search:
        raise BadRequest("with 'use_beam_search', 'n' is the beam width: leave 'best_of' out", "best_of")
    if req.prompts is not None and best_of * len(req.prompts) > MAX_N * MAX_N:
        raise BadRequest(f"a batch of {len(req.prompts)} prompts with best_of={best_of} samples "
                         f"{best_of * len(req.prompts)} choices; at most {MAX_N * MAX_N}", "best_of")
    return best_of


# What a beam search cannot honour: it ranks the model's own log-probabilities, and each of its steps
# is a request of one token after a beam (so nothing that depends on the output so far applies).
NOT_WITH_BEAM_SEARCH = (
    ("top_p", lambda r: r.top_p < 1.0), ("top_k", lambda r: r.top_k > 0), ("min_p", lambda r: r.min_p > 0),
    ("presence_penalty", lambda r: r.presence_penalty), ("frequency_penalty", lambda r: r.frequency_penalty),
    ("repetition_penalty", lambda r: r.repetition_penalty != 1.0), ("logit_bias", lambda r: r.logit_bias),
    ("allowed_token_ids", lambda r: r.allowed_token_ids is not None), ("bad_words", lambda r: r.bad_words),
    ("min_tokens", lambda r: r.min_tokens), ("response_format", lambda r: r.structured is not None),
)


def _check_beam_search(req: ParsedRequest) -> None:
    if not req.beam_search:
        if req.length_penalty != 1.0:
            raise BadRequest("'length_penalty' is for a beam search (\"use_beam_search\": true)", "length_penalty")
        return
    if req.n > MAX_BEAM_WIDTH:
        raise BadRequest(f"with 'use_beam_search', 'n' is the beam width: at most {MAX_BEAM_WIDTH}, got {req.n}", "n")
    if req.max_tokens == 0:
        raise BadRequest("a beam search generates: 'max_tokens' must be at least 1", "max_tokens")
    for name, used in NOT_WITH_BEAM_SEARCH:
        if used(req):
            what = "a structured output (response_format, structured_outputs, guided_*, a required tool call)" \
                if name == "response_format" else f"'{name}'"
            raise BadRequest(f"a beam search ranks the model's own log-probabilities: {what} cannot apply to it "
                             "(leave it out)", name)


def _message(m) -> dict:
    """A chat message as the template sees it: ``role``, ``content`` (text; a list of text parts
    joined by newlines, as vLLM does) and ``name`` when given."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
        raise BadRequest("each message needs a string 'role'", "messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest("message content parts must be {\"type\": \"text\", \"text\": ...} (this server "
                             "takes text only)", "messages")
        content = "\n".join(p["text"] for p in content)
    elif content is None and m["role"] == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise BadRequest("each message needs a string 'content' (or a list of text parts)", "messages")
    out = {"role": m["role"], "content": content}
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    calls = m.get("tool_calls")
    if calls is not None and m["role"] == "assistant":
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), str) for c in calls):
            raise BadRequest("an assistant message's 'tool_calls' must be a list of {\"id\", \"type\": \"function\", "
                             "\"function\": {\"name\", \"arguments\": <JSON text>}}", "messages")
        # (templates take the arguments as an object, as vLLM gives them)
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _json_or_text(c["function"].get(
            "arguments", "{}"))}} for c in calls]
    return out


def _json_or_text(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


def _tools(body: dict, chat: bool):
    from engine.serve.tools import parse_tools

    if not chat:
        for name, off in (("tools", []), ("tool_choice", "none")):
            if body.get(name) is not None and body[name] != off:
                raise BadRequest(f"'{name}' is for /v1/chat/completions", name)
        return None
    return parse_tools(body)


def _template_kwargs(body: dict, tools) -> dict:
    """vLLM's ``chat_template_kwargs`` (``enable_thinking``, …), ``add_generation_prompt`` and the
    request's tools."""
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise BadRequest("'chat_template_kwargs' must be an object of names to values", "chat_template_kwargs")
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
                "unk_token", "pad_token"}
    if reserved & set(kw):
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(sorted(reserved & set(kw)))}",
                         "chat_template_kwargs")
    cont = flag(body, "continue_final_message", False)
    if cont and body.get("add_generation_prompt") is True:
        raise BadRequest("'continue_final_message' goes on with the last message: it takes no "
                         "'add_generation_prompt'", "continue_final_message")
    msgs = body.get("messages") or [{}]
    if cont and msgs[-1].get("role") != "assistant":
        raise BadRequest("'continue_final_message' needs an assistant message last", "continue_final_message")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        kw = {"reasoning_effort": effort, **kw}  # (the template's to use, as vLLM passes it; the kwargs win)
    return {**kw, "add_generation_prompt": flag(body, "add_generation_prompt", not cont),
            "continue_final_message": cont, "tools": list(tools.tools) if tools is not None else None}


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (JSON object keys, so strings) to biases in [-100, 100]."""
    v = body.get("logit_bias")
    if not v:
        return None
    bad = BadRequest(f"'logit_bias' must be an object of up to {MAX_LOGIT_BIAS_ENTRIES} token ids (as strings) "
                     f"to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", "logit_bias")
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad
    out = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10) or int(k) > UINT32_MAX or isinstance(b, bool) \
                or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise bad
        out[int(k)] = float(b)
    return out


def _allowed(body: dict) -> tuple[int, ...] | None:
    v = body.get("allowed_token_ids")
    if v is None:
        return None
    if not isinstance(v, list) or not 0 < len(v) <= MAX_ALLOWED_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in v):
        raise BadRequest(f"'allowed_token_ids' must be a non-empty list of up to {MAX_ALLOWED_TOKEN_IDS} token ids",
                         "allowed_token_ids")
    return tuple(v)


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def _structured(body: dict) -> tuple[str, str] | None:
    """The grammar a request asks its output to follow, from OpenAI's ``response_format``
    (``json_object``; ``json_schema`` with its ``schema``), vLLM's ``structured_outputs`` (one of
    ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) or vLLM's older ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one of them."""
    given = [f for f in STRUCTURED_FIELDS if body.get(f) is not None
             and not (f == "response_format" and isinstance(body[f], dict) and body[f].get("type") == "text")]
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(f"give one way of structuring the output, not {' and '.join(map(repr, given))}", given[1])
    field, v = given[0], body[given[0]]
    if field == "response_format":
        kind = v.get("type") if isinstance(v, dict) else None
        if kind == "json_object":
            return "json_object", ""
        schema = v.get("json_schema") if kind == "json_schema" else None
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                             field)
        return "json", json.dumps(schema["schema"])
    if field == "structured_outputs":
        if not isinstance(v, dict):
            raise BadRequest("'structured_outputs' must be an object", field)
        set_ = {k: x for k, x in v.items() if x is not None and x is not False}
        unknown = set(set_) - {"json", "json_object", "regex", "choice", "grammar"}
        if unknown or len(set_) != 1:
            raise BadRequest("'structured_outputs' takes exactly one of json, json_object, regex, choice, grammar"
                             + (f" (not {', '.join(sorted(unknown))})" if unknown else ""), field)
        (kind, v), = set_.items()
        if kind == "json_object":
            if v is not True:
                raise BadRequest("'structured_outputs.json_object' must be true", field)
            return "json_object", ""
    else:
        kind = field.removeprefix("guided_")
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                v = None
        if not isinstance(v, dict):
            raise BadRequest(f"'{field}' needs a JSON schema (an object, or its JSON text)", field)
        return "json", json.dumps(v)
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise BadRequest(f"'{field}' needs a non-empty list of non-empty strings", field)
        return "choice", json.dumps(v)
    if not isinstance(v, str) or not v:
        raise BadRequest(f"'{field}' needs a non-empty string ({kind})", field)
    return kind, v


def _bad_words(body: dict) -> tuple[str, ...]:
    v = body.get("bad_words") or []
    if not isinstance(v, list) or len(v) > MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip() for w in v):
        raise BadRequest(f"'bad_words' must be a list of up to {MAX_BAD_WORDS} non-blank strings", "bad_words")
    return tuple(v)


def bad_words_ids(words: tuple[str, ...], tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell each word, as vLLM bans them: the word alone, and after a
    space where that is another token of its own (BPE vocabularies: " word" is not "word")."""
    out: list[tuple[int, ...]] = []
    for w in words:
        alone = tuple(tokenizer.encode(w.lstrip()))
        spaced = tuple(tokenizer.encode(" " + w.lstrip()))
        out.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; ``reasoning_tokens`` (with a reasoning parser): the completion tokens that were
    reasoning (``completion_tokens_details``)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def logprobs_body(req: ParsedRequest, tokens: list[int], lps: list[TokenLogprobs | None], tokenizer,
                  offset: int = 0) -> dict | None:
    """A choice's ``logprobs`` for ``tokens`` (None unless asked for). Tokens are shown as their
    text (``tokenizer.decode([id])``), as vLLM does. Completions: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the top ``logprobs`` and the chosen token, by text) and ``text_offset`` from
    ``offset`` (an echoed prompt's first token, predicted by nothing, has ``null`` logprobs); chat:
    ``content``, a list of ``{token, logprob, bytes, top_logprobs}``, ``bytes`` the token's own
    (``tokenizer.token_bytes``: a byte of a multi-byte character alone)."""
    if req.logprobs is None:
        return None
    text = {}

    def t(i: int) -> str:
        if i not in text:
            text[i] = tokenizer.decode([i])
        return text[i]

    if req.chat:
        def entry(i: int, lp: float) -> dict:
            return {"token": t(i), "logprob": lp, "bytes": list(tokenizer.token_bytes(i))}

        return {"content": [{**entry(i, lp.logprob), "top_logprobs": [entry(j, v) for j, v in lp.top]}
                            for i, lp in zip(tokens, lps)]}
    offsets = []
    for i in tokens:
        offsets.append(offset)
        offset += len(t(i))
    return {"tokens": [t(i) for i in tokens], "token_logprobs": [lp and lp.logprob for lp in lps],
            "top_logprobs": [lp and {**{t(j): v for j, v in lp.top}, t(i): lp.logprob} for i, lp in zip(tokens, lps)],
            "text_offset": offsets}


def prompt_logprobs_body(prompt: list[int], lps: list[TokenLogprobs], k: int, tokenizer) -> list:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (predicted by nothing), then for
    each the token's own and the ``k`` likeliest at its place, keyed by token id (as text), each
    ``{"logprob", "rank", "decoded_token"}`` (rank 1: the likeliest)."""
    text = {}

    def entry(i: int, lp: float, rank: int | None) -> dict:
        if i not in text:
            text[i] = tokenizer.decode([i])
        return {"logprob": lp, "rank": rank, "decoded_token": text[i]}

    out: list = [None]
    for tok, lp in zip(prompt[1:], lps):
        place = {str(tok): entry(tok, lp.logprob, lp.rank)}
        for rank, (j, v) in enumerate(lp.top[:k], 1):
            place.setdefault(str(j), entry(j, v, rank))
        out.append(place)
    return out


def full_response(req: ParsedRequest, rid: str, model: str, choices: list[tuple], use: dict,
                  reasoning: list | None = None, prompt_logprobs: list | None = None) -> dict:
    """The whole answer; ``choices``: (text, finish reason, logprobs[, tool calls]) of each, in
    index order (chat with tools or reasoning: the text is the content, None when there is none);
    ``reasoning``: each chat choice's reasoning (with a reasoning parser); ``prompt_logprobs``:
    each choice's ``prompt_logprobs_body`` (chat: one for the response, its prompt's)."""
    if req.chat:
        out = []
        for i, (text, reason, logprobs, *calls) in enumerate(choices):
            msg = {"role": "assistant", "content": text}
            if reasoning is not None:  # (vLLM's field, and its old name, which DeepSeek's API uses)
                msg["reasoning"] = msg["reasoning_content"] = reasoning[i]
            if req.tools is not None:
                msg["tool_calls"] = calls[0] if calls else []
            out.append({"index": i, "message": msg, "finish_reason": reason, "logprobs": logprobs})
        obj = "chat.completion"
    else:
        out = [{"index": i, "text": text, "finish_reason": reason, "logprobs": logprobs}
               for i, (text, reason, logprobs) in enumerate(choices)]
        for choice, plps in zip(out, prompt_logprobs or ()):
            choice["prompt_logprobs"] = plps
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": out, "usage": use}
    if req.chat and prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs[0]
    return body


def stream_chunk(req: ParsedRequest, rid: str, model: str, text: str | None, reason: str | None,
                 first: bool = False, use: dict | None = None, logprobs: dict | None = None, index: int = 0,
                 tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    """One chunk of a stream; ``reasoning``: a chat chunk of the reasoning (no content)."""
    if use is not None:
        return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [], "usage": use}
    if req.chat and reasoning is not None:
        delta = {"role": "assistant"} if first else {}
        delta["reasoning"] = delta["reasoning_content"] = reasoning
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    elif req.chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
