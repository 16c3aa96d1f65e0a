"""The training loss of a draft over a :class:`~dspark_ops.train.TrainingBatch`, and DeepSpec's
training metrics.

:func:`draft_loss` weights every block slot with DeepSpec's ``eval_mask * exp(-k / gamma)``,
flattens the batch and calls the fused :func:`dspark_ops.dspark_loss` with the draft's own LM head
and Markov ``W2``: DSpark's ``0.1 CE + 0.9 L1 + 1.0 BCE`` by default, DFlash's CE alone for a draft
without a Markov head. A draft with soft-capped logits (Gemma4's ``final_logit_softcapping``)
passes its cap to the same fused op (``logit_softcap``). :func:`block_metrics` turns the
per-slot expected acceptance ``c*`` into DeepSpec's ``accept_rate@k`` and ``tau_probabilistic``
(as sums, so that data-parallel ranks can add them up before dividing).

A draft with a draft vocabulary (``draft.draft_vocabulary``) trains on it
(:func:`restrict_to_vocabulary`): its logits over the vocabulary's ``N`` rows, the target's over
the whole vocabulary, whose mass outside stands in one extra column, so the L1 distance and the
expected acceptance are those of the draft that decodes (docs/semantics.md §3.7c).

Example
-------
>>> import torch
>>> from dspark_ops.models import DSparkConfig, DSparkDraft
>>> from dspark_ops.train import draft_loss, training_forward
>>> config = DSparkConfig(vocab_size=64, hidden_size=64, num_attention_heads=1,
...                       num_key_value_heads=1, head_dim=64, intermediate_size=128,
...                       num_hidden_layers=1, target_layer_ids=(0,), block_size=4,
...                       mask_token_id=63, markov_rank=8)
>>> draft = DSparkDraft(config)
>>> ids = torch.randint(0, 63, (1, 20))
>>> batch = training_forward(draft, ids, torch.randn(1, 20, 64), torch.ones(1, 20),
...                          torch.randn(1, 20, 64), num_anchors=4)
>>> out = draft_loss(draft, batch)
>>> out.loss.backward()
>>> bool(draft.markov_head.markov_w2.weight.grad.abs().sum() > 0)
True
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..ops.loss import Denominators, dspark_loss
from ..outputs import LossOutput
from .forward import TrainingBatch, position_weights

__all__ = ["block_metrics", "draft_loss", "flatten_batch", "loss_coefficients", "loss_weights",
           "restrict_to_vocabulary", "soft_cross_entropy", "softcapped_dspark_loss"]

#: The draft's logit in the column standing for the ids outside its vocabulary: finite, so that
#: the zero weights of the other rows multiply it to 0, and exp() of it is 0 in every dtype.
OUTSIDE_DRAFT_LOGIT = -1.0e4


def loss_coefficients(draft: nn.Module, ce_weight: Optional[float] = None,
                      l1_weight: Optional[float] = None,
                      confidence_weight: Optional[float] = None) -> Tuple[float, float, float]:
    """``(alpha, beta, gamma)`` of the loss, DeepSpec's defaults where not given.

    A DSpark draft (``markov_rank > 0``) trains with ``0.1, 0.9, 1.0``; a DFlash draft
    (``markov_rank = 0``) with cross-entropy alone, ``1, 0, 0``. A draft without a confidence
    head always gets ``gamma = 0``.
    """
    dflash = draft.config.markov_rank == 0
    alpha = (1.0 if dflash else 0.1) if ce_weight is None else float(ce_weight)
    beta = (0.0 if dflash else 0.9) if l1_weight is None else float(l1_weight)
    gamma = (0.0 if dflash else 1.0) if confidence_weight is None else float(confidence_weight)
    if draft.confidence_head is None:
        if confidence_weight:
            raise ValueError(f"confidence_weight={confidence_weight}: the draft has no "
                             "confidence head")
        gamma = 0.0
    for name, value in (("ce_weight", alpha), ("l1_weight", beta),
                        ("confidence_weight", gamma)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return alpha, beta, gamma


def loss_weights(batch: TrainingBatch, loss_decay_gamma: float = 4.0) -> torch.Tensor:
    """DeepSpec's per-slot loss weights ``eval_mask * exp(-k / loss_decay_gamma)``,
    float32 ``[B, A, G]``."""
    return position_weights(batch.eval_mask, loss_decay_gamma)


def flatten_batch(draft: nn.Module, batch: TrainingBatch, loss_decay_gamma: float = 4.0,
                  weights: Optional[torch.Tensor] = None) -> Dict[str, Optional[torch.Tensor]]:
    """The inputs of :func:`dspark_ops.dspark_loss` for ``batch``, flattened to ``N = B * A * G``
    rows: ``hidden``, ``lm_head_weight``, ``labels``, ``weights``, ``target_hidden``,
    ``markov_latent``, ``markov_w2`` and ``confidence_logits``. ``weights [B, A, G]``, when
    given, are the slots' weights already built from the eval mask (:func:`loss_weights`).

    The matrices are cast to ``batch.hidden``'s dtype (under autocast the backbone's output may
    be 16-bit while the parameters are float32); the casts are differentiable, so ``W2`` still
    gets its gradient.
    """
    dtype = batch.hidden.dtype
    width = batch.hidden.shape[-1]
    rows = batch.hidden.reshape(-1, width)
    head = draft.markov_head
    latent = w2 = None
    if head is not None and batch.markov_latent is not None:
        latent = batch.markov_latent.reshape(rows.shape[0], -1).to(dtype)
        w2 = head.markov_w2.weight.to(dtype)
    target = None
    if batch.target_hidden is not None:
        target = batch.target_hidden.reshape(rows.shape[0], -1).to(dtype)
    confidence = None
    if batch.confidence_logits is not None:
        confidence = batch.confidence_logits.reshape(-1)
    return {
        "hidden": rows,
        "lm_head_weight": draft.lm_head.weight.to(dtype),
        "labels": batch.labels.reshape(-1),
        "weights": (loss_weights(batch, loss_decay_gamma) if weights is None
                    else weights).reshape(-1),
        "target_hidden": target,
        "markov_latent": latent,
        "markov_w2": w2,
        "confidence_logits": confidence,
    }


def draft_loss(draft: nn.Module, batch: TrainingBatch, *, loss_decay_gamma: float = 4.0,
               ce_weight: Optional[float] = None, l1_weight: Optional[float] = None,
               confidence_weight: Optional[float] = None, denominators: Denominators = None,
               weights: Optional[torch.Tensor] = None, loss_fn=None) -> LossOutput:
    """DeepSpec's training loss of a draft on one training forward, fused.

    Slot ``k`` of every block weighs ``eval_mask * exp(-k / loss_decay_gamma)``; the rows are
    flattened and passed with ``draft.lm_head.weight`` (the frozen, shared LM head) and the
    Markov head's ``W2`` to :func:`dspark_ops.dspark_loss`, which never holds the ``[N, V]``
    logits in float32.

    Parameters
    ----------
    draft : dspark_ops.models.DSparkDraft
        The draft that produced ``batch``.
    batch : TrainingBatch
        From :func:`~dspark_ops.train.training_forward`. ``target_hidden`` is needed for the L1
        and confidence terms (and for the acceptance metrics).
    loss_decay_gamma : float
        Decay length of the slot weights (DeepSpec: 4).
    ce_weight, l1_weight, confidence_weight : float, optional
        ``alpha, beta, gamma``; default DSpark's ``0.1, 0.9, 1.0``, or ``1, 0, 0`` for a DFlash
        draft (:func:`loss_coefficients`).
    denominators : float, tensor or sequence of three, optional
        The divisors of the three terms (default: the local ``sum(w) + 1e-6``); a data-parallel
        trainer passes the all-reduced sums ``+ 1e-6``.
    weights : torch.Tensor, optional
        float32 ``[B, A, G]``: the slots' weights when the caller built them with the anchors
        (the trainer's batch, whose sum gave ``denominators``); default: from
        ``batch.eval_mask`` and ``loss_decay_gamma``.
    loss_fn : callable, optional
        Replaces :func:`dspark_ops.dspark_loss` (same signature), e.g.
        :func:`dspark_ops.reference.dspark_loss` to compare against the eager formula. A draft
        with ``config.final_logit_softcapping`` set (Gemma4) passes it as ``logit_softcap``.

    Returns
    -------
    LossOutput
        As :func:`dspark_ops.dspark_loss`; ``accept_rate`` is ``[B * A * G]`` (reshape it like
        ``batch.eval_mask``).
    """
    alpha, beta, gamma = loss_coefficients(draft, ce_weight, l1_weight, confidence_weight)
    if weights is not None and tuple(weights.shape) != tuple(batch.eval_mask.shape):
        raise ValueError(f"weights must have the eval mask's shape "
                         f"{tuple(batch.eval_mask.shape)}, got {tuple(weights.shape)}")
    inputs = flatten_batch(draft, batch, loss_decay_gamma, weights)
    if gamma == 0:
        inputs["confidence_logits"] = None
    if (beta or gamma) and inputs["target_hidden"] is None:
        raise ValueError("draft_loss(): the batch has no target_hidden (pass target_last_hidden "
                         "to training_forward); the L1 and confidence terms need it")
    fn = dspark_loss if loss_fn is None else loss_fn
    cap = getattr(draft.config, "final_logit_softcapping", None)
    if cap is not None:
        inputs["logit_softcap"] = float(cap)
    vocabulary = getattr(draft, "draft_vocabulary", None)
    if vocabulary is not None:
        if cap is not None:
            raise ValueError("draft_loss(): a draft vocabulary with soft-capped logits "
                             "(final_logit_softcapping) is not implemented: the cap would bend "
                             "the column that holds the target's mass outside the vocabulary")
        inputs = restrict_to_vocabulary(inputs, vocabulary)
    hidden, head, labels, weights = (inputs.pop(k) for k in ("hidden", "lm_head_weight",
                                                             "labels", "weights"))
    return fn(hidden, head, labels, weights, **inputs, ce_weight=alpha, l1_weight=beta,
              confidence_weight=gamma, denominators=denominators)


@torch.no_grad()
def _outside_log_mass(target_hidden: torch.Tensor, weight: torch.Tensor,
                      inside: torch.Tensor) -> torch.Tensor:
    """``[N]``: log-sum-exp of the target's logits ``W g`` over the ids outside the vocabulary
    (``inside`` bool ``[V]``), in float32 (float64 for float64 inputs), a chunk of rows at a time
    (``2**25`` logits), at least ``OUTSIDE_DRAFT_LOGIT`` (so ``-inf`` never enters a product)."""
    rows, vocab = target_hidden.shape[0], weight.shape[0]
    dtype = torch.float64 if target_hidden.dtype == torch.float64 else torch.float32
    out = torch.empty(rows, dtype=dtype, device=target_hidden.device)
    chunk = max(1, (1 << 25) // vocab)
    w = weight.to(dtype)
    for start in range(0, rows, chunk):
        logits = target_hidden[start:start + chunk].to(dtype) @ w.T
        out[start:start + chunk] = logits.masked_fill_(inside, float("-inf")).logsumexp(-1)
    return out.clamp_min_(OUTSIDE_DRAFT_LOGIT)


def restrict_to_vocabulary(inputs: Dict[str, Optional[torch.Tensor]],
                           vocabulary) -> Dict[str, Optional[torch.Tensor]]:
    """:func:`flatten_batch`'s inputs of a draft that proposes from ``vocabulary`` only
    (a :class:`~dspark_ops.models.vocab.DraftVocabulary` of ``N`` ids), for the same
    :func:`dspark_ops.dspark_loss` (docs/semantics.md §3.7c).

    The LM head and ``W2`` become their ``N`` rows plus one: the extra row stands for every id
    outside. Two columns are appended to the hidden states, which only that row reads: the
    draft's hold ``OUTSIDE_DRAFT_LOGIT`` (its probability outside is 0), the target's the
    log-sum-exp of its logits outside, split in two so a 16-bit dtype keeps it to about 16 bits.
    The target distribution over the ``N + 1`` columns is then the full one with the mass outside
    in one column, so ``l1`` and ``c* = 1 - l1 / 2`` are exactly the full vocabulary's with the
    draft at 0 outside. Labels map to draft indices; a slot whose label is outside gets weight 0
    (the draft cannot propose it; the trainer's eval mask drops it and the slots after it).
    Gradients reach the vocabulary's rows of ``W2`` and the hidden states.
    """
    head, hidden = inputs["lm_head_weight"], inputs["hidden"]
    device, dtype = head.device, hidden.dtype
    vocab, width = head.shape
    if vocabulary.vocab_size != vocab:
        raise ValueError(f"the draft vocabulary is over {vocabulary.vocab_size} ids, the LM head "
                         f"over {vocab}")
    d2t = vocabulary.d2t.to(device)
    size = d2t.numel()
    inside = vocabulary.inside(device)
    to_draft = torch.full((vocab,), size, dtype=torch.long, device=device)
    to_draft[d2t] = torch.arange(size, device=device)

    out = dict(inputs)
    extra_row = torch.cat([head.new_zeros(1, width), head.new_ones(1, 2)], 1)
    out["lm_head_weight"] = torch.cat([torch.cat([head[d2t], head.new_zeros(size, 2)], 1),
                                       extra_row])
    columns = hidden.new_zeros(hidden.shape[0], 2)
    columns[:, 0] = OUTSIDE_DRAFT_LOGIT
    out["hidden"] = torch.cat([hidden, columns], 1)
    labels = inputs["labels"].long()
    out["labels"] = to_draft[labels].clamp_max(size - 1)  # outside: weight 0 below
    out["weights"] = inputs["weights"] * inside[labels]
    target = inputs["target_hidden"]
    if target is not None:
        mass = _outside_log_mass(target, head, inside)
        high = mass.to(dtype)
        low = (mass - high.to(mass.dtype)).to(dtype)
        out["target_hidden"] = torch.cat([target, high[:, None], low[:, None]], 1)
    if inputs["markov_w2"] is not None:
        w2 = inputs["markov_w2"]
        out["markov_w2"] = torch.cat([w2[d2t], w2.new_zeros(1, w2.shape[1])])
    return out


def softcapped_dspark_loss(hidden, lm_head_weight, labels, weights, *, cap: float,
                           target_hidden=None, markov_latent=None, markov_w2=None,
                           confidence_logits=None, ce_weight=0.1, l1_weight=0.9,
                           confidence_weight=1.0, denominators=None) -> LossOutput:
    """DeepSpec's loss for a draft with soft-capped logits (Gemma4), fused:
    :func:`dspark_ops.dspark_loss` with ``logit_softcap=cap``. The base logits are
    ``cap * tanh(W h / cap)`` and the Markov bias is added after the cap,
    ``z = cap * tanh(W h / cap) + W2 u``; the target's logits are capped the same way,
    ``t = cap * tanh(W h_t / cap)`` (DeepSpec's Gemma4 trainer feeds the target's last hidden
    state through the draft's LM head and cap). Gradients flow through the cap
    (``1 - tanh^2``). The eager formula is :func:`dspark_ops.reference.dspark_loss` with the same
    ``logit_softcap``."""
    return dspark_loss(hidden, lm_head_weight, labels, weights, target_hidden=target_hidden,
                       markov_latent=markov_latent, markov_w2=markov_w2,
                       confidence_logits=confidence_logits, ce_weight=ce_weight,
                       l1_weight=l1_weight, confidence_weight=confidence_weight,
                       denominators=denominators, logit_softcap=cap)


@torch.no_grad()
def block_metrics(accept_rate: Optional[torch.Tensor], eval_mask: torch.Tensor,
                  block_keep_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """DeepSpec's acceptance metrics of one batch, as sums (divide after adding up ranks).

    Parameters
    ----------
    accept_rate : torch.Tensor or None
        ``c* = clamp(1 - L1 / 2, 0, 1)`` per slot (``LossOutput.accept_rate``, any shape with
        ``B * A * G`` elements), the expected acceptance of each slot's draft.
    eval_mask : torch.Tensor
        bool ``[B, A, G]`` (:attr:`TrainingBatch.eval_mask`).
    block_keep_mask : torch.Tensor
        bool ``[B, A]``.

    Returns
    -------
    dict
        float64 tensors: ``accept_sum [G]`` and ``accept_count [G]`` (``accept_rate@k`` =
        their ratio, over the slots the eval mask keeps), ``tau_sum`` and ``block_count``
        (``tau_probabilistic`` = their ratio: ``1 + sum_k prod_{i<=k} c*_i`` with ``c*`` zero
        past the eval mask, averaged over kept blocks with at least one valid slot).
    """
    mask = eval_mask
    block = mask.shape[-1]
    valid = mask.double()
    blocks = (block_keep_mask & mask.any(-1)).double()
    out = {"accept_count": valid.reshape(-1, block).sum(0),
           "block_count": blocks.sum()}
    if accept_rate is None:
        out["accept_sum"] = torch.zeros_like(out["accept_count"])
        out["tau_sum"] = torch.zeros_like(out["block_count"])
        return out
    accept = accept_rate.reshape(mask.shape).double() * valid
    out["accept_sum"] = accept.reshape(-1, block).sum(0)
    out["tau_sum"] = ((accept.cumprod(-1).sum(-1) + 1.0) * blocks).sum()
    return out


# ------------------------------------------------------------------------------------------------
# Soft cross-entropy against a target distribution, chunked over rows (Eagle3's TTT loss)

# Elements of one chunk's [rows, V] logits: 64 MiB in float32, a few such tensors live at a time.
_CHUNK_ELEMENTS = 1 << 24


def _capped_logits(rows: torch.Tensor, weight: torch.Tensor, cap: Optional[float],
                   dtype: torch.dtype) -> torch.Tensor:
    """``cap * tanh(rows @ weight.T / cap)`` (no cap: the product) in the operands' dtype, as the
    eager model computes it, then in ``dtype``."""
    logits = torch.nn.functional.linear(rows, weight)
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    return logits.to(dtype)


def _chunk_logit_grad(z, p, q, row_weights, cap):
    """``d(sum_i w_i * CE_i) / d(pre-cap logits)`` of a chunk: ``w (p * sum(q) - q)`` (the
    gradient of ``-sum_j q_j log p_j``; ``sum(q)`` is kept rather than taken as 1, as autograd
    of the eager formula does), times ``1 - tanh^2 = 1 - (z / cap)^2`` under a cap. Written
    over ``p`` (and ``z``), which the chunk no longer needs: one ``[rows, V]`` buffer fewer."""
    grad = p.mul_(q.sum(-1, keepdim=True)).sub_(q).mul_(row_weights[:, None])
    if cap is not None:
        grad.mul_(z.div_(cap).square_().neg_().add_(1))
    return grad


def _chunk(hidden, weight, target_hidden, target_weight, row_weights, cap, dtype, want_grad):
    """One chunk of rows: ``CE`` and the acceptance per row, and (``want_grad``) the gradient
    with respect to the head's product, ``[rows, V]`` in ``dtype``. At most three ``[rows, V]``
    buffers live at once (the capped logits, the draft's log-probabilities, then probabilities,
    then gradient, in one buffer, and the target's probabilities), plus one temporary."""
    z = _capped_logits(hidden, weight, cap, dtype)
    log_p = torch.log_softmax(z, -1)
    if cap is None:
        z = None  # only the cap's slope reads it again
    q = torch.softmax(_capped_logits(target_hidden, target_weight, cap, dtype), -1)
    losses = -(q * log_p).sum(-1)
    p = log_p.exp_()
    accept = torch.sub(p, q).abs_().sum(-1).mul_(-0.5).add_(1).clamp_(0, 1).float()
    grad = _chunk_logit_grad(z, p, q, row_weights, cap) if want_grad else None
    return losses, accept, grad


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * (-sum_j q_ij log p_ij)`` over row chunks; see :func:`soft_cross_entropy`.

    The forward computes the gradient with respect to ``hidden`` chunk by chunk while the
    chunk's logits are at hand (one more product per chunk instead of recomputing both logits in
    the backward) and keeps it, ``[N, d]``, with the per-row losses; the weight's gradient, when
    asked for, is computed in the backward by recomputing each chunk's logits. No ``[N, V]``
    tensor outlives its chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_hidden, target_weight, row_weights, cap,
                chunk_rows):
        rows = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        need_row_weights = ctx.needs_input_grad[4]
        losses = torch.empty(rows, dtype=dtype, device=hidden.device)
        accept = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        w = row_weights.to(dtype)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            losses[start:end], accept[start:end], grad = _chunk(
                hidden[start:end], weight, target_hidden[start:end], target_weight,
                w[start:end], cap, dtype, need_hidden)
            if need_hidden:
                grad_hidden[start:end] = grad.to(weight.dtype) @ weight
            del grad
        ctx.cap, ctx.chunk_rows, ctx.row_weights_dtype = cap, chunk_rows, row_weights.dtype
        ctx.save_for_backward(grad_hidden, losses if need_row_weights else None,
                              *((hidden, weight, target_hidden, target_weight, row_weights)
                                if need_weight else (None,) * 5))
        ctx.mark_non_differentiable(accept)
        return (losses * w).sum(), accept

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_accept):
        del grad_accept  # the acceptance is a metric, not differentiable
        (grad_hidden, losses, hidden, weight, target_hidden, target_weight,
         row_weights) = ctx.saved_tensors
        grads = [None] * 7
        if grad_hidden is not None:
            grads[0] = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if losses is not None:
            grads[4] = (losses * grad_loss).to(ctx.row_weights_dtype)
        if hidden is not None:  # the weight's gradient: each chunk's logits recomputed
            dtype = torch.promote_types(hidden.dtype, torch.float32)
            w = row_weights.to(dtype)
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
            for start in range(0, hidden.shape[0], ctx.chunk_rows):
                end = min(start + ctx.chunk_rows, hidden.shape[0])
                _, _, grad = _chunk(hidden[start:end], weight, target_hidden[start:end],
                                    target_weight, w[start:end], ctx.cap, dtype, True)
                grad_weight += grad.T @ hidden[start:end].to(dtype)
            grads[1] = (grad_weight * grad_loss).to(weight.dtype)
        return tuple(grads)


def soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_hidden: torch.Tensor,
                       row_weights: torch.Tensor, *, cap: Optional[float] = None,
                       target_weight: Optional[torch.Tensor] = None,
                       chunk_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The weighted soft cross-entropy of draft rows against target rows through one LM head,
    without the ``[N, V]`` logits: ``sum_i w_i * (-sum_j q_ij log p_ij)``.

    ``p_i = softmax(cap(W h_i))`` is the draft's distribution and ``q_i = softmax(cap(W_t g_i))``
    the target's, a constant (no gradient reaches ``g`` or ``W_t``, which defaults to ``W``
    detached: the eager loss computes it under ``no_grad``), ``cap(x) =
    cap * tanh(x / cap)`` (Gemma4's soft cap) or the identity. The rows are processed
    ``chunk_rows`` at a time; what is kept for the backward is ``O(N)`` scalars and an ``[N, d]``
    gradient (plus the inputs when ``weight`` needs a gradient), never a chunk's logits.
    Eagle3's training-time-test loss (:func:`dspark_ops.train.eagle3_ttt_loss`) calls it once
    per step; the formula is in ``docs/semantics.md`` §3.7b.

    Parameters
    ----------
    hidden : torch.Tensor
        ``[N, d]``: the draft's final-normed hidden states.
    weight : torch.Tensor
        ``[V, d]``: the LM head (frozen in Eagle3; its gradient is computed when it needs one).
    target_hidden : torch.Tensor
        ``[N, d]``: the target's final-normed hidden state whose distribution row ``i`` learns.
    row_weights : torch.Tensor
        ``[N]``: ``w_i`` (differentiable: its gradient is the per-row loss).
    cap : float, optional
        The logit soft cap of both distributions (``final_logit_softcapping``).
    target_weight : torch.Tensor, optional
        ``[V, d]``: the LM head of the target's distribution (default: ``weight``, detached).
    chunk_rows : int, optional
        Rows per chunk (default: ``2**24 // V``, 64 MiB of float32 logits).

    Returns
    -------
    loss : torch.Tensor
        Scalar, float32 (float64 for float64 inputs).
    accept : torch.Tensor
        float32 ``[N]``, no gradient: ``clamp(1 - TV(p_i, q_i), 0, 1)``, the expected acceptance
        of a draft sampled from ``p_i`` against the target ``q_i``.

    Notes
    -----
    Under autocast the products run in the autocast dtype, as the model's ``lm_head`` would;
    the softmaxes and the loss are float32.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, d] and weight [V, d], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if tuple(target_hidden.shape) != tuple(hidden.shape):
        raise ValueError(f"target_hidden must have hidden's shape {tuple(hidden.shape)}, got "
                         f"{tuple(target_hidden.shape)}")
    if tuple(row_weights.shape) != (hidden.shape[0],):
        raise ValueError(f"row_weights must be [N] with N = {hidden.shape[0]}, got "
                         f"{tuple(row_weights.shape)}")
    if target_weight is None:
        target_weight = weight
    if tuple(target_weight.shape) != tuple(weight.shape):
        raise ValueError(f"target_weight must have weight's shape {tuple(weight.shape)}, got "
                         f"{tuple(target_weight.shape)}")
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0 or None, got {cap}")
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // weight.shape[0])
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the eager lm_head's product dtype
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    with torch.autocast(device_type, enabled=False):
        return _ChunkedSoftCrossEntropy.apply(hidden.to(dtype), weight.to(dtype),
                                              target_hidden.detach().to(dtype),
                                              target_weight.detach().to(dtype), row_weights,
                                              None if cap is None else float(cap),
                                              int(chunk_rows))
