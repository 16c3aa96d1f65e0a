"""The training loss of a draft over a :class:`~dspark_ops.train.TrainingBatch`, and DeepSpec's
training metrics.

:func:`draft_loss` weights every block slot with DeepSpec's ``eval_mask * exp(-k / gamma)``,
flattens the batch and calls the fused :func:`dspark_ops.dspark_loss` with the draft's own LM head
and Markov ``W2``: DSpark's ``0.1 CE + 0.9 L1 + 1.0 BCE`` by default, DFlash's CE alone for a draft
without a Markov head. A draft with soft-capped logits (Gemma4's ``final_logit_softcapping``)
passes its cap to the same fused op (``logit_softcap``). :func:`block_metrics` turns the
per-slot expected acceptance ``c*`` into DeepSpec's ``accept_rate@k`` and ``tau_probabilistic``
(as sums, so that data-parallel ranks can add them up before dividing).

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
           "softcapped_dspark_loss"]


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


def flatten_batch(draft: nn.Module, batch: TrainingBatch, loss_decay_gamma: float = 4.0
                  ) -> Dict[str, Optional[torch.Tensor]]:
    """The inputs of :func:`dspark_ops.dspark_loss` for ``batch``, flattened to ``N = B * A * G``
    rows: ``hidden``, ``lm_head_weight``, ``labels``, ``weights``, ``target_hidden``,
    ``markov_latent``, ``markov_w2`` and ``confidence_logits``.

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
        "weights": loss_weights(batch, loss_decay_gamma).reshape(-1),
        "target_hidden": target,
        "markov_latent": latent,
        "markov_w2": w2,
        "confidence_logits": confidence,
    }


def draft_loss(draft: nn.Module, batch: TrainingBatch, *, loss_decay_gamma: float = 4.0,
               ce_weight: Optional[float] = None, l1_weight: Optional[float] = None,
               confidence_weight: Optional[float] = None, denominators: Denominators = None,
               loss_fn=None) -> LossOutput:
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
    inputs = flatten_batch(draft, batch, loss_decay_gamma)
    if gamma == 0:
        inputs["confidence_logits"] = None
    if (beta or gamma) and inputs["target_hidden"] is None:
        raise ValueError("draft_loss(): the batch has no target_hidden (pass target_last_hidden "
                         "to training_forward); the L1 and confidence terms need it")
    fn = dspark_loss if loss_fn is None else loss_fn
    cap = getattr(draft.config, "final_logit_softcapping", None)
    if cap is not None:
        inputs["logit_softcap"] = float(cap)
    hidden, head, labels, weights = (inputs.pop(k) for k in ("hidden", "lm_head_weight",
                                                             "labels", "weights"))
    return fn(hidden, head, labels, weights, **inputs, ce_weight=alpha, l1_weight=beta,
              confidence_weight=gamma, denominators=denominators)


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
def block_metrics(accept_rate: Optional[torch.Tensor], batch: TrainingBatch
                  ) -> Dict[str, torch.Tensor]:
    """DeepSpec's acceptance metrics of one batch, as sums (divide after adding up ranks).

    Parameters
    ----------
    accept_rate : torch.Tensor or None
        ``c* = clamp(1 - L1 / 2, 0, 1)`` per slot (``LossOutput.accept_rate``, any shape with
        ``B * A * G`` elements), the expected acceptance of each slot's draft.
    batch : TrainingBatch

    Returns
    -------
    dict
        float64 tensors: ``accept_sum [G]`` and ``accept_count [G]`` (``accept_rate@k`` =
        their ratio, over the slots the eval mask keeps), ``tau_sum`` and ``block_count``
        (``tau_probabilistic`` = their ratio: ``1 + sum_k prod_{i<=k} c*_i`` with ``c*`` zero
        past the eval mask, averaged over kept blocks with at least one valid slot).
    """
    mask = batch.eval_mask
    block = mask.shape[-1]
    valid = mask.double()
    blocks = (batch.block_keep_mask & mask.any(-1)).double()
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
