"""philox_uniform's CUDA kernel and launcher, run in the SIMT emulator: bit-identical to the CPU
kernel and the reference (the same Philox4x32-10 words, the same float conversion)."""

from __future__ import annotations

import pytest
import torch

import emulator
from dspark_ops import reference
from conftest import full_tests

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("rows, count", [(1, 1), (3, 5), (2, 4), (7, 1000), (1, 257)])
@pytest.mark.parametrize("purpose", [0, 1, 2])
def test_matches_cpu_and_reference(sim, rows, count, purpose):
    gen = torch.Generator().manual_seed(rows * 131 + count)
    seed = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    position = torch.randint(0, 2**62, (rows,), generator=gen)
    position[0] = 2**40 + 3  # the high counter word
    out = sim.philox_uniform(seed, position, purpose, count)
    assert torch.equal(out, torch.ops.dspark_ops.philox_uniform(seed, position, purpose, count))
    assert torch.equal(out, reference.philox_uniform(seed, position, purpose, count))


def test_empty(sim):
    seed = torch.zeros(0, dtype=torch.int64)
    assert sim.philox_uniform(seed, seed, 0, 4).shape == (0, 4)
    assert sim.philox_uniform(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), 0, 0).shape == (2, 0)


def test_argument_checks_run_on_the_cuda_path(sim):
    with pytest.raises(ValueError, match=r"philox_uniform\(\): .purpose. must lie in"):
        sim.philox_uniform(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), -1, 3)


@pytest.mark.skipif(not full_tests(), reason="DSPARK_OPS_TEST_FULL=1: 16.7M threads")
def test_grid_stride_loop(sim):
    """More elements than 65535 blocks of 256 threads: the kernel's grid-stride loop."""
    count = 65535 * 128 + 5  # per row, two rows
    seed = torch.tensor([1, 2], dtype=torch.int64)
    position = torch.tensor([3, 4], dtype=torch.int64)
    out = sim.philox_uniform(seed, position, 0, count)
    assert torch.equal(out, torch.ops.dspark_ops.philox_uniform(seed, position, 0, count))
    assert emulator.launches()["philox_uniform_kernel"] >= 1
