"""OpenAI's Responses API (``POST /v1/responses``) over the chat endpoint.

A Responses request is a chat request written another way: ``input`` (a string, or a list of items:
messages with text parts, the model's earlier ``function_call``s and their ``function_call_output``s)
and ``instructions`` become the messages, ``tools`` (flat ``{"type": "function", "name", ...}``) the
chat tools, ``text.format`` the response format, ``max_output_tokens`` the token limit. The chat
machinery answers it (templates, structured outputs, tool-call parsers, reasoning parsers) and its
answer is written back as a Response: ``output`` items (``reasoning``, ``message`` with
``output_text``, ``function_call``), ``status`` (``incomplete`` when the token limit cut it),
``usage``. Streamed, the chat chunks become the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, …, ``response.completed``).

Responses are kept (``store``, true unless the request says false, as OpenAI's) in the gateway's
memory, the ``--max-stored-responses`` used last (``ResponseStore``): ``previous_response_id``
continues one (its conversation, each turn's input and output, then the new input; the earlier
``instructions`` are not carried over, as OpenAI's), ``GET /v1/responses/{id}`` reads one back,
``DELETE`` forgets it. With API keys a tenant reaches only its own. Refused: the built-in tools (web
search, file search, …), background responses.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict

from engine.serve.openai_protocol import REASONING_EFFORTS, UINT32_MAX, BadRequest, _num
from engine.serve.reasoning import END

log = logging.getLogger(__name__)

END_TAG = END.encode()

# Responses fields that mean the same as a chat request's, passed on as they are (OpenAI's, then the
# extensions the chat endpoint takes, as vLLM's Responses API does)
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed", "top_k", "min_p",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "ignore_eos", "cache_salt",
         "include_reasoning", "chat_template_kwargs", "chat_template", "logit_bias", "min_tokens", "stop_token_ids",
         "include_stop_str_in_output", "allowed_token_ids", "bad_words", "speculative", "truncate_prompt_tokens",
         "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "priority")
# Responses fields this server reads, or accepts at the value that changes nothing
_KNOWN = {*_SAME, "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "store",
          "previous_response_id", "metadata", "reasoning", "truncation", "include", "background", "top_logprobs"}
LOGPROBS = "message.output_text.logprobs"
"""The one ``include`` this server answers: the message text's tokens' logprobs."""


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content, field: str) -> str:
    """A message's content: a string, or text parts (``input_text``, ``output_text``, ``text``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'{field}' content must be a string or a list of input_text parts (this server takes text "
                     "only)", "input")


def _messages(body: dict, history: list[dict] | None = None) -> list[dict]:
    """``instructions``, the conversation so far (``history``) and ``input`` as chat messages
    (function calls and their outputs included)."""
    msgs = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise BadRequest("'instructions' must be a string", "instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    msgs += history or []
    return msgs + _items_as_messages(body.get("input"))


def _items_as_messages(items) -> list[dict]:
    """Input (or output) items as chat messages."""
    msgs: list[dict] = []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    for item in items:
        if not isinstance(item, dict):
            raise BadRequest("each 'input' item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest("an input message's 'role' must be user, system, developer or assistant", "input")
            msgs.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"),
                                                                                              "input")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise BadRequest("a function_call item needs string 'call_id', 'name' and 'arguments'", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)  # (parallel calls: one assistant message)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest("a function_call_output item needs a string 'call_id'", "input")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"),
                                                                                           "input")})
        elif kind == "reasoning":
            continue  # (an earlier turn's reasoning: chat templates leave it out, as they do for chat)
        else:
            raise BadRequest(f"input items of type {kind!r} are not supported by this server (message, "
                             "function_call, function_call_output, reasoning)", "input")
    return msgs


def to_chat(body, history: list[dict] | None = None, can_store: bool = False) -> dict:
    """The chat completions request that a Responses request is, or BadRequest naming the field.
    ``history``: the conversation its ``previous_response_id`` continues; ``can_store``: this
    gateway keeps responses."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in _KNOWN:
            raise BadRequest(f"'{name}' is not supported by this server's Responses API", name)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise BadRequest("'store' must be true or false", "store")
    if not can_store and body.get("store"):
        raise BadRequest("this gateway stores no responses (--max-stored-responses 0): send \"store\": false and "
                         "the whole conversation in 'input'", "store")
    if body.get("previous_response_id") is not None and history is None:
        raise BadRequest("this gateway stores no responses (--max-stored-responses 0): leave out "
                         "'previous_response_id' and send the whole conversation in 'input'", "previous_response_id")
    if body.get("background"):
        raise BadRequest("background responses are not supported by this server", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest("'truncation' must be \"disabled\" here (a prompt over the context is a 400)", "truncation")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or any(x != LOGPROBS for x in include)):
        raise BadRequest(f"'include' takes {LOGPROBS!r} only here", "include")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise BadRequest("'metadata' must be an object", "metadata")
    chat = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = _messages(body, history)
    if body.get("max_output_tokens") is not None:  # (checked here: an error names the field the client sent)
        chat["max_tokens"] = _num(body, "max_output_tokens", None, 1, UINT32_MAX, integer=True)
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("'tools' must be a list of tools", "tools")
        for t in tools:
            if t.get("type") != "function":
                raise BadRequest(f"tools of type {t.get('type')!r} (built-in tools) are not supported by this "
                                 "server; function tools are", "tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise BadRequest("'text' must be an object ({\"format\": ...})", "text")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None:
        chat["response_format"] = fmt
    wanted = body.get("reasoning")
    if wanted is not None and (not isinstance(wanted, dict) or any(
            v is not None for k, v in wanted.items() if k != "effort")):
        raise BadRequest("'reasoning' takes an effort (passed to the chat template as reasoning_effort); its other "
                         "options (summary) are not supported by this server", "reasoning")
    if wanted and wanted.get("effort") is not None:
        if wanted["effort"] not in REASONING_EFFORTS:
            raise BadRequest(f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning")
        chat["reasoning_effort"] = wanted["effort"]
    if wants_logprobs(body):  # (the chat request's own checks then apply to top_logprobs)
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def wants_logprobs(body: dict) -> bool:
    """The message text's logprobs are asked for: ``include`` names them, or ``top_logprobs`` is given."""
    return LOGPROBS in (body.get("include") or ()) or body.get("top_logprobs") is not None


def message_logprobs(entries: list[dict], reasoning_parser: bool, content: str | None) -> list[dict]:
    """Of a chat choice's logprobs (``{token, logprob, bytes, top_logprobs}`` per token, in order),
    those of the tokens that wrote its content: after the reasoning (with a reasoning parser: the
    tokens through the one that completes ``</think>``, as the usage counts them) and as many as
    write the content's bytes (tool calls after it are not the message's)."""
    start = 0
    if reasoning_parser:
        tail = b""  # (the last bytes, enough to hold the tag: each entry read once)
        for i, e in enumerate(entries):
            tail = tail[-(len(END_TAG) - 1):] + bytes(e.get("bytes") or ())
            if END_TAG in tail:
                start = i + 1
                break
        else:  # (never closed: all reasoning, unless there was none and all is content)
            start = 0 if content else len(entries)
    want, got, out = len((content or "").encode()), 0, []
    for e in entries[start:]:
        if got >= want:
            break
        out.append(e)
        got += len(e.get("bytes") or ())
    return out


def _usage(use: dict | None) -> dict | None:
    if use is None:
        return None
    details = use.get("completion_tokens_details") or {}
    return {"input_tokens": use["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": use["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": use["total_tokens"]}


def _shell(body: dict, rid: str, created: int, status: str) -> dict:
    """A Response's fields around its output (``output``, ``usage`` and the status set by the caller)."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": body.get("model"), "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "store": bool(body.get("store")),
            "temperature": body.get("temperature", 1.0), "text": {"format": fmt or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_logprobs": body.get("top_logprobs"),
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": None, "user": body.get("user"),
            "metadata": body.get("metadata") or {}}


def _finish(resp: dict, reason: str | None) -> dict:
    if reason == "length":
        resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"
    return resp


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def from_chat(body: dict, chat: dict, reasoning_parser: bool = False) -> dict:
    """The Response for a chat completion (one choice) answering ``to_chat(body)`` (``reasoning_parser``:
    the gateway splits reasoning off)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    resp = _shell(body, _id("resp"), chat["created"], "completed")
    if msg.get("reasoning"):
        resp["output"].append(_reasoning_item(msg["reasoning"]))
    if msg.get("content"):
        resp["output"].append(_message_item(msg["content"]))
        if choice.get("logprobs"):
            resp["output"][-1]["content"][0]["logprobs"] = message_logprobs(
                choice["logprobs"]["content"], reasoning_parser, msg["content"])
    resp["output"] += [_call_item(c) for c in msg.get("tool_calls") or []]
    resp["usage"] = _usage(chat.get("usage"))
    return _finish(resp, choice["finish_reason"])


class StreamEvents:
    """Turns the chat chunks of a streamed answer into Responses events (server-sent events with
    an ``event:`` line): an output item opens when its first delta comes and closes when another
    kind begins or the answer ends; ``response.completed`` carries the whole Response."""

    def __init__(self, body: dict, reasoning_parser: bool = False) -> None:
        self.body = body
        self.reasoning_parser = reasoning_parser
        self.entries: list[dict] = []  # every token's logprobs so far (when asked for)
        self.logprobs_sent = 0  # of the message's, those sent in its deltas
        self.resp = _shell(body, _id("resp"), int(time.time()), "in_progress")
        self.seq = 0
        self.open: dict | None = None  # the item being written: its dict and its kind's key
        self.calls: dict[int, dict] = {}  # chat tool-call index: its function_call item
        self.reason: str | None = None

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=dict(self.resp)),
                self._event("response.in_progress", response=dict(self.resp))]

    def _open(self, item: dict) -> list[bytes]:
        out = self._close()
        self.resp["output"].append(item)
        self.open = item
        index = len(self.resp["output"]) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=_blank(item)))
        if item["type"] != "function_call":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_blank(item)["content"][0]))
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.resp["output"].index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {}
            if item["type"] == "message":
                part["logprobs"] = extra["logprobs"] = self._message_logprobs(part["text"])
            out += [self._event(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                **extra),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _delta(self, kind: str, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._open(_reasoning_item("", "in_progress") if kind == "reasoning"
                              else _message_item("", "in_progress"))
        item = self.open
        item["content"][0]["text"] += text
        extra = {}
        if kind == "message":  # (the logprobs of the message's tokens that came since its last delta)
            lps = self._message_logprobs(item["content"][0]["text"])
            extra["logprobs"], self.logprobs_sent = lps[self.logprobs_sent:], len(lps)
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        return out + [self._event(event, item_id=item["id"], output_index=self.resp["output"].index(item),
                                  content_index=0, delta=text, **extra)]

    def _message_logprobs(self, text: str) -> list[dict]:
        return message_logprobs(self.entries, self.reasoning_parser, text) if wants_logprobs(self.body) else []

    def chunk(self, obj: dict) -> list[bytes]:
        """The events of one chat chunk."""
        if not obj.get("choices"):  # the usage chunk
            self.resp["usage"] = _usage(obj.get("usage"))
            return []
        choice = obj["choices"][0]
        delta, out = choice.get("delta") or {}, []
        self.entries += (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning"):
            out += self._delta("reasoning", delta["reasoning"])
        if delta.get("content"):
            out += self._delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            item = self.calls.get(call["index"])
            piece = call["function"].get("arguments") or ""
            if item is None:
                item = self.calls[call["index"]] = _call_item(call, "in_progress")
                item["arguments"] = ""
                out += self._open(item)
            elif self.open is not item:  # (another item came between: this call's pieces go on apart)
                out += self._close()
                self.open = item
            item["arguments"] += piece
            if piece:
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.resp["output"].index(item), delta=piece))
        if choice.get("finish_reason"):
            self.reason = choice["finish_reason"]
        return out

    def end(self) -> list[bytes]:
        """The events closing the answer (the last item, then ``response.completed`` or, cut by
        the token limit, ``response.incomplete``)."""
        out = self._close()
        _finish(self.resp, self.reason)
        kind = "response.completed" if self.resp["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.resp)]

    def error(self, err: dict) -> list[bytes]:
        return [self._event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))]


def _blank(item: dict) -> dict:
    """An item as it is announced, before its text or arguments."""
    item = json.loads(json.dumps(item))
    if item["type"] == "function_call":
        item["arguments"] = ""
    else:
        item["content"][0]["text"] = ""
    item["status"] = "in_progress"
    return item


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``: the
    ``max_items`` used last (each use refreshes a response and those it continues), in memory, and
    no more than ``max_bytes`` of them (each counted as its response and turn in JSON: a long-context
    model's conversations are MiBs each; one larger than all of ``max_bytes`` is not kept).
    Each keeps its own turn (its input and output as chat messages) and the id it continues, so a
    conversation costs its length once, not once per turn. ``owner``: the tenant (None without API
    keys); another owner's responses are as absent as unknown ones."""

    def __init__(self, max_items: int, max_bytes: int = 256 << 20) -> None:
        if max_items < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_items}")
        if max_bytes <= 0:
            raise ValueError(f"the responses' memory must be > 0 bytes, got {max_bytes}")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple] = OrderedDict()  # id: (owner, response, parent id, turn, bytes)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, owner, parent: str | None, body: dict) -> None:
        """Keeps ``response`` (the answer to the Responses request ``body``)."""
        if not self.max_items:
            return
        turn = _items_as_messages(body.get("input")) + (_items_as_messages(response["output"])
                                                         if response["output"] else [])
        text = json.dumps(response)
        size = len(text) + len(json.dumps(turn))
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self.num_bytes -= old[4]
            if size > self.max_bytes:
                log.warning("response %s not kept: %d bytes, over the %d kept in all", response["id"], size,
                            self.max_bytes)
                return
            self._items[response["id"]] = (owner, json.loads(text), parent, turn, size)
            self.num_bytes += size
            while len(self._items) > self.max_items or self.num_bytes > self.max_bytes:
                self.num_bytes -= self._items.popitem(last=False)[1][4]

    def get(self, rid: str, owner) -> dict | None:
        with self._lock:
            entry = self._items.get(rid)
            if entry is None or entry[0] != owner:
                return None
            self._items.move_to_end(rid)
            return entry[1]

    def history(self, rid: str, owner) -> list[dict]:
        """The conversation response ``rid`` ends: each turn's input and output, oldest first;
        BadRequest when it, or one it continues, is not kept (or not ``owner``'s)."""
        turns = []
        with self._lock:
            at = rid
            while at is not None:
                entry = self._items.get(at)
                if entry is None or entry[0] != owner:
                    which = "" if at == rid else f" (the response {at!r} it continues is no longer kept)"
                    raise BadRequest(f"no stored response {rid!r}{which}: send the whole conversation in 'input'",
                                     "previous_response_id")
                self._items.move_to_end(at)
                turns.append(entry[3])
                at = entry[2]
        return [m for turn in reversed(turns) for m in turn]

    def delete(self, rid: str, owner) -> bool:
        with self._lock:
            entry = self._items.get(rid)
            if entry is None or entry[0] != owner:
                return False
            del self._items[rid]
            self.num_bytes -= entry[4]
            return True
