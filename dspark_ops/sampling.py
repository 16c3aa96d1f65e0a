"""Sampling conventions shared by the ops, the models and the references: the random-stream
purposes, the greedy temperature and the sampling filters (pure PyTorch, any device)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "PURPOSE_DRAFT",
    "PURPOSE_ACCEPT",
    "PURPOSE_RESAMPLE",
    "GREEDY_TEMPERATURE",
    "filter_logits",
    "allowed_tokens",
]

# Random streams (csrc/common/philox.h): a token's proposal, acceptance test and resampling never
# share random numbers.
PURPOSE_DRAFT = 0
PURPOSE_ACCEPT = 1
PURPOSE_RESAMPLE = 2

GREEDY_TEMPERATURE = 1e-5  # a temperature at or below this means greedy (argmax)


# ------------------------------------------------------------------------------------------------
# Sampling filters (csrc/kernels/filter_math.h). On a row of logits z (non-finite = -inf) with max
# m and weights w = exp((z - m) / T) (T = 1 for greedy rows), in this order: top-k keeps the
# tokens with fewer than k larger logits (boundary ties kept); top-p keeps those whose top-k-kept
# tokens with a larger logit weigh < top_p x the top-k-kept total (float64 sums); min-p keeps
# w >= min_p. Off: top_k outside [1, V), top_p >= 1, min_p <= 0.


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    *,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float32 ``logits [..., V]`` with -inf where a filter (or a non-finite logit) drops a token.

    ``temperature``, ``top_k``, ``top_p`` and ``min_p`` have the leading shape ``[...]``.
    """
    z = logits.float()
    z = torch.where(torch.isfinite(z), z, float("-inf"))
    vocab = z.shape[-1]
    greedy = ~(temperature > GREEDY_TEMPERATURE)
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature).float()
    row_max = z.amax(-1, keepdim=True)
    shifted = torch.where(row_max == float("-inf"), float("-inf"), z - row_max)
    weight = torch.exp(shifted * inv_t[..., None])
    keep = torch.isfinite(z)
    if top_k is not None:
        k = top_k.long()
        kth = z.sort(-1, descending=True).values.gather(-1, (k.clamp(1, vocab) - 1)[..., None])
        keep &= ((k <= 0) | (k >= vocab))[..., None] | (z >= kth)
    if top_p is not None:
        kept_weight = torch.where(keep, weight, 0.0).double()
        order = torch.where(keep, z, float("-inf")).sort(dim=-1, descending=True, stable=True)
        sorted_weight = kept_weight.gather(-1, order.indices)
        before = torch.cat([torch.zeros_like(sorted_weight[..., :1]),
                            sorted_weight.cumsum(-1)[..., :-1]], -1)
        # The weight strictly above a token is the running sum at the first token of its tie group.
        descending = (-order.values).contiguous()
        group_start = torch.searchsorted(descending, descending, side="left").clamp_max(vocab - 1)
        above = torch.empty_like(before).scatter_(-1, order.indices, before.gather(-1, group_start))
        bound = top_p.double().clamp_min(1e-30)[..., None] * kept_weight.sum(-1, keepdim=True)
        keep &= ~(top_p < 1.0)[..., None] | (above < bound)
    if min_p is not None:
        keep &= ~(min_p > 0.0)[..., None] | (weight >= min_p.clamp_max(1.0)[..., None])
    return torch.where(keep, z, float("-inf"))


def allowed_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[R, V]`` from an int32 bitmask ``[R, ceil(V / 32)]``: bit v % 32 of word v // 32."""
    v = torch.arange(vocab, device=mask.device)
    return ((mask.long()[:, v // 32] >> (v % 32)) & 1).bool()
