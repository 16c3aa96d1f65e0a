"""Every Python block of README.md runs as written (a fresh interpreter, from another directory),
or is an excerpt of an examples/ script (which test_examples.py runs), or states what it needs
in a first ``# requires:`` line and runs wherever that is present."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = re.findall(r"^```python\n(.*?)^```", open(os.path.join(ROOT, "README.md")).read(),
                    re.S | re.M)


def _missing(requirements):
    words = requirements.replace(",", " ").split()
    missing, i = [], 0
    while i < len(words):
        word = words[i]
        if word == "checkpoints":  # the rest are local model directories
            missing += [w for w in words[i + 1:] if w != "cuda" and not os.path.isdir(w)]
            if "cuda" in words[i + 1:] and not torch.cuda.is_available():
                missing.append("cuda")
            break
        if word == "cuda":
            if not torch.cuda.is_available():
                missing.append("cuda")
        elif importlib.util.find_spec(word) is None:
            missing.append(word)
        i += 1
    return missing


def test_readme_has_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block(index, tmp_path):
    code = BLOCKS[index]
    first = code.splitlines()[0]
    excerpt = re.match(r"# (examples/\S+\.py)", first)
    if excerpt:
        lines = [line.strip() for line in open(os.path.join(ROOT, excerpt.group(1)))]
        quoted = [line.strip() for line in code.splitlines()[1:]]
        starts = [i for i, line in enumerate(lines) if line == quoted[0]]
        assert any(lines[i:i + len(quoted)] == quoted for i in starts), \
            f"README block {index} is not an excerpt of {excerpt.group(1)} any more"
        return
    requires = re.match(r"# requires: (.*)", first)
    if requires and _missing(requires.group(1)):
        pytest.skip(f"needs {', '.join(_missing(requires.group(1)))}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README block {index}:\n{code}\n{result.stderr}"
