"""Shared test configuration: devices, the long-sweep switch and layout helpers.

Run with ``python -m pytest python_tests`` from the repository root. CUDA cases are marked
``cuda`` and skip on machines without a GPU; they run unchanged where one exists.
``DSPARK_OPS_TEST_FULL=1`` turns on the long sweeps.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from source_tree import op_families

import dspark_ops  # noqa: F401  (loads the operator library before any test runs)

CUDA_AVAILABLE = torch.cuda.is_available()
CUDA_SKIP_REASON = "CUDA is not available (torch.cuda.is_available() is False)"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped without one")
    config.addinivalue_line(
        "markers", "sim: runs the CUDA kernels in the SIMT emulator (python_tests/emulator.py)"
    )
    for family in sorted(set(op_families().values())):
        config.addinivalue_line(
            "markers", f"{family}: a test of the {family} op family (set from the file and test "
                       f"names; `make test-family F={family}`)")


# Files whose tests span every op: their tests are of the family their name or parameters name.
_ALL_OP_FILES = ("test_registration", "test_compile", "test_fuzz")


def _named_family(text: str, ops: dict):
    """The family of the first op, else of the first family, that ``text`` names as a word
    (underscores, dashes and brackets separate words)."""
    names = sorted(ops, key=len, reverse=True) + sorted(set(ops.values()), key=len, reverse=True)
    for name in names:
        if re.search(rf"(?<![a-z0-9]){name}(?![a-z0-9])", text):
            return ops.get(name, name)
    return None


def pytest_collection_modifyitems(config, items):
    """Marks each test with its op family: test_<family>*.py and test_sim_<family>*.py by the
    file name, the op-wide files' tests by the op or family their name or parameters name."""
    ops = op_families()
    for item in items:
        stem = item.path.stem
        if stem in _ALL_OP_FILES:
            family = _named_family(item.name, ops)
        else:
            rest = stem.removeprefix("test_").removeprefix("sim_")
            family = next((f for f in set(ops.values())
                           if rest == f or rest.startswith(f + "_")), None)
        if family is not None:
            item.add_marker(getattr(pytest.mark, family))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): their models are tiny, and a thread pool only loses time on a busy
    2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def sim(request):
    """torch.ops.dspark_ops_sim, reset for this test (emulated H200, no fault, a seed per test).
    Torch runs single-threaded meanwhile: the emulator is, and the small reference computations
    beside it only lose time to a thread pool on a busy 2-core machine. Memory from torch.empty /
    at::empty (the CUDA glue's outputs and workspaces) comes filled with NaN or the type's
    maximum, torch's deterministic mode: a kernel that reads what nothing wrote sees that."""
    from emulator import ops, reset

    reset(request.node.nodeid)
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield ops()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def cuda_param(*values, id=None):
    """A pytest.param that is marked ``cuda`` and skips without a GPU."""
    return pytest.param(
        *values,
        marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA_AVAILABLE, reason=CUDA_SKIP_REASON)],
        id=id,
    )


# Use as @pytest.mark.parametrize("device", DEVICES) where a test also needs other parameters.
DEVICES = [pytest.param("cpu", id="cpu"), cuda_param("cuda", id="cuda")]


def cuda_only(test):
    """Decorator for tests that exist only on CUDA (graph capture, device mismatch)."""
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA_AVAILABLE, reason=CUDA_SKIP_REASON)(test))


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def on_two_streams(calls, rounds: int = 3) -> list:
    """Runs ``calls[0]`` on one new CUDA stream and ``calls[1]`` on another, ``rounds`` times each,
    alternating, so that they overlap; returns each stream's outputs after a synchronize."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outputs = [[], []]
    for _ in range(rounds):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outputs[k].append(calls[k]())
    torch.cuda.synchronize()
    return outputs


def full_tests() -> bool:
    """True when DSPARK_OPS_TEST_FULL=1: run the long sweeps too."""
    return os.environ.get("DSPARK_OPS_TEST_FULL", "") == "1"


def _poison(dtype: torch.dtype):
    # What fills the gaps of a non-contiguous copy: values a kernel must never read.
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


def non_contiguous(t: torch.Tensor, kind: str = "strided", fill=None) -> torch.Tensor:
    """The same values in a non-contiguous layout whose gaps hold poison (NaN / iinfo.min), or
    ``fill`` (a valid value, so that a check reading the gaps instead of the values passes).

    ``strided``: every dimension's stride is doubled, including the last (allocated with an extra
    trailing dimension of 2 and sliced), so even a 1-D tensor is non-contiguous.
    ``padded``: the last dimension keeps unit stride but rows are padded (allocated wider and
    sliced), the layout of a logit slice taken out of a larger buffer; needs ``t.dim() >= 2``.
    ``transposed``: a 2-D ``t`` stored column-major (no gaps; the row stride is the smaller).
    """
    if kind == "transposed":
        assert t.dim() == 2 and min(t.shape) > 1, "transposed layout needs a 2-D [>1, >1] tensor"
        out = t.t().contiguous().t()
        assert not out.is_contiguous() and out.stride(0) < out.stride(1)
        return out
    if kind == "strided":
        gap = _poison(t.dtype) if fill is None else fill
        storage = torch.full((*t.shape, 2), gap, dtype=t.dtype, device=t.device)
        out = storage[..., 0]
    elif kind == "padded":
        assert t.dim() >= 2, "padded layout needs at least two dimensions"
        storage = torch.full(
            (*t.shape[:-1], t.shape[-1] + 3), _poison(t.dtype) if fill is None else fill,
            dtype=t.dtype, device=t.device,
        )
        out = storage[..., 1 : t.shape[-1] + 1]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    out.copy_(t)
    rows = t.numel() // max(t.shape[-1], 1) if t.dim() else 1
    assert out.is_contiguous() == (t.numel() <= 1 or (kind == "padded" and rows <= 1))
    torch.testing.assert_close(out, t, rtol=0, atol=0, equal_nan=True)
    return out
