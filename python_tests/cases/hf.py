"""Tiny transformers models' companions for the tests: a character-level tokenizer with a chat
template (no downloads)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


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
