"""Gemma4 drafts and targets for the tests: DeepSpec's Gemma4 draft config and a random state
for it, tiny random transformers Gemma4/Gemma3 targets with sliding layers, and their greedy
``generate``."""

from __future__ import annotations

import json
import os

import torch

from dspark_ops.models.checkpoint import save_safetensors

from dspark_ops.models.gemma4 import Gemma4DSparkConfig, Gemma4DSparkDraft

HIDDEN = 32
TARGET_LAYERS = [0, 2, 3]


def deepspec_config(**changes) -> dict:
    """A tiny Gemma4 draft config as DeepSpec saves one: a copy of the target's Gemma4 text
    config (``head_dim`` of its sliding layers beside ``global_head_dim``, a ``sliding_window``,
    rope parameters per layer type with stray top-level keys) plus the draft's fields."""
    values = {
        "architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text",
        "vocab_size": 96, "hidden_size": HIDDEN, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 64, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "sliding_window": 1024,
        "layer_types": ["full_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "rope_type": "default", "rope_theta": None},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "enable_moe_block": False, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 96, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "use_bidirectional_attention": None,
        "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "initializer_range": 0.02,
        "use_cache": True, "dtype": "bfloat16", "transformers_version": "5.10.2",
        "target_model_type": "gemma4_unified", "target_text_model_type": "gemma4_unified_text",
        "num_target_layers": 4, "block_size": 5, "mask_token_id": 4,
        "target_layer_ids": TARGET_LAYERS, "num_anchors": 512, "enable_confidence_head": True,
        "confidence_head_with_markov": True, "markov_rank": 8, "markov_head_type": "vanilla",
    }
    values.update(changes)
    return values


def random_state(config: Gemma4DSparkConfig, seed: int = 0, dtype=torch.float32,
                 draft_class=Gemma4DSparkDraft) -> dict:
    """Random weights for every tensor of a ``draft_class`` draft (Gemma4's DSpark draft, or an
    Eagle3 draft), norms near 1 and layer scalars != 1."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in draft_class(config).state_dict().items():
        noise = torch.randn(value.shape, generator=gen)
        if name.endswith("layer_scalar"):
            state[name] = (0.5 + torch.rand(value.shape, generator=gen)).to(dtype)
        elif "norm" in name:
            state[name] = (1.0 + 0.3 * noise).to(dtype)
        else:
            state[name] = (0.25 * noise).to(dtype)
    return state


def tiny_gemma(transformers, kind: str, window: int, seed: int = 0):
    """A random float64 Gemma4 (or Gemma3) text causal LM, four layers, sliding layers 0 and 2
    with a ``window``-token window; norms and Gemma4's layer scalars spread around 1."""
    common = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  sliding_window=window, max_position_embeddings=256,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention",
                               "full_attention"], final_logit_softcapping=30.0,
                  pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  tie_word_embeddings=False)
    if kind == "gemma4":
        config = transformers.Gemma4TextConfig(
            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, **common)
        model = transformers.Gemma4ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(query_pre_attn_scalar=16, **common)
        model = transformers.Gemma3ForCausalLM
    torch.manual_seed(seed)
    model = model(config)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or "layer_scalar" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("weight"):
                p.normal_(0, 0.3)
    model = model.to(torch.float64).eval()
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompts, steps):
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=steps, min_new_tokens=steps)
        rows.append(out[0, len(prompt):].tolist())
    return rows


def save_checkpoint(path, values: dict, state: dict) -> None:
    """A draft directory as DeepSpec writes it: ``config.json`` and ``model.safetensors``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(values, f)
    save_safetensors(state, os.path.join(path, "model.safetensors"))


def training_target_and_data(transformers, tmp_path, eos_token_id=None):
    """A float32 tiny Gemma4 target saved with a character tokenizer under ``tmp_path/target``,
    and 16 of its greedy continuations (4 prompt tokens, 28 trained) in ``tmp_path/data.jsonl``;
    returns the model and both paths."""
    from cases.hf import char_tokenizer

    model = tiny_gemma(transformers, "gemma4", 3).float()
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
    target = str(tmp_path / "target")
    model.save_pretrained(target)
    char_tokenizer(96).save_pretrained(target)
    gen = torch.Generator().manual_seed(8)
    rows = []
    with torch.no_grad():
        for _ in range(16):
            ids = torch.randint(5, 96, (1, 4), generator=gen)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=28, min_new_tokens=28)[0].tolist()
            rows.append({"input_ids": out, "loss_mask": [0] * 4 + [1] * 28})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, target, str(data)
