"""Every script of examples/ runs as a user runs it (a fresh interpreter, from another directory)
on every device, at small sizes, and reports success."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

# (script, extra arguments): small sizes, so the whole file takes seconds per device.
CASES = [
    ("verify_only.py", ["--vocab", "4096"]),
    ("decoding_loop.py", ["--temperature", "0"]),  # checks identity with plain greedy decoding
    ("decoding_loop.py", ["--max-new-tokens", "16", "--profile-step-rate"]),
    ("end_to_end.py", ["--max-new-tokens", "12", "--top-p", "0.9"]),
    ("dlpack_interop.py", []),
]


def run_example(script, args, device, cwd):
    env = dict(os.environ)
    # The package of this checkout, whether or not it is installed in the environment.
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--device", device,
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_example_is_tested():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == sorted({script for script, _ in CASES})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("script,args", CASES, ids=[" ".join([s] + a) for s, a in CASES])
def test_example_runs(script, args, device, tmp_path):
    result = run_example(script, args, device, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    if script == "dlpack_interop.py" and device == "cuda" and "skipping" in result.stdout:
        pytest.skip("CuPy is not installed: " + lines[-1])
    assert lines[-1] == "ok", result.stdout + result.stderr
    if "--temperature" in args and args[args.index("--temperature") + 1] == "0":
        assert "greedy output identical to plain target decoding" in result.stdout
