"""``dspark_loss``: DSpark's three-term training loss, fused from the hidden states
(docs/semantics.md §3.7)."""

from __future__ import annotations

import math
import struct
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..outputs import LossOutput
from .._fake_checks import checked_fake

__all__ = ["dspark_loss", "LossOutput", "loss_denominators"]

Denominators = Union[float, torch.Tensor, Sequence[Union[float, torch.Tensor]], None]


def loss_denominators(weights: torch.Tensor, denominators: Denominators = None):
    """The three divisors (ce, l1, confidence) of :func:`dspark_loss`, as 0-d tensors.

    ``None``: the local ``weights.sum() + 1e-6`` for all three. A number or a 0-d tensor: that
    divisor for all three. A sequence or a 1-D tensor of three: one per term. Values are used as
    given (a data-parallel trainer passes the all-reduced ``sum(w) + 1e-6``).
    """
    if denominators is None:
        local = weights.double().sum() + 1e-6
        return local, local, local
    if isinstance(denominators, torch.Tensor) and denominators.dim() == 0:
        denominators = (denominators,) * 3
    elif not isinstance(denominators, (torch.Tensor, Sequence)):
        denominators = (denominators,) * 3
    if len(denominators) != 3:
        raise ValueError("dspark_loss(): 'denominators' must be one divisor or three (ce, l1, "
                         f"confidence), got {len(denominators)}")
    return tuple(torch.as_tensor(d, dtype=torch.float64, device=weights.device).reshape(())
                 for d in denominators)


def dspark_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    target_hidden: Optional[torch.Tensor] = None,
    markov_latent: Optional[torch.Tensor] = None,
    markov_w2: Optional[torch.Tensor] = None,
    confidence_logits: Optional[torch.Tensor] = None,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    confidence_weight: float = 1.0,
    denominators: Denominators = None,
    chunk_rows: Optional[int] = None,
    logit_softcap: Optional[float] = None,
) -> LossOutput:
    """DSpark's training loss, without ever holding the ``[N, V]`` logits in float32.

    The weighted sum of the draft's cross-entropy, the L1 distance between the draft and target
    distributions and the confidence head's BCE against the expected acceptance
    ``c* = clamp(1 - l1 / 2, 0, 1)``, each over ``sum(w) + 1e-6``, as DeepSpec's
    ``compute_dspark_loss``; the formula and its gradients: docs/semantics.md §3.7. With
    ``logit_softcap`` (Gemma4's drafts) the LM head's products are soft-capped before the Markov
    bias is added, for the draft and the target alike.

    The logits are made a chunk of rows at a time (one product for the draft's, one for the
    target's) and a fused vocabulary pass computes both log-sum-exps, ``ce``, ``l1`` and, when
    anything requires grad, the gradients with respect to the logits, which the chunk's products
    turn into the inputs' gradients right away: the backward only scales them. Extra memory: one
    chunk of ``[rows, V]`` draft and target logits in the inputs' dtype (by default 256 MiB on
    CUDA, 128 MiB on CPU), plus the gradients.

    Parameters
    ----------
    hidden : torch.Tensor
        ``[N, d]`` draft hidden states after the final norm; float32, bfloat16 or float16
        (float64 on CPU).
    lm_head_weight : torch.Tensor
        ``[V, d]`` LM head shared by draft and target logits, ``hidden``'s dtype. Gets a gradient
        (through the draft and target logits, as autograd of the formula) when it requires grad.
    labels : torch.Tensor
        ``[N]`` int64 (or int32) next tokens in ``[0, V)``.
    weights : torch.Tensor
        ``[N]`` float32 position weights, finite and ``>= 0`` (0 excludes a position).
    target_hidden : torch.Tensor, optional
        ``[N, d]`` the target's final-normed hidden states at the aligned positions; needed when
        ``l1_weight`` or ``confidence_weight`` is nonzero. Never gets a gradient.
    markov_latent, markov_w2 : torch.Tensor, optional
        ``[N, r]`` and ``[V, r]``, together: the Markov head's bias is
        ``markov_latent @ markov_w2.T``.
    confidence_logits : torch.Tensor, optional
        ``[N]`` the confidence head's logits; needed when ``confidence_weight`` is nonzero.
    ce_weight, l1_weight, confidence_weight : float
        ``α, β, γ`` (DSpark: 0.1, 0.9, 1.0; DFlash: 1, 0, 0 with ``markov_latent=None``).
    denominators : float, tensor or sequence of three, optional
        Global divisors per term (see :func:`loss_denominators`); default the local ``S``.
    chunk_rows : int, optional
        Rows per chunk; default: the fewest chunks whose logits fit 256 MiB on CUDA (128 MiB
        on CPU), the rows spread evenly over them.
    logit_softcap : float, optional
        ``s``: the logits become ``z = s * tanh(W h / s) + W2 u`` and ``t = s * tanh(W g / s)``
        (Gemma4's ``final_logit_softcapping``, 30), with every gradient through the cap
        (``1 - tanh^2``). Finite and ``> 0`` (as a float32); ``None`` (default): no cap, and the
        op computes exactly what it does without the argument. With a Markov head the cap needs
        a third chunk of ``[rows, V]`` scratch (the bias apart), within the same default budget.

    Returns
    -------
    LossOutput
        ``loss`` (float32 scalar, differentiable), ``ce``, ``l1``, ``confidence`` (the three
        weighted means, detached) and ``accept_rate`` (``[N]`` c*, or None without
        ``target_hidden``).
    """
    if target_hidden is None and (l1_weight != 0 or confidence_weight != 0):
        raise ValueError("dspark_loss(): 'target_hidden' is required when l1_weight or "
                         "confidence_weight is nonzero (for CE only, pass l1_weight=0, "
                         "confidence_weight=0)")
    if confidence_weight != 0 and confidence_logits is None:
        raise ValueError("dspark_loss(): 'confidence_logits' is required when confidence_weight "
                         "is nonzero")
    if (confidence_logits is not None and hidden.dim() == 2
            and tuple(confidence_logits.shape) != tuple(hidden.shape[:1])):
        raise ValueError("dspark_loss(): 'confidence_logits' must have shape [N] = "
                         f"{tuple(hidden.shape[:1])}, got {tuple(confidence_logits.shape)}")
    if chunk_rows is not None and chunk_rows <= 0:
        raise ValueError(f"dspark_loss(): 'chunk_rows' must be positive, got {chunk_rows}")
    s_ce, s_l1, s_conf = loss_denominators(weights, denominators)
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    s_ce, s_l1, s_conf = s_ce.to(wide), s_l1.to(wide), s_conf.to(wide)
    term_scale = torch.stack([ce_weight / s_ce, l1_weight / s_l1])
    inputs = (hidden, lm_head_weight, markov_latent, markov_w2)
    compute_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in inputs)
    lm_head_grad = torch.is_grad_enabled() and lm_head_weight.requires_grad
    fused, ce, l1, *_ = torch.ops.dspark_ops.dspark_loss(
        hidden, lm_head_weight, labels, weights, term_scale, target_hidden=target_hidden,
        markov_latent=markov_latent, markov_w2=markov_w2, compute_grad=compute_grad,
        lm_head_grad=lm_head_grad, chunk_rows=chunk_rows or 0, logit_softcap=logit_softcap)
    ce, l1 = ce.detach(), l1.detach()
    w = weights.to(ce.dtype)
    zero = fused.new_zeros(())
    accept_rate = None
    confidence = zero
    loss = fused
    if target_hidden is not None:
        accept_rate = (1 - 0.5 * l1).clamp(0, 1)
        if confidence_logits is not None:
            bce = F.binary_cross_entropy_with_logits(
                confidence_logits.to(ce.dtype), accept_rate, reduction="none")
            confidence = (w * bce).sum() / s_conf
            if confidence_weight != 0:
                loss = loss + confidence_weight * confidence
            confidence = confidence.detach()
    return LossOutput(
        loss=loss,
        ce=((w * ce).sum() / s_ce).detach(),
        l1=((w * l1).sum() / s_l1).detach() if target_hidden is not None else zero.detach(),
        confidence=confidence,
        accept_rate=accept_rate,
    )


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (infinite past its range), as a C++ cast."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def check_logit_softcap(logit_softcap: Optional[float]) -> None:
    """Refuses a cap the kernels cannot apply, as the entry does (args/loss_args.h)."""
    if logit_softcap is None:
        return
    s = float(logit_softcap)
    s32 = _as_float32(s)
    if not (math.isfinite(s) and s > 0 and math.isfinite(s32) and s32 > 0):
        raise ValueError("dspark_loss(): 'logit_softcap' must be finite and > 0 as a float32 "
                         f"(None: no cap), got {logit_softcap}")


@torch.library.register_fake("dspark_ops::dspark_loss")
@checked_fake("dspark_loss")
def _dspark_loss_fake(hidden, lm_head_weight, labels, weights, term_scale, target_hidden=None,
                      markov_latent=None, markov_w2=None, compute_grad=False,
                      lm_head_grad=False, chunk_rows=0, logit_softcap=None):
    check_logit_softcap(logit_softcap)
    rows, width = hidden.shape
    vocab = lm_head_weight.shape[0]
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    grad = compute_grad or lm_head_grad
    has_u = markov_latent is not None

    def none():  # outputs never alias
        return hidden.new_empty((0,))

    return (
        hidden.new_empty((), dtype=wide),
        hidden.new_empty((rows,), dtype=wide),
        hidden.new_empty((rows if target_hidden is not None else 0,), dtype=wide),
        hidden.new_empty((rows, width)) if grad else none(),
        hidden.new_empty((rows, markov_latent.shape[1])) if grad and has_u else none(),
        markov_w2.new_empty(markov_w2.shape) if grad and has_u else none(),
        lm_head_weight.new_empty(lm_head_weight.shape) if lm_head_grad else none(),
    )


def _setup_context(ctx, inputs, output):
    ctx.compute_grad = inputs[8] or inputs[9]
    ctx.lm_head_grad = inputs[9]
    ctx.has_markov = inputs[6] is not None
    ctx.save_for_backward(*output[3:])


def _backward(ctx, grad_loss, *_unused):
    # The gradients were computed with the forward (the chunks' logits are gone): scale them.
    if not ctx.compute_grad:
        raise RuntimeError("dspark_loss(): backward through a call made with compute_grad=False; "
                           "call it with the inputs requiring grad (dspark_ops.dspark_loss does)")
    grad_hidden, grad_latent, grad_w2, grad_lm_head = ctx.saved_tensors

    def scaled(g):
        return grad_loss.to(g.dtype) * g

    return (
        scaled(grad_hidden),
        scaled(grad_lm_head) if ctx.lm_head_grad else None,
        None, None, None, None,
        scaled(grad_latent) if ctx.has_markov else None,
        scaled(grad_w2) if ctx.has_markov else None,
        None, None, None, None,
    )


torch.library.register_autograd("dspark_ops::dspark_loss", _backward, setup_context=_setup_context)
