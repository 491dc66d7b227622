"""Model presets with real shapes and vLLM-style hf_overrides: shapes, namespaces, the CLI flag."""

import argparse

import pytest

from engine.config import EngineConfig
from engine.model_runner import load_model_config
from kvstore.cli import add_config_args, config_from_args


def _kv_bytes_per_token(mc, elem: int = 2) -> int:
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem


def test_real_model_shapes():
    llama = load_model_config("random:llama3-8b")
    # Llama-3-8B's KV cache is 128 KiB per token in bf16: 32 layers x (K,V) x 8 heads x 128 x 2 B
    assert _kv_bytes_per_token(llama) == 131072
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads) == (4096, 14336, 32)
    assert llama.model_type == "llama" and llama.rope_theta == 500000.0
    qwen = load_model_config("random:qwen2-7b")
    # Qwen2-7B: 28 layers x 2 x 4 KV heads x 128 x 2 B = 57,344 B per token
    assert _kv_bytes_per_token(qwen) == 57344
    assert qwen.model_type == "qwen2" and qwen.attention_bias and qwen.hidden_size == 3584


def test_overrides_cut_depth_and_rename_the_model():
    cut = load_model_config("random:llama3-8b", {"num_hidden_layers": 8})
    assert cut.num_hidden_layers == 8 and cut.hidden_size == 4096
    assert _kv_bytes_per_token(cut) == 32768  # 8 x 2 x 8 x 128 x 2 B
    assert cut.name != load_model_config("random:llama3-8b").name  # its chunks are never a full model's


@pytest.mark.parametrize("bad, msg", [({"num_layers": 8}, "unknown field"),
                                      ({"num_hidden_layers": "8"}, "must be int"),
                                      ({"num_hidden_layers": 0}, "must be positive"),
                                      ({"rope_theta": "x"}, "must be float")])
def test_bad_overrides_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_model_config("random:tiny", bad)


def test_a_cut_model_never_reads_the_full_models_chunks(tmp_path):
    from engine.llm import LLM
    from tests.helpers import store_nodes

    gen = store_nodes(tmp_path, with_disk=False)
    make = next(gen)
    try:
        node = make()
        prompt = list(range(3, 100))
        with LLM(model="random:tiny", store=node.address, chunk_tokens=32, enable_prefix_caching=False) as full:
            assert full.generate(prompt, max_tokens=2)[0].num_cached_tokens == 0
            assert full.generate(prompt, max_tokens=2)[0].num_cached_tokens == 96
        with LLM(model="random:tiny", store=node.address, chunk_tokens=32, enable_prefix_caching=False,
                 hf_overrides={"num_hidden_layers": 1}) as cut:
            assert cut.engine.runner.model_config.num_hidden_layers == 1
            assert cut.generate(prompt, max_tokens=2)[0].num_cached_tokens == 0
            assert cut.generate(prompt, max_tokens=2)[0].num_cached_tokens == 96  # its own chunks
    finally:
        gen.close()


def test_hf_overrides_on_the_command_line():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_args(p, EngineConfig)
    cfg = config_from_args(EngineConfig, p.parse_args(["--model", "random:llama3-8b",
                                                       "--hf-overrides", '{"num_hidden_layers": 8}']))
    assert cfg.hf_overrides == {"num_hidden_layers": 8}
    assert config_from_args(EngineConfig, p.parse_args([])).hf_overrides is None
    for bad in ("{nope", "[8]"):
        with pytest.raises(argparse.ArgumentError, match="JSON"):
            p.parse_args(["--hf-overrides", bad])


def test_an_override_that_keeps_the_kv_shape_still_changes_the_namespace():
    from engine.config import EngineConfig
    from engine.llm_engine import model_identity

    base = EngineConfig(model="random:tiny", device="cpu")
    wider = EngineConfig(model="random:tiny", device="cpu", hf_overrides={"intermediate_size": 352})
    assert model_identity(base) == "random:tiny:seed=0"
    assert model_identity(wider) == 'random:tiny:seed=0{"intermediate_size":352}'
