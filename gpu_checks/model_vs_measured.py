"""Side by side: the static MODEL's prediction (python -m bench.static) and the benchmarks'
measured time (python -m bench) per op and shape, with the measured time as % of the floor.

    python -m gpu_checks.model_vs_measured --model DIR/static_sm90.json --bench DIR/all_*.json

Only GPU measurements are compared; a CPU benchmark file (or a shape the benchmarks did not run)
prints "-" in the measured columns.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional


def shape_params(shape: str) -> Dict[str, str]:
    return {k: v for k, v in re.findall(r"(\w+)<?=(\S+)", shape)}


def find_measured(match: Optional[dict], rows: List[dict]) -> Optional[dict]:
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


def table(model: dict, measured: List[dict]) -> List[str]:
    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"
    lines = [f"{'op / shape / variant':<62}{'measured us':>12}{'% of floor':>11}"
             f"{'MODEL us':>10}{'model/meas':>11}  model bound"]
    for row in model["rows"]:
        got = find_measured(row.get("match"), measured)
        us = got["ours_us"] if got else None
        floor = row["judged_floor_us"]
        pct = 100 * floor / us if us else None
        ratio = row["model_us"] / us if us else None
        label = f"{row['op']} {row['shape']} {row['variant']}"
        lines.append(f"{label[:61]:<62}{f(us):>12}{f(pct, 0):>11}{row['model_us']:>10.1f}"
                     f"{f(ratio, 2):>11}  {row['bound']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_checks.model_vs_measured",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="static_sm90.json")
    parser.add_argument("--bench", type=Path, nargs="*", default=[],
                        help="benchmark JSON files (python -m bench's all_<device>.json)")
    args = parser.parse_args(argv)
    if not args.model.exists():
        print(f"model_vs_measured: no model results at {args.model}", file=sys.stderr)
        return 1
    model = json.loads(args.model.read_text())
    measured = load_bench(args.bench)
    print("model vs measured (MODEL = static estimate from the SASS, not a measurement; "
          "% of floor = floor / measured)" + ("" if measured else
                                              "; no GPU measurements: '-'"))
    for line in table(model, measured):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
