"""Chat templates: a checkpoint's own Jinja template renders the messages, as the model was
trained to see them (Llama 3's headers, ChatML's ``<|im_start|>``, …).

The template comes from ``chat_template.jinja`` in the checkpoint folder or from
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the one named
``default``), or from a chat request (vLLM's ``chat_template``, on a gateway that trusts them). It
runs in Jinja's immutable sandbox with what Hugging Face templates expect: ``messages``,
``add_generation_prompt``, ``tools``, the special tokens' strings (``bos_token``, ``eos_token``, …),
``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that keeps non-ASCII text as is. A
template's own ``raise_exception`` (roles that do not alternate, a system message where none is
allowed) is a ValueError with its message: a bad request; so is anything else a template raises,
and a template that does not parse.
"""

from __future__ import annotations

import datetime
import json
import os


class ChatTemplateError(ValueError):
    """The template refused the conversation, or failed to render it."""


def load_chat_template(folder: str, config: dict) -> str | None:
    """The checkpoint's chat template, or None."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    return t if isinstance(t, str) and t else None


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _raise(message):
    raise ChatTemplateError(str(message))


class ChatTemplate:
    """A compiled template and the special tokens' strings it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except (jinja2.TemplateError, RecursionError, MemoryError) as exc:  # (nesting too deep: recursion)
            raise ChatTemplateError(f"the chat template does not parse: {type(exc).__name__}: {exc}") from None
        self.special_tokens = dict(special_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text. ``kwargs`` reach the template too (``enable_thinking``, …).
        ``continue_final_message``: the text stops where the final message's content does (what the
        template writes after it cut off), so that the model goes on with that message. Its end is
        found by a marker rendered after the content; a template that trims the content (the
        marker ends in a space) has the content's trailing spaces trimmed too."""
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": (messages[-1].get("content") or "") + _MARK}]
        try:
            text = self._template.render(**{**kwargs, **self.special_tokens}, messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt and not continue_final_message)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is code: whatever it raises (a division by zero,
            # a recursion, a range the sandbox refuses), it failed on these messages
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") \
                from None
        if continue_final_message:
            at = text.rfind(_MARK.strip())
            if at < 0:
                raise ChatTemplateError("continue_final_message: the chat template does not show the final "
                                        "message's content")
            text = text[:at] if text.startswith(_MARK, at) else text[:at].rstrip()
        return text


_MARK = "<|crescent:end-of-final-message|> "
