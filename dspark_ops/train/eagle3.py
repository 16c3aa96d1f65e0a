"""The training forward and loss of an Eagle3 draft: DeepSpec's training-time test (TTT).

One call of :func:`eagle3_ttt_loss` does what DeepSpec's ``compute_eagle3_loss`` does for a
batch of right-padded sequences ``[B, L]``, in plain PyTorch (SDPA with a dense boolean mask):

1. **Step 0.** Row ``i`` pairs ``fc`` of the target features at ``i`` with the token
   ``i + 1`` (the ids shifted left by one, zero past the end), RoPE at ``i``; attention causal
   over the valid rows.
2. **Step k > 0.** The hidden input of row ``i`` is the draft's own step ``k - 1`` output at
   row ``i``, its token is ``i + k + 1`` (shifted once more), RoPE at ``i + k``. Its query
   sees the step-0 keys at rows ``<= i`` and the keys of steps ``1 .. k`` at row ``i`` itself
   (its own chain so far), as at inference, where a chain step sees the committed rows and its
   own earlier steps.
3. **Loss.** Step ``k`` of row ``i`` predicts the target's next-token distribution at
   ``i + k + 1`` (``softmax(lm_head(target_last_hidden))``, the draft's frozen LM head, soft-capped
   for a Gemma4 draft);
   the soft cross-entropy ``-sum p log q`` is masked by the loss mask shifted by ``k`` (the last
   valid token has no target) and divided by ``B * L`` (DeepSpec's per-step local mean), then
   weighted by ``step_loss_decay ** k`` and summed over the ``ttt_length`` steps.

Metrics (DeepSpec's): per step, ``accept_rate@k`` = the mean of ``1 - TV(q, p)`` over the
step's masked rows, and ``tau_probabilistic`` = ``1 +`` the sum over steps of the running
product of those acceptances, over the rows valid at step 0.

The loss of a step never holds its ``[B, L, V]`` logits: the rows the step trains (mask set) are
gathered and passed to :func:`dspark_ops.train.loss.soft_cross_entropy`, which runs them in
chunks, recomputing each chunk's logits, and keeps an ``[N, d]`` gradient and ``O(N)`` scalars
for the backward (DeepSpec's fused Triton loss keeps two scalars per row). ``fused=False`` is the
eager formula, which keeps every step's ``[B, L, V]`` logits and the target's ``[B, L, V]``
distribution: the reference the fused path is tested against.

The rows a step does not train carry no loss: row ``i`` of step ``k`` trains when the loss mask
of ``i + k`` is set, and the mask is cleared at each sequence's last valid token, so a trained row
learns the target at ``i + k + 1`` inside the sequence. The rows past the end, whose target
DeepSpec sets to the uniform distribution, are never trained (the eager formula gives them that
distribution and a zero weight).
"""

from __future__ import annotations

import dataclasses

import torch

from ..models.gemma4 import soft_cap
from .loss import soft_cross_entropy

__all__ = ["Eagle3Batch", "eagle3_ttt_loss"]


@dataclasses.dataclass
class Eagle3Batch:
    """What :func:`eagle3_ttt_loss` returns.

    Attributes
    ----------
    loss : torch.Tensor
        Scalar: ``sum_k decay**k * loss_k``.
    step_losses : torch.Tensor
        float32 ``[K]``, the unweighted ``loss_k``.
    accept_sum, accept_count : torch.Tensor
        float64 ``[K]``: sums of ``1 - TV`` over the masked rows of each step, and their count.
    tau_sum : torch.Tensor
        float64 scalar: the sum over step-0 rows of ``1 + sum_k prod_{j<=k} (1 - TV_j)``.
    row_count : torch.Tensor
        float64 scalar: those rows.
    """

    loss: torch.Tensor
    step_losses: torch.Tensor
    accept_sum: torch.Tensor
    accept_count: torch.Tensor
    tau_sum: torch.Tensor
    row_count: torch.Tensor


def _shift_left(x: torch.Tensor, by: int = 1) -> torch.Tensor:
    """``x[:, by:]`` padded with zeros at the end to the same length."""
    return torch.cat([x[:, by:], torch.zeros_like(x[:, :by])], 1)


class _StepKeys:
    """What the rows of the training-time test attend over: at step 0 the sequence causally
    (``causal [B, L, L]``), at step ``k`` also the keys of every step before and, of step
    ``k``'s own, only their own row (``same``), as DeepSpec's mask. Each step's keys and values
    are kept for the steps after it; the rows attend through ``scaled_dot_product_attention``."""

    def __init__(self, causal: torch.Tensor, same: torch.Tensor):
        self.causal, self.same = causal, same
        self.keys, self.values, self.masks = [], [], []

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        self.masks.append(self.same if self.masks else self.causal)
        keys = torch.cat(self.keys, 1).transpose(1, 2).to(q.dtype)  # [B, Hkv, (k + 1) L, D]
        values = torch.cat(self.values, 1).transpose(1, 2).to(q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=torch.cat(self.masks, -1)[:, None],
            scale=attn.scaling, enable_gqa=attn.num_heads != attn.num_kv_heads)
        return out.transpose(1, 2)


def _fused_step(draft, hidden: torch.Tensor, target_last_hidden: torch.Tensor,
                mask_k: torch.Tensor, k: int, cap, chunk_rows):
    """Step ``k``'s ``sum_i mask_k[i] * CE_i / (B * L)`` over the rows it trains, and its
    acceptance ``1 - TV`` per row (``[B, L]``, 0 on untrained rows), without ``[B, L, V]``
    logits. ``compute_logits(h) = cap(lm_head(norm(h)))``: the rows are normed here and the
    head and cap are applied chunk by chunk."""
    batch, length, width = hidden.shape
    with torch.no_grad():
        rows = mask_k.reshape(-1).nonzero().squeeze(1)
        # A trained row (b, i) learns the target at (b, i + k + 1), in the same sequence.
        targets = rows + (k + 1)
        weights = mask_k.reshape(-1)[rows].float() / (batch * length)
    normed = draft.norm(hidden.reshape(-1, width).index_select(0, rows))
    target = target_last_hidden.reshape(batch * length, -1).index_select(0, targets)
    head = draft.lm_head.weight
    loss, accept_rows = soft_cross_entropy(normed, head, target.to(head.dtype), weights, cap=cap,
                                           chunk_rows=chunk_rows)
    accept = accept_rows.new_zeros(batch * length).index_copy_(0, rows, accept_rows)
    return loss.float(), accept.view(batch, length)  # float32, as the eager step loss


def eagle3_ttt_loss(draft, input_ids: torch.Tensor, target_features: torch.Tensor,
                    loss_mask: torch.Tensor, target_last_hidden: torch.Tensor,
                    valid: torch.Tensor, *, ttt_length=None, step_loss_decay=None,
                    fused: bool = True, chunk_rows=None) -> Eagle3Batch:
    """The TTT loss of ``draft`` (:class:`dspark_ops.models.Eagle3Draft`) on one batch.

    Parameters
    ----------
    input_ids : torch.Tensor
        int64 ``[B, L]``, right-padded.
    target_features : torch.Tensor
        ``[B, L, n * H]``: the target layers' outputs (``target_layer_ids``).
    loss_mask : torch.Tensor
        ``[B, L]``: 1 where a token is trained.
    target_last_hidden : torch.Tensor
        ``[B, L, H]``: the target's final-normed hidden states.
    valid : torch.Tensor
        bool ``[B, L]``: the real tokens (a prefix of each row).
    ttt_length, step_loss_decay : optional
        Default the draft config's (7 and 0.8 in DeepSpec).
    fused : bool
        True: each step's soft cross-entropy through
        :func:`~dspark_ops.train.loss.soft_cross_entropy` (no ``[B, L, V]`` tensor); False: the
        eager formula (the reference).
    chunk_rows : int, optional
        Rows per chunk of the fused loss (its default: 64 MiB of float32 logits).
    """
    config = draft.config
    steps = int(ttt_length or config.ttt_length)
    decay = float(step_loss_decay if step_loss_decay is not None else config.step_loss_decay)
    layer = draft.layers[0]
    batch, length = input_ids.shape
    device = input_ids.device
    lengths = valid.long().sum(-1)
    rows = torch.arange(length, device=device)
    cap = config.final_logit_softcapping
    with torch.no_grad():
        if not fused:
            target_logits = soft_cap(
                draft.lm_head(target_last_hidden.to(draft.lm_head.weight.dtype)), cap)
            target_probs = torch.softmax(target_logits.float(), -1)
        # Row i of step k learns the target's distribution at i + k + 1.
        mask0 = loss_mask.float() * valid.float()
        mask0[torch.arange(batch, device=device), (lengths - 1).clamp_min(0)] = 0.0
        row_ok = rows[None, :] < lengths[:, None]  # [B, L]
        causal = (rows[None, :] <= rows[:, None])[None] & row_ok[:, None, :]  # [B, L, L]
        same = torch.eye(length, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
    hidden = draft.fc(target_features.to(draft.fc.weight.dtype))
    ids = _shift_left(input_ids)
    total = hidden.new_zeros((), dtype=torch.float32)
    step_losses, accept_sum, accept_count, accept_rows = [], [], [], []
    steps_keys = _StepKeys(causal, same)
    for k in range(steps):
        hidden = layer(draft.embed_tokens(ids), hidden, (rows + k)[None].expand(batch, -1),
                       steps_keys)
        with torch.no_grad():
            mask_k = _shift_left(mask0, k)
        if fused:
            step_loss, accept = _fused_step(draft, hidden, target_last_hidden, mask_k, k, cap,
                                            chunk_rows)
        else:
            logits = draft.compute_logits(hidden).float()
            with torch.no_grad():
                probs_k = _shift_left(target_probs, k + 1)
                probs_k[:, length - k - 1:] = 1.0 / probs_k.shape[-1]  # DeepSpec's uniform tail
            soft_ce = -(probs_k * torch.log_softmax(logits, -1)).sum(-1)
            step_loss = (soft_ce * mask_k).sum() / (batch * length)
            with torch.no_grad():
                accept = (1 - 0.5 * (torch.softmax(logits, -1) - probs_k).abs().sum(-1)
                          ).clamp(0, 1)
        total = total + step_loss * decay**k
        step_losses.append(step_loss.detach())
        with torch.no_grad():
            accept_sum.append((accept * mask_k).sum().double())
            accept_count.append(mask_k.sum().double())
            accept_rows.append(accept * (mask_k > 0))
        ids = _shift_left(ids)
    with torch.no_grad():
        start = mask0 > 0
        expected = torch.stack(accept_rows).cumprod(0).sum(0)  # [B, L]
        tau_sum = ((expected + 1) * start).sum().double()
    return Eagle3Batch(total, torch.stack(step_losses), torch.stack(accept_sum),
                       torch.stack(accept_count), tau_sum, start.sum().double())
