"""Inputs of the scheduling ops (confidences, capacities, step rates), shared by
test_schedule.py and test_sim_schedule.py."""

from __future__ import annotations

import torch


def make_confidence(kind: str, batch: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [B, G] conditional confidences of one flavour."""
    shape = (batch, block)
    if kind == "uniform":
        return torch.rand(shape, generator=gen)
    if kind == "high":  # realistic heads: long survivals, few cut-offs
        return 0.6 + 0.4 * torch.rand(shape, generator=gen)
    if kind == "quantised":
        # Quarters: survivals are exact products, so pairs tie across requests and positions.
        return torch.randint(1, 5, shape, generator=gen).float() / 4
    if kind == "ones":  # every survival ties at 1: the order is position, then request
        return torch.ones(shape)
    if kind == "zeros":  # nothing is eligible
        return torch.zeros(shape)
    if kind == "zeros-mid-row":
        # Zeros (and -0.0) in the middle of rows: everything after them is ineligible.
        c = 0.5 + 0.5 * torch.rand(shape, generator=gen)
        zero = torch.rand(shape, generator=gen) < 0.15
        negative = torch.rand(shape, generator=gen) < 0.5
        return c.masked_fill(zero & negative, -0.0).masked_fill(zero & ~negative, 0.0)
    if kind == "tiny":
        # Factors down to 1e-6: survivals fall below 2^-33 (zero in fixed point) and into
        # float32 subnormals within a few positions.
        return 10 ** (-6 * torch.rand(shape, generator=gen))
    raise ValueError(kind)


def make_step_rate(kind: str, size: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [size] steps/second. ``linear``: a fixed cost plus a per-token cost comparable to
    the batch's, so some admissions improve Theta and some do not; ``tiles``: flat inside
    16-token tiles with a cliff at each boundary (tensor-core padding); ``jagged``: linear with
    ±20 % noise, so later sizes are sometimes faster than earlier ones."""
    n = torch.arange(size, dtype=torch.float64).clamp_min(1)
    if kind == "flat":
        rate = torch.ones(size, dtype=torch.float64)
    elif kind == "linear":
        rate = 5000.0 / (batch + n)
    elif kind == "tiles":
        rate = 5000.0 / (batch + 16 * torch.ceil(n / 16))
    elif kind == "jagged":
        rate = 5000.0 / (batch + n) * (0.8 + 0.4 * torch.rand(size, generator=gen,
                                                              dtype=torch.float64))
    elif kind == "steep":
        rate = 1.0 / n**2
    else:
        raise ValueError(kind)
    return rate.float()


def make_capacity(kind: str, batch: int, block: int) -> int:
    """M = len(step_rate). ``full``: every pair fits; ``tight``: about a third of the pairs fit
    (the capacity binds); ``minimal``: M = B + 1, no draft can be verified."""
    if kind == "full":
        return batch * (block + 1) + 1
    if kind == "tight":
        return batch + 1 + (batch * block) // 3
    if kind == "minimal":
        return batch + 1
    raise ValueError(kind)


def random_caps(batch: int, block: int, gen: torch.Generator) -> torch.Tensor:
    caps = torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32)
    if batch >= 3:  # both ends always present
        caps[0], caps[1] = 0, block
    return caps
