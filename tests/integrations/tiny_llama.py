"""A tiny random Llama and a word-level tokenizer, built in code and saved to a folder.

Nothing is downloaded: the tokenizer is a ``tokenizers`` WordLevel model over
the words ``w0 … w{N-1}``; the model is ``LlamaForCausalLM`` with seeded random
weights spread wide enough that greedy decoding is far from ties.
"""

from __future__ import annotations

import random

NUM_WORDS = 509
SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tiny_llama(folder: str, seed: int = 0, hidden: int = 256, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 512, max_positions: int = 1024) -> str:
    """Saves config, safetensors weights, tokenizer.json and tokenizer_config.json into ``folder``
    (the tests' model by default; larger shapes for benchmarks)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(NUM_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=max_positions,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype="float32")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # NOTE: wide weights give peaked logits: no near-ties for greedy decoding
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def random_prompt(rng: random.Random, num_words: int) -> str:
    """A prompt of ``num_words`` words; the tokenizer maps each word to one token."""
    return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(num_words))


def word_ids(prompt: str) -> list[int]:
    """Token ids of a prompt without loading the tokenizer (word ``wK`` is id ``K + 3``)."""
    return [len(SPECIALS) + int(w[1:]) for w in prompt.split()]


def build_lora_adapter(folder: str, base: str, rank: int = 8, seed: int = 1) -> str:
    """A PEFT LoRA adapter for ``build_tiny_llama``'s model (q, k and v projections), with random
    weights large enough that its outputs differ from the base model's; saved into ``folder``."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": base,
                   "target_modules": ["q_proj", "k_proj", "v_proj"]}, f)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for module, out in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, 256, generator=g) * 0.3
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
    return folder
