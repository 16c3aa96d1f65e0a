"""Block drafting attention with context K/V injection (docs/semantics.md §3.5).

DSpark drafts a whole block in one forward pass of the draft backbone: in every draft layer the G
block slots ``[x0, MASK, ...]`` attend, non-causally among themselves, to a context K/V cache built
from the target's hidden features of all earlier positions. The block's own keys and values are
scratch and are never written to the cache; only the anchor's and the accepted tokens' features are
appended after verification (:func:`append_context_kv`).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from .._fake_checks import checked_fake

__all__ = ["block_draft_attention", "append_context_kv"]


def block_draft_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    cache_slot: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    window: Optional[int] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention of the G block slots over their context cache rows and all G block keys.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, G, Hq, D]`` queries of the block slots; float16/bfloat16 (float32 too on CPU);
        ``D`` in {64, 128, 256}.
    k_block, v_block : torch.Tensor
        ``[B, G, Hkv, D]``: the block's own keys and values (never written anywhere). Every
        block slot sees every block key (non-causal). ``Hq`` must be a multiple of ``Hkv``
        (grouped-query attention: query head ``h`` reads KV head ``h // (Hq / Hkv)``).
    k_cache, v_cache : torch.Tensor
        ``[N, L, Hkv, D]`` context caches (unit stride along ``D``), read in place.
    cache_seqlens : torch.Tensor
        int32 ``[B]``: ``p0``, the number of context rows of each request, in ``[0, L]``.
    cache_slot : torch.Tensor, optional
        int32 ``[B]``: the cache row of each request; default ``b``.
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    window : int, optional
        Sliding window: only context positions ``[max(0, p0 - window), p0)`` are seen.
    return_lse : bool
        Also return the log-sum-exp of the scaled scores, float32 ``[B, G, Hq]``.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out`` ``[B, G, Hq, D]`` in ``q``'s dtype (softmax and accumulation in float32), and
        ``lse`` when ``return_lse``.
    """
    out, lse = torch.ops.dspark_ops.block_draft_attention(
        q, k_block, v_block, k_cache, v_cache, cache_seqlens, cache_slot, softmax_scale, window,
        return_lse,
    )
    return (out, lse) if return_lse else out


def append_context_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    num_new: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    cache_slot: Optional[torch.Tensor] = None,
) -> None:
    """Appends context K/V rows in place and advances ``cache_seqlens`` (never past ``L``).

    Row ``i < num_new[b]`` of ``k_new[b]`` / ``v_new[b]`` is written at position
    ``cache_seqlens[b] + i`` of cache row ``cache_slot[b]``; rows that would land at or past ``L``
    are dropped, and ``cache_seqlens[b]`` becomes ``min(cache_seqlens[b] + num_new[b], L)``. No
    host sync; nothing is ever written out of bounds.

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        ``[N, L, Hkv, D]``, updated in place: each element its own memory (no expanded view) and
        no memory shared with another argument, as for ``cache_seqlens``.
    k_new, v_new : torch.Tensor
        ``[B, n_max, Hkv, D]`` in the caches' dtype.
    num_new : torch.Tensor
        int32 ``[B]``, each in ``[0, n_max]``.
    cache_seqlens : torch.Tensor
        int32 ``[B]``, contiguous, updated in place.
    cache_slot : torch.Tensor, optional
        int32 ``[B]``: distinct cache rows; default ``b``.
    """
    torch.ops.dspark_ops.append_context_kv(
        k_cache, v_cache, k_new, v_new, num_new, cache_seqlens, cache_slot
    )


@torch.library.register_fake("dspark_ops::block_draft_attention")
@checked_fake("block_draft_attention")
def _block_draft_attention_fake(q, k_block, v_block, k_cache, v_cache, cache_seqlens,
                                cache_slot=None, softmax_scale=None, window=None,
                                return_lse=False):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("dspark_ops::append_context_kv")
@checked_fake("append_context_kv")
def _append_context_kv_fake(k_cache, v_cache, k_new, v_new, num_new, cache_seqlens,
                            cache_slot=None):
    return None
