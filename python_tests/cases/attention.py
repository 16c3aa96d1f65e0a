"""Inputs of the attention ops (block_draft_attention, append_context_kv) and their tolerances,
shared by test_attention.py and test_sim_attention.py."""

from __future__ import annotations

import torch

from cases.common import NAN

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OUT_TOL = {F32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=2e-2, rtol=2e-2),
           F16: dict(atol=3e-3, rtol=5e-3)}
LSE_TOL = {F32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=2e-3, rtol=0),
           F16: dict(atol=2e-3, rtol=0)}


def i32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


_SAME_SIZE_INT = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN payloads included), for exact before/after comparisons."""
    return t.view(_SAME_SIZE_INT[t.dtype]) if t.dtype in _SAME_SIZE_INT else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def randn(gen, *shape, dtype, device, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def make_slots(kind, batch, gen, device):
    """(N, cache_slot): ``none``: N = B, default rows; ``none-spare``: N > B, default rows;
    ``permuted``: N = B in random order; ``spread``: N > B, distinct random rows;
    ``shared``: rows repeat (requests forked from one context)."""
    if kind == "none":
        return batch, None
    if kind == "none-spare":
        return batch + 2, None
    if kind == "permuted":
        return batch, torch.randperm(batch, generator=gen).int().to(device)
    if kind == "spread":
        slots = 2 * batch + 1
        return slots, torch.randperm(slots, generator=gen)[:batch].int().to(device)
    if kind == "shared":
        slots = batch // 2 + 1
        chosen = torch.randint(0, slots, (batch,), generator=gen, dtype=torch.int32)
        if batch > 1:
            chosen[-1] = chosen[0]
        return slots, chosen.to(device)
    raise ValueError(kind)


def strided_cache(cache: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values in a cache layout with non-unit strides on the non-D dims (unit stride
    along D); the gaps hold NaN."""
    slots, length, kv_heads, dim = cache.shape
    nan = dict(dtype=cache.dtype, device=cache.device)
    if kind == "rows-of-a-larger-cache":  # every other row of a cache with 2N + 1 rows
        out = torch.full((2 * slots + 1, length, kv_heads, dim), NAN, **nan)[1::2]
    elif kind == "prefix-of-a-longer-cache":  # positions 3 .. 3+L of a longer cache
        out = torch.full((slots, length + 7, kv_heads, dim), NAN, **nan)[:, 3 : 3 + length]
    elif kind == "heads-of-a-wider-cache":  # every other KV head
        out = torch.full((slots, length, 2 * kv_heads, dim), NAN, **nan)[:, :, 1::2]
    elif kind == "head-major":  # [N, Hkv, L, D] storage seen as [N, L, Hkv, D]
        out = torch.full((slots, kv_heads, length, dim), NAN, **nan).transpose(1, 2)
    elif kind == "padded-rows":  # rows of a buffer with a wider last dimension
        out = torch.full((slots, length, kv_heads, dim + 16), NAN, **nan)[..., 8 : 8 + dim]
    elif kind == "unaligned-rows":  # rows 2 bytes off 16-byte alignment (the kernels' slow path)
        out = torch.full((slots, length, kv_heads, dim + 1), NAN, **nan)[..., 1:]
    else:
        raise ValueError(kind)
    out.copy_(cache)
    assert out.stride(3) == 1 and not out.is_contiguous()
    return out
