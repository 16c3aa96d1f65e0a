"""Per-request arguments: values shared by every request broadcast to ``[B]`` tensors, and seeds
drawn when none are given.

The op wrappers use :func:`per_request` (a tensor passes unchanged, for the op to check; a Python
number is broadcast) and :func:`draw_seeds`; the decoders, which take anything ``torch.as_tensor``
does, use :func:`as_per_request`.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

__all__ = ["SEED_BOUND", "as_per_request", "draw_seeds", "per_request", "per_request_args"]

SEED_BOUND = 2**62  # drawn seeds are uniform in [0, SEED_BOUND)

# The dtype each per-request argument of the ops has.
_DTYPES = {
    "temperature": torch.float32,
    "draft_temperature": torch.float32,
    "top_k": torch.int32,
    "top_p": torch.float32,
    "min_p": torch.float32,
}


def per_request(op: str, name: str, value, batch: int, dtype: torch.dtype,
                device: torch.device) -> Optional[torch.Tensor]:
    """``value`` as the op takes it: tensors and ``None`` pass through unchanged (the op checks
    them), a Python number becomes ``[B]`` of ``dtype`` on ``device`` (the same for every
    request); anything else is a ``TypeError`` naming the argument."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    integral = dtype in (torch.int32, torch.int64)
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        expected = "an int" if integral else "a float"
        raise TypeError(f"{op}(): '{name}' must be a tensor [B] or {expected} shared by every "
                        f"request, got {type(value).__name__}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def per_request_args(op: str, batch: int, device: torch.device, **values) -> tuple:
    """:func:`per_request` of each keyword argument (``temperature``, ``draft_temperature``,
    ``top_k``, ``top_p``, ``min_p``) in its dtype, in the order given."""
    return tuple(per_request(op, name, value, batch, _DTYPES[name], device)
                 for name, value in values.items())


def as_per_request(value, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``value`` (a number, a sequence or a tensor) as ``[B]`` of ``dtype`` on ``device``; a
    single number is shared by every request."""
    tensor = torch.as_tensor(value, dtype=dtype, device=device)
    return tensor.expand(batch).contiguous() if tensor.dim() == 0 else tensor


def draw_seeds(batch: int, generator: Optional[torch.Generator] = None,
               device=None) -> torch.Tensor:
    """int64 ``[B]`` seeds, uniform in ``[0, SEED_BOUND)``, drawn on ``device`` (default: torch's
    default device) from ``generator`` (default: torch's default generator there)."""
    return torch.randint(0, SEED_BOUND, (batch,), generator=generator, device=device,
                         dtype=torch.int64)
