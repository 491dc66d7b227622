"""OpenAI tool calling for the chat endpoint.

The request's ``tools`` reach the chat template (the model sees them as it was trained to), and
``tool_choice`` says how calls come out:

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is held to
  that function's ``parameters`` schema (a structured output) and is the call's ``arguments``;
- ``"required"``: the output is held to a JSON list of one or more ``{"name", "parameters"}``
  objects, one of the tools each, and becomes those calls;
- ``"auto"`` (the default with tools): the model writes text, calls, or both, in its own format;
  the gateway's ``--tool-call-parser`` reads the calls out of it (``hermes``: JSON objects between
  ``<tool_call>`` and ``</tool_call>``, as Qwen 2.5/3 and Hermes models write them); the text
  before the first call is the message's content;
- ``"none"``: plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.serve.openai_protocol import BadRequest

PARSERS = ("hermes",)
TOOL_CALL_TAG = "<tool_call>"
"""Where the hermes format's calls begin (streaming holds the text back from there)."""
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]
    """As sent (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
    choice: str
    """``none``, ``auto``, ``required`` or ``named``."""
    name: str | None = None
    """The function, for ``named``."""

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
            return "json", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": one}})
        return None


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool choice (None: no tools), or BadRequest naming what is wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
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
        return ToolRequest(tuple(tools), choice or "auto")
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or fn.get("name") not in names:
        raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                         "\"function\": {\"name\": <one of the tools>}}", "tool_choice")
    return ToolRequest(tuple(tools), "named", fn["name"])


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def extract(req: ToolRequest, text: str, parser: str | None) -> tuple[str | None, list[dict]]:
    """The message's ``content`` and ``tool_calls`` from a choice's text. What does not parse as
    calls (an output cut by ``max_tokens``, a malformed call) stays text."""
    if req.choice == "named":
        return None, [_call(req.name, text)]
    if req.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(i["name"], i["parameters"]) for i in items]
    if req.choice != "auto" or parser != "hermes" or "<tool_call>" not in text:
        return text, []
    known = {t["function"]["name"] for t in req.tools}
    calls = []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in known:
            return text, []
        calls.append(_call(obj["name"], obj.get("arguments", {})))
    content = text[:text.index("<tool_call>")].rstrip()
    return content or None, calls
