"""The counter-based random numbers that every sampling op draws."""

from __future__ import annotations

import torch

from ..sampling import PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_RESAMPLE
from .._fake_checks import checked_fake

__all__ = ["philox_uniform", "PURPOSE_DRAFT", "PURPOSE_ACCEPT", "PURPOSE_RESAMPLE"]


def philox_uniform(seed: torch.Tensor, position: torch.Tensor, purpose: int, count: int) -> torch.Tensor:
    """Uniforms in (0, 1) exactly as the kernels draw them.

    Parameters
    ----------
    seed, position : torch.Tensor
        int64 ``[N]``: stream keys (a request's seed and an absolute token position).
    purpose : int
        Which stream: ``PURPOSE_DRAFT`` (0, proposals), ``PURPOSE_ACCEPT`` (1, acceptance tests)
        or ``PURPOSE_RESAMPLE`` (2, correction and bonus tokens); any other value is a
        ``ValueError`` (no op draws from it). Layout: docs/semantics.md §2.1.
    count : int
        Elements per stream.

    Returns
    -------
    torch.Tensor
        float32 ``[N, count]``; entry ``[i, k]`` is element ``k`` of stream
        ``(seed[i], position[i], purpose)``. Identical on CPU and CUDA.
    """
    return torch.ops.dspark_ops.philox_uniform(seed, position, purpose, count)


@torch.library.register_fake("dspark_ops::philox_uniform")
@checked_fake("philox_uniform")
def _philox_uniform_fake(seed, position, purpose, count):
    return seed.new_empty((seed.shape[0], count), dtype=torch.float32)
