"""Our model's logits match Hugging Face transformers on the same random checkpoint (fp32)."""

import pytest
import torch

from tests.engine.reference import all_logits as _all_logits

transformers = pytest.importorskip("transformers")


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
