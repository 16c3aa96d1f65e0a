"""Semi-autoregressive drafting: the Markov and RNN heads and the confidence head.

Semantics: docs/semantics.md §3.2-3.3.

The parallel backbone gives base logits for all G block slots in one pass; a thin sequential head
then walks the slots, adding to slot j's logits a low-rank bias that depends on the token just
drafted, and samples the next token from the corrected distribution. Each op here runs the whole
walk in one call and returns the corrected logits it sampled from, so :func:`verify` sees exactly
the proposal distribution. The confidence head's calibration is in :mod:`dspark_ops.calibration`.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..outputs import DraftOutput
from .._per_request import draw_seeds, per_request_args
from .._fake_checks import checked_fake

__all__ = [
    "DraftOutput",
    "markov_draft",
    "rnn_draft",
    "draft_confidence",
]

_SHARED_PARAMETERS = """
    base_logits : torch.Tensor
        float32/bfloat16/float16 ``[B, G, V]``: the backbone's logits of the G block slots (slot
        ``j`` predicts ``x_{j+1}``); any strides (a copy is made unless the last one is 1).
    anchor : torch.Tensor
        int64 or int32 ``[B]``: ``x_0``, the last token the target emitted, in ``[0, V)``."""

_SHARED_SAMPLING = """
    temperature : torch.Tensor or float
        float32 ``[B]``: draft temperature, finite and ``>= 0``; ``<= 1e-5`` is greedy (argmax,
        ties to the lowest id). Greedy and sampled requests mix in one call. A Python number is
        shared by every request (as for ``top_k``, ``top_p`` and ``min_p``).
    seed : torch.Tensor or None
        int64 ``[B]``: per-request seeds; ``None`` draws them from ``generator``.
    position : torch.Tensor
        int64 ``[B]``: absolute position ``p0`` of each anchor, in ``[0, 2**62]``. Slot ``j``
        draws from the draft stream of position ``p0 + 1 + j`` only (the acceptance and
        resampling streams :func:`verify` uses at that position are independent of it).
    top_k, top_p, min_p : torch.Tensor or number, optional
        Per-request sampling filters (int32 ``[B]`` >= 0, float32 ``[B]`` in ``(0, 1]``, float32
        ``[B]`` in ``[0, 1]``; 0, 1 and 0 are off), as :func:`verify` takes them: each slot's
        token is sampled from the filtered ``softmax(z_j / T)`` and ``draft_logits`` holds -inf
        where a filter dropped a token (greedy requests: filters at ``T = 1``), so the same
        filters in :func:`verify` see exactly the proposal distribution."""

_SHARED_DTYPE = """
    draft_logits_dtype : torch.dtype, optional
        ``torch.float32`` (default) or ``torch.bfloat16``. With bfloat16 each ``z_j`` is rounded
        to bfloat16 as soon as it is computed, and everything after it (the filters, the
        Gumbel-max keys, the greedy argmax) uses the rounded value, which is what
        ``draft_logits`` stores: :func:`verify` still sees exactly the proposal, and the largest
        traffic of a step (the ``[B, G, V]`` write here, its read in :func:`verify`) halves
        (docs/semantics.md §3.2, §4)."""

_SHARED_RETURNS = """
    Returns
    -------
    DraftOutput
        ``tokens`` int64 ``[B, G]`` (``x_1..x_G``, always in ``[0, V)``: a slot with no finite
        logit yields 0, which :func:`verify` then reports as invalid) and ``draft_logits``
        ``[B, G, V]`` in ``draft_logits_dtype``: ``z_j`` before temperature (rounded to
        bfloat16 with that option), exactly the values ``x_{j+1}`` was
        sampled from. Pass them to :func:`verify` as ``draft_logits`` with
        ``draft_temperature=temperature``.

    Notes
    -----
    Sampling is Gumbel-max on Philox uniforms that depend only on ``(seed, p0 + 1 + j, v)``, so
    a request's drafts do not depend on its batch neighbours. The precision (docs/semantics.md
    §3.2): on CPU the tokens, and with bfloat16 ``draft_logits`` the stored values too, are the
    float64 reference's bit for bit; on CUDA tokens equal the reference's except at
    float-rounding near-ties. No host synchronisation on CUDA; value checks (ids, positions,
    temperatures) always run on CPU and on CUDA with ``DSPARK_OPS_DEBUG=1``. Without them an
    out-of-range id embeds as a zero row instead of being read out of bounds."""


def _logits_dtype(op, dtype):
    """``draft_logits_dtype`` checked on every device: float32 (default) or bfloat16."""
    if dtype is None:
        return torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}(): 'draft_logits_dtype' must be a torch.dtype (torch.float32 or "
                        f"torch.bfloat16), got {type(dtype).__name__}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{op}(): 'draft_logits_dtype' must be torch.float32 or torch.bfloat16, "
                         f"got {dtype}")
    return dtype


def _sampling_args(op, base_logits, seed, generator, temperature, top_k, top_p, min_p):
    """The per-request sampling arguments with Python numbers broadcast to [B], and the seeds
    (drawn from ``generator`` when ``seed`` is None)."""
    batch, device = base_logits.shape[0], base_logits.device
    sampling = per_request_args(op, batch, device, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p)
    if seed is None:
        seed = draw_seeds(batch, generator, device)
    return (seed, *sampling)


def markov_draft(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: Union[torch.Tensor, float],
    seed: Optional[torch.Tensor],
    position: torch.Tensor,
    *,
    top_k: Union[torch.Tensor, int, None] = None,
    top_p: Union[torch.Tensor, float, None] = None,
    min_p: Union[torch.Tensor, float, None] = None,
    generator: Optional[torch.Generator] = None,
    draft_logits_dtype: Optional[torch.dtype] = None,
) -> DraftOutput:
    dtype = _logits_dtype("markov_draft", draft_logits_dtype)
    seed, temperature, top_k, top_p, min_p = _sampling_args(
        "markov_draft", base_logits, seed, generator, temperature, top_k, top_p, min_p)
    tokens, draft_logits = torch.ops.dspark_ops.markov_draft(
        base_logits, anchor, w1, w2, temperature, seed, position, top_k, top_p, min_p, dtype
    )
    return DraftOutput(tokens, draft_logits)


markov_draft.__doc__ = f"""Drafts a whole block with the Markov head in one call.

    For slot ``j = 0..G-1``: ``z_j = base_logits[:, j] + W2 . W1[x_j]`` (``x_0`` = anchor, so
    even slot 0 is biased) and ``x_{{j+1}} ~ softmax(z_j / T)`` (docs/semantics.md §3.2).

    Parameters
    ----------{_SHARED_PARAMETERS}
    w1 : torch.Tensor
        ``[V, r]`` previous-token embedding (``markov_head.markov_w1.weight``).
    w2 : torch.Tensor
        ``[V, r]`` logit projection (``markov_head.markov_w2.weight``, the ``nn.Linear(r, V)``
        weight), in ``w1``'s dtype (float32, bfloat16 or float16); ``1 <= r <= 1024``.{_SHARED_SAMPLING}
    generator : torch.Generator, optional
        Only used to draw ``seed`` when it is ``None``.{_SHARED_DTYPE}
{_SHARED_RETURNS}
    """


def rnn_draft(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    joint_weight: torch.Tensor,
    joint_bias: torch.Tensor,
    temperature: Union[torch.Tensor, float],
    seed: Optional[torch.Tensor],
    position: torch.Tensor,
    *,
    top_k: Union[torch.Tensor, int, None] = None,
    top_p: Union[torch.Tensor, float, None] = None,
    min_p: Union[torch.Tensor, float, None] = None,
    generator: Optional[torch.Generator] = None,
    draft_logits_dtype: Optional[torch.dtype] = None,
) -> DraftOutput:
    dtype = _logits_dtype("rnn_draft", draft_logits_dtype)
    seed, temperature, top_k, top_p, min_p = _sampling_args(
        "rnn_draft", base_logits, seed, generator, temperature, top_k, top_p, min_p)
    tokens, draft_logits = torch.ops.dspark_ops.rnn_draft(
        base_logits, anchor, hidden, w1, w2, joint_weight, joint_bias, temperature, seed, position,
        top_k, top_p, min_p, dtype,
    )
    return DraftOutput(tokens, draft_logits)


rnn_draft.__doc__ = f"""Drafts a block with the RNN head in one call (docs/semantics.md §3.2).

    For slot ``j``: ``[g; c; o] = J [s_j; W1[x_j]; h_j] + b`` (``J = joint_weight``, rows split
    as gate, candidate, output), ``z_j = base_logits[:, j] + W2 . tanh(o)``,
    ``x_{{j+1}} ~ softmax(z_j / T)``, then ``s_{{j+1}} = sigmoid(g) * s_j + (1 - sigmoid(g)) *
    tanh(c)`` with ``s_0 = 0`` (the bias of slot j uses the state before its update).

    Parameters
    ----------{_SHARED_PARAMETERS}
    hidden : torch.Tensor
        float32/bfloat16/float16 ``[B, G, d]``: the backbone's hidden state ``h_j`` of each slot.
    w1, w2 : torch.Tensor
        ``[V, r]`` as in :func:`markov_draft`.
    joint_weight : torch.Tensor
        ``[3r, 2r + d]`` in ``w1``'s dtype; input columns ordered ``[s; W1[x]; h]``.
    joint_bias : torch.Tensor
        ``[3r]`` in ``w1``'s dtype.{_SHARED_SAMPLING}
    generator : torch.Generator, optional
        Only used to draw ``seed`` when it is ``None``.{_SHARED_DTYPE}
{_SHARED_RETURNS}
    """


def draft_confidence(
    hidden: torch.Tensor,
    prev_tokens: torch.Tensor,
    w1: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    calib_temperature: Optional[torch.Tensor] = None,
    *,
    return_logits: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Conditional confidences of the drafts (docs/semantics.md §3.3).

    ``c_j = sigmoid((w . [h_j; W1[x_j]] + b) / tau_j)``: the probability that draft ``x_{j+1}``
    survives verification given that ``x_1..x_j`` did. The survival of the first ``j + 1`` drafts
    is the cumulative product, which :func:`schedule_verify` takes.

    Parameters
    ----------
    hidden : torch.Tensor
        float32/bfloat16/float16 ``[B, G, d]``: the tensor that feeds the LM head.
    prev_tokens : torch.Tensor
        int64 or int32 ``[B, G]``: ``[anchor, x_1, ..., x_{G-1}]``, in ``[0, V)``.
    w1 : torch.Tensor
        ``[V, r]``: the Markov head's embedding.
    weight : torch.Tensor
        ``[d + r]``: the confidence head's ``nn.Linear(d + r, 1)`` weight (flattened).
    bias : torch.Tensor, optional
        A one-element tensor: the head's bias.
    calib_temperature : torch.Tensor, optional
        float32 ``[G]``, finite and ``> 0``: per-slot calibration temperatures (see
        :func:`fit_sequential_temperatures`); default 1.
    return_logits : bool
        Also return the uncalibrated logits ``w . [h_j; W1[x_j]] + b`` (float32 ``[B, G]``, the
        dot product in float64, rounded once): what :func:`fit_sequential_temperatures` fits.
        Unlike ``torch.logit`` of the confidences they stay exact where the sigmoid saturates.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        float32 ``[B, G]`` confidences in ``[0, 1]`` (and the logits with ``return_logits``).
        The dot product is float64 on CPU (float32 on CUDA); the logit is rounded to float32
        before the temperature and sigmoid.
    """
    confidence = torch.ops.dspark_ops.draft_confidence(
        hidden, prev_tokens, w1, weight, bias, calib_temperature
    )
    if not return_logits:
        return confidence
    return confidence, _confidence_logits(hidden, prev_tokens, w1, weight, bias)


def _confidence_logits(hidden, prev_tokens, w1, weight, bias):
    """w . [h_j; W1[x_j]] + b in float64, rounded to float32; the op has checked the arguments
    (ids outside [0, V), possible on CUDA without value checks, embed as zero rows, as in the
    kernels)."""
    in_range = (prev_tokens >= 0) & (prev_tokens < w1.shape[0])
    rows = w1[prev_tokens.long().clamp(0, w1.shape[0] - 1)].double()
    features = torch.cat([hidden.double(), torch.where(in_range[..., None], rows, 0.0)], -1)
    logits = features @ weight.double()
    if bias is not None:
        logits = logits + bias.double().reshape(())
    return logits.float()


@torch.library.register_fake("dspark_ops::markov_draft")
@checked_fake("markov_draft")
def _markov_draft_fake(base_logits, anchor, w1, w2, temperature, seed, position, top_k=None,
                       top_p=None, min_p=None, draft_logits_dtype=None, op="markov_draft"):
    torch._check(base_logits.dim() == 3, lambda: f"{op}(): 'base_logits' must be 3-D")
    batch, block, _ = base_logits.shape
    dtype = _logits_dtype(op, draft_logits_dtype)
    return (base_logits.new_empty((batch, block), dtype=torch.int64),
            base_logits.new_empty(base_logits.shape, dtype=dtype))


@torch.library.register_fake("dspark_ops::rnn_draft")
@checked_fake("rnn_draft")
def _rnn_draft_fake(base_logits, anchor, hidden, w1, w2, joint_weight, joint_bias, temperature,
                    seed, position, top_k=None, top_p=None, min_p=None, draft_logits_dtype=None):
    return _markov_draft_fake.__wrapped__(base_logits, anchor, w1, w2, temperature, seed,
                                          position, draft_logits_dtype=draft_logits_dtype,
                                          op="rnn_draft")


@torch.library.register_fake("dspark_ops::draft_confidence")
@checked_fake("draft_confidence")
def _draft_confidence_fake(hidden, prev_tokens, w1, weight, bias=None, calib_temperature=None):
    torch._check(hidden.dim() == 3, lambda: "draft_confidence(): 'hidden' must be 3-D")
    return hidden.new_empty(hidden.shape[:2], dtype=torch.float32)
