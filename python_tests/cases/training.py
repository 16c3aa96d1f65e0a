"""What the trainer's tests share: a tiny random transformers target saved with a character-level
tokenizer, and training data made of its own greedy continuations (no downloads). Importing this
module runs no test."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from cases.hf import char_tokenizer  # noqa: E402

VOCAB = 48  # the tokenizer has 41 entries: id 41 is the default mask token
LAYERS = 4
TARGET_LAYERS = ("0", "2")
PROMPT_TEXTS = ["hello", "why is the sky blue?", "a b c", "count to ten", "say yes", "tell me",
                "what is it", "the cat", "one two", "go on", "ok then", "is it so",
                "name a fruit", "hi there", "sing", "stop"]


def tokenizer():
    """The character-level tokenizer of the tiny targets (41 ids)."""
    return char_tokenizer()


def tiny_target(kind: str = "qwen3", seed: int = 0):
    """A random Qwen3 (or Llama) causal LM: hidden 64, one 64-wide head (the draft attention's
    head size), ``LAYERS`` layers, weights std 0.3 so its predictions are peaked."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                  max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=None, eos_token_id=3,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    config = (transformers.Qwen3Config if kind == "qwen3" else transformers.LlamaConfig)(**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()


def save_target(path: str, kind: str = "qwen3") -> str:
    model = tiny_target(kind)
    model.generation_config.eos_token_id = 3
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


@torch.no_grad()
def write_greedy_data(target_dir: str, path: str, count: int = 16, new_tokens: int = 40,
                      seed: int = 0) -> str:
    """``count`` rows: a prompt through the chat template, then the target's greedy continuation
    (``new_tokens`` tokens, EOS ignored) with loss_mask 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir,
                                                              attn_implementation="sdpa")
    tok = tokenizer()
    rows = []
    for i in range(count):
        text = PROMPT_TEXTS[(i + seed) % len(PROMPT_TEXTS)] + " " * (i // len(PROMPT_TEXTS))
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        prompt = tok(rendered, add_special_tokens=False).input_ids
        ids = torch.tensor([prompt])
        for _ in range(new_tokens):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
        full = ids[0].tolist()
        rows.append({"input_ids": full,
                     "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def train_args(target_dir: str, data: str, out: str, *extra: str):
    """Flags of a tiny run: 2 draft layers, blocks of 4, 8 anchors, rank 16, CPU, float32."""
    return ["--target", target_dir, "--data", data, "--out", out, "--num-layers", "1",
            "--block-size", "4", "--anchors", "8", "--target-layers", *TARGET_LAYERS,
            "--batch-tokens", "256", "--device", "cpu", "--dtype", "float32", "--no-progress",
            "--min-loss-tokens", "4", *extra]


def read_metrics(out: str):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
