"""Sequential temperature scaling of the confidence head and the calibration error it minimises
(dspark_ops.calibration: pure PyTorch, no kernel; the calibrated confidences that feed
draft_confidence are tested in test_draft.py)."""

from __future__ import annotations

import pytest
import torch

import dspark_ops
from cases.calibration import (CALIB_BLOCK, CALIB_SAMPLES, assert_near_three, calibration_data,
                               survival_ece)
from cases.common import generator


def test_expected_calibration_error_literal():
    p = torch.tensor([0.125, 0.125, 0.875, 0.875, 1.0])
    y = torch.tensor([0, 1, 1, 1, 1])
    # 20 bins: 0.125 -> bin 2 (mean p 0.125, mean outcome 0.5), 0.875 -> bin 17 (0.875 vs 1),
    # 1.0 -> the last bin (1 vs 1).
    expected = (2 * abs(0.125 - 0.5) + 2 * abs(0.875 - 1.0) + 1 * 0.0) / 5
    assert dspark_ops.expected_calibration_error(p, y) == pytest.approx(expected, abs=1e-7)
    assert dspark_ops.expected_calibration_error(p, y, num_bins=1) == pytest.approx(
        abs(float(p.double().mean()) - 0.8), abs=1e-7)
    assert dspark_ops.expected_calibration_error(torch.zeros(0), torch.zeros(0)) == 0.0
    perfect = torch.tensor([0.0, 0.0, 1.0])
    assert dspark_ops.expected_calibration_error(perfect, perfect.bool()) == 0.0


@pytest.mark.parametrize("samples", [1, 37, 2000])
def test_grid_errors_are_the_calibration_error_of_each_temperature(samples, monkeypatch):
    """The fit scores the whole grid at once; each score is the one-temperature ECE, bitwise,
    also when the grid is split into blocks (a tiny block budget forces several)."""
    from dspark_ops import calibration

    gen = generator(samples)
    before = torch.rand(samples, generator=gen, dtype=torch.float64)
    logit = 4 * torch.randn(samples, generator=gen, dtype=torch.float64)
    outcome = (torch.rand(samples, generator=gen) < 0.6).double()
    grid = torch.tensor([0.05, 0.3, 1.0, 1.0, 2.5, 7.0, 20.0], dtype=torch.float64)
    expected = torch.tensor([dspark_ops.expected_calibration_error(
        before * torch.sigmoid(logit / t), outcome, 7) for t in grid.tolist()],
        dtype=torch.float64)
    errors = calibration._grid_calibration_errors(before, logit, outcome, grid, 7)
    assert torch.equal(errors, expected)
    monkeypatch.setattr(calibration, "_GRID_BLOCK_ELEMENTS", 3 * samples)
    assert torch.equal(calibration._grid_calibration_errors(before, logit, outcome, grid, 7),
                       expected)


def test_sequential_temperatures_fix_overconfidence():
    gen = generator(121)
    train_logits, train_accepted = calibration_data(CALIB_SAMPLES, gen)
    test_logits, test_accepted = calibration_data(CALIB_SAMPLES, gen)
    tau = dspark_ops.fit_sequential_temperatures(train_logits, train_accepted)
    assert tau.dtype == torch.float32 and tau.shape == (CALIB_BLOCK,)
    assert_near_three(tau)
    before = survival_ece(test_logits, test_accepted, torch.ones(CALIB_BLOCK))
    after = survival_ece(test_logits, test_accepted, tau)
    assert all(e > 0.05 for e in before), before
    assert all(e < 0.02 for e in after), after
    # A custom grid: the temperatures come from it.
    grid = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0])
    coarse = dspark_ops.fit_sequential_temperatures(train_logits, train_accepted, grid=grid)
    assert all(float(t) in grid.tolist() for t in coarse)
    assert (coarse == 3.0).sum() >= CALIB_BLOCK - 1, coarse


def test_sequential_temperatures_respect_num_verified():
    # Slot k is fitted only on samples that verified more than k drafts: what the unverified slots'
    # logits hold does not matter, and the fit on the masked data still finds ~3 (treating the
    # unverified drafts as rejections would not).
    gen = generator(122)
    logits, full_accepted = calibration_data(CALIB_SAMPLES, gen)
    verified = torch.randint(1, CALIB_BLOCK + 1, (CALIB_SAMPLES,), generator=gen).int()
    verified[:CALIB_SAMPLES // 2] = CALIB_BLOCK  # enough samples reach every slot
    accepted = torch.minimum(full_accepted, verified)
    unverified = torch.arange(CALIB_BLOCK)[None] >= verified[:, None]
    junk_a = torch.where(unverified, 40.0, logits)
    junk_b = torch.where(unverified, torch.randn(logits.shape, generator=gen) * 10, logits)
    tau_a = dspark_ops.fit_sequential_temperatures(junk_a, accepted, num_verified=verified)
    tau_b = dspark_ops.fit_sequential_temperatures(junk_b, accepted, num_verified=verified.long())
    assert torch.equal(tau_a, tau_b)
    assert_near_three(tau_a)
    ignored = dspark_ops.fit_sequential_temperatures(junk_a, accepted)
    assert not torch.equal(ignored, tau_a)
    # A slot no sample verified keeps temperature 1.
    short = torch.minimum(verified, torch.tensor(CALIB_BLOCK - 1, dtype=torch.int32))
    tau_short = dspark_ops.fit_sequential_temperatures(
        logits, torch.minimum(accepted, short), num_verified=short)
    assert float(tau_short[-1]) == 1.0
    assert_near_three(tau_short[:-1])
