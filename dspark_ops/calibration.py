"""Calibration of the confidence head: sequential temperature scaling and the expected calibration
error it minimises. Pure PyTorch, any device; the fitted temperatures are
:func:`dspark_ops.draft_confidence`'s ``calib_temperature``."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["expected_calibration_error", "fit_sequential_temperatures"]


def expected_calibration_error(
    probability: torch.Tensor, outcome: torch.Tensor, num_bins: int = 20
) -> float:
    """ECE over equal-width bins of ``[0, 1]``: ``sum_bins (n_bin / n) |mean p - mean outcome|``."""
    p = probability.double().flatten()
    y = outcome.double().flatten()
    if p.numel() == 0:
        return 0.0
    return float(_binned_errors(p[None], y, num_bins)[0])


def fit_sequential_temperatures(
    confidence_logits: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    num_verified: Optional[torch.Tensor] = None,
    grid: Optional[torch.Tensor] = None,
    num_bins: int = 20,
) -> torch.Tensor:
    """Sequential temperature scaling of the confidence head (the DSpark paper, §3.2.1).

    From left to right, slot ``k``'s temperature is the grid value minimising the expected
    calibration error of the survival ``prod_{i<=k} sigmoid(z_i / tau_i)`` against the outcome
    "the first ``k + 1`` drafts were all accepted", with the temperatures of earlier slots held
    fixed. Temperature scaling keeps each slot's ranking, so it changes what the scheduler
    believes, never the order in which it admits a request's drafts.

    Parameters
    ----------
    confidence_logits : torch.Tensor
        ``[N, G]`` held-out confidence logits (``w . [h_j; W1[x_j]] + b``, before the sigmoid).
    num_accepted : torch.Tensor
        int ``[N]``: how many drafts of each sample were accepted (``verify``'s ``num_accepted``).
    num_verified : torch.Tensor, optional
        int ``[N]``: how many drafts of each sample were verified (default ``G``); slot ``k`` is
        fitted on the samples with ``num_verified > k`` only.
    grid : torch.Tensor, optional
        Candidate temperatures (positive); default 241 values spaced geometrically over
        ``[0.05, 20]``, plus 1.
    num_bins : int
        Bins of the calibration error (20, as DeepSpec's evaluator uses).

    Returns
    -------
    torch.Tensor
        float32 ``[G]``: ``calib_temperature`` for :func:`dspark_ops.draft_confidence`.
    """
    logits = confidence_logits.double()
    samples, block = logits.shape
    accepted = num_accepted.long().to(logits.device)
    verified = (
        torch.full_like(accepted, block) if num_verified is None
        else num_verified.long().to(logits.device)
    )
    if grid is None:
        grid = torch.cat([torch.logspace(-1.30103, 1.30103, 241, dtype=torch.float64),
                          torch.ones(1, dtype=torch.float64)])
    grid = grid.double().to(logits.device)
    temperatures = torch.ones(block, dtype=torch.float64, device=logits.device)
    survival_before = torch.ones(samples, dtype=torch.float64, device=logits.device)
    for k in range(block):
        seen = verified > k
        if bool(seen.any()):
            errors = _grid_calibration_errors(survival_before[seen], logits[seen, k],
                                              (accepted[seen] > k).double(), grid, num_bins)
            temperatures[k] = grid[int(errors.argmin())]
        survival_before = survival_before * torch.sigmoid(logits[:, k] / temperatures[k])
    return temperatures.float()


# Probabilities scored at once by the grid search (float64 and int64 copies: ~256 MB).
_GRID_BLOCK_ELEMENTS = 1 << 24


def _grid_calibration_errors(before: torch.Tensor, logit: torch.Tensor, outcome: torch.Tensor,
                             grid: torch.Tensor, num_bins: int) -> torch.Tensor:
    """``expected_calibration_error(before * sigmoid(logit / t), outcome)`` for every ``t`` of
    ``grid`` at once: one binned scatter per block of temperatures (at most ~16M probabilities
    in memory), each row summed in the same order as the one-temperature function."""
    errors = torch.empty(grid.numel(), dtype=torch.float64, device=grid.device)
    step = max(1, _GRID_BLOCK_ELEMENTS // max(before.numel(), 1))
    for first in range(0, grid.numel(), step):
        t = grid[first:first + step, None]
        errors[first:first + step] = _binned_errors(
            before[None] * torch.sigmoid(logit[None] / t), outcome, num_bins)
    return errors


def _binned_errors(p: torch.Tensor, outcome: torch.Tensor, num_bins: int) -> torch.Tensor:
    """The ECE of each row of float64 ``p`` ``[T, n]`` against float64 ``outcome`` ``[n]``: one
    scatter into ``T * num_bins`` bins, each row's elements added in order."""
    rows, n = p.shape
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    bins += torch.arange(rows, device=p.device)[:, None] * num_bins
    gap = torch.zeros(rows * num_bins, dtype=torch.float64, device=p.device)
    gap.index_add_(0, bins.flatten(), (p - outcome[None]).flatten())
    return gap.view(rows, num_bins).abs().sum(1) / n
