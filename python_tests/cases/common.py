"""What the sampling ops' tests share: dtypes, special values, seeds, small tensors and the
switch for value checks on CUDA."""

from __future__ import annotations

import os
import zlib

import torch

from dspark_ops import reference

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
             torch.int64: "i64", torch.int32: "i32"}
INF = float("inf")
NAN = float("nan")
# Value checks run on CPU always, on CUDA only with DSPARK_OPS_DEBUG=1 (they cost a sync).
DEBUG = os.environ.get("DSPARK_OPS_DEBUG", "") not in ("", "0")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stable_seed(*key) -> int:
    """A seed derived from test parameters, the same in every process (unlike hash())."""
    return zlib.crc32(repr(key).encode())


def is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    return ~(temperature.float() > reference.GREEDY_TEMPERATURE)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def f32(*values):
    return torch.tensor(values, dtype=torch.float32)
