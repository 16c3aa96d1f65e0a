"""The SIMT emulator itself (csrc/sim/): mma.sync against a plain matrix product on random
fragments, warp shuffles, and every check it makes — each shown to fire on a small kernel with a
planted defect (csrc/sim/selftest.cpp) and to stay quiet on its correct twin. Without these the
emulated tests of the library's kernels would prove nothing."""

from __future__ import annotations

import pytest
import torch

import emulator
from conftest import cuda_only

pytestmark = pytest.mark.sim

RACE = emulator.FLAVOUR == "race"
ASAN = emulator.FLAVOUR == "asan"


# ---- mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}


def _pack(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two 16-bit values per 32-bit register, the lower index in the low half (PTX ISA)."""
    bits = lambda t: t.view(torch.int16).to(torch.int64) & 0xFFFF  # noqa: E731
    word = bits(lo) | (bits(hi) << 16)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _fragments(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
    """Per-lane registers of A [16, 16] (row), B [16, 8] (col) and C [16, 8], written from the
    PTX ISA's "Matrix Fragments for mma.m16n8k16" (groupID g = lane / 4, t = lane % 4)."""
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    a_regs = torch.stack([
        _pack(a[g, 2 * t], a[g, 2 * t + 1]),
        _pack(a[g + 8, 2 * t], a[g + 8, 2 * t + 1]),
        _pack(a[g, 2 * t + 8], a[g, 2 * t + 9]),
        _pack(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9]),
    ], 1)
    b_regs = torch.stack([
        _pack(b[2 * t, g], b[2 * t + 1, g]),
        _pack(b[2 * t + 8, g], b[2 * t + 9, g]),
    ], 1)
    c_regs = torch.stack([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]], 1)
    return a_regs.contiguous(), b_regs.contiguous(), c_regs.contiguous()


def _unfragment(d_regs: torch.Tensor) -> torch.Tensor:
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    d = torch.empty(16, 8)
    d[g, 2 * t], d[g, 2 * t + 1] = d_regs[:, 0], d_regs[:, 1]
    d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = d_regs[:, 2], d_regs[:, 3]
    return d


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(4))
def test_mma_matches_matrix_product(sim, dtype, case):
    """D = A B + C on random fragments equals the float64 product of the same 16-bit values."""
    gen = torch.Generator().manual_seed(case)
    a = (torch.randn(16, 16, generator=gen) * (1 + case)).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    c = torch.randn(16, 8, generator=gen)
    d = _unfragment(sim.mma(*_fragments(a, b, c), dtype == torch.float16))
    expected = (a.double() @ b.double() + c.double()).float()
    torch.testing.assert_close(d, expected, rtol=1e-6, atol=1e-6)


def test_mma_catches_swapped_fragment_registers(sim):
    """With A registers 1 and 2 swapped (rows g+8 and columns 8.. exchanged) the product is wrong:
    the comparison above would fail."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(16, 16, generator=gen).to(torch.bfloat16)
    b = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    c = torch.zeros(16, 8)
    with emulator.planted("mma_swap_a12"):
        d = _unfragment(sim.mma(*_fragments(a, b, c), False))
    assert not torch.allclose(d, (a.double() @ b.double()).float(), rtol=1e-3, atol=1e-3)


def test_mma_special_values(sim):
    """Infinities and NaN propagate as IEEE arithmetic does."""
    a = torch.zeros(16, 16, dtype=torch.float16)
    b = torch.ones(16, 8, dtype=torch.float16)
    a[0, 0], a[1, 3], a[1, 4] = float("inf"), float("inf"), float("-inf")
    a[2, 5] = float("nan")
    d = _unfragment(sim.mma(*_fragments(a, b, torch.zeros(16, 8)), True))
    assert torch.isposinf(d[0]).all() and torch.isnan(d[1]).all() and torch.isnan(d[2]).all()
    assert (d[3:] == 0).all()


# ---- block and warp reductions on the correct kernels


def test_block_and_warp_sums(sim):
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    out = sim.selftest("sum", x, 50)
    torch.testing.assert_close(out[0], x[:50].sum(), rtol=1e-5, atol=1e-5)
    out = sim.selftest("warp_sum", x, 64)
    torch.testing.assert_close(out[:2], x.view(2, 32).sum(1), rtol=1e-5, atol=1e-5)


def test_warp_vote(sim):
    """__any_sync (the prelude's OR butterfly of shuffles): true in a warp exactly when one of its
    lanes votes true, the same answer in every lane; none, one (each position) or all true."""
    for true_lanes in ([], [0], [31], [5, 17], list(range(64))):
        for n in (64, 40):
            x = -torch.ones(64)
            x[true_lanes] = 1.0
            out = sim.selftest("warp_any", x, n).view(2, 32)
            want = torch.tensor([[float(any(t < n for t in true_lanes if t // 32 == w))] * 32
                                 for w in range(2)])
            assert torch.equal(out, want), (true_lanes, n)


def test_shuffle_fault_is_caught(sim):
    """Shuffles reading the neighbouring lane break the butterfly sum."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))
    with emulator.planted("shuffle_off_by_one"):
        out = sim.selftest("warp_sum", x, 64)
    assert not torch.allclose(out[:2], x.view(2, 32).sum(1), rtol=1e-3, atol=1e-3)


def test_same_seed_same_schedule(sim):
    """A run is reproducible from the seed: the emulator's only randomness."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    sim.set_seed(11)
    first = sim.selftest("sum", x, 64)
    sim.set_seed(11)
    assert torch.equal(first, sim.selftest("sum", x, 64))


# ---- barriers and warp-collective misuse: reported in every flavour


@pytest.mark.parametrize(
    "kernel, message",
    [
        ("divergent_barrier", "reached after 32 of 64 threads exited"),
        ("exit_before_barrier", "reached after 32 of 64 threads exited"),
        ("different_barriers", "different __syncthreads"),
        ("shuffle_missing_lanes", "exited while named in the mask"),
        ("vote_missing_lanes", "exited while named in the mask"),
        ("shuffle_outside_mask", "which is not in the mask 0xffff"),
    ],
)
def test_synchronisation_misuse_is_reported(sim, kernel, message):
    with pytest.raises(RuntimeError, match=message):
        sim.selftest(kernel, torch.randn(64), 64)


def test_dropped_barrier_changes_the_result_or_is_reported(sim):
    """The tree sum with its loop barrier removed: the race flavour reports it; in the plain
    flavour some seeded interleaving reads a partial sum before it is written."""
    x = torch.rand(64, generator=torch.Generator().manual_seed(4)) + 1
    site = _selftest_barrier_in("sum_kernel", after="half /= 2")
    outcomes = []
    with emulator.planted(site):
        for seed in range(8):
            sim.set_seed(seed)
            try:
                outcomes.append(sim.selftest("sum", x, 64)[0].item())
            except RuntimeError as e:
                assert RACE and "data race" in str(e)
                outcomes.append(None)
    expected = x.sum().item()
    assert any(o is None or abs(o - expected) > 1e-3 for o in outcomes)


def _selftest_barrier_in(kernel: str, after: str) -> str:
    lines = open(f"{emulator.ROOT}/csrc/sim/selftest.cpp").read().splitlines()
    start = next(i for i, line in enumerate(lines) if f" {kernel}(" in line)
    start = next(i for i in range(start, len(lines)) if after in lines[i])
    line = next(i for i in range(start, len(lines)) if "__syncthreads()" in lines[i])
    return f"drop_barrier:selftest.cpp:{line + 1}"


# ---- cp.async (kernels/async_copy.cuh): copies land at the wait that completes them


def test_async_copy_groups_and_zero_fill(sim):
    """Two copy groups per thread: the group-0 chunk is read after a wait that leaves one group
    pending, another thread's group-1 chunk after the last wait and a barrier; chunks at or past
    n are zero-filled without reading x."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(6))
    for n in (256, 100):
        out = sim.selftest("async_copy", x, n)
        want = 2 * x.view(64, 4).sum(1) * (torch.arange(64) * 4 < n)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_async_copy_read_before_its_wait_sees_poison(sim):
    """A group still pending after cp.async.wait_group 1 holds the poison (NaN), not the data."""
    out = sim.selftest("async_copy_early_read", torch.randn(256), 256)
    assert torch.isnan(out).all()


@pytest.mark.parametrize(
    "kernel, message",
    [
        ("async_copy_no_wait", "exited with 2 asynchronous copies never waited for"),
        ("async_copy_uncommitted", "exited with 1 asynchronous copies never waited for"),
        ("async_copy_misaligned", "16-byte copy .* not aligned to its size"),
    ],
)
def test_async_copy_misuse_is_reported(sim, kernel, message):
    with pytest.raises(RuntimeError, match=message):
        sim.selftest(kernel, torch.randn(256), 256)


def test_dependent_launch_waits_in_every_thread(sim):
    """A kernel launched with DSPARK_LAUNCH_DEPENDENT (programmatic dependent launch) runs after the
    kernel before it; a thread that exits without wait_for_previous_grid() is reported (its grid
    could complete first and release the stream's next kernel early), its correct twin is not."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    out = sim.selftest("dependent", x, 50)
    torch.testing.assert_close(out[:50], x[:50] + 1)
    assert (out[50:] == 0).all()
    with pytest.raises(RuntimeError, match=r"exited without wait_for_previous_grid\(\)"):
        sim.selftest("dependent_early_exit", x, 50)
    sim.selftest("dependent_early_exit", x, 64)  # every thread waits: quiet


# ---- launch configuration against the emulated device


def test_launch_bounds(sim):
    sim.selftest("threads_over_bounds", torch.randn(64), 64)
    with pytest.raises(RuntimeError, match=r"exceeds __launch_bounds__\(64\)"):
        sim.selftest("threads_over_bounds", torch.randn(64), 128)


def test_every_kernels_launch_bounds_are_registered():
    """csrc/sim/build.py registers the thread bound of every __launch_bounds__ in the kernel
    sources, also where the blocks-per-SM argument is an expression with parentheses of its own
    (the slot and statistics kernels): a kernel it missed would go unchecked."""
    import importlib.util
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("sim_build", root / "csrc" / "sim" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    registered = re.findall(r'DSPARK_SIM_BOUNDS\("(\w+)", (\w+)\)', build.launch_bounds())
    names = dict(registered)
    sources = sorted((root / "csrc" / "kernels").glob("*.cuh")) + [root / "csrc" / "sim" /
                                                                     "selftest.cpp"]
    declared = sum(len(re.findall(r"__global__\s+void\s+__launch_bounds__\(", p.read_text()))
                   for p in sources)
    assert len(registered) == declared
    assert names["draft_slot_kernel"] == "kDraftThreads"
    assert names["verify_row_stats_kernel"] == "kVerifyThreads"


def test_grid_limits(sim):
    sim.selftest("grid_y", torch.randn(64), 65535)
    with pytest.raises(RuntimeError, match="grid .* outside"):
        sim.selftest("grid_y", torch.randn(64), 65536)


def test_dynamic_shared_memory_without_opt_in(sim):
    x = torch.randn(64)
    out = sim.selftest("dynamic_copy", x, 48 * 1024 // 4)
    assert torch.equal(out, x)
    with pytest.raises(RuntimeError, match="above the 49152 bytes allowed without"):
        sim.selftest("dynamic_copy", x, 48 * 1024 // 4 + 1)


@pytest.mark.parametrize("device, limit", [("h200", 227 * 1024), ("a100", 163 * 1024), ("l4", 99 * 1024)])
def test_dynamic_shared_memory_opt_in_limit(sim, device, limit):
    """cudaFuncSetAttribute accepts up to the device's opt-in limit per block, no more."""
    x = torch.randn(64)
    with emulator.emulated_device(device):
        assert torch.equal(sim.selftest("opt_in", x, limit), x)
        with pytest.raises(RuntimeError, match=f"above the {limit} bytes a block may opt in to"):
            sim.selftest("opt_in", x, limit + 16)


def test_unknown_device_is_an_error(sim):
    with pytest.raises(ValueError, match="unknown emulated device 'h100x'"):
        sim.set_device("h100x")


# ---- the race flavour's checker


@pytest.mark.skipif(not RACE, reason="the race checker runs in the race flavour")
@pytest.mark.parametrize(
    "kernel, message",
    [
        ("sum_no_barrier", "data race .* shared"),
        ("global_race", "data race .* global"),
        ("uninitialised", "uninitialised shared memory"),
        # a race, or (when the reader runs before the issuing thread) an uninitialised read
        ("async_copy_no_barrier", "data race .* shared|uninitialised shared memory"),
    ],
)
def test_races_are_reported(sim, kernel, message):
    with pytest.raises(RuntimeError, match=message):
        sim.selftest(kernel, torch.randn(64), 64)


@pytest.mark.skipif(not RACE, reason="the race checker runs in the race flavour")
@pytest.mark.parametrize("kernel", ["sum", "warp_sum", "global_atomic", "async_copy"])
def test_correct_kernels_have_no_race(sim, kernel):
    x = torch.randn(256 if kernel == "async_copy" else 64)
    out = sim.selftest(kernel, x, 64)
    if kernel == "global_atomic":
        torch.testing.assert_close(out[0], x.sum(), rtol=1e-5, atol=1e-5)


# ---- the bounds flavour (AddressSanitizer + UBSan)


@pytest.mark.skipif(not ASAN, reason="bounds checks run in the asan flavour")
@pytest.mark.parametrize(
    "kernel, n",
    [("sum_tail", 50), ("shared_overflow", 64), ("dynamic_copy", 32), ("async_copy_tail", 128)],
)
def test_out_of_bounds_is_reported(sim, kernel, n):
    """One past a global buffer (x has exactly n elements; for cp.async, a 16-byte copy read at
    its wait), one past a static __shared__ array, and up to 128 bytes before the start of the
    dynamic shared buffer (32 floats for 64 threads): past the allocator's own redzone, inside
    the emulator's guard band, so the stray writes are reported and corrupt nothing."""
    x = torch.randn(n if kernel in ("sum_tail", "async_copy_tail") else max(n, 64))
    with pytest.raises(RuntimeError, match="out of bounds"):
        sim.selftest(kernel, x, n)


@pytest.mark.skipif(not ASAN, reason="bounds checks run in the asan flavour")
def test_in_bounds_kernels_are_quiet(sim):
    x = torch.randn(64)
    sim.selftest("sum", x, 64)
    assert torch.equal(sim.selftest("dynamic_copy", x, 64), x)
    sim.selftest("async_copy_tail", torch.randn(260), 256)


# ---- the emulation against the hardware (runs only where a GPU is present: gpu_checks/gpu_check.sh)


@cuda_only
def test_emulation_agrees_with_the_gpu(sim):
    """The same inputs through the emulated and the real CUDA kernels: verify tokens exactly, the
    tensor-core paths (bf16 markov_draft logits, block attention) within float32 rounding of the
    summation order — the check of the mma.sync emulation that only hardware can make."""
    gen = torch.Generator().manual_seed(5)
    B, G, V, r = 3, 4, 1000, 64
    target = torch.randn(B, G + 1, V, generator=gen)
    drafts = torch.randint(0, V, (B, G), generator=gen)
    args = (drafts, torch.full((B,), G, dtype=torch.int32), torch.tensor([1.0, 0.0, 0.7]),
            torch.arange(B), torch.tensor([3, 9, 27]))
    emulated = sim.verify(target, *args, None, None, None)
    real = torch.ops.dspark_ops.verify(target.cuda(), *[a.cuda() for a in args], None, None, None)
    for e, g in zip(emulated, real):
        assert torch.equal(e, g.cpu())

    base = torch.randn(B, G, V, generator=gen)
    w1 = (torch.randn(V, r, generator=gen) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(V, r, generator=gen) * 0.1).to(torch.bfloat16)
    dargs = (torch.ones(B), torch.arange(B), torch.tensor([1, 2, 3]))
    anchor = torch.randint(0, V, (B,), generator=gen)
    e_tokens, e_logits = sim.markov_draft(base, anchor, w1, w2, *dargs)
    g_tokens, g_logits = torch.ops.dspark_ops.markov_draft(
        base.cuda(), anchor.cuda(), w1.cuda(), w2.cuda(), *[a.cuda() for a in dargs])
    torch.testing.assert_close(e_logits, g_logits.cpu(), rtol=1e-5, atol=1e-5)

    q = torch.randn(2, 5, 4, 64, generator=gen).to(torch.bfloat16)
    kb, vb = (torch.randn(2, 5, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    kc, vc = (torch.randn(2, 300, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([300, 77], dtype=torch.int32)
    e_out, _ = sim.block_draft_attention(q, kb, vb, kc, vc, lens, None, None, None, False)
    g_out, _ = torch.ops.dspark_ops.block_draft_attention(
        q.cuda(), kb.cuda(), vb.cuda(), kc.cuda(), vc.cuda(), lens.cuda(), None, None, None, False)
    torch.testing.assert_close(e_out.float(), g_out.cpu().float(), rtol=2e-2, atol=2e-2)
