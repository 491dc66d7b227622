"""A tiny random Llama and a word-level tokenizer, built in code and saved to a folder.

Nothing is downloaded: the tokenizer is a ``tokenizers`` WordLevel model over
the words ``w0 … w{N-1}``; the model is ``LlamaForCausalLM`` with seeded random
weights spread wide enough that greedy decoding is far from ties.
"""

from __future__ import annotations

import random

NUM_WORDS = 509
SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tiny_llama(folder: str, seed: int = 0) -> str:
    """Saves config, safetensors weights, tokenizer.json and tokenizer_config.json into ``folder``."""
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
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
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
