"""Synthetic held-out data for sequential temperature scaling (dspark_ops.calibration): an
overconfident confidence head and the accepted lengths verification would give, and the
per-slot calibration error of a survival."""

from __future__ import annotations

import torch

import dspark_ops

CALIB_BLOCK = 5
CALIB_SAMPLES = 50000


def calibration_data(samples: int, gen: torch.Generator, block: int = CALIB_BLOCK):
    """Synthetic confidence logits 3 * logit(p) + noise for true conditional acceptance
    probabilities p in (0.3, 0.97) (an overconfident head: the right temperature is about 3), and
    the accepted lengths verification would give (sequential: accepted up to the first failure)."""
    p = 0.3 + 0.67 * torch.rand(samples, block, generator=gen, dtype=torch.float64)
    logits = 3 * torch.logit(p) + 0.3 * torch.randn(samples, block, generator=gen,
                                                    dtype=torch.float64)
    accepted = torch.rand(samples, block, generator=gen, dtype=torch.float64) < p
    return logits.float(), accepted.int().cumprod(1).sum(1).int()


def survival_ece(logits, num_accepted, tau, mask=None):
    """Per-position ECE of the survival prod_{i<=k} sigmoid(z_i / tau_i) against 1[accepted > k]."""
    survival = torch.sigmoid(logits.double() / tau.double()).cumprod(1)
    errors = []
    for k in range(logits.shape[1]):
        keep = slice(None) if mask is None else mask[:, k]
        errors.append(dspark_ops.expected_calibration_error(survival[keep, k],
                                                            (num_accepted > k)[keep]))
    return errors


def assert_near_three(tau: torch.Tensor) -> None:
    # Slot 0 sees every sample; later slots see only the survivors, and the calibration error of
    # a small survival is flat in tau, so their fits scatter more.
    assert abs(float(tau[0]) - 3) < 0.3 and ((tau > 2) & (tau < 4.5)).all(), tau
