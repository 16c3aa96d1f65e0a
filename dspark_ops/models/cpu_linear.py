"""Linear layers at decoding's shapes on the CPU: a few rows against a whole weight.

A decoding step multiplies 1 to 16 rows by every weight of the model, so each product reads its
weight once and does almost no arithmetic: its time is how fast the BLAS streams the weight.
``torch.nn.functional.linear`` asks for ``x @ weight.T``; with Intel MKL (torch's BLAS on x86)
that product of a few rows is slower than ``weight @ x.T``, several times so with a wide weight
(an LM head), and its matrix-vector path for one row streams a wide weight slower than a two-row
product does. Verifying a few drafts then costs much more than the plain step for no reason
but the call. ``python -m bench.cpu_linear`` measures both per weight shape and row count, and
the target's step with and without the rule (numbers: ``docs/semantics.md`` §3.6a and
``bench/results/cpu_linear_smollm2.json``).

The rule, per product of ``rows`` rows with an ``out × in`` float32 weight:

- ``2 <= rows <= NARROW_ROWS``: ``weight @ x.T``;
- a wide weight (``out >= WIDE_OUT``: an LM head) and ``rows <= WIDE_ROWS``: the same, a single
  row computed as two (the product of one row is the matrix-vector path);
- anything else: ``linear``.

:class:`CpuLinears` applies it to a model's ``nn.Linear`` layers only inside its ``with`` block, so
the model stays untouched for every other caller (``model.generate`` among them). It engages only
where it was measured: float32 weights on the CPU with torch built on MKL. The results equal
``linear``'s up to the order of the float sums.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CpuLinears", "NARROW_ROWS", "RULE", "WIDE_OUT", "WIDE_ROWS", "engages",
           "few_row_linear", "uses_rule"]

NARROW_ROWS = 4  # from 5 to 12 rows linear was as fast or faster (bench.cpu_linear)
WIDE_OUT = 8192
WIDE_ROWS = 16
RULE = f"weight@x.T for 2..{NARROW_ROWS} rows, 1..{WIDE_ROWS} for {WIDE_OUT}+ outputs"
"""The rule in words; part of a cost table's key (it changes what a step costs)."""


def uses_rule(rows: int, out_features: int) -> bool:
    """Whether :func:`few_row_linear` computes ``rows`` rows against an ``out_features``-row
    weight as ``weight @ x.T`` (else it calls ``linear``)."""
    if out_features >= WIDE_OUT:
        return 1 <= rows <= WIDE_ROWS
    return 2 <= rows <= NARROW_ROWS


def few_row_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear(x, weight, bias)``, computed as ``weight @ x.T`` where :func:`uses_rule` says so
    and :func:`engages` accepts the weight.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., in_features]``.
    weight : torch.Tensor
        ``[out_features, in_features]``.
    bias : torch.Tensor, optional
        ``[out_features]``.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (uses_rule(rows, weight.shape[0]) and engages(weight)):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])  # a real second row: a stride-0 one takes the slow path
    out = (weight @ flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _few_row_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, module.weight, module.bias)


def engages(weight: torch.Tensor) -> bool:
    """Whether the rule applies to a layer with this weight (float32, CPU, torch on MKL)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkl.is_available())


class CpuLinears:
    """A model's ``nn.Linear`` layers computed by :func:`few_row_linear` inside ``with``.

    Parameters
    ----------
    model : torch.nn.Module
        Its ``nn.Linear`` layers (exactly that class, not subclasses, whose forward may differ)
        with a weight :func:`engages` accepts are routed; the list is taken once, here.

    Entering sets each layer's ``forward`` in its instance dictionary and leaving removes it,
    so outside the block the model is the caller's as it was. Not reentrant across threads.
    """

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if type(m) is nn.Linear and engages(m.weight)]
        self._depth = 0

    def __len__(self) -> int:
        return len(self.layers)

    def __enter__(self) -> "CpuLinears":
        if self._depth == 0:
            for layer in self.layers:
                layer.__dict__["forward"] = types.MethodType(_few_row_forward, layer)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)
