"""The attention family's CUDA entry points, launchers and kernels (csrc/cuda/attention_cuda.cpp,
attention_launch.cu, csrc/kernels/attention.cuh) run in the SIMT emulator: block_draft_attention
and append_context_kv against the CPU kernel and dspark_ops.reference.

The rule is the one test_attention.py applies to CUDA: the output within OUT_TOL of the float32
reference (the emulated mma.sync sums exactly but P enters the second product rounded to the input
type, as on the GPU, so bfloat16/float16-level differences remain) and of the CPU kernel, lse
within LSE_TOL; appends bit for bit.

Covered: D = 64, 128, 256 (116 KB of dynamic shared memory with a ring of three K/V tiles: the
cudaFuncSetAttribute opt-in; on the emulated L4, whose blocks take 99 KB, the ring of two), float16
and bfloat16, GQA ratios 1, 2, 4, one, two and three row groups of 32 query rows (full and partial,
a second MMA row tile partly filled or all padding), L = 0, contexts shorter than a tile, one tile,
several tiles (more than the ring holds) and several splits of the split plan (the fewest splits s <= ceil(visible / 256) whose
waves(s) / s, waves of occupancy x SMs blocks, is within 2% of the best; a case at the wave
boundary on the emulated L4), among them splits that are empty or partly filled because a
request's context is shorter than L, windows 0 / smaller than the context / crossing a split / past
L, cache_slot remapping (permuted, spread, shared rows), return_lse on and off, an explicit
softmax_scale, aligned caches (16-byte vector tile loads) and unaligned ones (strides or base off
16 bytes: the element-wise loads), NaN outside the visible context; append_context_kv with 16- and
32-bit elements, rows dropped at L, num_new 0 and n_max, cache_slot mapping, cache_seqlens advanced
in place and guard bands around the caches left untouched, head dims with a partial 16-byte chunk
per row and rows aligned in both, one or neither of the new rows and the caches. Planted faults
(mma_swap_a12, shuffle_off_by_one, the barrier of the K/V tile ring, the barrier before cache_seqlens
advances, the ldmatrix fragments) are shown to be caught.

Out-of-range values (cache_seqlens outside [0, L], cache_slot outside [0, N), num_new outside
[0, n_max]) reach the kernels, as on CUDA without DSPARK_OPS_DEBUG=1: the emulator's tensors are
checked as CUDA tensors (value_checks_enabled in csrc/common/checks.cpp).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import emulator
from dspark_ops import reference
from cases.attention import (
    BF16,
    F16,
    F32,
    LSE_TOL,
    NAN,
    OUT_TOL,
    i32,
    make_slots,
    randn,
    same_bits,
    strided_cache,
)

pytestmark = pytest.mark.sim

RACE = emulator.FLAVOUR == "race"
CPU = torch.ops.dspark_ops
CUDA_TYPE = {F16: "__half", BF16: "__nv_bfloat16"}


def generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


# --------------------------------------------------------------------------------------------
# block_draft_attention
# --------------------------------------------------------------------------------------------


def make_inputs(name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype):
    gen = generator(name)
    slots, cache_slot = make_slots(slot_kind, batch, gen, "cpu")
    t = dict(
        q=randn(gen, batch, block, heads, dim, dtype=dtype, device="cpu", scale=1.5),
        k_block=randn(gen, batch, block, kv_heads, dim, dtype=dtype, device="cpu"),
        v_block=randn(gen, batch, block, kv_heads, dim, dtype=dtype, device="cpu"),
        k_cache=randn(gen, slots, length, kv_heads, dim, dtype=dtype, device="cpu"),
        v_cache=randn(gen, slots, length, kv_heads, dim, dtype=dtype, device="cpu"),
    )
    return t, cache_slot


def call(op, t, seqlens, cache_slot=None, softmax_scale=None, window=None, return_lse=True):
    return op.block_draft_attention(t["q"], t["k_block"], t["v_block"], t["k_cache"],
                                    t["v_cache"], seqlens, cache_slot, softmax_scale, window,
                                    return_lse)


def expected(t, seqlens, cache_slot=None, softmax_scale=None, window=None):
    f = {k: v.float() for k, v in t.items()}
    return reference.block_draft_attention(f["q"], f["k_block"], f["v_block"], f["k_cache"],
                                           f["v_cache"], seqlens, cache_slot=cache_slot,
                                           softmax_scale=softmax_scale, window=window)


def assert_close_to(out, lse, want_out, want_lse, dtype, what):
    torch.testing.assert_close(out.float(), want_out.float(), **OUT_TOL[dtype],
                               msg=lambda m: f"out {what}: {m}")
    torch.testing.assert_close(lse, want_lse, **LSE_TOL[dtype], msg=lambda m: f"lse {what}: {m}")


def check(sim, t, seqlens, what="", **options):
    """The emulated op: its output contract, return_lse=False giving the same output, and the
    result within tolerance of the CPU kernel and of the float32 reference. Returns (out, lse)."""
    dtype = t["q"].dtype
    out, lse = call(sim, t, seqlens, **options)
    assert out.shape == t["q"].shape and out.dtype == dtype and out.is_contiguous(), what
    assert lse.shape == t["q"].shape[:3] and lse.dtype == F32, what
    out_only, no_lse = call(sim, t, seqlens, **options, return_lse=False)
    assert no_lse.shape == (0,) and torch.equal(out_only, out), what
    cpu_out, cpu_lse = call(CPU, t, seqlens, **options)
    assert_close_to(out, lse, cpu_out, cpu_lse, dtype, f"vs CPU kernel {what}")
    want_out, want_lse = expected(t, seqlens, **options)
    assert_close_to(out, lse, want_out, want_lse, dtype, f"vs reference {what}")
    return out, lse


# (id, B, G, Hq, Hkv, D, L, slot kind, dtype, cache_seqlens). The split plan on the emulated H200
# (occupancy 3 / 2 / 1 blocks per SM at D = 64 / 128 / 256, 132 SMs; K/V tiles of 64 / 64 / 32
# rows) is always capped by ceil(visible / 256) at these sizes: the splits and their lengths are
# noted per case for window = None.
ATTENTION_CASES = [
    # 3 splits of 256: request 2 (130) fills part of split 0 only, request 1 has no context.
    ("d64-gqa4-3splits", 3, 3, 8, 2, 64, 700, "spread", BF16, [700, 0, 130]),
    # 4 splits of 256, the last one a partial tile (1000 = 3 x 256 + 3 x 64 + 40).
    ("d128-mha-4splits", 1, 4, 4, 1, 128, 1000, "none", F16, [1000]),
    # 28 query rows per KV head: one row group, its second row tile partial; 2 splits of 160
    # (5 tiles of 32, more than the ring of 3), the second one empty for the 45-row request.
    ("d256-gqa4-rowgroups", 2, 7, 8, 2, 256, 300, "permuted", BF16, [300, 45]),
    # 32 rows: one full row group; exactly one tile.
    ("d128-gqa2-one-tile", 2, 16, 2, 1, 128, 64, "none-spare", F16, [64, 17]),
    # Shorter than one tile; cache rows shared by requests.
    ("d64-mha-short", 4, 1, 1, 1, 64, 50, "shared", F16, [50, 0, 3, 33]),
    # 3 splits of 192 with 333 rows: split 1 partial, split 2 empty; Hkv = 6; 5 query rows, the
    # second row tile all padding (its warps idle).
    ("d256-mha-6heads", 1, 5, 6, 6, 256, 520, "spread", F16, [333]),
    # 2 splits of 192; contexts 1, 64, 65 (one row past a tile), 200.
    ("d64-gqa2-edges", 5, 2, 4, 2, 64, 260, "permuted", BF16, [260, 1, 64, 65, 200]),
    # L = 0: only the block keys.
    ("d128-L0", 2, 2, 2, 1, 128, 0, "none", BF16, [0, 0]),
    # 68 query rows per KV head: three row groups, the last one 4 rows; 2 splits of 192.
    ("d128-gqa4-3groups", 2, 17, 8, 2, 128, 380, "spread", BF16, [380, 250]),
    # D = 512 (Gemma4): tiles of 16 rows, one split of 192 (12 tiles: the ring wraps), contexts
    # 150 (a partial last tile) and 1 (a 1-row tail).
    ("d512-gqa4", 2, 3, 8, 2, 512, 190, "permuted", BF16, [150, 1]),
    ("d512-mha-f16", 1, 2, 2, 2, 512, 40, "none", F16, [37]),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_matches_cpu_and_reference(sim, case):
    """Every head dim, dtype, GQA ratio, row-group shape and context/split shape above, with
    windows none / 0 / inside the context / crossing a split / past L, and an explicit scale."""
    name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype, lengths = case
    t, cache_slot = make_inputs(name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype)
    seqlens = i32(*lengths)
    scale = 1.3 / math.sqrt(dim)
    for window, softmax_scale in [(None, None), (0, None), (37, scale), (length // 2 + 3, None),
                                  (length + 5, scale)]:
        check(sim, t, seqlens, f"{name} window={window} scale={softmax_scale}",
              cache_slot=cache_slot, window=window, softmax_scale=softmax_scale)


def test_attention_does_not_depend_on_the_schedule(sim):
    """Block order and thread interleaving change nothing: each value is computed by a fixed
    thread in a fixed order, whatever the seed."""
    name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype, lengths = ATTENTION_CASES[0]
    t, cache_slot = make_inputs(name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype)
    runs = []
    for seed in (1, 2, 3):
        sim.set_seed(seed)
        runs.append(call(sim, t, i32(*lengths), cache_slot, window=300))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("device", ["a100", "l4"])
def test_head_dim_256_on_smaller_devices(sim, device):
    """D = 256 with a ring of three tiles needs 116 KB of dynamic shared memory: the glue's
    cudaFuncSetAttribute opt-in is accepted on the A100 (163 KB); the L4's blocks take 99 KB, so
    there the ring holds two tiles (83 KB). The emulator checks the launches against those
    limits, and the result is the H200's (the split plan is capped by the context there)."""
    name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype, lengths = ATTENTION_CASES[2]
    t, cache_slot = make_inputs(name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype)
    seqlens = i32(*lengths)
    on_h200 = call(sim, t, seqlens, cache_slot, window=100)
    sim.clear_launch_log()
    with emulator.emulated_device(device):
        out, lse = check(sim, t, seqlens, device, cache_slot=cache_slot, window=100)
    stages = 2 if device == "l4" else 3
    assert emulator.launches() == {
        f"block_attention_split_kernel<{CUDA_TYPE[dtype]}, 256, {stages}>": 2,
        f"block_attention_merge_kernel<{CUDA_TYPE[dtype]}, 256>": 2,
    }
    assert torch.equal(out, on_h200[0]) and torch.equal(lse, on_h200[1])


def test_split_plan_at_the_wave_boundary(sim):
    """On the emulated L4 (58 SMs, one D = 256 block each) B x Hkv x row groups = 24 blocks:
    2 splits (48 blocks, one wave), not ceil(58 / 24) = 3 (72 blocks, two waves), 4 splits (96
    blocks, two waves of quarter-size work) being no better; the merge folds 2 splits per row,
    one of them partly filled or empty for the shorter contexts. Also the window that leaves one
    split."""
    t, cache_slot = make_inputs("wave", 3, 8, 16, 4, 256, 1024, "spread", BF16)
    with emulator.emulated_device("l4"):
        check(sim, t, i32(1024, 700, 300), "l4", cache_slot=cache_slot)
        check(sim, t, i32(1024, 700, 300), "l4 window", cache_slot=cache_slot, window=200)


def test_every_instantiation_runs(sim):
    """Both kernels of both 16-bit dtypes at every head dim run (one launch each per call);
    float32 attention is rejected by the CUDA entry point."""
    sim.clear_launch_log()
    for dtype in (F16, BF16):
        for dim in (64, 128, 256, 512):
            name = f"inst-{dtype}-{dim}"
            t, _ = make_inputs(name, 2, 2, 4, 2, dim, 70, "none", dtype)
            check(sim, t, i32(70, 9), name)
    launched = emulator.launches()
    assert launched == {name: 2 for dtype in (F16, BF16) for dim in (64, 128, 256, 512)
                        for name in (f"block_attention_split_kernel<{CUDA_TYPE[dtype]}, {dim}, 3>",
                                     f"block_attention_merge_kernel<{CUDA_TYPE[dtype]}, {dim}>")}, \
        launched
    t, _ = make_inputs("inst-f32", 2, 2, 4, 2, 64, 70, "none", F32)
    with pytest.raises(TypeError, match=r"on CUDA 'q' must have dtype Half or BFloat16, got Float"):
        call(sim, t, i32(70, 9))


def test_empty_shapes(sim):
    """B = 0, G = 0 and Hq = 0 launch nothing and give empty outputs of the CPU kernel's shapes
    (the glue's split plan once divided by the zero blocks such a shape has: UBSan's report in the
    asan flavour found it)."""
    sim.clear_launch_log()
    for batch, block, heads, kv_heads in ((0, 4, 4, 2), (2, 0, 4, 2), (2, 4, 0, 1)):
        t, _ = make_inputs(f"empty-{batch}-{block}-{heads}", batch, block, heads, kv_heads, 64, 9,
                           "none", F16)
        seqlens = i32(*[5] * batch)
        out, lse = call(sim, t, seqlens)
        cpu_out, cpu_lse = call(CPU, t, seqlens)
        assert out.shape == cpu_out.shape == (batch, block, heads, 64)
        assert lse.shape == cpu_lse.shape == (batch, block, heads)
    assert emulator.launches() == {}


def test_nothing_outside_the_visible_context_is_read(sim):
    """Positions at or past p0, rows before the window and rows of unused slots hold NaN: the
    tiles never load them (the past-the-end rows of a tile are zero-filled, not read), the output
    is finite and the caches come back bit-identical."""
    name, batch, block, heads, kv_heads, dim, length = "poison", 4, 3, 8, 2, 128, 400
    t, cache_slot = make_inputs(name, batch, block, heads, kv_heads, dim, length, "spread", BF16)
    seqlens = i32(400, 0, 333, 70)
    slots = t["k_cache"].shape[0]
    for window in (None, 100):
        poisoned = torch.ones(slots, length, dtype=torch.bool)
        for b in range(batch):
            end = int(seqlens[b])
            begin = 0 if window is None else max(0, end - window)
            poisoned[int(cache_slot[b]), begin:end] = False
        clean = {k: v.clone() for k, v in t.items()}
        for name_ in ("k_cache", "v_cache"):
            t[name_][poisoned] = NAN
        before = {k: t[k].clone() for k in ("k_cache", "v_cache")}
        out, lse = call(sim, t, seqlens, cache_slot, window=window)
        assert out.isfinite().all() and lse.isfinite().all(), f"window={window}"
        for k, snapshot in before.items():
            assert same_bits(t[k], snapshot), k
        want_out, want_lse = expected(clean, seqlens, cache_slot, window=window)
        assert_close_to(out, lse, want_out, want_lse, BF16, f"window={window}")
        t = clean


def unaligned_base(cache: torch.Tensor) -> torch.Tensor:
    """The same values in a contiguous-strided view whose base is one element (2 bytes) past a
    16-byte boundary: every stride is a 16-byte multiple, the base is not."""
    buffer = torch.full((cache.numel() + 8,), NAN, dtype=cache.dtype)
    out = buffer[1 : 1 + cache.numel()].view(cache.shape)
    out.copy_(cache)
    assert out.data_ptr() % 16 != 0
    return out


# Layout -> (k_cache, v_cache) builders and whether the glue sees kv_aligned.
LAYOUTS = {
    "contiguous": (lambda c: c, lambda c: c, True),
    "padded-rows": (lambda c: strided_cache(c, "padded-rows"),
                    lambda c: strided_cache(c, "padded-rows"), True),
    "head-major": (lambda c: strided_cache(c, "head-major"),
                   lambda c: strided_cache(c, "head-major"), True),
    "broadcast-row": (lambda c: c[:1].expand_as(c), lambda c: c[:1].expand_as(c), True),
    "unaligned-rows": (lambda c: strided_cache(c, "unaligned-rows"),
                       lambda c: strided_cache(c, "unaligned-rows"), False),
    "unaligned-base": (unaligned_base, unaligned_base, False),
    "only-v-unaligned": (lambda c: c, lambda c: strided_cache(c, "unaligned-rows"), False),
}


def kv_aligned(k: torch.Tensor, v: torch.Tensor) -> bool:
    """What attention_cuda.cpp computes: both bases and every non-D stride 16-byte multiples."""
    return all(c.data_ptr() % 16 == 0 and all(c.stride(d) * c.element_size() % 16 == 0
                                              for d in range(3)) for c in (k, v))


@pytest.mark.parametrize("dim,dtype", [(64, F16), (256, BF16)], ids=["d64-f16", "d256-bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cache_layouts(sim, layout, dim, dtype):
    """Aligned caches (vector tile loads) and unaligned ones (element loads) give the contiguous
    cache's result bit for bit (which matches the CPU kernel and the reference), and NaN in the
    gaps of the views is never read; q with padded, unaligned rows too."""
    name = f"layout-{layout}-{dim}"
    t, cache_slot = make_inputs(name, 3, 5, 4, 2, dim, 290, "permuted", dtype)
    make_k, make_v, aligned = LAYOUTS[layout]
    if layout == "broadcast-row":
        t["k_cache"], t["v_cache"] = t["k_cache"][:1].expand_as(t["k_cache"]).contiguous(), \
            t["v_cache"][:1].expand_as(t["v_cache"]).contiguous()
    seqlens = i32(290, 130, 7)
    laid = dict(t, k_cache=make_k(t["k_cache"]), v_cache=make_v(t["v_cache"]))
    if layout != "contiguous":
        laid["q"] = torch.full((3, 5, 4, dim + 8), NAN, dtype=dtype)[..., 3 : 3 + dim]
        laid["q"].copy_(t["q"])
        assert not laid["q"].is_contiguous()
    assert kv_aligned(laid["k_cache"], laid["v_cache"]) == aligned
    for window in (None, 75):
        want = call(sim, t, seqlens, cache_slot, window=window)
        if layout == "contiguous":
            check(sim, t, seqlens, f"window={window}", cache_slot=cache_slot, window=window)
        got = call(sim, laid, seqlens, cache_slot, window=window)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), window


def test_out_of_range_values_are_clamped_by_the_kernels(sim):
    """Unchecked values stay in bounds: cache_seqlens past L reads L rows, a negative one none, a
    cache_slot outside [0, N) sees no context; an append with num_new past n_max writes n_max
    rows, a negative num_new none, a slot outside [0, N) nothing (cache_seqlens still advances,
    capped at L), and the caches' guard bands stay NaN."""
    name, batch, block, heads, kv_heads, dim, length = "range", 4, 3, 4, 2, 64, 90
    t, _ = make_inputs(name, batch, block, heads, kv_heads, dim, length, "spread", F16)
    slots = t["k_cache"].shape[0]
    seqlens, cache_slot = i32(length + 40, -5, 60, 33), i32(0, 1, slots + 2, -1)
    out, lse = call(sim, t, seqlens, cache_slot, window=50)
    want = expected(t, i32(length, 0, 0, 0), i32(0, 1, 0, 0), window=50)
    assert_close_to(out, lse, *want, F16, "out-of-range attention")

    buffer = torch.full((slots + 2, length + 4, kv_heads, dim), NAN, dtype=F16)
    state = dict(k_cache=buffer[1:-1, 2:-2], v_cache=buffer.clone()[1:-1, 2:-2])
    state["k_cache"].copy_(t["k_cache"])
    state["v_cache"].copy_(t["v_cache"])
    before = {k: v.clone() for k, v in state.items()}
    gen = generator("range-append")
    k_new = randn(gen, batch, 3, kv_heads, dim, dtype=F16, device="cpu")
    v_new = randn(gen, batch, 3, kv_heads, dim, dtype=F16, device="cpu")
    seqlens = i32(length + 3, -4, 2, 5)
    sim.append_context_kv(state["k_cache"], state["v_cache"], k_new, v_new, i32(2, 9, -3, 1),
                          seqlens, i32(0, 1, 2, slots))
    assert seqlens.tolist() == [length, 9, 2, 6]
    for k, new in (("k_cache", k_new), ("v_cache", v_new)):
        want_cache = before[k].clone()
        want_cache[1, 0:3] = new[1, :3]
        assert same_bits(state[k], want_cache), k
    assert buffer[0].isnan().all() and buffer[-1].isnan().all()


# --------------------------------------------------------------------------------------------
# append_context_kv
# --------------------------------------------------------------------------------------------


def guarded_caches(gen, slots, length, kv_heads, dim, dtype):
    """k_cache, v_cache of random values as views inside NaN buffers with a band on every side
    of N and L, and the buffers (to check that nothing outside the caches is written)."""
    buffers, caches = [], []
    for _ in range(2):
        buffer = torch.full((slots + 2, length + 3, kv_heads, dim), NAN, dtype=dtype)
        cache = buffer[1 : slots + 1, 1 : length + 1]
        cache.copy_(randn(gen, slots, length, kv_heads, dim, dtype=dtype, device="cpu"))
        buffers.append(buffer)
        caches.append(cache)
    return caches, buffers


def band(slots, length, kv_heads, dim) -> torch.Tensor:
    inside = torch.zeros(slots + 2, length + 3, kv_heads, dim, dtype=torch.bool)
    inside[1 : slots + 1, 1 : length + 1] = True
    return ~inside


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("slot_kind", ["none", "none-spare", "permuted", "spread"])
@pytest.mark.parametrize("dim", [128, 512], ids=["d128", "d512"])  # 512: Gemma4's global heads
def test_append_matches_cpu_and_reference(sim, dtype, slot_kind, dim):
    """Rounds of appends (16-bit elements copied as uint16, float32 as uint32) from starts 0, L,
    L - 1 and in between with counts 0 .. n_max: rows past L dropped, cache_seqlens advanced in
    place and capped at L, the whole caches (untouched rows and slots included) and cache_seqlens
    equal to the CPU kernel's and the reference's bit for bit, the guard bands still NaN."""
    gen = generator(f"append-{dtype}-{slot_kind}-{dim}")
    batch, rows, kv_heads, length = 5, 6, 2, 20
    slots, cache_slot = make_slots(slot_kind, batch, gen, "cpu")
    (k_cache, v_cache), buffers = guarded_caches(gen, slots, length, kv_heads, dim, dtype)
    seqlens = i32(0, length, length - 1, 17, 6)
    outside = band(slots, length, kv_heads, dim)
    pointers = (k_cache.data_ptr(), v_cache.data_ptr(), seqlens.data_ptr())
    for round_ in range(5):
        k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device="cpu")
        v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device="cpu")
        num_new = torch.randint(0, rows + 1, (batch,), generator=gen, dtype=torch.int32)
        if round_ == 0:
            num_new = i32(rows, 3, 2, rows, 0)  # past L: 3 rows at L (all dropped), 1 of 2 kept
        cpu = [k_cache.clone(), v_cache.clone(), seqlens.clone()]
        ref = [k_cache.clone(), v_cache.clone(), seqlens.clone()]
        CPU.append_context_kv(cpu[0], cpu[1], k_new, v_new, num_new, cpu[2], cache_slot)
        reference.append_context_kv(ref[0], ref[1], k_new, v_new, num_new, ref[2],
                                    cache_slot=cache_slot)
        sim.append_context_kv(k_cache, v_cache, k_new, v_new, num_new, seqlens, cache_slot)
        for got, a, b, what in zip((k_cache, v_cache, seqlens), cpu, ref,
                                   ("k_cache", "v_cache", "cache_seqlens")):
            assert same_bits(got, a) and same_bits(got, b), f"{what} round {round_}"
        assert (k_cache.data_ptr(), v_cache.data_ptr(), seqlens.data_ptr()) == pointers
        for buffer in buffers:
            assert buffer[outside].isnan().all(), f"a guard band was written (round {round_})"
        if round_ == 0:
            assert seqlens.tolist() == [rows, length, length, length, 6]


@pytest.mark.parametrize("layout", ["rows-of-a-larger-cache", "prefix-of-a-longer-cache",
                                    "heads-of-a-wider-cache", "head-major", "padded-rows",
                                    "unaligned-rows"])
def test_append_into_strided_caches(sim, layout):
    """Caches that are views of larger buffers are written through their strides (the gaps keep
    their NaN), with new rows given strided (copied by the glue) or with padded rows (read in
    place)."""
    gen = generator(f"append-layout-{layout}")
    batch, rows, kv_heads, dim, length = 4, 3, 2, 64, 10
    slots, cache_slot = make_slots("spread", batch, gen, "cpu")
    dense = [randn(gen, slots, length, kv_heads, dim, dtype=BF16, device="cpu") for _ in range(2)]
    caches = [strided_cache(c, layout) for c in dense]
    gaps = [torch.isnan(c._base).clone() for c in caches]
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=BF16, device="cpu")
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=BF16, device="cpu")
    strided_k = torch.full((batch, rows, kv_heads, dim, 2), NAN, dtype=BF16)[..., 0].copy_(k_new)
    padded_v = torch.full((batch, rows, kv_heads, dim + 5), NAN, dtype=BF16)[..., 2:-3]
    padded_v.copy_(v_new)
    seqlens, want_seqlens, num_new = i32(0, 9, 10, 4), i32(0, 9, 10, 4), i32(3, 3, 1, 2)
    CPU.append_context_kv(dense[0], dense[1], k_new, v_new, num_new, want_seqlens, cache_slot)
    sim.append_context_kv(caches[0], caches[1], strided_k, padded_v, num_new, seqlens, cache_slot)
    assert torch.equal(seqlens, want_seqlens) and seqlens.tolist() == [3, 10, 10, 6]
    for cache, want, gap in zip(caches, dense, gaps):
        assert same_bits(cache, want)
        assert torch.isnan(cache._base).eq(gap).all(), "a gap was written"


def misaligned(t: torch.Tensor, units: int) -> torch.Tensor:
    """A copy of ``t`` whose storage starts ``units`` elements past a 16-byte boundary."""
    storage = torch.full((t.numel() + units,), NAN, dtype=t.dtype)
    out = storage[units:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("dim", [1, 3, 12, 20, 72, 256])
def test_append_chunks_tails_and_alignment(sim, dtype, dim):
    """append_context_kv's 16-byte chunks: head dims that are not a whole number of chunks (a
    unit-by-unit tail per row), rows 16-byte aligned in the new rows and the caches (vector
    chunks), in only one of them or in neither (unit by unit), and more chunks than one pass of
    the block's threads (16 rows x 4 heads at D = 256: several batches per thread): the caches
    and cache_seqlens equal the CPU kernel's bit for bit."""
    gen = generator(f"append-chunks-{dtype}-{dim}")
    batch, rows, kv_heads, length = 3, 16, 4, 40
    slots, cache_slot = make_slots("permuted", batch, gen, "cpu")
    dense = [randn(gen, slots, length, kv_heads, dim, dtype=dtype, device="cpu") for _ in range(2)]
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device="cpu")
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device="cpu")
    num_new = i32(rows, 9, rows)
    want = [dense[0].clone(), dense[1].clone(), i32(0, 3, 30)]
    CPU.append_context_kv(want[0], want[1], k_new, v_new, num_new, want[2], cache_slot)
    for new_units, cache_units in ((0, 0), (1, 0), (0, 1), (3, 1)):
        caches = [misaligned(c, cache_units) if cache_units else c.clone() for c in dense]
        news = [misaligned(t, new_units) if new_units else t for t in (k_new, v_new)]
        seqlens = i32(0, 3, 30)
        sim.append_context_kv(caches[0], caches[1], news[0], news[1], num_new, seqlens,
                              cache_slot)
        where = f"new rows {new_units} units off, caches {cache_units} off"
        assert torch.equal(seqlens, want[2]), where
        assert same_bits(caches[0], want[0]) and same_bits(caches[1], want[1]), where


def test_append_empty(sim):
    """B = 0 launches nothing; n_max = 0 (num_new all 0) writes nothing and keeps p0."""
    gen = generator("append-empty")
    (k_cache, v_cache), _ = guarded_caches(gen, 3, 8, 1, 64, F16)
    before = (k_cache.clone(), v_cache.clone())
    sim.clear_launch_log()
    empty = torch.zeros(0, 2, 1, 64, dtype=F16)
    sim.append_context_kv(k_cache, v_cache, empty, empty, i32(), i32(), None)
    assert emulator.launches() == {}
    seqlens = i32(0, 8, 3)
    none = torch.zeros(3, 0, 1, 64, dtype=F16)
    sim.append_context_kv(k_cache, v_cache, none, none, i32(0, 0, 0), seqlens, i32(2, 0, 1))
    assert seqlens.tolist() == [0, 8, 3]
    assert same_bits(k_cache, before[0]) and same_bits(v_cache, before[1])


# --------------------------------------------------------------------------------------------
# Planted faults
# --------------------------------------------------------------------------------------------


def fault_case():
    name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype, lengths = ATTENTION_CASES[0]
    t, cache_slot = make_inputs(name, batch, block, heads, kv_heads, dim, length, slot_kind, dtype)
    return t, i32(*lengths), cache_slot


@pytest.mark.parametrize("fault", ["mma_swap_a12", "shuffle_off_by_one"])
def test_planted_mma_and_shuffle_faults_are_caught(sim, fault):
    """Tensor-core fragments with A registers 1 and 2 swapped, or shuffles (the softmax's row
    max/sum, the merge's dot products) reading the next lane, fail the comparison the tests above
    pass."""
    t, seqlens, cache_slot = fault_case()
    check(sim, t, seqlens, "unplanted", cache_slot=cache_slot)
    with emulator.planted(fault):
        with pytest.raises(AssertionError):
            check(sim, t, seqlens, fault, cache_slot=cache_slot)


def test_planted_tile_barrier_is_caught(sim):
    """Without the barrier of the K/V tile ring, a warp reads tile rows (and Q rows) whose
    copies other threads have not yet waited for, and a copy refills a slot another warp still
    reads: the race flavour reports it (a data race, or uninitialised shared memory); in the
    plain flavour a copy's destination holds the emulator's 0xFF poison (NaN in 16-bit) from its
    issue until the issuing thread's wait, so the output and the log-sum-exp hold NaN and fail the
    comparison."""
    t, seqlens, cache_slot = fault_case()  # 4 tiles per split: the ring wraps
    site = emulator.barrier_site("attention.cuh", "copy_async_wait<kStages - 2>();")
    with emulator.planted("drop_barrier:" + site):
        if RACE:
            with pytest.raises(RuntimeError, match=r"(?s)dspark_sim.*block_attention_split_kernel"
                                                   r".*(uninitialised shared memory|data race)"):
                call(sim, t, seqlens, cache_slot)
        else:
            out, lse = call(sim, t, seqlens, cache_slot)
            assert out.isnan().any() and lse.isnan().any()
            with pytest.raises(AssertionError):
                check(sim, t, seqlens, "dropped barrier", cache_slot=cache_slot)


def test_planted_append_barrier_is_caught(sim):
    """Without the barrier before thread 0 advances cache_seqlens, threads that start after it
    read the new p0 and write their rows there: the race flavour reports the global race on
    cache_seqlens; in the plain flavour the caches differ from the CPU kernel's (cache_seqlens
    itself still ends right)."""
    gen = generator("append-barrier")
    batch, rows, kv_heads, dim, length = 3, 5, 2, 64, 12
    (k_cache, v_cache), _ = guarded_caches(gen, batch, length, kv_heads, dim, BF16)
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=BF16, device="cpu")
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=BF16, device="cpu")
    num_new, seqlens = i32(5, 3, 4), i32(2, 9, 0)
    want = [k_cache.clone(), v_cache.clone(), seqlens.clone()]
    CPU.append_context_kv(*want[:2], k_new, v_new, num_new, want[2], None)
    site = emulator.barrier_site("attention.cuh", "every thread has read cache_seqlens")
    with emulator.planted("drop_barrier:" + site):
        if RACE:
            with pytest.raises(RuntimeError, match=r"(?s)dspark_sim.*append_context_kv_kernel"
                                                   r".*data race"):
                sim.append_context_kv(k_cache, v_cache, k_new, v_new, num_new, seqlens, None)
        else:
            sim.append_context_kv(k_cache, v_cache, k_new, v_new, num_new, seqlens, None)
            assert torch.equal(seqlens, want[2])
            assert not (same_bits(k_cache, want[0]) and same_bits(v_cache, want[1]))
