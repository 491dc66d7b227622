"""Crescent's engine: a Llama-family model over paged KV with chunked prefill and store reuse.

The names below load on first use (PEP 562): `crescent store`, `conductor` and `ctl` import
``engine.config`` for their flags and never need torch (~1.7 s to import, ~0.7 s more at exit).
"""

import importlib

_WHERE = {"EngineConfig": "engine.config", "ModelConfig": "engine.config", "LLM": "engine.llm",
          "RequestOutput": "engine.llm", "SamplingParams": "engine.sampling"}

__all__ = ["LLM", "RequestOutput", "SamplingParams", "EngineConfig", "ModelConfig"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
