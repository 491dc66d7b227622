"""Our model's logits match Hugging Face transformers on the same random checkpoint (fp32)."""

import pytest
import torch

from engine.config import EngineConfig
from engine.model import AttnMetadata
from engine.model_runner import ModelRunner, load_model_config

transformers = pytest.importorskip("transformers")


def _all_logits(folder: str, ids: list[int], chunk: int | None = None, hf_overrides=None) -> torch.Tensor:
    cfg = EngineConfig(model=folder, dtype="float32", device="cpu", num_pages=64, hf_overrides=hf_overrides)
    runner = ModelRunner(cfg, load_model_config(folder, hf_overrides))
    n = len(ids)
    pages = list(range(-(-n // cfg.page_size)))
    table = torch.tensor([pages], dtype=torch.int32)
    out = []
    step = chunk or n
    for start in range(0, n, step):
        end = min(n, start + step)
        meta = AttnMetadata(
            positions=torch.arange(start, end),
            slot_mapping=torch.tensor([pages[p // 16] * 16 + p % 16 for p in range(start, end)]),
            block_tables=table, cu_q_lens=torch.tensor([0, end - start], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32), is_decode=end - start == 1,
            max_q_len=end - start)
        hidden = runner.model(torch.tensor(ids[start:end]), meta, runner.kv_caches)
        out.append(runner.model.logits(hidden))
    return torch.cat(out)


def _save(model_cls, cfg_cls, tmp_path, **kw):
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **kw)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # spread the weights so logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
            else:  # norm weights and biases away from their defaults, to test them too
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama3-rope-tied": ("LlamaForCausalLM", "LlamaConfig", {
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}}),
    "qwen2-bias": ("Qwen2ForCausalLM", "Qwen2Config", {"rope_theta": 1000000.0}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model_cls, cfg_cls, kw = CASES[case]
    hf = _save(getattr(transformers, model_cls), getattr(transformers, cfg_cls), tmp_path, **kw)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _all_logits(str(tmp_path), ids)
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    print(f"{case}: max abs logit error {err:.2e}, logit scale {ref.abs().max().item():.2f}")
    assert err < 1e-4 * max(1.0, ref.abs().max().item()), f"max abs error {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # chunked prefill over the paged history gives the same logits
    chunked = _all_logits(str(tmp_path), ids, chunk=48)
    assert (chunked - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_a_checkpoint_cut_by_hf_overrides_matches_transformers_cut_the_same_way(tmp_path):
    """hf_overrides={"num_hidden_layers": 1} keeps the first layer of a 2-layer checkpoint,
    as transformers does when told the same at load time."""
    _save(transformers.LlamaForCausalLM, transformers.LlamaConfig, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, num_hidden_layers=1).eval()
    assert len(hf.model.layers) == 1
    ids = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _all_logits(str(tmp_path), ids, hf_overrides={"num_hidden_layers": 1})
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    full = _all_logits(str(tmp_path), ids)
    assert (full - ours).abs().max().item() > 1e-2  # the second layer was really dropped
