"""Crescent's engine: a Llama-family model over paged KV with chunked prefill and store reuse."""

from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM, RequestOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "EngineConfig", "ModelConfig"]
