"""OpenAI tool calling for the chat endpoint.

The request's ``tools`` reach the chat template (the model sees them as it was trained to), and
``tool_choice`` says how calls come out:

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is held to
  that function's ``parameters`` schema (a structured output) and is the call's ``arguments``;
- ``"required"``: the output is held to a JSON list of one or more ``{"name", "parameters"}``
  objects, one of the tools each, and becomes those calls;
- ``"auto"`` (the default with tools): the model writes text, calls, or both, in its own format;
  the gateway's ``--tool-call-parser`` reads the calls out of it: ``hermes`` (JSON objects between
  ``<tool_call>`` and ``</tool_call>``, as Qwen 2.5/3 and Hermes models write them; the text
  before the first call is the message's content), ``llama3_json`` (Llama 3.x/4: the output is
  JSON objects ``{"name", "parameters"}``) or ``pythonic`` (Llama 3.2/4: the output is a list of
  Python calls with keyword arguments);
- ``"none"``: plain text.

``parallel_tool_calls: false`` keeps a choice to one call ("required" is held to a list of one;
with "auto" the calls after the first are dropped, as vLLM does).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from engine.serve.openai_protocol import BadRequest, flag, tag_tail

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]
    """As sent (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
    choice: str
    """``none``, ``auto``, ``required`` or ``named``."""
    name: str | None = None
    """The function, for ``named``."""
    parallel: bool = True
    """``parallel_tool_calls``: false keeps a choice to one call at most."""

    def schema(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def structured(self) -> tuple[str, str] | None:
        """The grammar the output follows (``SamplingParams.structured``), or None."""
        if self.choice == "named":
            return "json", json.dumps(self.schema(self.name))
        if self.choice == "required":
            one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "parameters": self.schema(t["function"]["name"])},
                    "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            return "json", json.dumps({"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                                       "items": {"anyOf": one}})
        return None


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool choice (None: no tools), or BadRequest naming what is wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = flag(body, "parallel_tool_calls", True)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of up to {MAX_TOOLS} tools", "tools")
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not re.fullmatch(r"[\w.-]{1,64}",
                                                                                              fn["name"]):
            raise BadRequest("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                             "\"parameters\": {...}}} with a name of letters, digits, _, . or - (64 at most)", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"the parameters of tool {fn['name']!r} must be a JSON schema object", "tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise BadRequest("tool names must be unique", "tools")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tuple(tools), choice or "auto", parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or fn.get("name") not in names:
        raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                         "\"function\": {\"name\": <one of the tools>}}", "tool_choice")
    return ToolRequest(tuple(tools), "named", fn["name"], parallel)


def tool_call(name: str, arguments) -> dict:
    """An OpenAI tool call (a fresh ``call_…`` id); ``arguments`` as JSON text, or an object."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


class ToolParser:
    """Reads a model's own tool-call format (``tool_choice: auto``)."""

    def calls(self, text: str, known: set[str]) -> tuple[str | None, list[tuple[str, dict]]] | None:
        """The content and the calls (name, arguments) in ``text``; None where it holds no calls,
        or calls that do not parse or name a tool not offered (the whole text is then content)."""
        raise NotImplementedError

    def streamable(self, pending: str, started: bool) -> tuple[int, bool]:
        """Streaming: of ``pending`` (the text not streamed yet; ``started``: some content was),
        how much may stream as content now, and whether a call has begun (the rest is then held
        for ``calls``)."""
        raise NotImplementedError


class Hermes(ToolParser):
    """JSON ``{"name", "arguments"}`` between ``<tool_call>`` and ``</tool_call>`` (Qwen 2.5/3,
    Hermes); the text before the first call is the content."""

    TAG = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def calls(self, text, known):
        if self.TAG not in text:
            return None
        out = []
        for m in self._CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                return None
            if not isinstance(obj, dict) or obj.get("name") not in known:
                return None
            out.append((obj["name"], obj.get("arguments", {})))
        return text[:text.index(self.TAG)].rstrip() or None, out

    def streamable(self, pending, started):
        at = pending.find(self.TAG)
        if at >= 0:
            return at, True
        return len(pending) - tag_tail(pending, self.TAG), False


class _AtStart(ToolParser):
    """Formats whose calls are the whole output (leading whitespace aside): it begins with
    ``START`` or is content, decided by its first character."""

    START = ""

    def streamable(self, pending, started):
        if started:
            return len(pending), False
        head = pending.lstrip()
        if not head:
            return 0, False
        return (0, True) if head.startswith(self.START) else (len(pending), False)


class Llama3Json(_AtStart):
    """Llama 3.1/3.2/3.3 and 4's JSON calls: ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``), several separated by ``;``; their ``<|python_tag|>`` is a special token,
    gone from the text."""

    START = "{"

    def calls(self, text, known):
        s = text.strip()
        if not s.startswith("{"):
            return None
        dec, out, at = json.JSONDecoder(), [], 0
        while at < len(s):
            try:
                obj, at = dec.raw_decode(s, at)
            except ValueError:
                return None
            if not isinstance(obj, dict) or obj.get("name") not in known:
                return None
            args = obj.get("parameters", obj.get("arguments", {}))
            if not isinstance(args, dict):
                return None
            out.append((obj["name"], args))
            at = len(s) - len(s[at:].lstrip().removeprefix(";").lstrip())
        return None, out


class Pythonic(_AtStart):
    """Python-call lists, as Llama 3.2 (lightweight) and Llama 4 write them:
    ``[get_weather(city="paris", days=2), get_time(zone="utc")]``, keyword arguments of Python
    literals (read by ``ast.literal_eval``, never evaluated)."""

    START = "["

    def calls(self, text, known):
        s = text.strip()
        if not s.startswith("["):
            return None
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            out = []
            for call in tree.elts:
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                        and call.func.id in known and all(k.arg for k in call.keywords)):
                    return None
                out.append((call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords}))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None
        return None, out


PARSERS: dict[str, ToolParser] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "pythonic": Pythonic()}


def extract(req: ToolRequest, text: str, parser: str | None) -> tuple[str | None, list[dict]]:
    """The message's ``content`` and ``tool_calls`` from a choice's text. What does not parse as
    calls (an output cut by ``max_tokens``, a malformed call) stays text. Without parallel tool
    calls only the first call is kept."""
    if req.choice == "named":
        return None, [tool_call(req.name, text)]
    if req.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [tool_call(i["name"], i["parameters"]) for i in items[:None if req.parallel else 1]]
    if req.choice != "auto" or parser is None:
        return text, []
    got = PARSERS[parser].calls(text, {t["function"]["name"] for t in req.tools})
    if not got:
        return text, []
    content, calls = got
    return content, [tool_call(n, a) for n, a in calls[:None if req.parallel else 1]]
