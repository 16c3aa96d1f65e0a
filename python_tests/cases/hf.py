"""Tiny transformers models for the tests and their companions: random Qwen3/Llama causal LMs,
a character-level tokenizer with a chat template (no downloads)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
import torch  # noqa: E402

VOCAB = 64
LAYERS = 4


def char_tokenizer(vocab=None):
    """A character-level tokenizer with a chat template: four specials, lower-case letters and
    punctuation, then ``<extra_i>`` entries up to ``vocab`` ids when it is given."""
    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    names = specials + list("abcdefghijklmnopqrstuvwxyz .,?!'\n")
    if vocab is not None:
        names += [f"<extra_{i}>" for i in range(vocab - len(names))]
    model = tokenizers.models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("(?m)."), "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
        chat_template=template)


def tiny_model(kind: str, *, vocab: int = VOCAB, layers: int = LAYERS, dtype=torch.float64,
               seed: int = 0, rope_theta: float = 10_000.0):
    """A random-initialised Qwen3 or Llama causal LM, weights spread enough (std 0.3) that its
    next-token distributions are far from uniform."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if kind == "qwen3":
        config = transformers.Qwen3Config(**common)
    else:
        config = transformers.LlamaConfig(**common)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()
