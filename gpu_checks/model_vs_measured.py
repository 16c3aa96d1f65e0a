"""Side by side: the static MODEL's prediction (python -m bench.static) and the benchmarks'
measured time (python -m bench) per op and shape, with the measured time as % of the floor.

    python -m gpu_checks.model_vs_measured --model DIR/static_sm90.json --bench DIR/all_*.json \
        [--profile DIR/profile_ops.json]

Only GPU measurements are compared; a CPU benchmark file (or a shape the benchmarks did not run)
prints "-" in the measured columns. With --profile (python -m gpu_checks.profile_ops), each
profiled op's kernels are set beside the model's: device µs per call from the profiler against
the model's per-kernel time, the library's kernels (cuBLAS, ATen) together, and verify's
measured per-row chain: what the model is re-calibrated from.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import List, Optional

from bench.static.measured import find_measured, load_bench


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


def kernel_key(name: str) -> str:
    """A kernel's name as the model and the profiler both spell it: no return type, namespace
    or parameter list, bf16 for __nv_bfloat16, no spaces."""
    name = re.sub(r"^void\s+", "", name)
    name = re.sub(r"\(.*\)$", "", name).replace("dspark_ops::kernels::", "")
    return name.replace("__nv_bfloat16", "bf16").replace(" ", "")


def find_model_row(model: dict, op: str, variant: str, shape: str) -> Optional[dict]:
    for row in model["rows"]:
        if row["op"] == op and row["variant"] == variant and row["shape"].startswith(shape):
            return row
    return None


def profile_table(model: dict, profile: dict) -> List[str]:
    """Per profiled op: its measured times beside the model's, then kernel by kernel."""
    def f(v, d=1):
        return "-" if v is None else f"{v:.1f}" if d == 1 else f"{v:.{d}f}"
    lines = [f"{'op / kernel':<58}{'measured us':>12}{'MODEL us':>10}{'model/meas':>11}"]
    for name, measured in profile["ops"].items():
        if not measured.get("model") or "error" in measured:
            continue
        row = find_model_row(model, *measured["model"])
        cold = measured.get("eager_cold_us")
        model_us = row["model_us"] if row else None
        ratio = model_us / cold if model_us and cold else None
        lines.append(f"{name[:57]:<58}{f(cold):>12}{f(model_us):>10}{f(ratio, 2):>11}"
                     f"  (eager cold; graph warm {f(measured.get('graph_warm_us'))})")
        table = (measured.get("kernels") or {}).get("table", [])
        modelled = {kernel_key(k["kernel"]): k for k in (row or {}).get("kernels", [])}
        other = 0.0
        for kernel in table:
            mine = modelled.get(kernel_key(kernel["kernel"]))
            if mine is None:
                other += kernel["us_per_call"]
                continue
            r = mine["total_us"] / kernel["us_per_call"] if kernel["us_per_call"] else None
            lines.append(f"  {mine['kernel'][:54]:<56}{kernel['us_per_call']:>12.1f}"
                         f"{mine['total_us']:>10.1f}{f(r, 2):>11}  x{kernel['launches_per_call']:g}"
                         f" ({mine['bound']})")
        library = sum(c["total_us"] for c in (row or {}).get("library", []))
        if other or library:
            lines.append(f"  {'other kernels (cuBLAS, ATen: library)':<56}{other:>12.1f}"
                         f"{library:>10.1f}")
    chain = profile.get("verify_chain")
    if chain:
        lines.append(f"verify's measured per-row chain: {chain['us_per_row']:.1f} us per row of G "
                     f"(intercept {chain['intercept_us']:.1f} us)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_checks.model_vs_measured",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="static_sm90.json")
    parser.add_argument("--bench", type=Path, nargs="*", default=[],
                        help="benchmark JSON files (python -m bench's all_<device>.json)")
    parser.add_argument("--profile", type=Path,
                        help="profile_ops.json (python -m gpu_checks.profile_ops)")
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
    if args.profile:
        if not args.profile.exists():
            print(f"model_vs_measured: no profile at {args.profile}", file=sys.stderr)
            return 1
        profile = json.loads(args.profile.read_text())
        print(f"\nper kernel ({profile.get('kind', 'MEASURED')}; MODEL = static estimate):")
        for line in profile_table(model, profile):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
