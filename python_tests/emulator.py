"""The SIMT emulator, for tests: the library's CUDA entry points and kernels, compiled by g++
against csrc/sim/ and run on CPU tensors (torch.ops.dspark_ops_sim.<op>, same schemas as
torch.ops.dspark_ops.<op>).

Build with ``python csrc/sim/build.py [plain|race|asan]`` (``make test`` builds ``plain``;
``make test-sim`` all three). ``DSPARK_OPS_SIM_FLAVOUR`` picks the flavour a test run loads,
``DSPARK_OPS_SIM_SEED`` the scheduling seed (block order and thread interleaving) and
``DSPARK_OPS_SIM_REQUIRED=1`` turns a missing library into a failure instead of a skip.
"""

from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAVOUR = os.environ.get("DSPARK_OPS_SIM_FLAVOUR", "plain")


def library_path(flavour: str = FLAVOUR) -> str:
    return os.path.join(ROOT, "build", "sim", flavour, "dspark_ops_sim.so")


def ops():
    """torch.ops.dspark_ops_sim, loading the emulator library once (skips if it is not built)."""
    if not hasattr(torch.ops.dspark_ops_sim, "set_device"):
        path = library_path()
        if not os.path.exists(path):
            message = (f"the SIMT emulator ({FLAVOUR}) is not built: "
                       f"run `python csrc/sim/build.py {FLAVOUR}` (make test does)")
            if os.environ.get("DSPARK_OPS_SIM_REQUIRED") == "1":
                pytest.fail(message)
            pytest.skip(message)
        torch.ops.load_library(path)
    return torch.ops.dspark_ops_sim


def reset(test_id: str) -> None:
    """A fresh emulator state per test: H200, no planted fault, a seed from the test's name."""
    sim = ops()
    sim.set_device("h200")
    sim.set_plant("")
    base = int(os.environ.get("DSPARK_OPS_SIM_SEED", "0"))
    sim.set_seed(base * 1_000_003 + zlib.crc32(test_id.encode()))


@contextlib.contextmanager
def emulated_device(name: str):
    """Runs the block on another emulated GPU ("h200", "a100", "l4")."""
    sim = ops()
    previous = sim.device_name()
    sim.set_device(name)
    try:
        yield
    finally:
        sim.set_device(previous)


@contextlib.contextmanager
def planted(fault: str):
    """Plants a fault in the emulator for the block, to show a check catches a broken kernel:
    ``drop_barrier:<file>:<line>`` (that __syncthreads does nothing), ``shuffle_off_by_one``
    (shuffles read the next lane), ``mma_swap_a12`` (mma.sync takes A registers 1 and 2 swapped)."""
    sim = ops()
    sim.set_plant(fault)
    try:
        yield
    finally:
        sim.set_plant("")


def launches() -> dict[str, int]:
    """Kernel instantiation -> launches since the last clear_launch_log()."""
    out = {}
    for line in ops().launch_log().splitlines():
        name, count = line.rsplit("\t", 1)
        out[name] = int(count)
    return out


def barrier_site(file: str, after: str) -> str:
    """``file:line`` of the first __syncthreads in csrc/kernels/<file> after the line containing
    ``after`` (for planting drop_barrier without hard-coding line numbers)."""
    path = os.path.join(ROOT, "csrc", "kernels", file)
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    for i in range(start, len(lines)):
        if "__syncthreads()" in lines[i] and not lines[i].lstrip().startswith("//"):
            return f"{file}:{i + 1}"
    raise ValueError(f"no __syncthreads after {after!r} in {file}")


def caught(run) -> str:
    """How ``run`` failed — a mismatch (AssertionError) or an emulator report (RuntimeError from
    dspark_sim) — or '' if it passed: for showing that a planted fault is caught."""
    try:
        run()
    except AssertionError as e:
        return f"mismatch: {str(e)[:300]}"
    except RuntimeError as e:
        assert "dspark_sim" in str(e) or "emulated" in str(e), e
        return f"emulator: {str(e)[:300]}"
    return ""
