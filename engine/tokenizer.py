"""Tokenizers: a folder's ``tokenizer.json`` through the ``tokenizers`` package, or bytes."""

from __future__ import annotations

import json
import logging
import os

from engine.config import BYTE_BOS, BYTE_EOS


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS (256) and EOS (257). For random models."""

    bos_token_id = BYTE_BOS
    eos_token_id = BYTE_EOS

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes as UTF-8; BOS/EOS dropped; any other id (a random model's vocabulary
        beyond bytes) shown as ``<|id|>`` so that no generated token is invisible."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if i not in (self.bos_token_id, self.eos_token_id):
                out.append(f"<|{i}|>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"

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

        def tok_id(name):
            v = cfg.get(name)
            v = v.get("content") if isinstance(v, dict) else v
            return self._tok.token_to_id(v) if isinstance(v, str) else None

        self.bos_token_id = tok_id("bos_token")
        self.eos_token_id = tok_id("eos_token")
        self.chat_template = cfg.get("chat_template")

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, i: int) -> bytes:
        """Token ``i``'s text as UTF-8 (a byte-level piece of a character shows as U+FFFD)."""
        return self.decode([i]).encode()

    def apply_chat_template(self, messages: list[dict]) -> str:
        # NOTE: Jinja chat templates need transformers; a plain role-tagged prompt
        # is used instead (documented in docs/engine.md).
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


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
