"""The scheduling family's CUDA code (csrc/cuda/schedule_cuda.cpp, schedule_launch.cu,
csrc/kernels/schedule.cuh) run in the SIMT emulator: schedule_verify, plan_verify_budget,
allocate_verify and pack_verify_inputs equal the CPU kernel and dspark_ops.reference exactly
(lengths and budgets are decided on fixed-point sums, so CPU and CUDA make identical decisions), on
every mode and both merge paths of schedule_kernel (keys in dynamic shared memory up to kSharedKeys,
else in a global workspace), on emulated GPUs whose opt-in shared memory per block differs
(h200 227 KB, a100 163 KB, l4 99 KB), and with planted faults that the comparison must catch.

``step_rate[n]`` is the rate of an n-token verify batch including the anchors (see
test_schedule.py). The emulator runs on CPU tensors, so the value checks of the CPU front end are on:
out-of-range caps and lengths raise there (as on CPU) and never reach the kernels' clamps.
"""

from __future__ import annotations

import pytest
import torch

import emulator
from conftest import full_tests, non_contiguous
from dspark_ops import reference
from cases.schedule import make_capacity, make_confidence, make_step_rate, random_caps

pytestmark = pytest.mark.sim

INT32_MAX = 2**31 - 1
SHARED_KEYS = 16384  # kSharedKeys in schedule_launch.h: 64-bit pair keys
SHARED_OPTIN = {"h200": 227 * 1024, "a100": 163 * 1024, "l4": 99 * 1024}  # csrc/sim/runtime.cpp
STATIC_SHARED_MARGIN = 2048  # kScheduleStaticSharedMargin in schedule_launch.h
MODES = {"schedule_verify": 0, "plan_verify_budget": 1, "allocate_verify": 2}
CPU = torch.ops.dspark_ops


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def shared_sort(batch: int, block: int, device: str = "h200") -> bool:
    """Whether the launcher should merge in shared memory on `device` (the path the fix chooses)."""
    n = batch * block
    return n <= SHARED_KEYS and n * 8 <= SHARED_OPTIN[device] - STATIC_SHARED_MARGIN


def expected_kernel(op: str, batch: int, block: int, device: str = "h200") -> str:
    shared = "true" if shared_sort(batch, block, device) else "false"
    return f"schedule_kernel<{MODES[op]}, {shared}>"


def assert_equal(what, got, cpu, ref):
    assert got.dtype == cpu.dtype == ref.dtype and got.shape == cpu.shape == ref.shape, what
    if not torch.equal(cpu, ref):  # the CPU kernel itself is tested in test_schedule.py
        raise AssertionError(f"{what}: the CPU kernel differs from the reference")
    if not torch.equal(got, cpu):
        bad = (got != cpu).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: emulated CUDA differs at {bad}: got {got[bad].tolist()}, "
                             f"CPU and reference {cpu[bad].tolist()}")


def check_schedulers(sim, confidence, rate, caps=None, budgets=(), what=""):
    """The three scheduling ops on the emulator equal the CPU kernel and the reference exactly;
    allocate_verify runs with the plan's budget and with ``budgets``. Returns the instantiations
    launched (name -> count)."""
    sim.clear_launch_log()
    got = sim.schedule_verify(confidence, rate, caps)
    assert_equal(f"schedule_verify {what}", got, CPU.schedule_verify(confidence, rate, caps),
                 reference.schedule_verify(confidence, rate, max_verify=caps))
    plan = sim.plan_verify_budget(confidence, rate)
    assert_equal(f"plan_verify_budget {what}", plan, CPU.plan_verify_budget(confidence, rate),
                 reference.plan_verify_budget(confidence, rate))
    for budget in [plan, *[i32(b) for b in budgets]]:
        assert_equal(f"allocate_verify budget={int(budget)} {what}",
                     sim.allocate_verify(confidence, budget, caps),
                     CPU.allocate_verify(confidence, budget, caps),
                     reference.allocate_verify(confidence, budget, max_verify=caps))
    return emulator.launches()


def budgets_for(batch, block, gen):
    return [batch, int(torch.randint(batch, batch * (block + 1) + 1, (1,), generator=gen)),
            batch * (block + 1) + 1, INT32_MAX]


# --------------------------------------------------------------------------------------------
# schedule_kernel: modes, sort paths, shapes
# --------------------------------------------------------------------------------------------

# (B, G, confidence kinds, (rate kind, capacity kind, capped) combos). B = 1, odd, 1024 and beyond
# (several requests per thread); G = 1, 7, 32 (odd G: merge segments crossing pairs of runs);
# 1024 x 16 is exactly kSharedKeys (two segments per thread in registers); 1024 x 32 and
# 1100 x 32 take the global workspace; the large shapes are slow in the emulator's reference
# check: few.
ALL = [("linear", "full", False), ("jagged", "tight", True), ("tiles", "full", True),
       ("flat", "tight", False), ("steep", "full", True), ("linear", "minimal", True)]
FEW = [("jagged", "full", True), ("flat", "tight", False)]
SHAPES = [
    (1, 1, ["uniform", "ones"], ALL), (1, 7, ["uniform", "quantised"], ALL),
    (1, 32, ["high", "tiny"], ALL), (7, 1, ["uniform", "quantised"], ALL),
    (7, 7, ["uniform", "zeros-mid-row"], ALL), (7, 32, ["high", "quantised"], ALL),
    (33, 0, ["uniform"], FEW), (1024, 1, ["uniform"], FEW), (1024, 7, ["quantised"], FEW),
    (1024, 16, ["high"], FEW), (2000, 1, ["uniform"], FEW[:1]),
    (1024, 32, ["quantised"], FEW[:1]), (513, 32, ["uniform"], FEW[1:]),
    (1100, 32, ["high"], FEW[1:]),
]


@pytest.mark.parametrize("batch,block,kinds,combos", SHAPES,
                         ids=[f"B{b}-G{g}" for b, g, _, _ in SHAPES])
def test_modes_match_cpu_and_reference(sim, batch, block, kinds, combos):
    """All three modes of schedule_kernel, on the shared-memory and the global-workspace sort,
    equal the CPU kernel and the reference on every shape, confidence flavour, step-rate shape,
    capacity and cap setting; the launches are the expected instantiations."""
    gen = generator(batch * 100 + block)
    for kind in kinds:
        confidence = make_confidence(kind, batch, block, gen)
        for rate_kind, m_kind, capped in combos:
            rate = make_step_rate(rate_kind, make_capacity(m_kind, batch, block), batch, gen)
            caps = random_caps(batch, block, gen) if capped else None
            launched = check_schedulers(sim, confidence, rate, caps, budgets_for(batch, block, gen),
                                        what=f"(B={batch}, G={block}, {kind}, {rate_kind}, "
                                             f"M={m_kind}, caps={capped})")
            assert launched == {expected_kernel("schedule_verify", batch, block): 1,
                                expected_kernel("plan_verify_budget", batch, block): 1,
                                expected_kernel("allocate_verify", batch, block): 5}, launched


def test_random_sweep(sim):
    """Random small shapes, flavours, rates and caps (DSPARK_OPS_TEST_FULL=1 runs many more)."""
    gen = generator(99)
    kinds = ["uniform", "high", "quantised", "ones", "zeros", "zeros-mid-row", "tiny"]
    rates = ["flat", "linear", "tiles", "jagged", "steep"]
    for _ in range(200 if full_tests() else 12):
        batch = int(torch.randint(1, 100, (1,), generator=gen))
        block = int(torch.randint(1, 33, (1,), generator=gen))
        kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))]
        confidence = make_confidence(kind, batch, block, gen)
        size = int(torch.randint(batch + 1, batch * (block + 1) + 3, (1,), generator=gen))
        rate_kind = rates[int(torch.randint(0, len(rates), (1,), generator=gen))]
        rate = make_step_rate(rate_kind, size, batch, gen)
        for caps in (None, random_caps(batch, block, gen)):
            check_schedulers(sim, confidence, rate, caps, [batch + 1],
                             what=f"(B={batch}, G={block}, {kind}, {rate_kind}, M={size})")


def test_caps_given_absent_and_out_of_range(sim):
    """max_verify absent, all 0, all G and mixed give the CPU's lengths; negative and over-G caps,
    which only DSPARK_OPS_DEBUG=1 refuses on CUDA, are clamped to [0, G] by the kernel."""
    gen = generator(3)
    batch, block = 37, 7
    confidence = make_confidence("high", batch, block, gen)
    rate = torch.ones(batch * (block + 1) + 1)  # flat: every eligible pair below its cap is admitted
    for caps in (None, torch.zeros(batch, dtype=torch.int32),
                 torch.full((batch,), block, dtype=torch.int32), random_caps(batch, block, gen)):
        check_schedulers(sim, confidence, rate, caps, [batch + 5, INT32_MAX])
    capped = random_caps(batch, block, gen)
    lengths = sim.schedule_verify(confidence, rate, capped)
    assert torch.equal(lengths, capped)  # confidences > 0 and a flat rate: exactly the caps
    for bad in (-1, block + 1, -(2**31), 2**31 - 1):
        caps = random_caps(batch, block, gen)
        caps[5] = bad
        clamped = caps.clamp(0, block)
        assert torch.equal(sim.schedule_verify(confidence, rate, caps),
                           CPU.schedule_verify(confidence, rate, clamped))
        assert torch.equal(sim.allocate_verify(confidence, i32(batch + 9), caps),
                           CPU.allocate_verify(confidence, i32(batch + 9), clamped))


@pytest.mark.parametrize("batch,block", [(5, 7), (1024, 7)])
def test_zero_survivals(sim, batch, block):
    """Nothing eligible (all zeros), zeros and -0.0 mid-row (what follows is ineligible) and
    survivals below 2^-33 (zero in fixed point) all give the CPU's lengths and budgets; with all
    zeros nothing is verified and the plan is B."""
    gen = generator(batch + block)
    rate = make_step_rate("flat", batch * (block + 1) + 1, batch, gen)
    zeros = make_confidence("zeros", batch, block, gen)
    check_schedulers(sim, zeros, rate, None, [batch + 3])
    assert not sim.schedule_verify(zeros, rate, None).any()
    assert not sim.allocate_verify(zeros, i32(INT32_MAX), None).any()
    assert sim.plan_verify_budget(zeros, rate).tolist() == [batch]
    for kind in ("zeros-mid-row", "tiny"):
        confidence = make_confidence(kind, batch, block, gen)
        check_schedulers(sim, confidence, rate, random_caps(batch, block, gen), [batch + 3],
                         what=kind)


@pytest.mark.parametrize("batch,block", [(7, 32), (300, 16)])
def test_capacity_limits(sim, batch, block):
    """With a flat rate every admission improves Theta, so only the capacity M stops schedule and
    plan: room = M - 1 - B admissions (room < eligible), down to M = B + 1 (none)."""
    gen = generator(block)
    confidence = 0.5 + 0.5 * torch.rand(batch, block, generator=gen)  # everything eligible
    for room in (0, 1, 5, batch * block // 3, batch * block - 1):
        rate = torch.ones(batch + 1 + room)
        check_schedulers(sim, confidence, rate, None, [batch + room], what=f"room={room}")
        assert int(sim.schedule_verify(confidence, rate, None).sum()) == room
        assert sim.plan_verify_budget(confidence, rate).tolist() == [batch + room]


def test_survival_ties(sim):
    """Ties of survivals (all ones; quarters, whose products tie across requests and positions)
    are broken by position, then request, as on CPU: the capacity cuts inside a run of ties."""
    gen = generator(11)
    batch, block = 9, 5
    ones = torch.ones(batch, block)
    rate = torch.ones(batch + 1 + 13)  # 13 admissions: position 0 of all 9, position 1 of 0..3
    check_schedulers(sim, ones, rate, None, [batch + 13])
    assert sim.schedule_verify(ones, rate, None).tolist() == [2] * 4 + [1] * 5
    quarters = make_confidence("quantised", 64, 16, gen)
    for rate_kind, m_kind in [("flat", "tight"), ("tiles", "full"), ("jagged", "tight")]:
        rate = make_step_rate(rate_kind, make_capacity(m_kind, 64, 16), 64, gen)
        check_schedulers(sim, quarters, rate, random_caps(64, 16, gen), [64 + 100, 64 + 517])


def test_survival_ties_across_thread_chunks(sim):
    """The tie rank of the last admitted survival runs over requests in chunks of 1024 threads:
    with all ones at B = 1500 and room for 1500 + 1200 pairs, position 0 of every request and
    position 1 of requests 0..1199 are admitted; caps move the tie position; B = 1024, G = 32 all
    ones cut inside position 20; G = 40; B = 1024, G = 32 of quarters (products tie everywhere)
    cut at many capacities."""
    batch, block = 1500, 2
    ones = torch.ones(batch, block)
    rate = torch.ones(batch + 1 + 2700)
    check_schedulers(sim, ones, rate, None, [batch + 2700, batch + 1499, batch + 1501])
    assert sim.schedule_verify(ones, rate, None).tolist() == [2] * 1200 + [1] * 300
    caps = torch.ones(batch, dtype=torch.int32)
    caps[::3] = 2  # position 1 only for every third request: 500 of them
    check_schedulers(sim, ones, rate, caps, [batch + 250, 2 * batch + 250])
    assert sim.schedule_verify(ones, rate, caps).tolist() == caps.tolist()
    lengths = sim.allocate_verify(ones, i32(2 * batch + 250), caps)
    assert lengths.tolist() == [2 if r % 3 == 0 and r < 750 else 1 for r in range(batch)]
    ones = torch.ones(1024, 32)  # B = 1024, G = 32, all tied: the cut inside position 20
    rate = torch.ones(1024 + 1 + 20 * 1024 + 500)
    check_schedulers(sim, ones, rate, None, [1024 + 7])
    assert sim.schedule_verify(ones, rate, None).tolist() == [21] * 500 + [20] * 524
    ones = torch.ones(3, 40)  # G > 32 (the tie search is over any G)
    rate = torch.ones(3 + 1 + 100)
    check_schedulers(sim, ones, rate, None, [3 + 50])
    assert sim.schedule_verify(ones, rate, None).tolist() == [34, 33, 33]
    gen = generator(12)
    quarters = make_confidence("quantised", 1024, 32, gen)
    rate = make_step_rate("flat", make_capacity("tight", 1024, 32), 1024, gen)
    check_schedulers(sim, quarters, rate, random_caps(1024, 32, gen),
                     [1024 + 1, 1024 + 4000, 1024 + 17000])


@pytest.mark.parametrize("batch,block", [(64, 7), (100, 20), (300, 16)])
def test_first_stop_at_every_segment_edge(sim, batch, block):
    """The step rates of a thread's first two admission counts are read before the sort, its
    later ones after it (B * G > 1024: several counts a thread): a rate that drops right after
    count s makes Theta stop at exactly s, for s at, before and after the edges of the threads'
    segments, in schedule and plan; the CPU's lengths and budgets every time."""
    confidence = 0.5 + 0.5 * torch.rand(batch, block, generator=generator(batch))
    pairs = batch * block
    per_thread = -(-pairs // 1024)  # segments sized by the most admissions: M - 1 - B >= B * G
    stops = {0, 1, 2, pairs - 1}
    for edge in range(per_thread, pairs, per_thread * 211):
        stops.update({edge - 1, edge, edge + 1})
    for stop in sorted(s for s in stops if 0 <= s < pairs):
        rate = torch.ones(batch + pairs + 1)
        rate[batch + stop + 1:] = 0.01  # no later admission wins back the drop
        check_schedulers(sim, confidence, rate, None, [batch + stop], what=f"stop={stop}")
        assert int(sim.schedule_verify(confidence, rate, None).sum()) == stop
        assert sim.plan_verify_budget(confidence, rate).tolist() == [batch + stop]


def test_empty_batch(sim):
    """B = 0 launches and returns what the CPU kernel returns."""
    confidence = torch.rand(0, 4, generator=generator(7))
    rate = torch.tensor([1.0, 0.5])
    assert sim.schedule_verify(confidence, rate, None).shape == (0,)
    assert sim.plan_verify_budget(confidence, rate).tolist() == [0]
    assert sim.allocate_verify(confidence, i32(3), None).shape == (0,)


# --------------------------------------------------------------------------------------------
# Dynamic shared memory: what the sort needs, within the device's opt-in limit
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["l4", "a100", "h200"])
def test_shared_memory_fits_the_device(sim, device):
    """On every emulated device (l4: 99 KB opt-in per block) small merges, a 64 KB merge, a 128 KB
    merge (16384 keys of 8 bytes) and a 256 KB one run and match the CPU kernel; the 128 KB merge
    takes the shared path where it fits (a100, h200) and the global workspace on l4, the 256 KB
    one the global workspace everywhere."""
    gen = generator(17)
    cases = [(3, 4), (512, 16), (1024, 16), (1024, 32)]  # 12, 8192, 16384, 32768 keys
    with emulator.emulated_device(device):
        for batch, block in cases:
            confidence = make_confidence("uniform", batch, block, gen)
            rate = make_step_rate("jagged", make_capacity("tight", batch, block), batch, gen)
            launched = check_schedulers(sim, confidence, rate, random_caps(batch, block, gen),
                                        [batch + 7], what=f"{device} B={batch} G={block}")
            assert set(launched) == {expected_kernel(op, batch, block, device) for op in MODES}
    assert expected_kernel("schedule_verify", 1024, 16, "l4") == "schedule_kernel<0, false>"
    assert expected_kernel("schedule_verify", 1024, 16, "h200") == "schedule_kernel<0, true>"
    assert expected_kernel("schedule_verify", 512, 16, "l4") == "schedule_kernel<0, true>"
    assert expected_kernel("schedule_verify", 1024, 32, "h200") == "schedule_kernel<0, false>"


def test_device_switch_in_one_process(sim):
    """The path is chosen from the current device on each call (no cached limit): the same 128 KB
    merge alternates between the global path on l4 and the shared path on h200."""
    confidence = make_confidence("high", 1024, 16, generator(23))
    rate = make_step_rate("linear", make_capacity("full", 1024, 16), 1024, generator(24))
    expected = CPU.schedule_verify(confidence, rate, None)
    for device in ("h200", "l4", "h200", "l4"):
        with emulator.emulated_device(device):
            sim.clear_launch_log()
            assert torch.equal(sim.schedule_verify(confidence, rate, None), expected), device
            shared = "false" if device == "l4" else "true"
            assert emulator.launches() == {f"schedule_kernel<0, {shared}>": 1}, device


# --------------------------------------------------------------------------------------------
# pack_verify_inputs
# --------------------------------------------------------------------------------------------


def make_pack(batch, block, gen, anchor_dtype=torch.int64, token_dtype=torch.int64):
    anchor = torch.randint(0, 50000, (batch,), generator=gen).to(anchor_dtype)
    drafts = torch.randint(0, 50000, (batch, block), generator=gen).to(token_dtype)
    lengths = torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32)
    if batch >= 2:
        lengths[0], lengths[-1] = 0, block
    position = torch.randint(0, 2**40, (batch,), generator=gen)
    return anchor, drafts, lengths, position


def check_pack(sim, args, what=""):
    got = sim.pack_verify_inputs(*args)
    cpu = CPU.pack_verify_inputs(*args)
    ref = reference.pack_verify_inputs(*args)
    for name, g, c, r in zip(("input_ids", "positions", "cu_seqlens"), got, cpu, ref):
        assert_equal(f"pack_verify_inputs {name} {what}", g, c, r)
    return got


PACK_SHAPES = [(1, 0), (1, 1), (1, 32), (7, 7), (33, 5), (1000, 3), (1024, 32), (2000, 2)]


@pytest.mark.parametrize("batch,block", PACK_SHAPES, ids=[f"B{b}-G{g}" for b, g in PACK_SHAPES])
def test_pack_matches_cpu_and_reference(sim, batch, block):
    """pack_verify_inputs for every int32/int64 combination of anchors and tokens, B from 1 to 1024
    (the block scan over 32 warps) and past it (several requests per thread)."""
    gen = generator(batch * 37 + block)
    for anchor_dtype in (torch.int32, torch.int64):
        for token_dtype in (torch.int32, torch.int64):
            args = make_pack(batch, block, gen, anchor_dtype, token_dtype)
            check_pack(sim, args, what=f"({anchor_dtype}, {token_dtype})")
    sim.clear_launch_log()
    check_pack(sim, make_pack(batch, block, gen))
    assert emulator.launches() == {"pack_verify_inputs_kernel<long int, long int>": 1}


@pytest.mark.parametrize("layout", ["strided", "padded", "transposed", "expanded"])
def test_pack_non_contiguous(sim, layout):
    """Non-contiguous draft_tokens (and anchors) are read through their strides: gaps hold
    INT_MIN, which must never appear in the output."""
    gen = generator(41)
    batch, block = 70, 9
    for token_dtype in (torch.int32, torch.int64):
        anchor, drafts, lengths, position = make_pack(batch, block, gen, torch.int32, token_dtype)
        if layout == "transposed":
            strided = drafts.t().contiguous().t()
        elif layout == "expanded":
            strided = drafts[:1].expand(batch, block)  # stride 0 over requests
        else:
            strided = non_contiguous(drafts, layout)
        assert not strided.is_contiguous()
        got = check_pack(sim, (non_contiguous(anchor), strided, lengths, position), layout)
        contiguous = sim.pack_verify_inputs(anchor, strided.contiguous(), lengths, position)
        assert all(torch.equal(g, c) for g, c in zip(got, contiguous))
        assert int(got[0].min()) >= 0


def test_pack_out_of_range_lengths(sim):
    """Lengths past G or negative (refused only under DSPARK_OPS_DEBUG=1 on CUDA) are clamped to
    [0, G] by the kernel; the limits 0 and G themselves are packed."""
    gen = generator(43)
    anchor, drafts, lengths, position = make_pack(12, 6, gen)
    lengths[:] = 6
    lengths[3] = 0
    check_pack(sim, (anchor, drafts, lengths, position))
    for bad in (-1, 7, -(2**31), 2**31 - 1):
        wrong = lengths.clone()
        wrong[4] = bad
        got = sim.pack_verify_inputs(anchor, drafts, wrong, position)
        expected = CPU.pack_verify_inputs(anchor, drafts, wrong.clamp(0, 6), position)
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


# --------------------------------------------------------------------------------------------
# Planted faults: the comparisons above catch a broken kernel
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,block", [(64, 16), (1100, 32)])
def test_planted_merge_barrier_is_caught(sim, batch, block):
    """Dropping the __syncthreads of a merge round (shared path: between reading the inputs and
    writing the outputs in place; global path: between rounds) breaks the ranking, and the
    comparison with the CPU kernel and the reference fails."""
    gen = generator(51)
    confidence = make_confidence("uniform", batch, block, gen)
    rate = make_step_rate("jagged", make_capacity("tight", batch, block), batch, gen)
    caps = random_caps(batch, block, gen)
    check = lambda: check_schedulers(sim, confidence, rate, caps, [batch + 50])  # noqa: E731
    check()  # the intact kernel passes
    with emulator.planted("drop_barrier:" + emulator.barrier_site("schedule.cuh", "2. Merge rounds")):
        assert emulator.caught(check)
    check()


def test_planted_scan_barrier_is_caught(sim):
    """Dropping the first __syncthreads of block_exclusive_scan lets warp 0 scan the warp totals
    before the other warps wrote them: pack_verify_inputs' offsets are wrong and the comparison
    fails. (The static scratch keeps the previous launch's values, so a one-request launch goes
    first: its stale scan values are all 1, and the faulty offsets then stay below the right total
    plus 32 + one warp's tokens, within the B * (G + 1) buffer, about half full here.)"""
    gen = generator(53)
    args = make_pack(1024, 8, gen)
    check_pack(sim, args)
    check_pack(sim, make_pack(1, 8, gen))  # the same instantiation, <long int, long int>
    with emulator.planted("drop_barrier:" + emulator.barrier_site("reduce.cuh",
                                                                  "block_exclusive_scan")):
        assert emulator.caught(lambda: check_pack(sim, args))
    check_pack(sim, args)


def test_pack_extreme_position_wraps_without_overflow(sim):
    """Positions are range-checked on CPU (and on CUDA under DSPARK_OPS_DEBUG=1); unchecked, the
    kernel's p0 + j is computed modulo 2^64 with no signed overflow (the asan flavour's UBSan
    checks that), as the reference's int64 arithmetic does."""
    gen = generator(44)
    anchor, drafts, lengths, position = make_pack(3, 4, gen)
    lengths[:] = 4
    position[1] = 2**63 - 1
    got = sim.pack_verify_inputs(anchor, drafts, lengths, position)
    ref = reference.pack_verify_inputs(anchor, drafts, lengths, position)
    for name, g, r in zip(("input_ids", "positions", "cu_seqlens"), got, ref):
        assert torch.equal(g, r.to(g.dtype)), name
    assert got[1][5:10].tolist() == [2**63 - 1, *range(-(2**63), -(2**63) + 4)]
