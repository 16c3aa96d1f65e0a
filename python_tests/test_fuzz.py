"""A short, fixed-seed fuzzing campaign over every op (python_tests/fuzz/harness.py): every
one-argument mutation of four valid calls per op on CPU, and a fixed sample of mutations of
another through the emulated CUDA path (DSPARK_OPS_FUZZ_SIM_CALLS calls). Any finding (crash,
hang, unclear error, mismatch with the reference, broken invariant, modified input, sanitizer or
emulator report) fails. ``make fuzz`` runs the long campaign."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "fuzz", "harness.py")


def _campaign(tmp_path, *args):
    report = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, HARNESS, "--report", str(report), *args],
                          capture_output=True, text=True, timeout=900)
    assert report.exists(), proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert not data["findings"], proc.stdout[-6000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return data


def test_fuzz_cpu(tmp_path):
    data = _campaign(tmp_path, "--seed", "0", "--seeds", "4", "--backends", "cpu")
    # Every op was called, and both the valid calls and the refusals were exercised.
    assert len(data["counts"]) >= 12
    for counts in data["counts"].values():
        assert counts.get("result", 0) > 0 and counts.get("error", 0) > 0, data["counts"]


@pytest.mark.sim
def test_fuzz_emulated(tmp_path):
    from emulator import FLAVOUR, library_path

    if not os.path.exists(library_path()):
        if os.environ.get("DSPARK_OPS_SIM_REQUIRED") == "1":
            pytest.fail(f"the SIMT emulator is not built ({library_path()})")
        pytest.skip("the SIMT emulator is not built")
    # The race and asan flavours (make test-sim) run a few times slower: fewer calls there.
    calls = os.environ.get("DSPARK_OPS_FUZZ_SIM_CALLS", "150" if FLAVOUR == "plain" else "60")
    _campaign(tmp_path, "--seed", "1", "--backends", "sim", "--limit", calls)
