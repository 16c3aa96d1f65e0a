"""Loads the compiled operator library (dspark_ops._C) with errors that say how to fix things."""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

# Every op of the library, in torch.ops.dspark_ops.
OPS = (
    "verify",
    "markov_draft",
    "rnn_draft",
    "draft_confidence",
    "schedule_verify",
    "plan_verify_budget",
    "allocate_verify",
    "pack_verify_inputs",
    "block_draft_attention",
    "append_context_kv",
    "philox_uniform",
    "dspark_loss",
)

_BUILD_HINT = (
    "build it from the repository root with `pip install --no-build-isolation -e .` "
    "(see README.md: `make test` does everything)"
)


def build_info() -> dict:
    """What setup.py recorded: flavour, torch/CUDA versions, CUDA archs, CPU ISA."""
    try:
        from ._build_info import BUILD_INFO
    except ImportError:
        return {}
    return dict(BUILD_INFO)


def _check_cpu_isa(info: dict) -> None:
    if info.get("cpu_isa") != "avx2":
        return
    is_avx2 = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")()
    supported = getattr(getattr(torch, "cpu", None), "_is_avx2_supported", None)
    if (supported is not None and not supported()) or (supported is None and is_avx2 == "DEFAULT"):
        raise ImportError(
            "dspark_ops was built with AVX2/FMA CPU kernels but this CPU lacks AVX2; rebuild with "
            "DSPARK_OPS_CPU_ISA=generic"
        )


def _warn_if_cpu_only(info: dict, cuda_available: bool) -> None:
    # pip hides the build's "building the CPU flavour" banner; say it where it matters.
    if info.get("flavour") == "cpu" and cuda_available:
        warnings.warn(
            f"dspark_ops was built without CUDA kernels ({info.get('reason', 'reason unknown')}), "
            "so its ops reject CUDA tensors although a GPU is present; rebuild with a CUDA "
            "toolkit (DSPARK_OPS_CUDA=1 makes a missing toolkit an error)",
            RuntimeWarning, stacklevel=3)


def load_library() -> None:
    """Loads _C once, which registers every op with the PyTorch dispatcher."""
    if hasattr(torch.ops.dspark_ops, OPS[0]):
        return
    spec = importlib.util.find_spec("dspark_ops._C")
    if spec is None or spec.origin is None:
        raise ImportError(f"dspark_ops: the compiled library dspark_ops._C is missing; {_BUILD_HINT}")
    info = build_info()
    _check_cpu_isa(info)
    _warn_if_cpu_only(info, torch.cuda.is_available())
    try:
        torch.ops.load_library(spec.origin)
    except OSError as error:
        built_with = info.get("torch_version", "an unknown torch")
        raise ImportError(
            f"dspark_ops: could not load {os.path.basename(spec.origin)} ({error}). It was built "
            f"against torch {built_with} and this is torch {torch.__version__}; {_BUILD_HINT}"
        ) from error


def op_backends(name: str) -> list:
    """Backends with a kernel for torch.ops.dspark_ops.<name>: CPU, CUDA, and Fake."""
    qualname = f"dspark_ops::{name}"
    found = [
        key for key in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)
    ]
    from torch._library.simple_registry import singleton

    if singleton.find(qualname).fake_impl.kernel is not None:
        found.append("Fake")
    return found
