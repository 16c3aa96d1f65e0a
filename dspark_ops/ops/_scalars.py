"""Python numbers for per-request arguments: broadcast to a ``[B]`` tensor in the op's dtype."""

from __future__ import annotations

import numbers
from typing import Optional

import torch


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
