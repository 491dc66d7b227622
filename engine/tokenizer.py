"""Tokenizers: a folder's ``tokenizer.json`` through the ``tokenizers`` package, or bytes."""

from __future__ import annotations

import json
import logging
import os

from engine.chat_template import ChatTemplate, load_chat_template
from engine.config import BYTE_BOS, BYTE_EOS


def plain_chat_prompt(messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                      **_) -> str:
    """``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n``: for models without a template.
    ``continue_final_message``: the last message left open (its text goes on)."""
    if continue_final_message:
        *head, last = messages
        return plain_chat_prompt(head, False) + f"<|{last['role']}|>\n{last['content']}"
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + (
        "<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS (256) and EOS (257). For random models."""

    bos_token_id = BYTE_BOS
    eos_token_id = BYTE_EOS
    special_tokens: dict[str, str] = {}
    """The special tokens' strings a chat template is rendered with (none: they are not bytes)."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Bytes as UTF-8; BOS/EOS dropped (``skip_special_tokens``, else shown as the others); any
        other id (a random model's vocabulary beyond bytes) shown as ``<|id|>`` so that no generated
        token is invisible."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if not skip_special_tokens or i not in (self.bos_token_id, self.eos_token_id):
                out.append(f"<|{i}|>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return plain_chat_prompt(messages, **kwargs)

    def encode_chat(self, messages: list[dict], template: ChatTemplate | None = None, **kwargs) -> list[int]:
        """The plain role-tagged prompt with BOS, or what ``template`` writes (a request's)."""
        if template is not None:
            return self.encode(template.render(messages, **kwargs))
        return self.encode(plain_chat_prompt(messages, **kwargs), add_bos=True)

    def token_bytes(self, i: int) -> bytes:
        """Token ``i``'s own bytes (a byte of a multi-byte character alone, unlike ``decode``)."""
        return bytes([i]) if 0 <= i < 256 else self.decode([i]).encode()


class HFTokenizer:
    """A ``tokenizer.json`` (and ``tokenizer_config.json`` for BOS/EOS and the chat template)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)

        def tok_str(name):
            v = cfg.get(name)
            v = v.get("content") if isinstance(v, dict) else v
            return v if isinstance(v, str) else None

        def tok_id(name):
            v = tok_str(name)
            return self._tok.token_to_id(v) if v is not None else None

        self.bos_token_id = tok_id("bos_token")
        self.eos_token_id = tok_id("eos_token")
        source = load_chat_template(path, cfg)
        self.special_tokens = {n: v for n in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (v := tok_str(n)) is not None}
        """The special tokens' strings a chat template is rendered with."""
        self.chat_template = ChatTemplate(source, self.special_tokens) if source else None
        """The checkpoint's own (engine/chat_template.py); None: the plain role-tagged one."""

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """Token ``i``'s text as UTF-8 (a byte-level piece of a character shows as U+FFFD)."""
        return self.decode([i]).encode()

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        """The prompt text of a conversation: the checkpoint's template (``kwargs`` reach it:
        ``tools``, ``enable_thinking``, …), or without one the plain role-tagged prompt."""
        if self.chat_template is None:
            return plain_chat_prompt(messages, **kwargs)
        return self.chat_template.render(messages, **kwargs)

    def encode_chat(self, messages: list[dict], template: ChatTemplate | None = None, **kwargs) -> list[int]:
        """A conversation's prompt ids, through ``template`` (a request's) or the checkpoint's. A
        template writes its own BOS (or none, as ChatML's): its text is encoded as is, the special
        tokens in it as themselves."""
        template = template or self.chat_template
        if template is None:
            return self.encode(plain_chat_prompt(messages, **kwargs), add_bos=True)
        return self.encode(template.render(messages, **kwargs))


def load_tokenizer(model: str, require: bool = False):
    """The model folder's ``tokenizer.json``; UTF-8 bytes for a ``random:`` preset, and (with a
    warning) for a folder without one, unless ``require``.

    Raises:
        ValueError: ``model`` is neither a preset nor a folder; or ``require`` and no tokenizer.json.
    """
    if model.startswith("random:"):
        return ByteTokenizer()
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a random:* preset nor a checkpoint folder")
    if os.path.exists(os.path.join(model, "tokenizer.json")):
        return HFTokenizer(model)
    if require:
        raise ValueError(f"no tokenizer.json in {model} (a Hugging Face fast tokenizer is needed to encode text)")
    logging.getLogger(__name__).warning("no tokenizer.json in %s: text is encoded as UTF-8 bytes", model)
    return ByteTokenizer()
