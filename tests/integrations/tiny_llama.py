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


IMAGE_SIZE = 112
IMAGE_TOKENS = 16
"""Image tokens per image of ``build_tiny_idefics3``'s model: (112 / 14)^2 patches / 2^2 (pixel shuffle)."""
IMAGE_PLACEHOLDER = IMAGE_TOKENS + 3
"""Prompt tokens one ``<image>`` becomes: ``<fake_token_around_image><global-img>``, the image
tokens, ``<fake_token_around_image>``."""
IMAGE_SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]


def build_tiny_idefics3(folder: str, seed: int = 0, hidden: int = 256, layers: int = 2,
                        vision_hidden: int = 64, vision_layers: int = 2, image_size: int = IMAGE_SIZE,
                        patch_size: int = 14) -> str:
    """A tiny random Idefics3 (SmolVLM's architecture: a SigLIP vision tower, pixel shuffle by 2, a
    Llama with heads of 64, a KV head per 2) and its processor, without image splitting: each
    ``<image>`` of a prompt stands for ``(image_size / patch_size / 2)^2 + 3`` tokens
    (``IMAGE_PLACEHOLDER`` with the defaults). Words map as in ``build_tiny_llama``; the image
    tokens come after them. Saved into ``folder``; larger shapes for benchmarks."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig,
                              PreTrainedTokenizerFast)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(NUM_WORDS)})
    vocab.update({t: len(vocab) for t in IMAGE_SPECIALS})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=IMAGE_SPECIALS)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    image_tokens = (image_size // patch_size // 2) ** 2
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=image_tokens).save_pretrained(folder)
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=max(1, hidden // 128), head_dim=64,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False)
    vision = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=vision_layers,
                  num_attention_heads=max(2, vision_hidden // 64),
                  image_size=image_size, patch_size=patch_size)
    cfg = Idefics3Config(vision_config=vision, text_config=text.to_dict(), image_token_id=vocab["<image>"],
                         scale_factor=2, pad_token_id=0, vocab_size=len(vocab), dtype="float32")
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # NOTE: as build_tiny_llama's: peaked logits, no near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def random_image(seed: int, size: int = IMAGE_SIZE):
    """A ``size`` square RGB image of seeded random pixels (PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def build_tiny_sliding(folder: str, kind: str, window: int = 64, seed: int = 0) -> str:
    """A tiny random sliding-window model with ``build_tiny_llama``'s tokenizer: ``"mistral"``,
    every layer (2) attending to the last ``window`` tokens, or ``"gemma3"``, sliding-window and
    full-attention layers in turn (4), as Gemma 3 and gpt-oss mix them. Saved into ``folder``."""
    import glob
    import os

    import torch

    build_tiny_llama(folder)  # (its tokenizer; its model is replaced)
    for f in glob.glob(os.path.join(folder, "*.safetensors")) + [os.path.join(folder, "config.json")]:
        os.remove(f)
    vocab = len(SPECIALS) + NUM_WORDS
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, sliding_window=window,
                  bos_token_id=1, eos_token_id=2, dtype="float32")
    torch.manual_seed(seed)
    if kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, tie_word_embeddings=False, **common))
    elif kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=4, pad_token_id=0,
                                                   layer_types=["sliding_attention", "full_attention"] * 2, **common))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    with torch.no_grad():  # NOTE: as build_tiny_llama's: peaked logits, no near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return folder
