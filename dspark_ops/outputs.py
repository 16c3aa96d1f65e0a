"""The ops' output types: plain named tuples of tensors, so they unpack like tuples, pass through
``torch.compile`` and carry no dependency on the reference implementations."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["VerifyOutput", "DraftOutput", "VerifyBatch", "LossOutput"]


class VerifyOutput(NamedTuple):
    tokens: torch.Tensor  # int64 [B, G+1]: emitted tokens, then -1
    num_accepted: torch.Tensor  # int32 [B]: accepted draft tokens (one more token is emitted)
    valid: torch.Tensor  # bool [B]: False where a needed row had no finite logit or a draft id was out of range
    logprobs: Optional[torch.Tensor] = None  # float32 [B, G+1] when asked for: log p of each emitted token, then -inf


class DraftOutput(NamedTuple):
    tokens: torch.Tensor  # int64 [B, G]: x_1..x_G
    draft_logits: torch.Tensor  # float32 [B, G, V]: z_0..z_{G-1}, pre-temperature


class VerifyBatch(NamedTuple):
    input_ids: torch.Tensor  # int64 [B*(G+1)]: [x0, x_1..x_l] of every request, then padding 0
    positions: torch.Tensor  # int64 [B*(G+1)]: p0..p0+l of every request, then padding 0
    cu_seqlens: torch.Tensor  # int32 [B+1]: exclusive prefix sums of l + 1


class LossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable: ce_weight * ce + l1_weight * l1 + confidence_weight * confidence
    ce: torch.Tensor  # scalar, detached: the weighted mean cross-entropy
    l1: torch.Tensor  # scalar, detached: the weighted mean L1 distance (0 without target_hidden)
    confidence: torch.Tensor  # scalar, detached: the weighted mean BCE of the confidence head (0 without it)
    accept_rate: Optional[torch.Tensor]  # [N], detached: c* = clamp(1 - l1 / 2, 0, 1); None without target_hidden
