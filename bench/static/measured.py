"""The GPU benchmarks' measured rows (``python -m bench``'s ``all_<device>.json``) matched to the
static model's rows: what ``python -m bench.static.calibrate`` fits the model to and
``gpu_checks.model_vs_measured`` sets beside it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["find_measured", "load_bench", "shape_params"]


def shape_params(shape: str) -> Dict[str, str]:
    """``{"B": "64", ...}`` from a benchmark row's shape text (``B=64 G=8 ...``)."""
    return {k: v for k, v in re.findall(r"(\w+)<?=(\S+)", shape)}


def find_measured(match: Optional[dict], rows: List[dict]) -> Optional[dict]:
    """The first measured row of the op, shape parameters and variant prefix a model row's
    ``match`` names, or None."""
    if not match:
        return None
    for row in rows:
        if row.get("op") != match["op"] or row.get("ours_us") is None:
            continue
        params = shape_params(row.get("shape", ""))
        if any(params.get(k) != str(v) for k, v in match["params"].items()):
            continue
        if not str(row.get("variant", "")).startswith(match.get("variant", "")):
            continue
        return row
    return None


def load_bench(paths: List[Path]) -> List[dict]:
    """Rows of the GPU benchmark files among ``paths`` (CPU files give none)."""
    rows = []
    for path in paths:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if str(data.get("environment", {}).get("device", "")).startswith("cuda"):
            rows += data.get("rows", [])
    return rows
