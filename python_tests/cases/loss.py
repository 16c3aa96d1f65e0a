"""Inputs of dspark_loss: a DSpark-like case (Markov head, target, confidence head) or a DFlash one."""

from __future__ import annotations

import torch


def make_loss_case(rows: int, vocab: int, width: int, rank: int = 0, *, dtype=torch.float32,
                   device="cpu", target: bool = True, confidence: bool = True, seed: int = 0,
                   logit_scale: float = 1.0, zero_weights: int = 0) -> dict:
    """Keyword arguments of ``dspark_loss`` / ``reference.dspark_loss`` (``rank`` 0: no Markov
    head). Hidden states are scaled so logits have a standard deviation of about
    ``logit_scale``; the draft and target share a component, so p and q overlap as a trained
    draft's do. The last ``zero_weights`` rows get weight 0 (padding blocks)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    hidden64 = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    args = {
        "hidden": (hidden64 * logit_scale / width ** 0.5).to(dtype).to(device),
        "lm_head_weight": randn(vocab, width),
        "labels": torch.randint(0, vocab, (rows,), generator=gen).to(device),
        "weights": (torch.rand(rows, generator=gen) + 0.1).to(device),
    }
    if zero_weights:
        args["weights"][rows - zero_weights:] = 0
    if target:
        mix = 0.7 * hidden64 + 0.7 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
        args["target_hidden"] = (mix * logit_scale / width ** 0.5).to(dtype).to(device)
    if rank:
        args["markov_latent"] = randn(rows, rank, scale=0.5 / rank ** 0.5)
        args["markov_w2"] = randn(vocab, rank)
    if confidence and target:
        args["confidence_logits"] = randn(rows, scale=2.0)
    if not target:
        args.update(l1_weight=0.0, confidence_weight=0.0)
    elif not confidence:
        args["confidence_weight"] = 0.0
    return args


# What trains in DeepSpec (the LM head is frozen there); target_hidden never gets a gradient.
TRAINABLE = ("hidden", "markov_latent", "markov_w2", "confidence_logits")
WITH_LM_HEAD = TRAINABLE + ("lm_head_weight",)


def with_grad(args: dict, names=TRAINABLE) -> dict:
    """A copy of ``args`` whose tensors in ``names`` are fresh leaves that require grad."""
    out = dict(args)
    for name in names:
        if name in out and isinstance(out[name], torch.Tensor):
            out[name] = out[name].detach().clone().requires_grad_(True)
    return out


def grads(args: dict, names=TRAINABLE) -> dict:
    return {n: args[n].grad for n in names if n in args and isinstance(args[n], torch.Tensor)
            and args[n].requires_grad}
