"""The checks every fake kernel makes before it allocates its outputs.

A fake kernel runs whenever one argument is on the ``meta`` device (and under ``torch.compile``),
so it must refuse what the CPU and CUDA entry points refuse before they touch data: a required
tensor passed as ``None``, and tensors on different devices. Without the device check, one
``meta`` tensor among CPU tensors would hand back the fake's uninitialised CPU outputs (and an
in-place op would silently write nothing) where the real kernels raise.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch


def _tensor_arguments(op: str) -> list[tuple[str, bool]]:
    """(name, required) of every Tensor / Tensor? argument of dspark_ops::<op>, schema order."""
    schema = getattr(torch.ops.dspark_ops, op).default._schema
    out = []
    for arg in schema.arguments:
        kind = arg.type
        if isinstance(kind, torch.TensorType):
            out.append((arg.name, True))
        elif isinstance(kind, torch.OptionalType) and isinstance(kind.getElementType(),
                                                                 torch.TensorType):
            out.append((arg.name, False))
    return out


def check_tensor_arguments(op: str, tensors: dict) -> None:
    """Raises as the entry points do: TypeError for ``None`` where ``op`` requires a tensor,
    ValueError for a tensor on another device than the op's first tensor argument."""
    reference_name, reference = None, None
    for name, required in _tensor_arguments(op):
        t = tensors.get(name)
        if t is None:
            if required:
                raise TypeError(f"{op}(): '{name}' must be a tensor, got None")
            continue
        if reference is None:
            reference_name, reference = name, t
        elif t.device != reference.device:
            raise ValueError(f"{op}(): '{name}' must be on {reference.device} like "
                             f"'{reference_name}', got {t.device}")


def checked_fake(op: str) -> Callable:
    """Decorates the fake kernel of ``op``: check_tensor_arguments on its bound arguments first.
    The undecorated function stays reachable as ``__wrapped__``."""

    def decorate(fake: Callable) -> Callable:
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            check_tensor_arguments(op, bound.arguments)
            return fake(*args, **kwargs)

        return wrapper

    return decorate
