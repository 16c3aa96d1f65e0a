"""Loads the compiled operator library (dspark_ops._C) with errors that say how to fix things."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import warnings

import torch

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


def _schemas_of(path: str) -> tuple:
    """The schemas csrc/schemas.h compiled into the library at path, in its order."""
    export = ctypes.CDLL(path).dspark_ops_schemas
    export.restype = ctypes.POINTER(ctypes.c_char_p)
    export.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    count = ctypes.c_size_t()
    array = export(ctypes.byref(count))
    return tuple(array[i].decode() for i in range(count.value))


def _loaded_library() -> tuple:
    """(path, schemas) of the loaded library that defines the ops. torch.ops keeps the path of
    every library it loaded; ours has the schema export (it may be a build other than
    dspark_ops._C, e.g. the CMake one, loaded first)."""
    for path in sorted(torch.ops.loaded_libraries):
        try:
            return path, _schemas_of(path)
        except (AttributeError, OSError):
            continue
    raise ImportError(f"dspark_ops: the ops are registered, but no loaded library lists them; "
                      f"{_BUILD_HINT}")


def _library_loaded() -> bool:
    return any(name.startswith("dspark_ops::") for name in torch._C._dispatch_get_all_op_names())


_SCHEMAS: tuple = ()


def load_library() -> None:
    """Loads _C once, which registers every op with the PyTorch dispatcher."""
    global _SCHEMAS
    if _SCHEMAS:
        return
    if _library_loaded():
        _SCHEMAS = _loaded_library()[1]
        return
    override = os.environ.get("DSPARK_OPS_LIBRARY", "")
    if override:
        # Another build of the same sources, e.g. the CPU kernels under AddressSanitizer + UBSan
        # (csrc/build_cpu_asan.py): loaded instead of dspark_ops._C.
        if not os.path.exists(override):
            raise ImportError(f"dspark_ops: DSPARK_OPS_LIBRARY={override} does not exist")
        torch.ops.load_library(override)
        _SCHEMAS = _schemas_of(override)
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
    try:
        _SCHEMAS = _schemas_of(spec.origin)
    except AttributeError as error:  # a build from before the library listed its schemas
        raise ImportError(f"dspark_ops: {os.path.basename(spec.origin)} is an older build that "
                          f"does not list its ops; {_BUILD_HINT}") from error


def schemas() -> tuple:
    """Every op's schema as csrc/schemas.h spells it (without the namespace), in its order."""
    load_library()
    return _SCHEMAS


def __getattr__(name):
    # OPS: every op of the library, in torch.ops.dspark_ops, in the order of csrc/schemas.h; read
    # from the loaded library, so it is the list of the build being run.
    if name == "OPS":
        return tuple(schema.split("(", 1)[0] for schema in schemas())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
