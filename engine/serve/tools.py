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

A call's ``arguments`` are the JSON the model wrote (the pythonic format's literals turned to
JSON), cut short where the output was (its finish reason says so). Streamed, a call is named as
soon as its arguments begin and they follow in pieces as they are written (``CallStream``).
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


# Calls stream as the model writes them (vLLM's and OpenAI's way): a call's first delta once its
# name is read and its arguments have begun, then its arguments piece by piece, exactly as written.
# So a call is read from a prefix of the text and stays a call as the text grows: what the
# unstreamed answer holds is what the stream sent. The JSON formats are read by a small scanner
# that tolerates a text cut anywhere.

_WS = " \t\r\n"
_STRING_STOP = re.compile(r'["\\]')
_SCALAR = re.compile(r"[-+.\w]+")
DONE, CUT, BAD = "done", "cut", "bad"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value(s: str, i: int, memo: dict | None = None) -> tuple[int, str]:
    """The JSON value that begins at ``s[i]``: (where it ends, DONE), (len(s), CUT) where the text
    ends inside it, or (where it stops being JSON, BAD). Strings and containers are followed by
    their quotes and brackets; scalars in containers are not checked. ``memo``: where the scans of
    cut values stopped, for a text that only grows (a stream's), so that each piece is read once."""
    ch = s[i]
    if ch != '"' and ch not in "{[":
        m = _SCALAR.match(s, i)
        if m is None:
            return i, BAD
        return (m.end(), DONE) if m.end() < len(s) else (len(s), CUT)
    seen = memo.get(i) if memo is not None else None
    if seen is not None and len(seen) == 2:  # (ended before: a text that grows keeps it so)
        return seen
    j, depth, in_str = seen or ((i + 1, 0, True) if ch == '"' else (i, 0, False))
    end = _scan(s, j, depth, in_str)
    if memo is not None:
        memo[i] = end
    return end if len(end) == 2 else (len(s), CUT)


def _scan(s: str, j: int, depth: int, in_str: bool) -> tuple:
    """``_value``'s walk from ``s[j]`` (``depth`` brackets open, inside a string or not): (end,
    DONE or BAD), or where it stopped in a cut text, ``(j, depth, in_str)``."""
    while j < len(s):
        if in_str:  # (to the next quote or escape)
            m = _STRING_STOP.search(s, j)
            if m is None:
                j = len(s)
                break
            if m.group() == "\\":
                if m.end() >= len(s):  # (an escape cut in two: read it again with the next piece)
                    j = m.start()
                    break
                j = m.end() + 1
                continue
            in_str, j = False, m.end()
            if depth == 0:
                return j, DONE
            continue
        c = s[j]
        if c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1, DONE
        elif not (c in _WS or c in ",:" or c.isalnum() or c in "-+."):
            return j, BAD
        j += 1
    return j, depth, in_str


def _members(s: str, i: int, memo: dict | None = None) -> tuple[dict[str, tuple[int, int, str]], int, str]:
    """The members of the JSON object at ``s[i]`` (``{``) as far as they go: ``{key: (start, end,
    state)}`` of their values (a repeated key: its first), and the object's (end, state)."""
    members: dict[str, tuple[int, int, str]] = {}
    j = _skip_ws(s, i + 1)
    while True:
        if j >= len(s):
            return members, len(s), CUT
        if s[j] == "}":
            return members, j + 1, DONE
        if s[j] != '"':
            return members, j, BAD
        end, state = _value(s, j, memo)
        if state != DONE:
            return members, end, state
        key = s[j + 1:end - 1]
        j = _skip_ws(s, end)
        if j >= len(s):
            return members, len(s), CUT
        if s[j] != ":":
            return members, j, BAD
        j = _skip_ws(s, j + 1)
        if j >= len(s):
            return members, len(s), CUT
        end, state = _value(s, j, memo)
        members.setdefault(key, (j, end, state))
        if state != DONE:
            return members, end, state
        j = _skip_ws(s, end)
        if j < len(s) and s[j] == ",":
            j = _skip_ws(s, j + 1)
        elif j < len(s) and s[j] != "}":
            return members, j, BAD


_PENDING, _NOT_A_CALL = "pending", "not a call"


def _json_call(s: str, i: int, known: set[str], arg_keys: tuple[str, ...], memo: dict | None = None):
    """The call written as the JSON object at ``s[i]``: ((name, arguments as written so far), end,
    state), or _PENDING where the text ends before that is decided, or _NOT_A_CALL. A call is
    one once its name (one of ``known``) is read and its arguments have begun with ``{`` (or the
    object closed without them: ``{}``)."""
    if s[i] != "{":
        return _NOT_A_CALL
    members, end, state = _members(s, i, memo)
    name = members.get("name")
    if name is None or name[2] != DONE:
        return _PENDING if state == CUT else _NOT_A_CALL
    try:
        fn = json.loads(s[name[0]:name[1]])
    except ValueError:
        return _NOT_A_CALL
    if fn not in known:
        return _NOT_A_CALL
    args = next((members[k] for k in arg_keys if k in members), None)
    if args is None:
        if state == CUT:
            return _PENDING
        return (fn, "{}"), end, state
    if s[args[0]] != "{":
        return _NOT_A_CALL
    return (fn, s[args[0]:args[1]]), end, state


def _json_calls(s: str, i: int, known: set[str], arg_keys: tuple[str, ...], sep: str, final: bool,
                close: str = "", memo: dict | None = None):
    """Calls written as JSON objects from ``s[i]`` on, separated by ``sep`` (and ended by ``close``
    where given): ([(name, arguments)], where the text after them begins, or None). What follows
    the last call that is not one is that text; a call cut short ends the calls."""
    calls, j = [], i
    while True:
        got = _json_call(s, j, known, arg_keys, memo)
        if got is _PENDING:
            return calls, (j if final else None)
        if got is _NOT_A_CALL:
            return calls, j
        call, end, state = got
        calls.append(call)
        if state != DONE:
            return calls, None
        j = _skip_ws(s, end)
        if j < len(s) and s[j] == sep:
            j = _skip_ws(s, j + 1)
        if j >= len(s) or s[j] == close:
            return calls, None
        if s[j] != "{":
            return calls, j


class ToolParser:
    """Reads a model's own tool-call format (``tool_choice: auto``)."""

    def calls(self, text: str, known: set[str], final: bool = True,
              memo: dict | None = None) -> tuple[int, list[tuple[str, str]], int | None]:
        """The calls in ``text`` (or its prefix so far, when not ``final``): (where they begin,
        [(name, arguments as written)], where the text after them begins or None). The text before
        them is content, and the text after them (the two a line apart); with no calls the whole
        text is content. ``memo``: see ``_value``."""
        raise NotImplementedError

    def streamable(self, pending: str, started: bool) -> tuple[int, bool]:
        """Streaming: of ``pending`` (the text not streamed yet; ``started``: some content was),
        how much may stream as content now, and whether a call has begun (the rest is then held
        for ``calls``)."""
        raise NotImplementedError


class Hermes(ToolParser):
    """JSON ``{"name", "arguments"}`` between ``<tool_call>`` and ``</tool_call>`` (Qwen 2.5/3,
    Hermes); the text before the first call is the content, the text between calls is dropped,
    and from a call that is not one (no JSON, a tool not offered) on, the text is content too."""

    TAG = "<tool_call>"

    def calls(self, text, known, final=True, memo=None):
        head = text.find(self.TAG)
        if head < 0:
            return len(text), [], None
        calls, at = [], head
        while True:
            j = _skip_ws(text, at + len(self.TAG))
            if j >= len(text):
                return head, calls, (at if final else None)
            got = _json_call(text, j, known, ("arguments", "parameters"), memo)
            if got is _PENDING:
                return head, calls, (at if final else None)
            if got is _NOT_A_CALL:
                return head, calls, at
            call, end, state = got
            calls.append(call)
            if state == CUT:
                return head, calls, None
            at = text.find(self.TAG, end)
            if at < 0:
                return head, calls, None

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
    gone from the text. What follows the calls (not JSON, or a tool not offered) is content."""

    START = "{"

    def calls(self, text, known, final=True, memo=None):
        at = _skip_ws(text, 0)
        if at >= len(text) or text[at] != "{":
            return at, [], None
        return (at, *_json_calls(text, at, known, ("parameters", "arguments"), ";", final, memo=memo))


class Pythonic(_AtStart):
    """Python-call lists, as Llama 3.2 (lightweight) and Llama 4 write them:
    ``[get_weather(city="paris", days=2), get_time(zone="utc")]``, keyword arguments of Python
    literals (read by ``ast.literal_eval``, never evaluated), each call's arguments the JSON object
    of them. Read as the text grows: a call is named once its ``(`` is written, and its arguments
    follow one keyword at a time (``{"city": "paris"``, then ``, "days": 2``, then ``}``: a JSON
    object written left to right). From a call that is not one (a positional argument, a name
    that is not a literal, a tool not offered) on, the text is content; so is what follows the
    list. A list with no call is all content."""

    START = "["

    def calls(self, text, known, final=True, memo=None):
        at = _skip_ws(text, 0)
        if at >= len(text) or text[at] != "[":
            return len(text), [], None
        calls, rest = _py_calls(text, at + 1, known, final, memo)
        if not calls:
            return (len(text), [], None) if final or rest is not None else (at, [], None)
        return at, calls, rest


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PY_OPEN, _PY_CLOSE = "([{", ")]}"


def _py_value_end(s: str, i: int, memo: dict | None = None) -> int | None:
    """Where the Python literal that begins at ``s[i]`` ends (at the ``,`` or ``)`` after it, at
    depth 0; -1 at a stray closing bracket), or None where the text ends first. Quotes and brackets
    are followed; what is in between is for ``ast.literal_eval`` to judge. ``memo``: where the scan
    of a cut value stopped, resumed when the text has grown (a stream's: each piece read once)."""
    j, depth, quote = memo.get(("py", i), (i, 0, None)) if memo is not None else (i, 0, None)
    n = len(s)
    while j < n:
        if quote is not None:  # (to the next backslash or quote character)
            k = min((x for x in (s.find("\\", j), s.find(quote[0], j)) if x >= 0), default=-1)
            if k < 0:
                j = n
                break
            if s[k] == "\\":
                j = k + 2
            elif len(quote) == 3 and n - k < 3 and s[k:] == quote[0] * (n - k):
                j = k  # (two quotes of three so far: wait)
                break
            elif s.startswith(quote, k):
                j, quote = k + len(quote), None
            else:
                j = k + 1
            continue
        ch = s[j]
        if ch in "'\"":
            if n - j < 3 and s[j:] == ch * (n - j):
                break  # (one quote, or three? wait)
            quote = ch * 3 if s.startswith(ch * 3, j) else ch
            j += len(quote)
            continue
        if ch in _PY_OPEN:
            depth += 1
        elif ch in _PY_CLOSE:
            if depth == 0:
                return j if ch == ")" else -1
            depth -= 1
        elif ch == "," and depth == 0:
            return j
        j += 1
    if memo is not None:
        memo[("py", i)] = (j, depth, quote)
    return None


def _py_literal(s: str, j: int, end: int, memo: dict | None) -> str | None:
    """The JSON of the Python literal ``s[j:end]`` (None: not a literal JSON can hold)."""
    if memo is not None and ("pyv", j, end) in memo:
        return memo[("pyv", j, end)]
    try:
        out = json.dumps(ast.literal_eval(s[j:end].strip()), ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        out = None
    if memo is not None:
        memo[("pyv", j, end)] = out
    return out


def _py_calls(s: str, i: int, known: set[str], final: bool,
              memo: dict | None = None) -> tuple[list[tuple[str, str]], int | None]:
    """The calls of a pythonic list from ``s[i]`` (just past its ``[``): ([(name, arguments as JSON
    so far)], where the text after them begins, None while they may go on). A call is one once its
    first keyword argument is read (or it closed without any), as a JSON call is once its arguments
    began: a call the text cuts after that keeps the keywords read so far, and from a keyword that
    is not one on, the text is content."""
    calls: list[tuple[str, str]] = []
    while True:
        start = i = _skip_ws(s, i)
        if i < len(s) and s[i] == "]":
            return calls, i + 1  # (the list ends, after a trailing comma too)
        m = _NAME.match(s, i)
        if i >= len(s) or (m is not None and m.end() >= len(s)):  # the text ends before a name, or in it
            return calls, None if not final or i >= len(s) else start
        if m is None:
            return calls, start
        name, i = m.group(), _skip_ws(s, m.end())
        if i >= len(s):
            return calls, None if not final else start
        if s[i] != "(" or name not in known:
            return calls, start
        parts: list[str] = []
        seen: set[str] = set()

        def cut():  # (the text ends in the call: it is one if a keyword was read)
            if parts:
                return calls + [(name, "{" + ", ".join(parts))], None
            return calls, None if not final else start

        def bad():  # (not a keyword argument: from here on the text is content)
            if parts:
                return calls + [(name, "{" + ", ".join(parts))], here
            return calls, start

        i += 1
        while True:  # keyword arguments, up to the call's ")"
            here = i = _skip_ws(s, i)
            if i >= len(s):
                return cut()
            if s[i] == ")":
                calls.append((name, "{" + ", ".join(parts) + "}"))
                i += 1
                break
            k = _NAME.match(s, i)
            if k is None:
                return bad()
            j = _skip_ws(s, k.end())
            if j >= len(s):
                return cut()
            if s[j] != "=" or s.startswith("==", j) or k.group() in seen:
                return bad()
            j = _skip_ws(s, j + 1)
            end = _py_value_end(s, j, memo) if j < len(s) else None
            if end is None:
                return cut()
            if end < 0 or end == j:
                return bad()
            value = _py_literal(s, j, end, memo)
            if value is None:
                return bad()
            seen.add(k.group())
            parts.append(json.dumps(k.group()) + ": " + value)
            i = end + 1 if s[end] == "," else end
        i = _skip_ws(s, i)
        if i >= len(s):
            return calls, None if not final else len(s)
        if s[i] == "]":
            return calls, i + 1
        if s[i] != ",":
            return calls, i
        i += 1


PARSERS: dict[str, ToolParser] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "pythonic": Pythonic()}


def _calls(req: ToolRequest, text: str, parser: str | None, final: bool, memo: dict | None = None):
    """(where the calls begin, [(name, arguments)], where the text after them begins or None) of a
    choice's text, for "required" and "auto"; no calls for the other choices."""
    known = {t["function"]["name"] for t in req.tools}
    if req.choice == "required":  # the grammar's JSON list of {"name", "parameters"}
        at = _skip_ws(text, 0)
        if at >= len(text) or text[at] != "[":
            return at, [], None
        j = _skip_ws(text, at + 1)
        if j >= len(text):
            return at, [], None
        calls, rest = _json_calls(text, j, known, ("parameters",), ",", final, close="]", memo=memo)
    elif req.choice == "auto" and parser is not None:
        at, calls, rest = PARSERS[parser].calls(text, known, final, memo)
    else:
        return len(text), [], None
    return at, calls[:None if req.parallel else 1], rest


def extract(req: ToolRequest, text: str, parser: str | None) -> tuple[str | None, list[dict]]:
    """The message's ``content`` and ``tool_calls`` from a choice's text: each call's arguments
    as the model wrote them (cut short where the output was: its finish reason says so). Text
    with no calls is content; so is the text before them and after them (see the parsers).
    Without parallel tool calls only the first call is kept."""
    if req.choice == "named":
        return None, [tool_call(req.name, text)]
    at, calls, rest = _calls(req, text, parser, final=True)
    if not calls:
        return text, []
    content = "\n".join(part for part in (text[:at].rstrip(), _after(text, rest)) if part)
    return content or None, [tool_call(n, a) for n, a in calls]


def _after(text: str, rest: int | None) -> str:
    return text[rest:].strip() if rest is not None else ""


class CallStream:
    """A streamed choice's content and calls ("required", or "auto" with a parser) as its text
    grows. The content streams up to where a call may begin (the parser says; trailing whitespace
    is held too: the content before a call has none). A call's first delta carries its id and name
    with its arguments so far, the next ones the rest of its arguments as they are written. Joined,
    they are what ``extract`` gives for the whole text."""

    def __init__(self, req: ToolRequest, parser: str | None) -> None:
        self.req, self.parser = req, parser
        self.reader = PARSERS[parser] if req.choice == "auto" else None  # None: the text is all calls
        self.pending = ""  # the text not streamed as content: where a call may begin, trailing spaces
        self.calling = self.reader is None  # a call began: the rest is read as calls
        self.streamed = False  # some content was streamed
        self.sent: list[int] = []  # per call begun: how much of its arguments went out
        self._memo: dict = {}  # the scanner's place in cut values (once a call began, the text only grows)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content to stream now and the tool-call deltas (``index`` included) for the next
        piece of the choice's text; ``final``: it is the last."""
        self.pending += text
        out = ""
        if not self.calling:
            at, self.calling = self.reader.streamable(self.pending, self.streamed)
            out = self.pending[:at].rstrip()
            self.pending = self.pending[len(out):]
            self.streamed = self.streamed or bool(out)
        if not (self.calling or final):
            return out, []
        at, calls, rest = _calls(self.req, self.pending, self.parser, final, self._memo)
        deltas = []
        for k, (name, args) in enumerate(calls):
            if k == len(self.sent):
                deltas.append({"index": k, **tool_call(name, args)})
                self.sent.append(len(args))
            elif len(args) > self.sent[k]:
                deltas.append({"index": k, "function": {"arguments": args[self.sent[k]:]}})
                self.sent[k] = len(args)
        if final:  # what follows the calls is content (a line below the content before them); no calls: all is
            after = _after(self.pending, rest)
            out += (("\n" if self.streamed and after else "") + after) if self.sent else self.pending
        return out, deltas
