"""Confidence-scheduled, load-aware verification: which draft tokens are worth a target forward.

Each op ranks the (request, position) pairs by survival ``a[r, j] = c[r, 0] * ... * c[r, j]``
and admits a prefix of that ranking; the ranking, the objective ``Theta = tau * step_rate[N]``
and its fixed-point sum are docs/semantics.md §3.4, the losslessness condition §5.2.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..outputs import VerifyBatch
from .._fake_checks import checked_fake

__all__ = [
    "schedule_verify",
    "plan_verify_budget",
    "allocate_verify",
    "VerifyBatch",
    "pack_verify_inputs",
]


def schedule_verify(
    confidence: torch.Tensor, step_rate: torch.Tensor, *, max_verify: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-request verify lengths by Algorithm 1 of the DSpark paper, lossless.

    Admits pairs in survival order while ``Theta`` strictly improves and stops at the first
    admission that does not (or that would need ``M`` tokens): the stop is what keeps sampling
    exact (docs/semantics.md §3.4, §5.2).

    Parameters
    ----------
    confidence : torch.Tensor
        float32 ``[B, G]``: conditional confidences ``c`` in ``[0, 1]`` (``draft_confidence``).
    step_rate : torch.Tensor
        float32 ``[M]`` with ``M > B``: ``step_rate[n]`` is the target's steps per second for a
        verify batch of ``n`` tokens (see :func:`dspark_ops.profile_step_rate`). Batches of ``M``
        or more tokens are never scheduled.
    max_verify : torch.Tensor, optional
        int32 ``[B]``: per-request caps on the verify length, each in ``[0, G]``.

    Returns
    -------
    torch.Tensor
        int32 ``[B]``: ``num_verify``, each in ``[0, G]``; feed it to :func:`pack_verify_inputs`
        and ``verify(num_draft=...)``.
    """
    return torch.ops.dspark_ops.schedule_verify(confidence, step_rate, max_verify)


def plan_verify_budget(confidence: torch.Tensor, step_rate: torch.Tensor) -> torch.Tensor:
    """The verify token budget ``K`` in ``[B, M)`` that maximises ``Theta``, searched globally.

    Stage 1 of the production scheduler: fed with confidences from an earlier step (two steps
    ago in a pipelined engine), it may search past cliffs of a jagged ``step_rate`` without
    biasing the current drafts. ``Theta(K) = (B + sum of the top K - B survivals) *
    step_rate[K]``; ties go to the smaller ``K``.

    Returns
    -------
    torch.Tensor
        int32 ``[1]``: ``K``, for :func:`allocate_verify`.
    """
    return torch.ops.dspark_ops.plan_verify_budget(confidence, step_rate)


def allocate_verify(
    confidence: torch.Tensor, budget: torch.Tensor, *, max_verify: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-request verify lengths admitting the top ``budget - B`` survivals (stage 2).

    Ranking by fresh survivals is rank-preserving: whether ``(r, k)`` is admitted depends only on
    survivals at least as large, so the allocation is lossless for any ``budget`` that does not
    depend on the current drafts (e.g. from :func:`plan_verify_budget` on older confidences).

    Parameters
    ----------
    confidence : torch.Tensor
        float32 ``[B, G]``, as for :func:`schedule_verify`.
    budget : torch.Tensor
        int32 ``[1]``: total verify tokens ``K >= B`` (anchors included). Fewer are used when
        fewer pairs are eligible (survival 0 or past a cap).
    max_verify : torch.Tensor, optional
        int32 ``[B]``: per-request caps, each in ``[0, G]``.

    Returns
    -------
    torch.Tensor
        int32 ``[B]``: ``num_verify``.
    """
    return torch.ops.dspark_ops.allocate_verify(confidence, budget, max_verify)


def pack_verify_inputs(
    anchor: torch.Tensor, draft_tokens: torch.Tensor, num_verify: torch.Tensor, position: torch.Tensor
) -> VerifyBatch:
    """Flattens ``[x0, x_1..x_l]`` of every request into one ragged target batch.

    Parameters
    ----------
    anchor : torch.Tensor
        int64 or int32 ``[B]``: each request's anchor token ``x0``.
    draft_tokens : torch.Tensor
        int64 or int32 ``[B, G]``.
    num_verify : torch.Tensor
        int32 ``[B]``: drafts to verify per request, each in ``[0, G]``.
    position : torch.Tensor
        int64 ``[B]``: absolute position ``p0`` (in ``[0, 2**62]``) of each anchor.

    Returns
    -------
    VerifyBatch
        ``input_ids`` and ``positions`` int64 ``[B*(G+1)]`` (fixed upper-bound shape: entries
        past ``cu_seqlens[B]`` are padding, id 0 and position 0) and ``cu_seqlens`` int32
        ``[B+1]`` (exclusive prefix sums of ``num_verify + 1``). The target's logits for this
        batch are the ragged ``target_logits`` of ``verify``, with
        ``target_start=cu_seqlens[:-1]`` and ``num_draft=num_verify``.
    """
    input_ids, positions, cu_seqlens = torch.ops.dspark_ops.pack_verify_inputs(
        anchor, draft_tokens, num_verify, position
    )
    return VerifyBatch(input_ids, positions, cu_seqlens)


@torch.library.register_fake("dspark_ops::schedule_verify")
@checked_fake("schedule_verify")
def _schedule_verify_fake(confidence, step_rate, max_verify=None):
    return confidence.new_empty((confidence.shape[0],), dtype=torch.int32)


@torch.library.register_fake("dspark_ops::plan_verify_budget")
@checked_fake("plan_verify_budget")
def _plan_verify_budget_fake(confidence, step_rate):
    return confidence.new_empty((1,), dtype=torch.int32)


@torch.library.register_fake("dspark_ops::allocate_verify")
@checked_fake("allocate_verify")
def _allocate_verify_fake(confidence, budget, max_verify=None):
    return confidence.new_empty((confidence.shape[0],), dtype=torch.int32)


@torch.library.register_fake("dspark_ops::pack_verify_inputs")
@checked_fake("pack_verify_inputs")
def _pack_verify_inputs_fake(anchor, draft_tokens, num_verify, position):
    batch, block = draft_tokens.shape
    ids = draft_tokens.new_empty((batch * (block + 1),), dtype=torch.int64)
    return ids, torch.empty_like(ids), draft_tokens.new_empty((batch + 1,), dtype=torch.int32)
