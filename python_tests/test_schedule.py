"""Scheduling ops (docs/semantics.md §3.4): schedule_verify, plan_verify_budget, allocate_verify
and pack_verify_inputs against reference.py, hand-worked cases, properties, light and heavy load,
scheduler losslessness (docs/semantics.md §5) through verify, profile_step_rate and every argument
check.

Indexing of ``step_rate`` used throughout: ``step_rate[n]`` is the rate of a verify batch of ``n``
tokens *including the anchors*, so B requests verifying ℓ_r drafts each read
``step_rate[B + Σ ℓ_r]``; with no draft verified the batch is ``step_rate[B]``, and entries below
B are never read (the tests put absurd values there to catch an off-by-one).
"""

from __future__ import annotations

import time

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import CUDA_AVAILABLE, DEVICES, cuda_only, full_tests, non_contiguous
from stats import binomial_z, chi_square, chi_square_passes
from cases.arguments import (
    error_params, per_request_errors, raises, skip_value_checks_without_debug, with_overrides,
)
from cases.common import DEBUG
from cases.schedule import (
    make_capacity,
    make_confidence,
    make_step_rate,
    random_caps,
)

INF = float("inf")
NAN = float("nan")
INT32_MAX = 2**31 - 1
FIXED_POINT_ZERO = 2.0**-33  # survivals at or below this add nothing to tau (fixed point 2^32)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def i32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def f32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# Building inputs
# --------------------------------------------------------------------------------------------

CONFIDENCE_KINDS = ["uniform", "high", "quantised", "ones", "zeros", "zeros-mid-row", "tiny"]


RATE_KINDS = ["flat", "linear", "tiles", "jagged", "steep"]


M_KINDS = ["full", "tight", "minimal"]


# --------------------------------------------------------------------------------------------
# Comparing with the reference
# --------------------------------------------------------------------------------------------


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str):
    assert got.dtype == torch.int32, (what, got.dtype)
    assert got.device == expected.device, (what, got.device, expected.device)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    if not torch.equal(got, expected):
        bad = (got != expected).nonzero().flatten()[:8].tolist()
        raise AssertionError(
            f"{what}: differs from the reference at {bad}: got {got.cpu()[bad].tolist()}, "
            f"expected {expected.cpu()[bad].tolist()}")


def check_against_reference(confidence, step_rate, max_verify=None, budgets=(), what=""):
    """schedule_verify, plan_verify_budget and allocate_verify (with the plan's budget and with
    ``budgets``) equal the reference exactly. Returns (num_verify, budget)."""
    got = dspark_ops.schedule_verify(confidence, step_rate, max_verify=max_verify)
    assert_same(got, reference.schedule_verify(confidence, step_rate, max_verify=max_verify),
                f"schedule_verify {what}")
    budget = dspark_ops.plan_verify_budget(confidence, step_rate)
    assert_same(budget, reference.plan_verify_budget(confidence, step_rate),
                f"plan_verify_budget {what}")
    for b in [budget, *budgets]:
        b = b if isinstance(b, torch.Tensor) else i32(b, device=confidence.device)
        assert_same(dspark_ops.allocate_verify(confidence, b, max_verify=max_verify),
                    reference.allocate_verify(confidence, b, max_verify=max_verify),
                    f"allocate_verify budget={int(b)} {what}")
    return got, budget


def run_combos(confidence, gen, combos):
    """Every (rate kind, capacity kind, capped) combination of ``combos`` against the reference,
    with allocate budgets B, a random one, one past every pair, and INT32_MAX."""
    batch, block = confidence.shape
    device = confidence.device
    for rate_kind, m_kind, capped in combos:
        size = make_capacity(m_kind, batch, block)
        rate = make_step_rate(rate_kind, size, batch, gen).to(device)
        caps = random_caps(batch, block, gen).to(device) if capped else None
        budgets = [batch, int(torch.randint(batch, batch * (block + 1) + 1, (1,), generator=gen)),
                   batch * (block + 1) + 1, INT32_MAX]
        check_against_reference(confidence, rate, caps, budgets,
                                what=f"(rate={rate_kind}, M={m_kind}={size}, caps={capped})")


ALL_COMBOS = [(r, m, (i + j) % 2 == 1) for i, r in enumerate(RATE_KINDS)
              for j, m in enumerate(M_KINDS)]
SMALL_SHAPES = [(1, 0), (1, 1), (1, 7), (1, 32), (3, 0), (3, 1), (3, 7), (3, 16), (3, 32),
                (64, 1), (64, 7), (64, 16), (64, 32)]


def _shape_id(shape):
    return "B{}-G{}".format(*shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("kind", CONFIDENCE_KINDS)
def test_matches_reference(device, shape, kind):
    gen = generator((shape[0] * 1000 + shape[1]) * 31 + CONFIDENCE_KINDS.index(kind))
    confidence = make_confidence(kind, *shape, gen).to(device)
    run_combos(confidence, gen, ALL_COMBOS)


# Large batches: few (the reference walks the pairs in Python). The CUDA kernel sorts up to
# 16384 keys (1024 x 16) in shared memory and more (513 x 32 rounds up to 32768) in a global
# workspace.
LARGE_CASES = [(257, 7, "quantised"), (257, 16, "high"), (256, 16, "uniform"),
               (1024, 0, "uniform"), (1024, 1, "quantised"), (1024, 7, "zeros-mid-row"),
               (1024, 16, "ones"), (1024, 16, "quantised"), (513, 32, "uniform"),
               (1024, 32, "high"), (1024, 32, "tiny")]
LARGE_COMBOS = [("linear", "full", False), ("tiles", "tight", True), ("jagged", "full", True),
                ("flat", "tight", False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,block,kind", LARGE_CASES,
                         ids=["B{}-G{}-{}".format(*c) for c in LARGE_CASES])
def test_matches_reference_large(device, batch, block, kind):
    gen = generator(batch * 100 + block + 7 * CONFIDENCE_KINDS.index(kind))
    confidence = make_confidence(kind, batch, block, gen).to(device)
    run_combos(confidence, gen, LARGE_COMBOS)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_random_sweep(device):
    # Random shapes, flavours and step rates; DSPARK_OPS_TEST_FULL=1 runs many more.
    gen = generator(4242)
    for _ in range(300 if full_tests() else 25):
        batch = int(torch.randint(1, 100, (1,), generator=gen))
        block = int(torch.randint(0, 33, (1,), generator=gen))
        kind = CONFIDENCE_KINDS[int(torch.randint(0, len(CONFIDENCE_KINDS), (1,), generator=gen))]
        confidence = make_confidence(kind, batch, block, gen).to(device)
        size = int(torch.randint(batch + 1, batch * (block + 1) + 3, (1,), generator=gen))
        rate_kind = RATE_KINDS[int(torch.randint(0, len(RATE_KINDS), (1,), generator=gen))]
        rate = make_step_rate(rate_kind, size, batch, gen).to(device)
        caps = random_caps(batch, block, gen).to(device)
        for cap in (None, caps):
            check_against_reference(confidence, rate, cap, [batch + 1],
                                    what=f"(B={batch}, G={block}, {kind}, {rate_kind}, M={size})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["strided", "padded", "transposed"])
def test_non_contiguous_inputs(device, layout):
    # Gaps hold NaN (confidence, step rate) or INT32_MIN (caps): an op that read them would
    # see values outside every valid range.
    gen = generator(5)
    batch, block = 37, 9
    confidence = make_confidence("quantised", batch, block, gen)
    confidence[::3] = make_confidence("high", (batch + 2) // 3, block, gen)
    rate = make_step_rate("jagged", batch * 4, batch, gen)
    confidence, rate = confidence.to(device), rate.to(device)
    caps = random_caps(batch, block, gen).to(device)
    if layout == "transposed":
        strided_confidence = confidence.t().contiguous().t()
    else:  # built on the device: .to() would make a layout with gaps contiguous
        strided_confidence = non_contiguous(confidence, layout)
    args = [(confidence, rate, caps),
            (strided_confidence, non_contiguous(rate), non_contiguous(caps))]
    assert not any(t.is_contiguous() for t in args[1])
    results = []
    for c, r, m in args:
        budget = dspark_ops.plan_verify_budget(c, r)
        results.append((dspark_ops.schedule_verify(c, r, max_verify=m), budget,
                        dspark_ops.allocate_verify(c, budget, max_verify=m),
                        dspark_ops.allocate_verify(c, budget)))
    for got, expected in zip(results[1], results[0]):
        assert torch.equal(got, expected)
    check_against_reference(*args[1])


@pytest.mark.parametrize("device", DEVICES)
def test_output_contract(device):
    gen = generator(6)
    confidence = make_confidence("uniform", 5, 3, gen).to(device)
    rate = make_step_rate("linear", 9, 5, gen).to(device)
    for out, shape in [(dspark_ops.schedule_verify(confidence, rate), (5,)),
                       (dspark_ops.plan_verify_budget(confidence, rate), (1,)),
                       (dspark_ops.allocate_verify(confidence, i32(7, device=device)), (5,))]:
        assert out.dtype == torch.int32 and out.shape == shape
        assert out.device == confidence.device and out.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    confidence = torch.rand(0, 4, generator=generator(7)).to(device)
    rate = f32(1.0, 0.5, device=device)
    assert dspark_ops.schedule_verify(confidence, rate).shape == (0,)
    assert dspark_ops.plan_verify_budget(confidence, rate).tolist() == [0]
    assert dspark_ops.allocate_verify(confidence, i32(3, device=device)).shape == (0,)


# --------------------------------------------------------------------------------------------
# Hand-worked cases
# --------------------------------------------------------------------------------------------


def schedule_all(confidence, step_rate, budget=None, max_verify=None):
    """(schedule_verify, plan_verify_budget, allocate_verify with ``budget`` or the plan's) as
    lists, each checked against the reference."""
    num_verify, plan = check_against_reference(confidence, step_rate, max_verify)
    budget = plan if budget is None else i32(budget, device=confidence.device)
    allocated = dspark_ops.allocate_verify(confidence, budget, max_verify=max_verify)
    assert_same(allocated, reference.allocate_verify(confidence, budget, max_verify=max_verify),
                "allocate_verify")
    return num_verify.tolist(), int(plan), allocated.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_literal_flat_rate_verifies_every_eligible_draft(device):
    # Survivals: request 0: 0.9, 0.45, 0 (x3 ineligible); request 1: 1, 0.25, 0.125.
    # A flat rate makes every admission improve Theta = tau: num_verify = [2, 3], K = 2 + 5.
    c = f32([0.9, 0.5, 0.0], [1.0, 0.25, 0.5], device=device)
    rate = torch.ones(9, device=device)
    assert schedule_all(c, rate) == ([2, 3], 7, [2, 3])
    # Caps cut the lengths and the plan (which ignores caps) does not change.
    assert schedule_all(c, rate, max_verify=i32(1, 2, device=device)) == ([1, 2], 7, [1, 2])


@pytest.mark.parametrize("device", DEVICES)
def test_literal_early_stop(device):
    # One request, survivals 0.5, 0.25, 0.125; step_rate[0] = 1000 is never read.
    #   Theta(N=1) = 1.0  * 1.0 = 1.0
    #   Theta(N=2) = 1.5  * 0.8 = 1.2    improves: admit x1
    #   Theta(N=3) = 1.75 * 0.3 = 0.525  does not improve: stop (num_verify = 1)
    #   Theta(N=4) = 1.875 * 1.0 = 1.875 the global best, which only the plan may look at: K = 4
    c = f32([0.5, 0.5, 0.5], device=device)
    rate = f32(1000.0, 1.0, 0.8, 0.3, 1.0, device=device)
    assert schedule_all(c, rate) == ([1], 4, [3])
    assert schedule_all(c, rate, budget=3) == ([1], 4, [2])


@pytest.mark.parametrize("device", DEVICES)
def test_literal_step_rate_indexing(device):
    # step_rate[n] is the rate of an n-token batch, anchors included. One request, c = 0.5:
    # Theta(0) = 1 * step_rate[1], Theta(1) = 1.5 * step_rate[2]. Entry 0 (1000) is never read.
    c = f32([0.5], device=device)
    assert schedule_all(c, f32(1000.0, 1.0, 0.7, device=device))[:2] == ([1], 2)   # 1.05 > 1
    assert schedule_all(c, f32(1000.0, 1.0, 0.66, device=device))[:2] == ([0], 1)  # 0.99 < 1
    # Two requests start at step_rate[2]: Theta = 2 * 1, then 2.5 * 0.85 = 2.125 (admit (0, 0)),
    # then 3 * 0.7 = 2.1 (stop). Entries 0 and 1 are never read.
    c2 = f32([0.5], [0.5], device=device)
    rate = f32(1000.0, 1000.0, 1.0, 0.85, 0.7, device=device)
    assert schedule_all(c2, rate) == ([1, 0], 3, [1, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("via", ["capacity", "budget"])
def test_literal_tie_order(device, via):
    # Survivals: request 0: 0.5, 0.5; request 1: 0.5, 0.5; request 2: 0.5, 0.25. Admission
    # order: equal survivals by position, then request: (0,0) (1,0) (2,0) (0,1) (1,1), then
    # (2,1) at 0.25. With a flat rate, admitting k pairs (capacity M = B + k + 1, or budget
    # B + k) gives:
    c = f32([0.5, 1.0], [0.5, 1.0], [0.5, 0.5], device=device)
    expected = {1: [1, 0, 0], 2: [1, 1, 0], 3: [1, 1, 1],  # position 0 of request 2 beats
                4: [2, 1, 1],  # position 1 of request 0; the cut between tied (0,1) and (1,1)
                5: [2, 2, 1], 6: [2, 2, 2]}  # goes to the smaller request
    for k, lengths in expected.items():
        if via == "capacity":
            rate = torch.ones(3 + k + 1, device=device)
            assert schedule_all(c, rate)[0] == lengths, k
        else:
            assert schedule_all(c, torch.ones(10, device=device), budget=3 + k)[2] == lengths, k


@pytest.mark.parametrize("device", DEVICES)
def test_literal_tie_position_before_request(device):
    # Request 0: 1.0, 0.5; request 1: 0.5, 0.5. After (0,0), the tied pairs at 0.5 go (1,0)
    # (smaller position), (0,1), (1,1): two admissions give [1, 1], not [2, 0].
    c = f32([1.0, 0.5], [0.5, 1.0], device=device)
    assert schedule_all(c, torch.ones(5, device=device))[0] == [1, 1]
    assert schedule_all(c, torch.ones(6, device=device))[0] == [2, 1]
    assert schedule_all(c, torch.ones(8, device=device), budget=4)[2] == [1, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_literal_all_ones_capacity(device):
    # Every survival is 1: pairs go position-major. Capacity M = 11 lets 3 + 7 < 11 tokens in:
    # positions 0 and 1 of all three requests and position 2 of request 0.
    c = torch.ones(3, 4, device=device)
    assert schedule_all(c, torch.ones(11, device=device)) == ([3, 2, 2], 10, [3, 2, 2])


@pytest.mark.parametrize("device", DEVICES)
def test_literal_minimal_capacity_and_zeros(device):
    # M = B + 1: a batch of B + 1 tokens is not allowed, so nothing is verified and K = B.
    c = f32([0.9, 0.9], [0.8, 0.7], device=device)
    assert schedule_all(c, f32(1.0, 1.0, 1.0, device=device)) == ([0, 0], 2, [0, 0])
    assert schedule_all(c, f32(1.0, 1.0, 1.0, device=device), budget=6)[2] == [2, 2]
    # All-zero confidences: nothing is eligible, whatever the rate or budget.
    z = torch.zeros(2, 3, device=device)
    assert schedule_all(z, torch.ones(9, device=device), budget=INT32_MAX) == ([0, 0], 2, [0, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_literal_steep_rate_verifies_nothing(device):
    # step_rate[n] = 1/n^2: admitting a pair at N tokens needs a > tau * ((N+1)^2/N^2 - 1)
    # = 2.5 for B = N = 2, tau = 2: impossible for a survival <= 1.
    c = f32([1.0, 0.9], [0.95, 0.9], device=device)
    rate = (1.0 / torch.arange(1, 8, dtype=torch.float64).square()).float().to(device)
    rate = torch.cat([rate[:1], rate])
    assert schedule_all(c, rate)[:2] == ([0, 0], 2)


@pytest.mark.parametrize("device", DEVICES)
def test_literal_fixed_point_zero_survival(device):
    # tau is accumulated in fixed point (survival * 2^32, rounded half to even): a survival
    # below 2^-33 adds 0 and so never strictly improves Theta, even at a flat rate, although it
    # is eligible (> 0) for allocate_verify. Survivals: 1e-5, 1e-10 (< 2^-33 = 1.16e-10), 5e-11.
    c = f32([1e-5, 1e-5, 0.5], device=device)
    rate = torch.ones(5, device=device)
    assert schedule_all(c, rate, budget=4) == ([1], 2, [3])
    assert float(c[0, 0] * c[0, 1]) < FIXED_POINT_ZERO
    # Exactly 2^-33 rounds to 0 (half to even), 3 * 2^-33 to 2.
    c = torch.tensor([[FIXED_POINT_ZERO, 1.0], [3 * FIXED_POINT_ZERO, 1.0]], device=device)
    assert schedule_all(c, torch.ones(7, device=device))[0] == [0, 2]


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


def eligible_lengths(confidence, max_verify=None) -> torch.Tensor:
    """Per request: the index of the first survival <= 0 (or G), capped by max_verify."""
    a = reference.survivals(confidence.cpu())
    batch, block = a.shape
    positive = (a > 0).int().cumprod(1).sum(1)
    if max_verify is not None:
        positive = torch.minimum(positive, max_verify.cpu())
    assert batch == 0 or int(positive.max()) <= block
    return positive.int()


def rank_keys(confidence) -> torch.Tensor:
    """int64 [B, G] that orders pairs as docs/semantics.md §3.4 does: survival descending, then
    position, then request (non-negative float32 values order like their bit patterns)."""
    a = reference.survivals(confidence.cpu()).clamp_min(0)
    batch, block = a.shape
    bits = a.view(torch.int32).long()
    j = torch.arange(block)[None, :]
    r = torch.arange(batch)[:, None]
    return (2**31 - bits) * (batch * block + 1) + j * batch + r


def check_admitted_set(confidence, num_verify, max_verify=None):
    """num_verify in [0, G] and under the caps; the admitted pairs {(r, j): j < num_verify[r]}
    are eligible and rank before every eligible pair that was not admitted."""
    nv = num_verify.cpu().long()
    batch, block = confidence.shape
    assert ((nv >= 0) & (nv <= block)).all(), nv
    if max_verify is not None:
        assert (nv <= max_verify.cpu()).all()
    eligible = eligible_lengths(confidence, max_verify).long()
    assert (nv <= eligible).all(), "an ineligible pair was admitted"
    if block == 0:
        return
    keys = rank_keys(confidence)
    j = torch.arange(block)[None, :]
    admitted = j < nv[:, None]
    left_out = (j < eligible[:, None]) & ~admitted
    if admitted.any() and left_out.any():
        assert keys[admitted].max() < keys[left_out].min(), "admitted set is not a ranking prefix"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_properties(device, seed):
    gen = generator(100 + seed)
    batch = [1, 3, 17, 64, 200, 5][seed]
    block = [7, 32, 16, 5, 3, 1][seed]
    kind = ["uniform", "quantised", "high", "zeros-mid-row", "ones", "tiny"][seed]
    confidence = make_confidence(kind, batch, block, gen).to(device)
    caps = random_caps(batch, block, gen).to(device)
    everything = eligible_lengths(confidence)
    for rate_kind in RATE_KINDS:
        for m_kind in ("full", "tight"):
            size = make_capacity(m_kind, batch, block)
            rate = make_step_rate(rate_kind, size, batch, gen).to(device)
            where = (rate_kind, m_kind)
            for cap in (None, caps):
                nv = dspark_ops.schedule_verify(confidence, rate, max_verify=cap)
                check_admitted_set(confidence, nv, cap)
                assert batch + int(nv.sum()) < size, where  # never M tokens or more
                # Both admit a prefix of the same ranking, so the schedule is an allocation.
                budget = i32(batch + int(nv.sum()), device=device)
                assert torch.equal(dspark_ops.allocate_verify(confidence, budget, max_verify=cap),
                                   nv), where
            k = int(dspark_ops.plan_verify_budget(confidence, rate))
            assert batch <= k < size, where
            nv = dspark_ops.schedule_verify(confidence, rate)
            # Theta strictly rises up to the schedule's stop, so the global argmax is not earlier.
            assert k - batch >= int(nv.sum()), where
            # The plan only counts eligible pairs: allocating K admits exactly K - B of them.
            allocated = dspark_ops.allocate_verify(confidence, i32(k, device=device))
            assert int(allocated.sum()) == k - batch, where
            check_admitted_set(confidence, allocated)
    # Budgets: B admits nothing, more than B*(G+1) admits everything; lengths grow with it.
    for cap in (None, caps):
        previous = torch.zeros(batch, dtype=torch.int32)
        for budget in [batch, batch + 1, batch + 2, batch + batch * block // 2,
                       batch * (block + 1), batch * (block + 1) + 5, INT32_MAX]:
            got = dspark_ops.allocate_verify(confidence, i32(budget, device=device),
                                             max_verify=cap).cpu()
            check_admitted_set(confidence, got, cap)
            assert int(got.sum()) == min(budget - batch,
                                         int(eligible_lengths(confidence, cap).sum()))
            if budget == batch:
                assert not got.any()
            if budget >= batch * (block + 1):
                assert torch.equal(got, eligible_lengths(confidence, cap))
            assert (got >= previous).all()
            previous = got
    assert torch.equal(dspark_ops.allocate_verify(confidence, i32(INT32_MAX, device=device)).cpu(),
                       everything)


# --------------------------------------------------------------------------------------------
# Light and heavy load
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,block", [(1, 32), (8, 7), (64, 16)])
def test_light_load_verifies_every_draft(device, batch, block):
    # A flat step rate (the target costs the same for any batch that fits): every admission
    # raises tau, so every draft with survival > 0 is verified. Factors >= 0.6 keep survivals
    # above 0.6^32 >> 2^-33 (see test_literal_fixed_point_zero_survival for smaller ones).
    gen = generator(batch + block)
    confidence = make_confidence("zeros-mid-row", batch, block, gen)
    confidence = torch.where(confidence > 0, 0.6 + 0.4 * confidence, confidence).to(device)
    a = reference.survivals(confidence.cpu())
    assert (a[a > 0] > FIXED_POINT_ZERO).all()
    caps = random_caps(batch, block, gen).to(device)
    rate = torch.full((batch * (block + 1) + 1,), 123.0, device=device)
    for cap in (None, caps):
        expected = eligible_lengths(confidence, cap).to(device)
        num_verify, budget = check_against_reference(confidence, rate, cap)
        assert torch.equal(num_verify, expected)
        assert torch.equal(dspark_ops.allocate_verify(confidence, budget, max_verify=cap),
                           expected)
    assert int(budget) == batch + int(eligible_lengths(confidence).sum())


# step_rate[n] = 1 / n^p: p = 0 is flat, p = 2 makes every extra token cost more than any
# survival can pay for.
STEEPNESS = [0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0]


@pytest.mark.parametrize("device", DEVICES)
def test_heavy_load_budgets_shrink(device):
    gen = generator(11)
    batch, block = 64, 8
    confidence = make_confidence("high", batch, block, gen).to(device)
    size = batch * (block + 1) + 1
    n = torch.arange(size, dtype=torch.float64).clamp_min(1)
    totals, plans = [], []
    for p in STEEPNESS:
        rate = (1.0 / n**p).float().to(device)
        num_verify, budget = check_against_reference(confidence, rate)
        totals.append(int(num_verify.sum()))
        plans.append(int(budget) - batch)
    # Admitting the k-th pair needs tau_k / tau_{k-1} > (N_k / N_{k-1})^p: a steeper profile
    # stops earlier, and the global argmax of log tau_K - p log K moves to smaller K.
    assert totals == sorted(totals, reverse=True), totals
    assert plans == sorted(plans, reverse=True), plans
    assert totals[0] == batch * block  # flat: every draft
    # Mild (p = 0.25) already trims the least likely drafts; steeper profiles trim more.
    assert totals[5] < totals[4] < totals[3] < totals[0], totals
    assert totals[-1] == 0 and plans[-1] == 0, (totals, plans)  # heavy: anchors only


@pytest.mark.parametrize("device", DEVICES)
def test_heavy_load_linear_cost(device):
    # The same with a realistic cost model, time(n) = t0 + t1 * n: raising the per-token cost
    # t1 (a busier target) shrinks the budget monotonically.
    gen = generator(12)
    batch, block = 32, 7
    confidence = make_confidence("uniform", batch, block, gen).to(device)
    n = torch.arange(batch * (block + 1) + 1, dtype=torch.float64).clamp_min(1)
    totals = []
    for per_token in [0.0, 0.001, 0.01, 0.03, 0.1, 1.0]:
        rate = (1.0 / (1.0 + per_token * n)).float().to(device)
        totals.append(int(check_against_reference(confidence, rate)[0].sum()))
    assert totals == sorted(totals, reverse=True), totals
    assert totals[0] == batch * block and totals[-1] < totals[2] < totals[0], totals


# --------------------------------------------------------------------------------------------
# Scheduler losslessness (docs/semantics.md §5)
# --------------------------------------------------------------------------------------------
#
# One request, G = 2, vocabulary {A = 0, B = 1}. Target p = (0.7, 0.3) at every position,
# draft q = (0.5, 0.5). c1 = 0.8 (a1 = 0.8); c2 = 0.9 after x1 = A and 0 after x1 = B, so the
# confidence of x2 depends on the draft x1 itself. SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45 are
# step_rate[1..3] (a batch of 1 + ℓ tokens); step_rate[0] is never read.
#
# Algorithm 1: Theta(ℓ=0) = 1 * 1.0 = 1.0; admitting x1 gives 1.8 * 0.5 = 0.9: stop, ℓ = 0 for
# every x1, and the emitted token is drawn from p.
# Retrospective (argmax over ℓ of Theta, no early stop): Theta(ℓ=2) = (1 + 0.8 + 0.72) * 0.45
# = 1.134 > 1.0 when x1 = A, but 1.8 * 0.45 = 0.81 when x1 = B: ℓ = 2 iff x1 = A. x1 = A is
# then always accepted (p(A) = 0.7 >= q(A) = 0.5), so P(first token = A) = 0.5 + 0.5 * 0.7
# = 0.85, not 0.7.
# plan (on a stale confidence [0.8, 0.9]) gives K = 3 (Theta 1.134) whatever x1 is; allocating
# the top K - B = 2 fresh pairs verifies x1 always (ℓ = 2 after A, 1 after B): lossless.

TOKEN_A, TOKEN_B = 0, 1
P_TARGET = torch.tensor([0.7, 0.3], dtype=torch.float64)
Q_DRAFT = torch.tensor([0.5, 0.5], dtype=torch.float64)
EXAMPLE_STEP_RATE = [1.0, 1.0, 0.5, 0.45]
BUSIER_STEP_RATE = [1.0, 1.0, 0.6, 0.45]  # Theta(ℓ=1) = 1.08 > 1: x1 is worth verifying
LOSSLESS_TRIALS = 4000


def example_confidence(x1: torch.Tensor) -> torch.Tensor:
    c2 = torch.where(x1 == TOKEN_A, 0.9, 0.0)
    return torch.stack([torch.full_like(c2, 0.8), c2], 1).float()


def per_trial(op):
    """Schedules each trial alone (B = 1): a batched call would couple the trials through the
    shared budget."""
    return lambda confidence: torch.cat([op(confidence[t:t + 1])
                                         for t in range(confidence.shape[0])])


def retrospective_schedule(step_rate: torch.Tensor):
    """A global search over every prefix length ℓ of one request (no early stop), applied to
    each trial alone: the decision to verify x1 then depends on c2, i.e. on x1."""
    rates = step_rate.double().cpu()

    def schedule(confidence):
        a = reference.survivals(confidence.cpu()).double()
        trials, block = a.shape
        tau = 1 + torch.cat([torch.zeros(trials, 1, dtype=torch.float64), a.cumsum(1)], 1)
        theta = tau * rates[1:block + 2]
        # Only prefixes of eligible drafts (survival > 0) are candidates.
        eligible = torch.cat([torch.ones(trials, 1, dtype=torch.bool), a > 0], 1).cumprod(1)
        theta = torch.where(eligible.bool(), theta, -INF)
        return theta.argmax(1).int().to(confidence.device)  # ties: the smaller ℓ

    return schedule


def run_two_token_example(schedule, device, seed, trials=LOSSLESS_TRIALS):
    """Draws x1, x2 ~ q per trial, schedules with ``schedule(confidence [T, 2])``, verifies all
    trials in one launch (per-request, independent streams). Returns (tokens, num_verify, x1)."""
    gen = generator(seed)
    drafts = torch.multinomial(Q_DRAFT, 2 * trials, replacement=True, generator=gen)
    drafts = drafts.reshape(trials, 2)
    confidence = example_confidence(drafts[:, 0]).to(device)
    num_verify = schedule(confidence)
    assert num_verify.dtype == torch.int32 and num_verify.shape == (trials,)
    target = P_TARGET.log().float().expand(3, 2).contiguous()  # rows for ℓ = 0, 1, 2
    draft_logits = Q_DRAFT.log().float().expand(trials, 2, 2)
    out = dspark_ops.verify(
        target.to(device), drafts.to(device), num_verify, torch.ones(trials, device=device),
        torch.randint(-(2**62), 2**62, (trials,), generator=gen).to(device),
        torch.randint(0, 2**40, (trials,), generator=gen).to(device),
        draft_logits=draft_logits.to(device),
        target_start=torch.zeros(trials, dtype=torch.int32, device=device))
    assert out.valid.all()
    return out.tokens.cpu(), out.num_accepted.cpu(), num_verify.cpu(), drafts[:, 0]


def first_token_test(tokens):
    """(passes, chi2, df, z, fraction of A) for the first emitted token against p."""
    first = tokens[:, 0]
    chi2, df = chi_square(first, P_TARGET)
    count_a = int((first == TOKEN_A).sum())
    return (df == 1 and chi_square_passes(chi2, df), chi2, df,
            binomial_z(count_a, first.numel(), 0.7), count_a / first.numel())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rates", ["example", "busier"])
def test_lossless_schedule_verify(device, rates):
    rate = f32(*(EXAMPLE_STEP_RATE if rates == "example" else BUSIER_STEP_RATE), device=device)
    tokens, accepted, nv, x1 = run_two_token_example(per_trial(
        lambda c: dspark_ops.schedule_verify(c, rate)), device, seed=201)
    # The hand-worked lengths: example: never verify; busier: x1 always (1.08 > 1), and x2 as
    # well when x1 = A (Theta 1.134 > 1.08) -- a decision that depends on x1, not on x2.
    expected = torch.zeros_like(nv) if rates == "example" else 1 + (x1 == TOKEN_A).int()
    assert torch.equal(nv, expected)
    passes, chi2, df, z, frac = first_token_test(tokens)
    assert passes and abs(z) < 5, (chi2, df, z, frac)
    if rates == "busier":
        # The second emitted token, over the trials that emitted one, is distributed as p too.
        second = tokens[accepted >= 1, 1]
        assert second.numel() > 1000
        chi2, df = chi_square(second, P_TARGET)
        assert chi_square_passes(chi2, df), (chi2, df, second.numel())


@pytest.mark.parametrize("device", DEVICES)
def test_retrospective_schedule_is_biased(device):
    # The same harness with a global search over ℓ: biased as docs/semantics.md §5.2 says.
    rate = f32(*EXAMPLE_STEP_RATE)
    tokens, _, nv, x1 = run_two_token_example(retrospective_schedule(rate), device, seed=201)
    assert torch.equal(nv, 2 * (x1 == TOKEN_A).int())  # verifies x1 only when x1 = A
    passes, chi2, df, z, frac = first_token_test(tokens)
    assert not passes and z > 10, (chi2, df, z, frac)
    assert abs(binomial_z(int((tokens[:, 0] == TOKEN_A).sum()), tokens.shape[0], 0.85)) < 5, frac


@pytest.mark.parametrize("device", DEVICES)
def test_lossless_plan_then_allocate(device):
    # Stage 1 on a confidence that does not depend on the current drafts (an older round's),
    # stage 2 on the fresh ones: lossless.
    rate = f32(*EXAMPLE_STEP_RATE, device=device)
    stale = f32([0.8, 0.9], device=device)
    budget = dspark_ops.plan_verify_budget(stale, rate)
    assert budget.tolist() == [3]  # Theta(K=3) = 1.134 beats Theta(1) = 1.0 and Theta(2) = 0.9
    tokens, _, nv, x1 = run_two_token_example(per_trial(
        lambda c: dspark_ops.allocate_verify(c, budget)), device, seed=202)
    assert torch.equal(nv, 1 + (x1 == TOKEN_A).int())  # x1 always verified
    passes, chi2, df, z, frac = first_token_test(tokens)
    assert passes and abs(z) < 5, (chi2, df, z, frac)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_on_current_confidence_is_biased(device):
    # The plan's global search fed with the *current* confidences is the retrospective search
    # again: K = 3 after A, 1 after B.
    rate = f32(*EXAMPLE_STEP_RATE, device=device)

    def plan_then_allocate(c):
        return dspark_ops.allocate_verify(c, dspark_ops.plan_verify_budget(c, rate))

    tokens, _, nv, x1 = run_two_token_example(per_trial(plan_then_allocate), device, seed=203)
    assert torch.equal(nv, 2 * (x1 == TOKEN_A).int())
    passes, chi2, df, z, frac = first_token_test(tokens)
    assert not passes and z > 10, (chi2, df, z, frac)


def test_harness_detects_bias_with_plain_sampling():
    # The harness's statistic on plain draws: p passes, the biased (0.85, 0.15) fails.
    gen = generator(204)
    for probs, should_pass in [(P_TARGET, True), (torch.tensor([0.85, 0.15]), False)]:
        tokens = torch.multinomial(probs, LOSSLESS_TRIALS, replacement=True, generator=gen)
        assert first_token_test(tokens[:, None])[0] == should_pass


# --------------------------------------------------------------------------------------------
# pack_verify_inputs
# --------------------------------------------------------------------------------------------


def make_pack_args(batch, block, gen, *, anchor_dtype=torch.int64, token_dtype=torch.int64,
                   vocab=50000):
    anchor = torch.randint(0, vocab, (batch,), generator=gen).to(anchor_dtype)
    drafts = torch.randint(0, vocab, (batch, block), generator=gen).to(token_dtype)
    num_verify = torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32)
    if batch >= 2:
        num_verify[0], num_verify[-1] = 0, block  # both ends
    position = torch.randint(0, 2**40, (batch,), generator=gen)
    return anchor, drafts, num_verify, position


def check_pack(args, expected_args=None):
    got = dspark_ops.pack_verify_inputs(*args)
    expected = reference.pack_verify_inputs(*(expected_args or args))
    assert isinstance(got, dspark_ops.VerifyBatch)
    for name, g, e in zip(got._fields, got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and g.device == e.device, name
        assert torch.equal(g, e), name
    # Padding past cu_seqlens[B] is id 0, position 0; each segment is [x0, x_1..x_l].
    end = int(got.cu_seqlens[-1])
    assert not got.input_ids[end:].any() and not got.positions[end:].any()
    anchor, drafts, num_verify, position = [t.cpu() for t in args]
    cu = got.cu_seqlens.cpu().long()
    assert torch.equal(cu.diff(), num_verify.long() + 1)
    for b in range(min(len(anchor), 8)):
        n = int(num_verify[b])
        ids = got.input_ids.cpu()[cu[b]:cu[b + 1]]
        assert ids.tolist() == [int(anchor[b])] + drafts[b, :n].tolist()
        assert got.positions.cpu()[cu[b]:cu[b + 1]].tolist() == list(
            range(int(position[b]), int(position[b]) + n + 1))
    return got


PACK_SHAPES = [(1, 0), (1, 1), (1, 32), (3, 7), (64, 16), (257, 5), (1024, 32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", PACK_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int32),
                                    (torch.int32, torch.int64), (torch.int64, torch.int32)],
                         ids=["i64-i64", "i32-i32", "i32-i64", "i64-i32"])
def test_pack_matches_reference(device, shape, dtypes):
    gen = generator(shape[0] * 64 + shape[1])
    args = make_pack_args(*shape, gen, anchor_dtype=dtypes[0], token_dtype=dtypes[1])
    check_pack([t.to(device) for t in args])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_verify", ["zeros", "full"])
def test_pack_extreme_lengths(device, num_verify):
    gen = generator(31)
    anchor, drafts, _, position = make_pack_args(5, 6, gen)
    n = torch.full((5,), 0 if num_verify == "zeros" else 6, dtype=torch.int32)
    got = check_pack([t.to(device) for t in (anchor, drafts, n, position)])
    if num_verify == "zeros":
        assert got.input_ids[:5].tolist() == anchor.tolist()
        assert got.cu_seqlens.tolist() == list(range(6))
    else:  # no padding at all
        assert int(got.cu_seqlens[-1]) == 5 * 7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["strided", "padded", "transposed"])
@pytest.mark.parametrize("token_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_pack_non_contiguous(device, layout, token_dtype):
    # Gaps hold iinfo.min: read by mistake they would show up in input_ids.
    gen = generator(32)
    dense = [t.to(device) for t in make_pack_args(19, 8, gen, token_dtype=token_dtype,
                                                  anchor_dtype=token_dtype)]
    anchor, drafts, num_verify, position = dense
    if layout == "transposed":
        strided = drafts.t().contiguous().t()
    else:  # built on the device: .to() would make a layout with gaps contiguous
        strided = non_contiguous(drafts, layout)
    args = [non_contiguous(anchor), strided, non_contiguous(num_verify), non_contiguous(position)]
    assert not any(t.is_contiguous() for t in args)
    got = check_pack(args, dense)
    assert got.input_ids.min() >= 0


def target_model(vocab: int, gen: torch.Generator):
    """A fixed "target": logits = token table[id] + position table[position mod 97], so every
    row depends on both the token and its absolute position."""
    token_table = 4 * torch.randn(vocab, vocab, generator=gen)
    position_table = torch.randn(97, vocab, generator=gen)

    def forward(ids, positions):
        return token_table.to(ids.device)[ids] + position_table.to(ids.device)[positions % 97]

    return forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_pack_round_trip_with_verify(device, draft):
    # A decode round: schedule, pack, run the target over the ragged batch, verify with
    # target_start = cu_seqlens[:-1]; equals verify on the padded [B, G+1, V] layout built
    # directly from the same target model.
    gen = generator(33 if draft == "logits" else 34)
    batch, block, vocab = 24, 7, 61
    forward = target_model(vocab, gen)
    anchor, _, _, position = make_pack_args(batch, block, gen, vocab=vocab)
    # An autoregressive draft close to the target, so that deep positions are accepted and the
    # row mapping of both layouts is exercised past row 0.
    draft_logits = torch.empty(batch, block, vocab)
    drafts = torch.empty(batch, block, dtype=torch.int64)
    previous = anchor
    for j in range(block):
        draft_logits[:, j] = forward(previous, position + j) + 0.5 * torch.randn(
            batch, vocab, generator=gen)
        previous = torch.multinomial(torch.softmax(draft_logits[:, j], -1), 1,
                                     generator=gen)[:, 0]
        drafts[:, j] = previous
    confidence = make_confidence("high", batch, block, gen)
    # A light load (fixed cost 8x the batch's per-token cost): long but uneven lengths.
    rate = make_step_rate("linear", batch * (block + 1) + 1, 8 * batch, gen)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * (batch // 4))
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    anchor, drafts, position, confidence, rate, temperature, seed, draft_logits = to(
        anchor, drafts, position, confidence, rate, temperature, seed, draft_logits)
    draft_logits = draft_logits if draft == "logits" else None

    caps = torch.tensor([0, block] * (batch // 2), dtype=torch.int32, device=device)
    caps[2::4] = 3  # 0, G, 3, G, ...: a request with nothing to verify among them
    num_verify = dspark_ops.schedule_verify(confidence, rate, max_verify=caps)
    assert 0 < int(num_verify.sum()) < batch * block  # a mix of lengths, not all or nothing
    packed = check_pack([anchor, drafts, num_verify, position])
    ragged_logits = forward(packed.input_ids, packed.positions)  # [B*(G+1), V], padding too
    ragged = dspark_ops.verify(ragged_logits, drafts, num_verify, temperature, seed, position,
                               draft_logits=draft_logits, target_start=packed.cu_seqlens[:-1])

    ids = torch.cat([anchor[:, None], drafts], 1)
    positions = position[:, None] + torch.arange(block + 1, device=device)
    padded_logits = forward(ids, positions)  # [B, G+1, V]
    padded = dspark_ops.verify(padded_logits, drafts, num_verify, temperature, seed, position,
                               draft_logits=draft_logits)
    for name, r, p in zip(ragged._fields[:3], ragged, padded):
        assert torch.equal(r, p), name
    expected = reference.verify(ragged_logits, drafts, num_verify, temperature, seed, position,
                                draft_logits=draft_logits, target_start=packed.cu_seqlens[:-1])
    for name, r, e in zip(ragged._fields[:3], ragged, expected):
        assert torch.equal(r, e), name
    assert (ragged.num_accepted <= num_verify).all()
    assert int((ragged.num_accepted >= 2).sum()) >= 3, (ragged.num_accepted, num_verify)


# --------------------------------------------------------------------------------------------
# profile_step_rate
# --------------------------------------------------------------------------------------------


class FakeForward:
    """forward(n) that sleeps ``delay(n)`` seconds and records its calls."""

    def __init__(self, delay=lambda n: 0.0):
        self.delay = delay
        self.calls = []

    def __call__(self, n):
        self.calls.append(n)
        if self.delay(n) > 0:
            time.sleep(self.delay(n))


def test_profile_step_rate_table():
    forward = FakeForward()
    rate = dspark_ops.profile_step_rate(forward, 6, device="cpu", warmup=2, repeats=3)
    assert rate.shape == (7,) and rate.dtype == torch.float32 and rate.device.type == "cpu"
    assert rate[0] == rate[1] and (rate > 0).all() and rate.isfinite().all()
    # Sizes 1..max_tokens in order, warmup + repeats calls each.
    assert forward.calls == [n for n in range(1, 7) for _ in range(5)]
    # The table is valid input for the schedulers (M = max_tokens + 1 > B).
    confidence = torch.rand(3, 4, generator=generator(41))
    check_against_reference(confidence, rate)


def test_profile_step_rate_no_warmup_and_default_device():
    forward = FakeForward()
    rate = dspark_ops.profile_step_rate(forward, 2, warmup=0, repeats=1)
    assert forward.calls == [1, 2]
    assert rate.shape == (3,)
    assert rate.device.type == ("cuda" if CUDA_AVAILABLE else "cpu")


def cliff_delay(n):  # 1 ms up to 3 tokens, 4 ms at 4, 2 ms from 5 on: a cliff at 4
    return 0.001 if n <= 3 else 0.004 if n == 4 else 0.002


def test_profile_step_rate_keeps_cliffs():
    rate = dspark_ops.profile_step_rate(FakeForward(cliff_delay), 6, device="cpu", warmup=1,
                                        repeats=3)
    assert rate[4] < rate[5], rate  # 4 tokens are slower than 5
    assert rate[1] > rate[4] and rate[3] > rate[4], rate
    # 1 / median seconds: time.sleep never returns early, so the rates are bounded above.
    assert rate[4] <= 250 and rate[5] <= 500 and rate[1] <= 1000, rate


def test_profile_step_rate_enforce_non_increasing():
    rate = dspark_ops.profile_step_rate(FakeForward(cliff_delay), 6, device="cpu", warmup=1,
                                        repeats=3, enforce_non_increasing=True)
    assert rate[5] <= rate[4] and rate[6] <= rate[5], rate
    assert (rate[1:].diff() <= 0).all(), rate
    assert rate[5] == rate[4]  # the running minimum carries the cliff's rate forward
    assert rate[0] == rate[1]


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), r"profile_step_rate\(\): 'max_tokens' must be >= 1, got 0"),
    (dict(max_tokens=-3), r"'max_tokens' must be >= 1, got -3"),
    (dict(max_tokens=2, warmup=-1),
     r"profile_step_rate\(\): need warmup >= 0 and repeats >= 1, got -1 and 10"),
    (dict(max_tokens=2, repeats=0), r"need warmup >= 0 and repeats >= 1, got 3 and 0"),
])
def test_profile_step_rate_errors(kwargs, message):
    forward = FakeForward()
    with pytest.raises(ValueError, match=message):
        dspark_ops.profile_step_rate(forward, **kwargs)
    assert forward.calls == []  # validated before any forward


@cuda_only
def test_profile_step_rate_cuda_events():
    x = torch.randn(64, 64, device="cuda")
    forward = FakeForward()

    def run(n):
        forward(n)
        for _ in range(n):
            x.matmul(x)

    rate = dspark_ops.profile_step_rate(run, 4, device="cuda", warmup=1, repeats=2)
    assert rate.device.type == "cuda" and rate.shape == (5,)
    assert (rate > 0).all() and rate.isfinite().all()
    assert forward.calls == [n for n in range(1, 5) for _ in range(3)]


# --------------------------------------------------------------------------------------------
# Argument checks: every check of csrc/args/schedule_args.{h,cpp} with its message
# --------------------------------------------------------------------------------------------

B, G, M = 3, 4, 10


def valid_args(device) -> dict:
    gen = generator(51)
    args = dict(
        confidence=torch.rand(B, G, generator=gen),
        step_rate=make_step_rate("linear", M, B, gen),
        max_verify=i32(0, 2, 4),
        budget=i32(7),
        anchor=torch.randint(0, 1000, (B,), generator=gen),
        draft_tokens=torch.randint(0, 1000, (B, G), generator=gen),
        num_verify=i32(0, 2, 4),
        position=torch.randint(0, 2**40, (B,), generator=gen),
    )
    return {k: v.to(device) for k, v in args.items()}


def call_op(op: str, args: dict):
    if op == "schedule_verify":
        return dspark_ops.schedule_verify(args["confidence"], args["step_rate"],
                                          max_verify=args["max_verify"])
    if op == "plan_verify_budget":
        return dspark_ops.plan_verify_budget(args["confidence"], args["step_rate"])
    if op == "allocate_verify":
        return dspark_ops.allocate_verify(args["confidence"], args["budget"],
                                          max_verify=args["max_verify"])
    return dspark_ops.pack_verify_inputs(args["anchor"], args["draft_tokens"], args["num_verify"],
                                         args["position"])


SCHEDULERS = ["schedule_verify", "plan_verify_budget", "allocate_verify"]
WITH_RATE = ["schedule_verify", "plan_verify_budget"]
WITH_CAPS = ["schedule_verify", "allocate_verify"]
PACK = ["pack_verify_inputs"]


def _over_pairs():
    # B*G = 1025 * 1024 > 2^20, as a stride-0 view (no memory).
    return torch.full((1, 1), 0.5).expand(1025, 1024)


# (id, ops, overrides: {argument: value}, exception, message after "<op>(): ").
STRUCTURE_ERRORS = [
    ("confidence-1d", SCHEDULERS, lambda: dict(confidence=f32(0.5, 0.5, 0.5, 0.5)), ValueError,
     r"'confidence' must be 2-D \[B, G\], got a 1-D tensor of shape \[4\]"),
    ("confidence-3d", SCHEDULERS, lambda: dict(confidence=torch.full((B, G, 1), 0.5)),
     ValueError, r"'confidence' must be 2-D \[B, G\], got a 3-D tensor of shape \[3, 4, 1\]"),
    ("confidence-0d", SCHEDULERS, lambda: dict(confidence=torch.tensor(0.5)), ValueError,
     r"'confidence' must be 2-D \[B, G\], got a 0-D tensor of shape \[\]"),
    ("confidence-float64", SCHEDULERS,
     lambda: dict(confidence=torch.rand(B, G, dtype=torch.float64)), TypeError,
     r"'confidence' must have dtype Float, got Double"),
    ("confidence-bf16", SCHEDULERS, lambda: dict(confidence=torch.rand(B, G).bfloat16()),
     TypeError, r"'confidence' must have dtype Float, got BFloat16"),
    ("confidence-f16", SCHEDULERS, lambda: dict(confidence=torch.rand(B, G).half()), TypeError,
     r"'confidence' must have dtype Float, got Half"),
    ("confidence-int", SCHEDULERS, lambda: dict(confidence=torch.ones(B, G, dtype=torch.int32)),
     TypeError, r"'confidence' must have dtype Float, got Int"),
    ("too-many-pairs", SCHEDULERS, lambda: dict(confidence=_over_pairs()), ValueError,
     r"at most 2\^20 requests and 2\^20 \(request, position\) pairs, got B = 1025, G = 1024"),
    ("too-many-requests", SCHEDULERS, lambda: dict(confidence=torch.ones(2**20 + 1, 0)),
     ValueError, r"at most 2\^20 requests and 2\^20 \(request, position\) pairs, "
     r"got B = 1048577, G = 0"),
    ("step_rate-2d", WITH_RATE, lambda: dict(step_rate=torch.ones(1, M)), ValueError,
     r"'step_rate' must be 1-D \[M\], got a 2-D tensor of shape \[1, 10\]"),
    ("step_rate-0d", WITH_RATE, lambda: dict(step_rate=torch.tensor(1.0)), ValueError,
     r"'step_rate' must be 1-D \[M\], got a 0-D tensor of shape \[\]"),
    ("step_rate-float64", WITH_RATE, lambda: dict(step_rate=torch.ones(M, dtype=torch.float64)),
     TypeError, r"'step_rate' must have dtype Float, got Double"),
    ("step_rate-f16", WITH_RATE, lambda: dict(step_rate=torch.ones(M).half()), TypeError,
     r"'step_rate' must have dtype Float, got Half"),
    ("step_rate-M=B", WITH_RATE, lambda: dict(step_rate=torch.ones(B)), ValueError,
     r"'step_rate' must have more than B = 3 entries \(step_rate\[n\] is the rate of an n-token "
     r"verify batch and every request needs its anchor\), got 3"),
    ("step_rate-empty", WITH_RATE, lambda: dict(step_rate=torch.ones(0)), ValueError,
     r"'step_rate' must have more than B = 3 entries .*, got 0"),
    ("max_verify-int64", WITH_CAPS, lambda: dict(max_verify=torch.tensor([0, 2, 4])), TypeError,
     r"'max_verify' must have dtype Int, got Long"),
    ("max_verify-float", WITH_CAPS, lambda: dict(max_verify=f32(0, 2, 4)), TypeError,
     r"'max_verify' must have dtype Int, got Float"),
    ("max_verify-shape", WITH_CAPS, lambda: dict(max_verify=i32(0, 2, 4, 1)), ValueError,
     r"'max_verify' must have shape \[B\] = \[3\], got \[4\]"),
    ("max_verify-2d", WITH_CAPS, lambda: dict(max_verify=i32(0, 2, 4)[:, None]), ValueError,
     r"'max_verify' must have shape \[B\] = \[3\], got \[3, 1\]"),
    ("budget-int64", ["allocate_verify"], lambda: dict(budget=torch.tensor([7])), TypeError,
     r"'budget' must have dtype Int, got Long"),
    ("budget-float", ["allocate_verify"], lambda: dict(budget=f32(7)), TypeError,
     r"'budget' must have dtype Int, got Float"),
    ("budget-0d", ["allocate_verify"], lambda: dict(budget=torch.tensor(7, dtype=torch.int32)),
     ValueError, r"'budget' must have shape \[1\] = \[1\], got \[\]"),
    ("budget-shape", ["allocate_verify"], lambda: dict(budget=i32(7, 7)), ValueError,
     r"'budget' must have shape \[1\] = \[1\], got \[2\]"),
    ("draft_tokens-1d", PACK, lambda: dict(draft_tokens=torch.tensor([1, 2, 3])), ValueError,
     r"'draft_tokens' must be 2-D \[B, G\], got a 1-D tensor of shape \[3\]"),
    ("draft_tokens-3d", PACK, lambda: dict(draft_tokens=torch.ones(B, G, 1, dtype=torch.int64)),
     ValueError, r"'draft_tokens' must be 2-D \[B, G\], got a 3-D tensor of shape \[3, 4, 1\]"),
    ("draft_tokens-float", PACK, lambda: dict(draft_tokens=torch.ones(B, G)), TypeError,
     r"'draft_tokens' must have dtype Long or Int, got Float"),
    ("draft_tokens-int16", PACK, lambda: dict(draft_tokens=torch.ones(B, G, dtype=torch.int16)),
     TypeError, r"'draft_tokens' must have dtype Long or Int, got Short"),
    ("cu_seqlens-overflow", PACK,
     lambda: dict(draft_tokens=torch.zeros(1, 1, dtype=torch.int64).expand(2**16, 2**15)),
     ValueError, r"B\*\(G\+1\) must fit int32 cu_seqlens, got B = 65536, G = 32768"),
    ("anchor-float", PACK, lambda: dict(anchor=f32(1, 2, 3)), TypeError,
     r"'anchor' must have dtype Long or Int, got Float"),
    ("anchor-uint8", PACK, lambda: dict(anchor=torch.tensor([1, 2, 3], dtype=torch.uint8)),
     TypeError, r"'anchor' must have dtype Long or Int, got Byte"),
    ("anchor-shape", PACK, lambda: dict(anchor=torch.tensor([1, 2])), ValueError,
     r"'anchor' must have shape \[B\] = \[3\], got \[2\]"),
    ("anchor-2d", PACK, lambda: dict(anchor=torch.tensor([[1, 2, 3]])), ValueError,
     r"'anchor' must have shape \[B\] = \[3\], got \[1, 3\]"),
    ("num_verify-int64", PACK, lambda: dict(num_verify=torch.tensor([0, 2, 4])), TypeError,
     r"'num_verify' must have dtype Int, got Long"),
    ("num_verify-shape", PACK, lambda: dict(num_verify=i32(0, 2)), ValueError,
     r"'num_verify' must have shape \[B\] = \[3\], got \[2\]"),
] + per_request_errors(PACK, B, names=("position",))

# Value checks: always on CPU; on CUDA only with DSPARK_OPS_DEBUG=1 (they cost a sync).
VALUE_ERRORS = [
    ("confidence-above-1", SCHEDULERS,
     lambda: dict(confidence=f32([0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 1.5, 0.5], [1, 1, 1, 1])),
     ValueError, r"'confidence' must be probabilities in \[0, 1\], got 1.5 at index \[1, 2\]"),
    ("confidence-negative", SCHEDULERS,
     lambda: dict(confidence=f32([0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [1, 1, 1, -0.25])),
     ValueError, r"'confidence' must be probabilities in \[0, 1\], got -0.25 at index \[2, 3\]"),
    ("confidence-nan", SCHEDULERS,
     lambda: dict(confidence=f32([NAN, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [1, 1, 1, 1])),
     ValueError, r"'confidence' must be probabilities in \[0, 1\], got nan at index \[0, 0\]"),
    ("confidence-inf", SCHEDULERS,
     lambda: dict(confidence=f32([0.5, 0.5, 0.5, 0.5], [0.5, INF, 0.5, 0.5], [1, 1, 1, 1])),
     ValueError, r"'confidence' must be probabilities in \[0, 1\], got inf at index \[1, 1\]"),
    ("step_rate-zero", WITH_RATE, lambda: dict(step_rate=f32(*[1.0] * 5, 0.0, *[1.0] * 4)),
     ValueError, r"'step_rate' must be finite and > 0, got 0 at index \[5\]"),
    ("step_rate-entry-0", WITH_RATE, lambda: dict(step_rate=f32(-1.0, *[1.0] * 9)),
     ValueError, r"'step_rate' must be finite and > 0, got -1 at index \[0\]"),
    ("step_rate-nan", WITH_RATE, lambda: dict(step_rate=f32(*[1.0] * 9, NAN)), ValueError,
     r"'step_rate' must be finite and > 0, got nan at index \[9\]"),
    ("step_rate-inf", WITH_RATE, lambda: dict(step_rate=f32(1.0, 1.0, INF, *[1.0] * 7)),
     ValueError, r"'step_rate' must be finite and > 0, got inf at index \[2\]"),
    ("max_verify-above-G", WITH_CAPS, lambda: dict(max_verify=i32(0, 5, 4)), ValueError,
     r"'max_verify' values must lie in \[0, 4\], got 5 at index \[1\]"),
    ("max_verify-negative", WITH_CAPS, lambda: dict(max_verify=i32(0, 2, -1)), ValueError,
     r"'max_verify' values must lie in \[0, 4\], got -1 at index \[2\]"),
    ("budget-below-B", ["allocate_verify"], lambda: dict(budget=i32(2)), ValueError,
     r"'budget' values must lie in \[3, 2147483647\], got 2 at index \[0\]"),
    ("budget-negative", ["allocate_verify"], lambda: dict(budget=i32(-7)), ValueError,
     r"'budget' values must lie in \[3, 2147483647\], got -7 at index \[0\]"),
    ("num_verify-above-G", PACK, lambda: dict(num_verify=i32(0, 5, 4)), ValueError,
     r"'num_verify' values must lie in \[0, 4\], got 5 at index \[1\]"),
    ("num_verify-negative", PACK, lambda: dict(num_verify=i32(-1, 2, 4)), ValueError,
     r"'num_verify' values must lie in \[0, 4\], got -1 at index \[0\]"),
    # Positions p0 .. p0 + G are written: p0 must lie in [0, 2^62] as verify's (2^63 - 1 would
    # overflow p0 + 1).
    ("position-max", PACK, lambda: dict(position=torch.tensor([0, 2**63 - 1, 5])), ValueError,
     r"'position' values must lie in \[0, 4611686018427387904\], got 9223372036854775807 at "
     r"index \[1\]"),
    ("position-negative", PACK, lambda: dict(position=torch.tensor([0, 1, -1])), ValueError,
     r"'position' values must lie in \[0, 4611686018427387904\], got -1 at index \[2\]"),
    # The CPU checks read the data through its strides: offenders at the last element read, in
    # non-contiguous layouts.
    ("confidence-nan-last-strided", SCHEDULERS,
     lambda: dict(confidence=non_contiguous(
         f32([0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [1, 1, 1, NAN]), fill=0.5)),
     ValueError, r"'confidence' must be probabilities in \[0, 1\], got nan at index \[2, 3\]"),
    ("confidence-above-1-last-transposed", SCHEDULERS,
     lambda: dict(confidence=non_contiguous(
         f32([0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [1, 1, 1, 1.5]), "transposed")),
     ValueError, r"'confidence' must be probabilities in \[0, 1\], got 1.5 at index \[2, 3\]"),
    ("step_rate-inf-last-strided", WITH_RATE,
     lambda: dict(step_rate=non_contiguous(f32(*[1.0] * 9, INF), fill=1.0)), ValueError,
     r"'step_rate' must be finite and > 0, got inf at index \[9\]"),
    ("max_verify-last-strided", WITH_CAPS,
     lambda: dict(max_verify=non_contiguous(i32(0, 2, 5), fill=0)),
     ValueError, r"'max_verify' values must lie in \[0, 4\], got 5 at index \[2\]"),
    ("num_verify-last-strided", PACK, lambda: dict(num_verify=non_contiguous(i32(0, 2, 5), fill=0)),
     ValueError, r"'num_verify' values must lie in \[0, 4\], got 5 at index \[2\]"),
]


def _with_overrides(device, overrides) -> dict:
    return with_overrides(valid_args(device), device, overrides)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message", error_params(STRUCTURE_ERRORS))
def test_argument_errors(device, op, overrides, error, message):
    with raises(op, error, message):
        call_op(op, _with_overrides(device, overrides))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message", error_params(VALUE_ERRORS))
def test_value_errors(device, op, overrides, error, message):
    skip_value_checks_without_debug(device)
    with raises(op, error, message):
        call_op(op, _with_overrides(device, overrides))


@pytest.mark.parametrize("device", DEVICES)
def test_valid_arguments_accepted(device):
    # The base of the error tests is itself valid, so each error above is due to its one
    # change; and the limits of every range are accepted.
    args = valid_args(device)
    for op in SCHEDULERS + PACK:
        call_op(op, args)
    check_against_reference(args["confidence"], args["step_rate"], args["max_verify"],
                            [B, INT32_MAX])
    check_pack([args["anchor"], args["draft_tokens"], args["num_verify"], args["position"]])
    edge = _with_overrides(device, lambda: dict(
        confidence=f32([0.0, 1.0, 1.0, 0.0], [-0.0, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]),
        step_rate=f32(*[1e-30] * (B + 1)),  # M = B + 1, tiny but positive rates
        max_verify=i32(G, 0, G)))
    check_against_reference(edge["confidence"], edge["step_rate"], edge["max_verify"], [B])
    check_against_reference(edge["confidence"], torch.ones(B * (G + 1) + 1, device=device),
                            edge["max_verify"], [B])


@pytest.mark.parametrize("device", DEVICES)
def test_pair_limit_accepted(device):
    # Exactly 2^20 pairs (B = G = 1024, a stride-0 view) is allowed. Every survival ties at
    # 0.5, 0.25, ...: a budget of B + 5 goes to position 0 of requests 0..4.
    confidence = torch.full((1, 1), 0.5, device=device).expand(1024, 1024)
    got = dspark_ops.allocate_verify(confidence, i32(1024 + 5, device=device))
    assert got.cpu().tolist() == [1] * 5 + [0] * 1019


@cuda_only
@pytest.mark.parametrize("name", ["step_rate", "max_verify"])
def test_device_mismatch_schedule(name):
    args = valid_args("cuda")
    args[name] = args[name].cpu()
    message = rf"schedule_verify\(\): '{name}' must be on cuda:\d+ like 'confidence', got cpu"
    with pytest.raises(ValueError, match=message):
        call_op("schedule_verify", args)


@cuda_only
def test_device_mismatch_budget_and_plan():
    args = valid_args("cuda")
    with pytest.raises(ValueError, match=r"allocate_verify\(\): 'budget' must be on cuda:\d+ "
                                         r"like 'confidence', got cpu"):
        call_op("allocate_verify", {**args, "budget": args["budget"].cpu()})
    with pytest.raises(ValueError, match=r"allocate_verify\(\): 'max_verify' must be on "
                                         r"cuda:\d+ like 'confidence', got cpu"):
        call_op("allocate_verify", {**args, "max_verify": args["max_verify"].cpu()})
    with pytest.raises(ValueError, match=r"plan_verify_budget\(\): 'step_rate' must be on "
                                         r"cpu like 'confidence', got cuda:\d+"):
        call_op("plan_verify_budget", {**args, "confidence": args["confidence"].cpu()})


@cuda_only
@pytest.mark.parametrize("name", ["anchor", "num_verify", "position"])
def test_device_mismatch_pack(name):
    args = valid_args("cuda")
    args[name] = args[name].cpu()
    message = (rf"pack_verify_inputs\(\): '{name}' must be on cuda:\d+ like 'draft_tokens', "
               rf"got cpu")
    with pytest.raises(ValueError, match=message):
        call_op("pack_verify_inputs", args)


@cuda_only
def test_cuda_out_of_range_values_without_value_checks():
    # Without DSPARK_OPS_DEBUG the CUDA kernels do not check values; they clamp: confidences to
    # [0, 1] (NaN to 0), caps and num_verify to [0, G], budgets below B admit nothing.
    if DEBUG:
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    gen = generator(61)
    batch, block = 40, 6
    clean = make_confidence("quantised", batch, block, gen)
    dirty = clean.clone()
    dirty[::4, 1] = 1.5 + torch.rand(dirty[::4, 1].shape, generator=gen)  # clamps to 1
    dirty[1::4, 2] = -torch.rand(dirty[1::4, 2].shape, generator=gen) - 0.1  # clamps to 0
    dirty[2::4, 3] = NAN  # counts as 0
    clean = torch.where(dirty.isnan(), 0.0, dirty.clamp(0, 1))
    caps = torch.randint(-3, block + 4, (batch,), generator=gen, dtype=torch.int32)
    rate = make_step_rate("linear", batch * 3, batch, gen)
    got = dspark_ops.schedule_verify(dirty.cuda(), rate.cuda(), max_verify=caps.cuda())
    expected = reference.schedule_verify(clean, rate, max_verify=caps.clamp(0, block))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(dspark_ops.plan_verify_budget(dirty.cuda(), rate.cuda()),
                       reference.plan_verify_budget(clean, rate).cuda())
    assert not dspark_ops.allocate_verify(dirty.cuda(), i32(batch - 5, device="cuda")).any()
    anchor, drafts, _, position = make_pack_args(batch, block, gen)
    n = torch.randint(-3, block + 4, (batch,), generator=gen, dtype=torch.int32)
    got = dspark_ops.pack_verify_inputs(anchor.cuda(), drafts.cuda(), n.cuda(), position.cuda())
    expected = reference.pack_verify_inputs(anchor, drafts, n.clamp(0, block), position)
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)
    # Non-positive or NaN rates: undefined choice, but lengths stay in range and below M.
    bad_rate = rate.clone()
    bad = bad_rate[batch + 3::5]
    bad.copy_(torch.tensor([0.0, -1.0, NAN])[torch.arange(bad.numel()) % 3])
    nv = dspark_ops.schedule_verify(clean.cuda(), bad_rate.cuda()).cpu()
    assert ((nv >= 0) & (nv <= block)).all() and batch + int(nv.sum()) < len(bad_rate)
    k = int(dspark_ops.plan_verify_budget(clean.cuda(), bad_rate.cuda()))
    assert batch <= k < len(bad_rate)


@cuda_only
@pytest.mark.parametrize("batch,block", [(1, 1), (64, 16), (257, 16), (1024, 16), (513, 32),
                                         (1024, 32)])
def test_cpu_and_cuda_agree(batch, block):
    gen = generator(batch + block)
    for kind in ("quantised", "tiny", "high"):
        confidence = make_confidence(kind, batch, block, gen)
        for rate_kind, m_kind in [("jagged", "full"), ("tiles", "tight"), ("flat", "full")]:
            rate = make_step_rate(rate_kind, make_capacity(m_kind, batch, block), batch, gen)
            caps = random_caps(batch, block, gen)
            for cap in (None, caps):
                cpu = dspark_ops.schedule_verify(confidence, rate, max_verify=cap)
                cuda = dspark_ops.schedule_verify(confidence.cuda(), rate.cuda(),
                                                  max_verify=None if cap is None else cap.cuda())
                assert torch.equal(cpu, cuda.cpu()), (kind, rate_kind, m_kind)
            k = dspark_ops.plan_verify_budget(confidence, rate)
            assert torch.equal(k, dspark_ops.plan_verify_budget(confidence.cuda(),
                                                                rate.cuda()).cpu())
            assert torch.equal(dspark_ops.allocate_verify(confidence, k, max_verify=caps),
                               dspark_ops.allocate_verify(confidence.cuda(), k.cuda(),
                                                          max_verify=caps.cuda()).cpu())
