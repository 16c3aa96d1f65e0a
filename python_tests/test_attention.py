"""Attention family (docs/semantics.md §3.5): block_draft_attention against reference.py over
context lengths (0 and L included), windows, GQA ratios, head dims, dtypes, cache-row indirection
and strided layouts; semantics by construction; the block's K/V never touching the cache;
append_context_kv against reference.py, its bounds and in-place behaviour; every argument check.

Tolerances: float32 matches the float32 reference to ~1e-5. For float16/bfloat16 the reference is
computed in float32 from the same low-precision inputs, so what remains is the rounding of the
output to q's dtype (and, in a tensor-core kernel, of the probabilities fed to the P·V product);
lse is float32 on every path and is held to a tight absolute tolerance.
``test_broken_variants_fail_the_comparison`` shows that a kernel one key off anywhere (window
edge, context end, a block key, the GQA mapping, the cache row, the scale) fails these tolerances.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import cuda_only, cuda_param, full_tests, non_contiguous
from cases.arguments import (
    error_params, raises, skip_value_checks_without_debug, with_overrides,
)
from cases.common import DEBUG
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

DTYPE_IDS = {F32: "f32", BF16: "bf16", F16: "f16"}
INF = float("inf")

# float32 attention runs on CPU only: the CUDA attention kernel takes float16/bfloat16.
DEVICE_DTYPES = [
    pytest.param("cpu", F32, id="cpu-f32"),
    pytest.param("cpu", BF16, id="cpu-bf16"),
    pytest.param("cpu", F16, id="cpu-f16"),
    cuda_param("cuda", BF16, id="cuda-bf16"),
    cuda_param("cuda", F16, id="cuda-f16"),
]
# One low-precision dtype per device, for tests about layouts and bounds rather than numerics.
DEVICE_HALF = [pytest.param("cpu", BF16, id="cpu-bf16"), cuda_param("cuda", F16, id="cuda-f16")]

# A large finite value every dtype holds (float16 tops out at 65504).
HUGE = 3.0e4


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# Building inputs
# --------------------------------------------------------------------------------------------


def make_block(gen, batch, block, heads, kv_heads, dim, dtype, device, q_scale=1.5) -> dict:
    """q, k_block, v_block. Queries are scaled up a little so that attention is peaked enough for
    a single key to matter at the tolerances above."""
    return dict(
        q=randn(gen, batch, block, heads, dim, dtype=dtype, device=device, scale=q_scale),
        k_block=randn(gen, batch, block, kv_heads, dim, dtype=dtype, device=device),
        v_block=randn(gen, batch, block, kv_heads, dim, dtype=dtype, device=device),
    )


def make_caches(gen, slots, length, kv_heads, dim, dtype, device) -> dict:
    return dict(k_cache=randn(gen, slots, length, kv_heads, dim, dtype=dtype, device=device),
                v_cache=randn(gen, slots, length, kv_heads, dim, dtype=dtype, device=device))


def make_seqlens(batch, length, gen, device) -> torch.Tensor:
    """Random p0 in [0, L], with L (a full row) and 0 (no context) always present."""
    seqlens = torch.randint(0, length + 1, (batch,), generator=gen, dtype=torch.int32)
    seqlens[0] = length
    if batch > 1:
        seqlens[1] = 0
    return seqlens.to(device)


SLOT_KINDS = ["none", "none-spare", "permuted", "spread", "shared"]


# --------------------------------------------------------------------------------------------
# Running the op and the reference
# --------------------------------------------------------------------------------------------


def attention(t: dict, cache_seqlens, *, return_lse=True, **options):
    return dspark_ops.block_draft_attention(t["q"], t["k_block"], t["v_block"], t["k_cache"],
                                            t["v_cache"], cache_seqlens, return_lse=return_lse,
                                            **options)


def expected_attention(t: dict, cache_seqlens, *, cache_slot=None, **options):
    """reference.block_draft_attention in float32 on the CPU, from the same inputs."""
    f = {k: v.float().cpu() for k, v in t.items()}
    return reference.block_draft_attention(
        f["q"], f["k_block"], f["v_block"], f["k_cache"], f["v_cache"], cache_seqlens.cpu(),
        cache_slot=None if cache_slot is None else cache_slot.cpu(), **options)


def assert_matches(out, lse, expected, dtype, what=""):
    """out (in ``dtype``) and lse (float32; skipped when None) against the float32 reference."""
    expected_out, expected_lse = expected
    torch.testing.assert_close(out.float().cpu(), expected_out, **OUT_TOL[dtype],
                               msg=lambda m: f"out {what}: {m}")
    if lse is not None:
        torch.testing.assert_close(lse.cpu(), expected_lse, **LSE_TOL[dtype],
                                   msg=lambda m: f"lse {what}: {m}")


def check_attention(t: dict, cache_seqlens, dtype, what="", **options):
    """Runs the op with and without lse, checks the output contract and compares with the
    reference. Returns (out, lse)."""
    q = t["q"]
    out, lse = attention(t, cache_seqlens, **options)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device, what
    assert out.is_contiguous(), what
    assert lse.shape == q.shape[:3] and lse.dtype == F32 and lse.device == q.device, what
    assert torch.equal(attention(t, cache_seqlens, return_lse=False, **options), out), what
    assert_matches(out, lse, expected_attention(t, cache_seqlens, **options), dtype, what)
    return out, lse


# --------------------------------------------------------------------------------------------
# block_draft_attention against the reference
# --------------------------------------------------------------------------------------------

# (B, G, Hq, Hkv, D, L, slots): GQA ratios 1, 4, 8; every D; G in {1, 8, 32}; B in {1, 3, 16};
# contexts shorter than, equal to and several times a 256-key tile.
REFERENCE_CASES = [
    (1, 1, 1, 1, 64, 1, "none"),
    (1, 32, 32, 4, 64, 600, "spread"),
    (3, 8, 8, 2, 128, 100, "permuted"),
    (3, 32, 4, 4, 256, 300, "none-spare"),
    (3, 1, 16, 2, 256, 20, "shared"),
    (16, 8, 8, 1, 64, 48, "spread"),
    (16, 1, 16, 2, 128, 37, "shared"),
    (16, 8, 2, 2, 128, 256, "permuted"),
    (2, 8, 4, 1, 512, 300, "permuted"),  # Gemma4's head dim
]


def _case_id(case):
    return "B{}-G{}-H{}x{}-D{}-L{}-{}".format(*case)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=_case_id)
def test_matches_reference(device, dtype, case):
    batch, block, heads, kv_heads, dim, length, slot_kind = case
    gen = generator(zlib.crc32(repr(case).encode()) + 17 * list(DTYPE_IDS).index(dtype))
    slots, cache_slot = make_slots(slot_kind, batch, gen, device)
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, dtype, device),
         **make_caches(gen, slots, length, kv_heads, dim, dtype, device)}
    seqlens = make_seqlens(batch, length, gen, device)
    small, exact = max(1, length // 4), int(seqlens[-1])
    scale = 1.7 / math.sqrt(dim)
    # Windows: none, 0 (block only), smaller than most contexts, exactly one request's p0, larger
    # than every context; the default scale and an explicit one.
    for window, softmax_scale in [(None, None), (0, None), (small, None), (exact, None),
                                  (length + 5, None), (None, scale), (small, scale)]:
        check_attention(t, seqlens, dtype, cache_slot=cache_slot, window=window,
                        softmax_scale=softmax_scale,
                        what=f"window={window} scale={softmax_scale} p0={seqlens.tolist()}")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_matches_reference_random_sweep(device, dtype):
    # Random shapes, lengths, windows and cache rows; DSPARK_OPS_TEST_FULL=1 runs many more.
    gen = generator(900 + list(DTYPE_IDS).index(dtype))
    for _ in range(200 if full_tests() else 20):
        batch = int(torch.randint(1, 17, (1,), generator=gen))
        block = int(torch.randint(1, 33, (1,), generator=gen))
        kv_heads = int(torch.randint(1, 4, (1,), generator=gen))
        ratio = [1, 2, 4, 8][int(torch.randint(0, 4, (1,), generator=gen))]
        dim = [64, 128, 256][int(torch.randint(0, 3, (1,), generator=gen))]
        length = int(torch.randint(1, 400, (1,), generator=gen))
        slot_kind = SLOT_KINDS[int(torch.randint(0, len(SLOT_KINDS), (1,), generator=gen))]
        window = [None, int(torch.randint(0, length + 10, (1,), generator=gen))][
            int(torch.randint(0, 2, (1,), generator=gen))]
        slots, cache_slot = make_slots(slot_kind, batch, gen, device)
        t = {**make_block(gen, batch, block, kv_heads * ratio, kv_heads, dim, dtype, device),
             **make_caches(gen, slots, length, kv_heads, dim, dtype, device)}
        seqlens = make_seqlens(batch, length, gen, device)
        check_attention(t, seqlens, dtype, cache_slot=cache_slot, window=window,
                        what=f"B={batch} G={block} H={kv_heads * ratio}x{kv_heads} D={dim} "
                             f"L={length} {slot_kind} window={window}")


def test_references_agree():
    # The explicit-softmax reference (the semantics) and the SDPA formulation an engine would use
    # agree, and so does the op, with cache rows, a window and GQA.
    gen = generator(31)
    batch, block, heads, kv_heads, dim, length = 5, 8, 8, 2, 128, 70
    slots, cache_slot = make_slots("spread", batch, gen, "cpu")
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, F32, "cpu"),
         **make_caches(gen, slots, length, kv_heads, dim, F32, "cpu")}
    seqlens = make_seqlens(batch, length, gen, "cpu")
    for window, scale in [(None, None), (0, None), (20, 0.2), (length, None)]:
        options = dict(cache_slot=cache_slot, window=window, softmax_scale=scale)
        expected, _ = expected_attention(t, seqlens, **options)
        sdpa = reference.block_draft_attention_sdpa(t["q"], t["k_block"], t["v_block"],
                                                    t["k_cache"], t["v_cache"], seqlens,
                                                    **options)
        torch.testing.assert_close(sdpa, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attention(t, seqlens, return_lse=False, **options), sdpa,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_default_scale_is_one_over_sqrt_d(device, dtype):
    gen = generator(32)
    for dim in (64, 128, 256, 512):
        t = {**make_block(gen, 3, 4, 4, 2, dim, dtype, device),
             **make_caches(gen, 3, 9, 2, dim, dtype, device)}
        seqlens = make_seqlens(3, 9, gen, device)
        default = attention(t, seqlens)
        explicit = attention(t, seqlens, softmax_scale=1 / math.sqrt(dim))
        assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
        other = attention(t, seqlens, softmax_scale=2 / math.sqrt(dim), return_lse=False)
        assert (other.float() - default[0].float()).abs().max() > 0.1


def test_broken_variants_fail_the_comparison():
    # The comparison used above (bfloat16 tolerances, the loosest) rejects kernels that are one
    # key off: each variant is the reference with one mistake, rounded as a kernel would round.
    gen = generator(33)
    batch, block, heads, kv_heads, dim, length, window = 3, 8, 8, 2, 128, 100, 25
    slots, cache_slot = make_slots("permuted", batch, gen, "cpu")
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, BF16, "cpu"),
         **make_caches(gen, slots, length, kv_heads, dim, BF16, "cpu")}
    seqlens = i32(length, 0, 57)
    f = {k: v.float() for k, v in t.items()}

    def ref(q=f["q"], k_block=f["k_block"], v_block=f["v_block"], seqlens=seqlens,
            cache_slot=cache_slot, window=window, softmax_scale=None):
        return reference.block_draft_attention(q, k_block, v_block, f["k_cache"], f["v_cache"],
                                               seqlens, cache_slot=cache_slot,
                                               softmax_scale=softmax_scale, window=window)

    # Query head h reading KV head h % Hkv instead of h // (Hq / Hkv).
    perm = sorted(range(heads), key=lambda h: (h % kv_heads, h))
    inverse = torch.argsort(torch.tensor(perm))
    interleaved = [x[:, :, inverse] for x in ref(q=f["q"][:, :, perm])]
    # A causal mask inside the block.
    causal = [torch.cat(parts, 1) for parts in zip(*[
        ref(q=f["q"][:, g : g + 1], k_block=f["k_block"][:, : g + 1],
            v_block=f["v_block"][:, : g + 1]) for g in range(block)])]
    variants = {
        "window one too wide": ref(window=window + 1),
        "window one too narrow": ref(window=window - 1),
        "no window": ref(window=None),
        "context includes p0": ref(seqlens=(seqlens + 1).clamp(max=length)),
        "context stops before p0 - 1": ref(seqlens=(seqlens - 1).clamp(min=0)),
        "last block key missing": ref(k_block=f["k_block"][:, :-1], v_block=f["v_block"][:, :-1]),
        "another request's block": ref(k_block=f["k_block"].roll(1, 0),
                                       v_block=f["v_block"].roll(1, 0)),
        "cache_slot ignored": ref(cache_slot=None),
        "interleaved GQA": interleaved,
        "causal block": causal,
        "scale 1/D": ref(softmax_scale=1 / dim),
    }
    expected = ref()
    assert_matches(expected[0].to(BF16), expected[1], expected, BF16)  # the rounding alone passes
    for name, (out, lse) in variants.items():
        with pytest.raises(AssertionError):  # the output alone gives them away
            assert_matches(out.to(BF16), None, expected, BF16, name)
        with pytest.raises(AssertionError):  # and so does lse alone
            torch.testing.assert_close(lse, expected[1], **LSE_TOL[BF16])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_visible_keys_by_construction(device, dtype):
    # Independent of reference.py: all keys of a (request, KV head) are one vector c, so each
    # visible key gets the same weight, lse = scale * q.c + log(#visible), and each output channel
    # is the mean of a value channel that codes where the row came from.
    gen = generator(34)
    batch, block, heads, kv_heads, dim, length = 6, 5, 8, 2, 64, 40
    ratio = heads // kv_heads
    slots, cache_slot = make_slots("spread", batch, gen, device)
    q = randn(gen, batch, block, heads, dim, dtype=dtype, device=device)
    c = torch.randn(kv_heads, dim, generator=gen).to(dtype)
    k_cache = c.expand(slots, length, kv_heads, dim).contiguous().to(device)
    k_block = c.expand(batch, block, kv_heads, dim).contiguous().to(device)
    v_cache = torch.randn(slots, length, kv_heads, dim, generator=gen)
    v_block = torch.randn(batch, block, kv_heads, dim, generator=gen)
    v_cache[..., :6] = 0
    v_block[..., :6] = 0
    v_cache[..., 0] = 1  # a context row
    v_cache[..., 1] = torch.arange(length, dtype=F32)[None, :, None]  # its position
    v_cache[..., 2] = torch.arange(slots, dtype=F32)[:, None, None]  # its cache row
    v_cache[..., 3] = torch.arange(kv_heads, dtype=F32)  # its KV head
    v_block[..., 3] = torch.arange(kv_heads, dtype=F32)
    v_block[..., 4] = torch.arange(1, block + 1, dtype=F32)[None, :, None]  # block slot + 1
    v_block[..., 5] = torch.arange(1, batch + 1, dtype=F32)[:, None, None]  # request + 1
    t = dict(q=q, k_block=k_block, v_block=v_block.to(dtype).to(device), k_cache=k_cache,
             v_cache=v_cache.to(dtype).to(device))
    seqlens = make_seqlens(batch, length, gen, device)
    scale = 1 / math.sqrt(dim)
    score = torch.einsum("bghd,hd->bgh", q.double().cpu(),
                         c.double().repeat_interleave(ratio, 0)) * scale
    kv_head = (torch.arange(heads) // ratio).double()
    for window in (None, 0, 1, 7, length, length + 60):
        out, lse = attention(t, seqlens, cache_slot=cache_slot, window=window)
        out, lse = out.double().cpu(), lse.double().cpu()
        for b in range(batch):
            end = int(seqlens[b])
            begin = 0 if window is None else max(0, end - window)
            context, total = end - begin, end - begin + block
            slot = b if cache_slot is None else int(cache_slot[b])
            what = f"window={window} request {b} p0={end}"
            torch.testing.assert_close(lse[b], score[b] + math.log(total), atol=1e-4, rtol=1e-5,
                                       msg=lambda m: f"lse {what}: {m}")
            expected = torch.tensor([
                context / total, sum(range(begin, end)) / total, slot * context / total, 0.0,
                block * (block + 1) / 2 / total, (b + 1) * block / total], dtype=torch.float64)
            expected = expected.expand(block, heads, 6).clone()
            expected[..., 3] = kv_head
            torch.testing.assert_close(out[b, ..., :6], expected, **OUT_TOL[dtype],
                                       msg=lambda m: f"out {what}: {m}")


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


CACHE_LAYOUTS = ["rows-of-a-larger-cache", "prefix-of-a-longer-cache", "heads-of-a-wider-cache",
                 "head-major", "padded-rows", "unaligned-rows"]


@pytest.mark.parametrize("device,dtype", DEVICE_HALF)
@pytest.mark.parametrize("block_layout", ["contiguous", "strided", "padded"])
@pytest.mark.parametrize("cache_layout", ["contiguous", *CACHE_LAYOUTS])
def test_strided_layouts(device, dtype, block_layout, cache_layout):
    # q/k_block/v_block in any layout and caches with any strides but D's give the contiguous
    # result bit for bit; the NaN in the gaps would show if they were read.
    gen = generator(zlib.crc32(f"{block_layout}/{cache_layout}".encode()))
    batch, block, heads, kv_heads, dim, length = 4, 8, 8, 2, 128, 45
    slots, cache_slot = make_slots("spread", batch, gen, device)
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, dtype, device),
         **make_caches(gen, slots, length, kv_heads, dim, dtype, device)}
    seqlens = make_seqlens(batch, length, gen, device)
    strided = dict(t)
    if block_layout != "contiguous":
        for name in ("q", "k_block", "v_block"):
            strided[name] = non_contiguous(t[name], block_layout)
    if cache_layout != "contiguous":
        for name in ("k_cache", "v_cache"):
            strided[name] = strided_cache(t[name], cache_layout)
    for window in (None, 10):
        options = dict(cache_slot=cache_slot, window=window)
        expected = attention(t, seqlens, **options)
        got = check_attention(strided, seqlens, dtype, **options,
                              what=f"{block_layout}/{cache_layout} window={window}")
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("device,dtype", DEVICE_HALF)
def test_broadcast_cache_row(device, dtype):
    # A stride-0 cache (one context row shared by every slot) is a valid read-only layout.
    gen = generator(41)
    batch, block, heads, kv_heads, dim, length = 3, 4, 4, 1, 64, 30
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, dtype, device),
         **make_caches(gen, 1, length, kv_heads, dim, dtype, device)}
    seqlens = make_seqlens(batch, length, gen, device)
    shared = {**t, "k_cache": t["k_cache"].expand(5, -1, -1, -1),
              "v_cache": t["v_cache"].expand(5, -1, -1, -1)}
    out, _ = check_attention(shared, seqlens, dtype, cache_slot=i32(4, 0, 2, device=device))
    assert torch.equal(out, attention(t, seqlens, cache_slot=i32(0, 0, 0, device=device))[0])


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), cuda_param("cuda", id="cuda")])
def test_output_contract(device):
    gen = generator(42)
    dtype = BF16
    t = {**make_block(gen, 3, 4, 4, 2, 64, dtype, device),
         **make_caches(gen, 3, 6, 2, 64, dtype, device)}
    seqlens = make_seqlens(3, 6, gen, device)
    # The schema always returns (out, lse); lse is empty without return_lse.
    out, lse = torch.ops.dspark_ops.block_draft_attention(
        t["q"], t["k_block"], t["v_block"], t["k_cache"], t["v_cache"], seqlens, None, None, None,
        False)
    assert out.shape == (3, 4, 4, 64) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (0,) and lse.dtype == F32 and lse.device == out.device
    single = dspark_ops.block_draft_attention(t["q"], t["k_block"], t["v_block"], t["k_cache"],
                                              t["v_cache"], seqlens)
    assert isinstance(single, torch.Tensor) and torch.equal(single, out)
    # Empty batch.
    empty = {k: v[:0] for k, v in t.items()}
    out, lse = attention(empty, seqlens[:0])
    assert out.shape == (0, 4, 4, 64) and lse.shape == (0, 4, 4)


# --------------------------------------------------------------------------------------------
# The block's K/V never touch the cache; what lies outside the visible context is never read
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_block_kv_never_touch_the_cache(device, dtype):
    # Positions >= p0 and rows of unused slots hold NaN: an engine allocates caches with
    # torch.empty and never writes there, so a kernel must neither read them into the output nor
    # write the block's K/V there. The caches come back bit-identical.
    gen = generator(50 + list(DTYPE_IDS).index(dtype))
    batch, block, heads, kv_heads, dim, length = 5, 8, 8, 2, 128, 64
    slots, cache_slot = make_slots("spread", batch, gen, device)  # 6 of 11 rows unused
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, dtype, device),
         **make_caches(gen, slots, length, kv_heads, dim, dtype, device)}
    seqlens = make_seqlens(batch, length, gen, device)
    seqlens[2] = length - 1
    unused = torch.ones(slots, dtype=torch.bool)
    unused[cache_slot.long().cpu()] = False
    stale = torch.zeros(slots, length, dtype=torch.bool)  # positions >= p0 of used rows
    for b in range(batch):
        stale[int(cache_slot[b]), int(seqlens[b]):] = True
    poisoned = stale | unused[:, None]
    for name in ("k_cache", "v_cache"):
        t[name][poisoned.to(device)] = NAN
    before = {name: t[name].clone() for name in ("k_cache", "v_cache")}
    for window in (None, 0, 9, length + 1):
        out, lse = check_attention(t, seqlens, dtype, cache_slot=cache_slot, window=window,
                                   what=f"window={window}")
        assert out.isfinite().all() and lse.isfinite().all()
        for name, snapshot in before.items():
            assert same_bits(t[name], snapshot), f"{name} written (window={window})"

    # Changing what lies at or past p0 (huge values instead of NaN) changes nothing.
    reference_out = attention(t, seqlens, cache_slot=cache_slot)
    for name in ("k_cache", "v_cache"):
        huge = HUGE * torch.randn(t[name].shape, generator=gen).sign()
        t[name][poisoned.to(device)] = huge.to(dtype).to(device)[poisoned.to(device)]
    got = attention(t, seqlens, cache_slot=cache_slot)
    assert torch.equal(got[0], reference_out[0]) and torch.equal(got[1], reference_out[1])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_rows_before_the_window_are_ignored(device, dtype):
    # Rows in [0, p0 - window) are old context (finite: a tiled kernel may load them and weight
    # them by an exact zero); replacing them by huge values or fresh noise changes nothing.
    gen = generator(51 + list(DTYPE_IDS).index(dtype))
    batch, block, heads, kv_heads, dim, length, window = 4, 8, 16, 2, 64, 300, 37
    slots, cache_slot = make_slots("permuted", batch, gen, device)
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, dtype, device),
         **make_caches(gen, slots, length, kv_heads, dim, dtype, device)}
    seqlens = i32(length, 0, 280, 40, device=device)
    expected = check_attention(t, seqlens, dtype, cache_slot=cache_slot, window=window)
    hidden = torch.zeros(slots, length, dtype=torch.bool)
    for b in range(batch):
        hidden[int(cache_slot[b]), : max(0, int(seqlens[b]) - window)] = True
    for fill in ("huge", "noise"):
        changed = dict(t)
        for name in ("k_cache", "v_cache"):
            values = torch.randn(t[name].shape, generator=gen)
            values = HUGE * values.sign() if fill == "huge" else 3 * values
            changed[name] = torch.where(hidden[..., None, None].to(device),
                                        values.to(dtype).to(device), t[name])
        got = attention(changed, seqlens, cache_slot=cache_slot, window=window)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), fill
    # ... while the rows inside the window do matter.
    inside = dict(t)
    inside["v_cache"] = t["v_cache"].clone()
    inside["v_cache"][int(cache_slot[0]), length - window] += 3
    assert not torch.equal(attention(inside, seqlens, cache_slot=cache_slot, window=window)[0][0],
                           expected[0][0])


# --------------------------------------------------------------------------------------------
# append_context_kv
# --------------------------------------------------------------------------------------------


def append(state: dict, k_new, v_new, num_new, cache_slot=None, fn=dspark_ops.append_context_kv):
    fn(state["k_cache"], state["v_cache"], k_new, v_new, num_new, state["cache_seqlens"],
       cache_slot=cache_slot)


def cpu_clone(state: dict) -> dict:
    return {k: v.cpu().clone() for k, v in state.items()}


def assert_state_equal(got: dict, expected: dict, what=""):
    for name in ("k_cache", "v_cache", "cache_seqlens"):
        assert same_bits(got[name].cpu(), expected[name]), f"{name} {what}"


# append_context_kv copies rows bit for bit; the CUDA kernel accepts float32 caches as well.
APPEND_DTYPES = [*DEVICE_DTYPES, cuda_param("cuda", F32, id="cuda-f32")]


@pytest.mark.parametrize("device,dtype", APPEND_DTYPES)
@pytest.mark.parametrize("slot_kind", ["none", "none-spare", "permuted", "spread"])
def test_append_matches_reference(device, dtype, slot_kind):
    # Rounds of appends with random counts (0 and n_max included) from random starts (0, L and
    # just below L included) until every row is full: exact equality with the reference for the
    # whole caches (rows and slots nobody writes stay bit-identical) and cache_seqlens.
    gen = generator(60 + SLOT_KINDS.index(slot_kind))
    batch, rows, kv_heads, dim, length = 6, 5, 2, 64, 12
    slots, cache_slot = make_slots(slot_kind, batch, gen, device)
    state = {**make_caches(gen, slots, length, kv_heads, dim, dtype, device),
             "cache_seqlens": i32(length, 0, length - 2, length - 1, 3, 7, device=device)}
    pointers = [state[name].data_ptr() for name in state]
    for round_ in range(6):
        k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
        v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
        num_new = torch.randint(0, rows + 1, (batch,), generator=gen, dtype=torch.int32)
        num_new[round_ % batch] = 0
        num_new[(round_ + 1) % batch] = rows
        num_new = num_new.to(device)
        expected = cpu_clone(state)
        append(expected, k_new.cpu(), v_new.cpu(), num_new.cpu(),
               None if cache_slot is None else cache_slot.cpu(), fn=reference.append_context_kv)
        append(state, k_new, v_new, num_new, cache_slot)
        assert_state_equal(state, expected, f"round {round_}")
        assert [state[name].data_ptr() for name in state] == pointers  # in place
    assert state["cache_seqlens"].tolist() == [length] * batch


@pytest.mark.parametrize("device,dtype", DEVICE_HALF)
def test_append_literal_bounds(device, dtype):
    # L = 6. Request 0 starts at 4 with 3 rows: 2 land, 1 is dropped, p0 stops at 6.
    # Request 1 starts at L: nothing lands. Request 2 appends 0 rows. Request 3 fills 0..3.
    gen = generator(61)
    length, kv_heads, dim = 6, 2, 64
    state = {**make_caches(gen, 5, length, kv_heads, dim, dtype, device),
             "cache_seqlens": i32(4, 6, 2, 0, device=device)}
    before = cpu_clone(state)
    k_new = randn(gen, 4, 4, kv_heads, dim, dtype=dtype, device=device)
    v_new = randn(gen, 4, 4, kv_heads, dim, dtype=dtype, device=device)
    cache_slot = i32(3, 1, 0, 4, device=device)
    append(state, k_new, v_new, i32(3, 2, 0, 4, device=device), cache_slot)
    assert state["cache_seqlens"].tolist() == [6, 6, 2, 4]
    for name, new in (("k_cache", k_new), ("v_cache", v_new)):
        expected = before[name].clone()
        expected[3, 4:6] = new[0, :2].cpu()
        expected[4, 0:4] = new[3, :4].cpu()
        assert same_bits(state[name].cpu(), expected), name  # slots 0, 1, 2 untouched


@pytest.mark.parametrize("device,dtype", DEVICE_HALF)
@pytest.mark.parametrize("cache_layout", CACHE_LAYOUTS)
def test_append_into_strided_caches(device, dtype, cache_layout):
    # Caches that are views of larger buffers are written in place through their strides: the
    # buffers see the new rows and their gaps keep their NaN.
    gen = generator(62 + CACHE_LAYOUTS.index(cache_layout))
    batch, rows, kv_heads, dim, length = 4, 3, 2, 64, 10
    slots, cache_slot = make_slots("spread", batch, gen, device)
    dense = make_caches(gen, slots, length, kv_heads, dim, dtype, device)
    state = {name: strided_cache(dense[name], cache_layout) for name in dense}
    state["cache_seqlens"] = i32(0, 9, 10, 4, device=device)
    buffers = {name: state[name]._base for name in ("k_cache", "v_cache")}
    gaps = {name: torch.isnan(buffer).clone() for name, buffer in buffers.items()}
    expected = cpu_clone({**dense, "cache_seqlens": state["cache_seqlens"]})
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    num_new = i32(3, 3, 1, 2, device=device)
    append(expected, k_new.cpu(), v_new.cpu(), num_new.cpu(), cache_slot.cpu(),
           fn=reference.append_context_kv)
    append(state, k_new, v_new, num_new, cache_slot)
    assert_state_equal(state, expected)
    for name, buffer in buffers.items():
        assert torch.isnan(buffer).eq(gaps[name]).all(), f"{name}: a gap was written"


@pytest.mark.parametrize("device,dtype", DEVICE_HALF)
@pytest.mark.parametrize("overlap", ["expanded-requests", "expanded-rows", "k-is-v",
                                     "seqlens-is-num-new", "new-rows-in-cache"])
def test_append_refuses_overlapping_outputs(device, dtype, overlap):
    # k_cache, v_cache and cache_seqlens are written in place: an output whose elements share
    # memory (a cache expanded along the request dimension would have every request write the
    # same rows, the last one winning) or that shares memory with another argument is refused,
    # and nothing is written.
    gen = generator(64)
    batch, rows, kv_heads, dim, length = 3, 2, 2, 64, 6
    state = {**make_caches(gen, batch, length, kv_heads, dim, dtype, device),
             "cache_seqlens": i32(0, 1, 2, device=device)}
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    num_new = i32(2, 1, 2, device=device)
    if overlap == "expanded-requests":
        state["k_cache"] = state["k_cache"][:1].expand(batch, length, kv_heads, dim)
        name, message = "k_cache", "its elements must not share memory"
    elif overlap == "expanded-rows":
        state["v_cache"] = state["v_cache"][:, :1].expand(batch, length, kv_heads, dim)
        name, message = "v_cache", "its elements must not share memory"
    elif overlap == "k-is-v":
        state["v_cache"] = state["k_cache"]
        name, message = "k_cache", "must not share memory with 'v_cache'"
    elif overlap == "seqlens-is-num-new":
        num_new = state["cache_seqlens"]
        name, message = "cache_seqlens", "must not share memory with 'num_new'"
    else:
        # Dense views, so the overlap is decidable (as in torch's own checks, interleaved
        # strided views such as k and v halves of one buffer are not refused).
        k_new = state["k_cache"].flatten()[:k_new.numel()].view(k_new.shape)
        name, message = "k_cache", "must not share memory with 'k_new'"
    before = cpu_clone({**state, "num_new": num_new})
    with pytest.raises(ValueError, match=rf"append_context_kv\(\): '{name}' is written in "
                                         rf"place.*{message}"):
        append(state, k_new, v_new, num_new)
    assert_state_equal({**state, "num_new": num_new}, before)


@pytest.mark.parametrize("device,dtype", DEVICE_HALF)
def test_append_non_contiguous_new_rows(device, dtype):
    gen = generator(63)
    batch, rows, kv_heads, dim, length = 3, 4, 2, 128, 9
    state = {**make_caches(gen, batch, length, kv_heads, dim, dtype, device),
             "cache_seqlens": i32(0, 5, 8, device=device)}
    expected = cpu_clone(state)
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    num_new = i32(4, 2, 3, device=device)
    append(expected, k_new.cpu(), v_new.cpu(), num_new.cpu(), fn=reference.append_context_kv)
    append(state, non_contiguous(k_new), non_contiguous(v_new, "padded"), non_contiguous(num_new))
    assert_state_equal(state, expected)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_appended_rows_are_attended(device, dtype):
    # A round: append the accepted rows, then draft the next block. The next call sees exactly
    # the appended rows: with window = rows appended it equals attention over k_new alone.
    gen = generator(64 + list(DTYPE_IDS).index(dtype))
    batch, block, heads, kv_heads, dim, length, rows = 4, 8, 8, 2, 128, 40, 5
    slots, cache_slot = make_slots("spread", batch, gen, device)
    state = {**make_caches(gen, slots, length, kv_heads, dim, dtype, device),
             "cache_seqlens": i32(0, 17, 35, 30, device=device)}
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    v_new = randn(gen, batch, rows, kv_heads, dim, dtype=dtype, device=device)
    append(state, k_new, v_new, i32(rows, rows, rows, rows, device=device), cache_slot)
    assert state["cache_seqlens"].tolist() == [5, 22, 40, 35]
    t = {**make_block(gen, batch, block, heads, kv_heads, dim, dtype, device),
         "k_cache": state["k_cache"], "v_cache": state["v_cache"]}
    check_attention(t, state["cache_seqlens"], dtype, cache_slot=cache_slot)
    out, lse = attention(t, state["cache_seqlens"], cache_slot=cache_slot, window=rows)
    only_new = {**t, "k_cache": k_new, "v_cache": v_new}
    assert_matches(out, lse, expected_attention(only_new, i32(*[rows] * batch)), dtype)


# --------------------------------------------------------------------------------------------
# Argument checks: every check of csrc/args/attention_args.{h,cpp} with its message
# --------------------------------------------------------------------------------------------

B, G, HQ, HKV, D, N, L, NMAX = 3, 4, 4, 2, 64, 5, 6, 4


def valid_args(device) -> dict:
    gen = generator(70)
    args = dict(
        q=torch.randn(B, G, HQ, D, generator=gen),
        k_block=torch.randn(B, G, HKV, D, generator=gen),
        v_block=torch.randn(B, G, HKV, D, generator=gen),
        k_cache=torch.randn(N, L, HKV, D, generator=gen),
        v_cache=torch.randn(N, L, HKV, D, generator=gen),
        k_new=torch.randn(B, NMAX, HKV, D, generator=gen),
        v_new=torch.randn(B, NMAX, HKV, D, generator=gen),
    )
    args = {k: v.to(BF16) for k, v in args.items()}
    args.update(cache_seqlens=i32(0, 3, 6), cache_slot=i32(4, 0, 2), num_new=i32(0, 2, 4))
    return {k: v.to(device) for k, v in args.items()}


def call_op(op: str, args: dict):
    if op == "block_draft_attention":
        return dspark_ops.block_draft_attention(
            args["q"], args["k_block"], args["v_block"], args["k_cache"], args["v_cache"],
            args["cache_seqlens"], cache_slot=args["cache_slot"],
            softmax_scale=args.get("softmax_scale"), window=args.get("window"))
    return dspark_ops.append_context_kv(
        args["k_cache"], args["v_cache"], args["k_new"], args["v_new"], args["num_new"],
        args["cache_seqlens"], cache_slot=args["cache_slot"])


ATT, APP = ["block_draft_attention"], ["append_context_kv"]
BOTH = ATT + APP


def _bf16(*shape):
    return torch.randn(*shape).to(BF16)


def _d_strided(*shape):
    return _bf16(*shape[:-1], 2 * shape[-1])[..., ::2]


# (id, ops, overrides, error, message after "<op>(): ")
STRUCTURE_ERRORS = [
    ("q-3d", ATT, lambda: dict(q=_bf16(B, G, HQ * D)), ValueError,
     r"'q' must be 4-D \[B, G, Hq, D\], got a 3-D tensor of shape \[3, 4, 256\]"),
    ("q-5d", ATT, lambda: dict(q=_bf16(B, G, HQ, D, 1)), ValueError,
     r"'q' must be 4-D \[B, G, Hq, D\], got a 5-D tensor of shape \[3, 4, 4, 64, 1\]"),
    ("q-float64", ATT, lambda: dict(q=torch.randn(B, G, HQ, D, dtype=torch.float64)), TypeError,
     r"'q' must have dtype Half or BFloat16( or Float)?, got Double"),
    ("q-int", ATT, lambda: dict(q=torch.ones(B, G, HQ, D, dtype=torch.int32)), TypeError,
     r"'q' must have dtype Half or BFloat16( or Float)?, got Int"),
    ("D-32", ATT, lambda: dict(q=_bf16(B, G, HQ, 32)), ValueError,
     r"the head dimension D of 'q' must be 64, 128, 256 or 512, got 32"),
    ("D-96", ATT, lambda: dict(q=_bf16(B, G, HQ, 96)), ValueError,
     r"the head dimension D of 'q' must be 64, 128, 256 or 512, got 96"),
    ("D-1024", ATT, lambda: dict(q=_bf16(B, G, HQ, 1024)), ValueError,
     r"the head dimension D of 'q' must be 64, 128, 256 or 512, got 1024"),
    ("k_cache-3d", BOTH, lambda: dict(k_cache=_bf16(N, L, HKV * D)), ValueError,
     r"'k_cache' must be 4-D \[N, L, Hkv, D\], got a 3-D tensor of shape \[5, 6, 128\]"),
    ("k_cache-dtype", ATT, lambda: dict(k_cache=_bf16(N, L, HKV, D).half()), TypeError,
     r"'k_cache' must have the dtype of 'q' \(BFloat16\), got Half"),
    ("k_cache-float64", APP, lambda: dict(k_cache=torch.randn(N, L, HKV, D, dtype=torch.float64)),
     TypeError, r"'k_cache' must have dtype Half or BFloat16( or Float)?, got Double"),
    ("k_cache-D-stride", BOTH, lambda: dict(k_cache=_d_strided(N, L, HKV, D)), ValueError,
     r"'k_cache' must have unit stride along D \(its rows are read in place\), got strides "
     r"\[1536, 256, 128, 2\]"),
    ("k_cache-D", ATT, lambda: dict(k_cache=_bf16(N, L, HKV, 128)), ValueError,
     r"'k_cache' must have shape \[N, L, Hkv, D\] = \[5, 6, 2, 64\], got \[5, 6, 2, 128\]"),
    ("v_cache-3d", BOTH, lambda: dict(v_cache=_bf16(N, L, HKV * D)), ValueError,
     r"'v_cache' must be 4-D \[N, L, Hkv, D\], got a 3-D tensor of shape \[5, 6, 128\]"),
    ("v_cache-dtype", ATT, lambda: dict(v_cache=_bf16(N, L, HKV, D).float()), TypeError,
     r"'v_cache' must have the dtype of 'q' \(BFloat16\), got Float"),
    ("v_cache-dtype", APP, lambda: dict(v_cache=_bf16(N, L, HKV, D).half()), TypeError,
     r"'v_cache' must have the dtype of 'k_cache' \(BFloat16\), got Half"),
    ("v_cache-D-stride", BOTH, lambda: dict(v_cache=_d_strided(N, L, HKV, D)), ValueError,
     r"'v_cache' must have unit stride along D \(its rows are read in place\), got strides "
     r"\[1536, 256, 128, 2\]"),
    ("v_cache-L", BOTH, lambda: dict(v_cache=_bf16(N, L + 1, HKV, D)), ValueError,
     r"'v_cache' must have shape \[N, L, Hkv, D\] like 'k_cache' = \[5, 6, 2, 64\], "
     r"got \[5, 7, 2, 64\]"),
    ("v_cache-N", BOTH, lambda: dict(v_cache=_bf16(N - 1, L, HKV, D)), ValueError,
     r"'v_cache' must have shape \[N, L, Hkv, D\] like 'k_cache' = \[5, 6, 2, 64\], "
     r"got \[4, 6, 2, 64\]"),
    ("v_cache-heads", BOTH, lambda: dict(v_cache=_bf16(N, L, 1, D)), ValueError,
     r"'v_cache' must have shape \[N, L, Hkv, D\] like 'k_cache' = \[5, 6, 2, 64\], "
     r"got \[5, 6, 1, 64\]"),
    ("Hq-not-multiple", ATT,
     lambda: dict(k_cache=_bf16(N, L, 3, D), v_cache=_bf16(N, L, 3, D)), ValueError,
     r"the query heads Hq = 4 of 'q' must be a multiple of the KV heads Hkv = 3 of "
     r"'k_cache'"),
    ("Hkv-0", ATT, lambda: dict(k_cache=_bf16(N, L, 0, D), v_cache=_bf16(N, L, 0, D)),
     ValueError, r"the query heads Hq = 4 of 'q' must be a multiple of the KV heads Hkv = 0 of "
     r"'k_cache'"),
    ("Hkv-above-Hq", ATT,
     lambda: dict(k_cache=_bf16(N, L, 8, D), v_cache=_bf16(N, L, 8, D)), ValueError,
     r"the query heads Hq = 4 of 'q' must be a multiple of the KV heads Hkv = 8 of "
     r"'k_cache'"),
    ("k_block-dtype", ATT, lambda: dict(k_block=_bf16(B, G, HKV, D).half()), TypeError,
     r"'k_block' must have the dtype of 'q' \(BFloat16\), got Half"),
    ("v_block-dtype", ATT, lambda: dict(v_block=_bf16(B, G, HKV, D).float()), TypeError,
     r"'v_block' must have the dtype of 'q' \(BFloat16\), got Float"),
    ("k_block-G", ATT, lambda: dict(k_block=_bf16(B, G + 1, HKV, D)), ValueError,
     r"'k_block' must have shape \[B, G, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 5, 2, 64\]"),
    ("k_block-B", ATT, lambda: dict(k_block=_bf16(B - 1, G, HKV, D)), ValueError,
     r"'k_block' must have shape \[B, G, Hkv, D\] = \[3, 4, 2, 64\], got \[2, 4, 2, 64\]"),
    ("k_block-heads", ATT, lambda: dict(k_block=_bf16(B, G, HQ, D)), ValueError,
     r"'k_block' must have shape \[B, G, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 4, 4, 64\]"),
    ("v_block-D", ATT, lambda: dict(v_block=_bf16(B, G, HKV, 128)), ValueError,
     r"'v_block' must have shape \[B, G, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 4, 2, 128\]"),
    ("v_block-3d", ATT, lambda: dict(v_block=_bf16(B, G, HKV * D)), ValueError,
     r"'v_block' must have shape \[B, G, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 4, 128\]"),
    ("cache_seqlens-int64", BOTH, lambda: dict(cache_seqlens=torch.tensor([0, 3, 6])), TypeError,
     r"'cache_seqlens' must have dtype Int, got Long"),
    ("cache_seqlens-float", BOTH, lambda: dict(cache_seqlens=torch.tensor([0.0, 3.0, 6.0])),
     TypeError, r"'cache_seqlens' must have dtype Int, got Float"),
    ("cache_seqlens-shape", BOTH, lambda: dict(cache_seqlens=i32(0, 3)), ValueError,
     r"'cache_seqlens' must have shape \[B\] = \[3\], got \[2\]"),
    ("cache_seqlens-2d", BOTH, lambda: dict(cache_seqlens=i32(0, 3, 6)[None]), ValueError,
     r"'cache_seqlens' must have shape \[B\] = \[3\], got \[1, 3\]"),
    ("cache_seqlens-non-contiguous", APP,
     lambda: dict(cache_seqlens=i32(0, 0, 3, 3, 6, 6)[::2]), ValueError,
     r"'cache_seqlens' must be contiguous \(it is updated in place\)"),
    ("cache_slot-int64", BOTH, lambda: dict(cache_slot=torch.tensor([4, 0, 2])), TypeError,
     r"'cache_slot' must have dtype Int, got Long"),
    ("cache_slot-shape", BOTH, lambda: dict(cache_slot=i32(4, 0, 2, 1)), ValueError,
     r"'cache_slot' must have shape \[B\] = \[3\], got \[4\]"),
    ("N-below-B", ATT, lambda: dict(cache_slot=None, k_cache=_bf16(2, L, HKV, D),
                                    v_cache=_bf16(2, L, HKV, D)), ValueError,
     r"without 'cache_slot', the cache must have a row per request: N = 2 < B = 3"),
    ("N-below-B", APP, lambda: dict(cache_slot=None, k_cache=_bf16(2, L, HKV, D),
                                    v_cache=_bf16(2, L, HKV, D)), ValueError,
     r"without 'cache_slot', the cache must have a row per request: N = 2 < B = 3"),
    ("window-negative", ATT, lambda: dict(window=-1), ValueError, r"'window' must be >= 0, got -1"),
    ("softmax_scale-zero", ATT, lambda: dict(softmax_scale=0.0), ValueError,
     r"'softmax_scale' must be finite and > 0, got 0"),
    ("softmax_scale-negative", ATT, lambda: dict(softmax_scale=-0.125), ValueError,
     r"'softmax_scale' must be finite and > 0, got -0.125"),
    ("softmax_scale-inf", ATT, lambda: dict(softmax_scale=INF), ValueError,
     r"'softmax_scale' must be finite and > 0, got inf"),
    ("softmax_scale-nan", ATT, lambda: dict(softmax_scale=NAN), ValueError,
     r"'softmax_scale' must be finite and > 0, got nan"),
    ("k_new-3d", APP, lambda: dict(k_new=_bf16(B, NMAX, HKV * D)), ValueError,
     r"'k_new' must be 4-D \[B, n_max, Hkv, D\], got a 3-D tensor of shape \[3, 4, 128\]"),
    ("k_new-dtype", APP, lambda: dict(k_new=_bf16(B, NMAX, HKV, D).float()), TypeError,
     r"'k_new' must have the dtype of 'k_cache' \(BFloat16\), got Float"),
    ("v_new-dtype", APP, lambda: dict(v_new=_bf16(B, NMAX, HKV, D).half()), TypeError,
     r"'v_new' must have the dtype of 'k_cache' \(BFloat16\), got Half"),
    ("k_new-heads", APP, lambda: dict(k_new=_bf16(B, NMAX, 1, D), v_new=_bf16(B, NMAX, 1, D)),
     ValueError,
     r"'k_new' must have shape \[B, n_max, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 4, 1, 64\]"),
    ("k_new-D", APP, lambda: dict(k_new=_bf16(B, NMAX, HKV, 128)), ValueError,
     r"'k_new' must have shape \[B, n_max, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 4, 2, 128\]"),
    ("v_new-rows", APP, lambda: dict(v_new=_bf16(B, NMAX - 1, HKV, D)), ValueError,
     r"'v_new' must have shape \[B, n_max, Hkv, D\] = \[3, 4, 2, 64\], got \[3, 3, 2, 64\]"),
    ("v_new-batch", APP, lambda: dict(v_new=_bf16(B + 1, NMAX, HKV, D)), ValueError,
     r"'v_new' must have shape \[B, n_max, Hkv, D\] = \[3, 4, 2, 64\], got \[4, 4, 2, 64\]"),
    ("num_new-int64", APP, lambda: dict(num_new=torch.tensor([0, 2, 4])), TypeError,
     r"'num_new' must have dtype Int, got Long"),
    ("num_new-shape", APP, lambda: dict(num_new=i32(0, 2)), ValueError,
     r"'num_new' must have shape \[B\] = \[3\], got \[2\]"),
]

# Value checks: always on CPU; on CUDA only with DSPARK_OPS_DEBUG=1 (they cost a sync).
VALUE_ERRORS = [
    ("cache_seqlens-above-L", BOTH, lambda: dict(cache_seqlens=i32(0, 7, 6)), ValueError,
     r"'cache_seqlens' values must lie in \[0, 6\], got 7 at index \[1\]"),
    ("cache_seqlens-negative", BOTH, lambda: dict(cache_seqlens=i32(0, 3, -1)), ValueError,
     r"'cache_seqlens' values must lie in \[0, 6\], got -1 at index \[2\]"),
    ("cache_slot-above-N", BOTH, lambda: dict(cache_slot=i32(5, 0, 2)), ValueError,
     r"'cache_slot' values must lie in \[0, 4\], got 5 at index \[0\]"),
    ("cache_slot-negative", BOTH, lambda: dict(cache_slot=i32(4, 0, -2)), ValueError,
     r"'cache_slot' values must lie in \[0, 4\], got -2 at index \[2\]"),
    ("cache_slot-duplicate", APP, lambda: dict(cache_slot=i32(4, 2, 4)), ValueError,
     r"'cache_slot' values must be distinct \(two requests would write the same cache row\)"),
    ("num_new-above-n_max", APP, lambda: dict(num_new=i32(0, 5, 4)), ValueError,
     r"'num_new' values must lie in \[0, 4\], got 5 at index \[1\]"),
    ("num_new-negative", APP, lambda: dict(num_new=i32(-1, 2, 4)), ValueError,
     r"'num_new' values must lie in \[0, 4\], got -1 at index \[0\]"),
    # The CPU checks read the data through its strides: offenders at the last element read, in
    # non-contiguous layouts.
    ("cache_seqlens-last-strided", ["block_draft_attention"],
     lambda: dict(cache_seqlens=non_contiguous(i32(0, 3, 7), fill=0)), ValueError,
     r"'cache_seqlens' values must lie in \[0, 6\], got 7 at index \[2\]"),
    ("cache_slot-last-strided", BOTH, lambda: dict(cache_slot=non_contiguous(i32(4, 0, 5), fill=1)),
     ValueError, r"'cache_slot' values must lie in \[0, 4\], got 5 at index \[2\]"),
    ("cache_slot-duplicate-last-strided", APP,
     lambda: dict(cache_slot=non_contiguous(i32(0, 4, 4), fill=1)), ValueError,
     r"'cache_slot' values must be distinct \(two requests would write the same cache row\)"),
    ("num_new-last-strided", APP,
     lambda: dict(num_new=non_contiguous(i32(0, 2, 5), fill=0)), ValueError,
     r"'num_new' values must lie in \[0, 4\], got 5 at index \[2\]"),
]


def _with_overrides(device, overrides) -> dict:
    return with_overrides(valid_args(device), device, overrides)


def _assert_untouched(args: dict, before: dict):
    # A rejected call writes nothing.
    for name in ("k_cache", "v_cache", "cache_seqlens"):
        assert same_bits(args[name], before[name]), name


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), cuda_param("cuda", id="cuda")])
@pytest.mark.parametrize("op,overrides,error,message", error_params(STRUCTURE_ERRORS))
def test_argument_errors(device, op, overrides, error, message):
    args = _with_overrides(device, overrides)
    before = {name: args[name].clone() for name in ("k_cache", "v_cache", "cache_seqlens")}
    with raises(op, error, message):
        call_op(op, args)
    _assert_untouched(args, before)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), cuda_param("cuda", id="cuda")])
@pytest.mark.parametrize("op,overrides,error,message", error_params(VALUE_ERRORS))
def test_value_errors(device, op, overrides, error, message):
    skip_value_checks_without_debug(device)
    args = _with_overrides(device, overrides)
    before = {name: args[name].clone() for name in ("k_cache", "v_cache", "cache_seqlens")}
    with raises(op, error, message):
        call_op(op, args)
    _assert_untouched(args, before)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), cuda_param("cuda", id="cuda")])
def test_valid_arguments_accepted(device):
    # The base of the error tests is itself valid, so each error above is due to its one change;
    # the limits of every range are accepted (p0 = 0 and L, slots 0 and N-1, num_new 0 and
    # n_max, window 0, repeated slots for reading).
    args = valid_args(device)
    for op in BOTH:
        call_op(op, args)
    assert args["cache_seqlens"].tolist() == [0, 5, 6]
    for window in (0, 10**9):
        call_op("block_draft_attention", {**args, "window": window, "softmax_scale": 1e-3,
                                          "cache_slot": i32(4, 4, 0, device=device)})
    call_op("block_draft_attention", {**args, "cache_slot": None})  # N = 5 >= B = 3


@cuda_only
@pytest.mark.parametrize("name,like", [("k_block", "q"), ("v_block", "q"), ("k_cache", "q"),
                                       ("v_cache", "q"), ("cache_seqlens", "k_cache"),
                                       ("cache_slot", "k_cache")])
def test_device_mismatch_attention(name, like):
    args = valid_args("cuda")
    args[name] = args[name].cpu()
    message = rf"block_draft_attention\(\): '{name}' must be on cuda:\d+ like '{like}', got cpu"
    with pytest.raises(ValueError, match=message):
        call_op("block_draft_attention", args)
    args = valid_args("cuda")
    args["q"] = args["q"].cpu()
    with pytest.raises(ValueError, match=r"block_draft_attention\(\): 'k_cache' must be on cpu "
                                         r"like 'q', got cuda:\d+"):
        call_op("block_draft_attention", args)


@cuda_only
@pytest.mark.parametrize("name", ["v_cache", "k_new", "v_new", "num_new", "cache_seqlens",
                                  "cache_slot"])
def test_device_mismatch_append(name):
    args = valid_args("cuda")
    args[name] = args[name].cpu()
    message = rf"append_context_kv\(\): '{name}' must be on cuda:\d+ like 'k_cache', got cpu"
    with pytest.raises(ValueError, match=message):
        call_op("append_context_kv", args)


@cuda_only
def test_float32_attention_rejected_on_cuda():
    # The CUDA attention kernel takes float16/bfloat16 only (docs/semantics.md §3.5).
    args = {k: v.float() if v.is_floating_point() else v for k, v in valid_args("cuda").items()}
    with pytest.raises(TypeError, match=r"block_draft_attention\(\): .*'q' must have dtype "
                                        r"Half or BFloat16, got Float"):
        call_op("block_draft_attention", args)


@cuda_only
def test_cuda_out_of_range_values_stay_in_bounds():
    # Without DSPARK_OPS_DEBUG nothing checks values on CUDA; out-of-range lengths, counts and
    # cache rows must still never write outside the caches (guard bands of NaN around them in
    # one buffer stay NaN) and cache_seqlens never passes L.
    if DEBUG:
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    gen = generator(80)
    batch, rows, kv_heads, dim, length, slots = 4, 3, 2, 64, 8, 6
    buffer = torch.full((slots + 2, length + 4, kv_heads, dim), NAN, dtype=BF16, device="cuda")
    k_cache = buffer[1 : slots + 1, 2 : length + 2]
    v_buffer = buffer.clone()
    v_cache = v_buffer[1 : slots + 1, 2 : length + 2]
    k_cache.copy_(randn(gen, slots, length, kv_heads, dim, dtype=BF16, device="cuda"))
    v_cache.copy_(randn(gen, slots, length, kv_heads, dim, dtype=BF16, device="cuda"))
    guard = torch.ones(buffer.shape[:2], dtype=torch.bool, device="cuda")
    guard[1 : slots + 1, 2 : length + 2] = False
    k_new = randn(gen, batch, rows, kv_heads, dim, dtype=BF16, device="cuda")
    seqlens = i32(length + 3, -4, 2, 5, device="cuda")
    append({"k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": seqlens}, k_new, k_new,
           i32(2, 1, rows + 5, -3, device="cuda"), i32(slots + 1, -1, 0, 2, device="cuda"))
    torch.cuda.synchronize()
    assert buffer[guard].isnan().all() and v_buffer[guard].isnan().all()
    assert (seqlens <= length).all()
    q = randn(gen, batch, 4, 4, dim, dtype=BF16, device="cuda")
    out = dspark_ops.block_draft_attention(q, k_new[:, :1].expand(-1, 4, -1, -1).contiguous(),
                                           k_new[:, :1].expand(-1, 4, -1, -1).contiguous(),
                                           k_cache, v_cache, i32(length + 9, -2, 3, 1,
                                                                 device="cuda"),
                                           cache_slot=i32(0, 1, slots + 3, -5, device="cuda"))
    torch.cuda.synchronize()
    assert out.shape == q.shape
