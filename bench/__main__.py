"""``python -m bench``: runs every ``bench/bench_*.py`` family and prints one combined table.

Each family module provides ``main(argv, emit=False) -> list[Row]`` and accepts ``--quick``,
``--device``, ``--no-anchors`` and ``--results-dir``; adding a family is adding a file. Runs on
CUDA when available, else on CPU, and writes ``all_<device>.json/.csv`` next to each family's own
files (by default under build/bench-results/, which git ignores).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench.common import log, resolve_device
from bench.report import add_output_args, add_smoke_arg, environment, print_table, write_results
from bench.timing import measure_copy_bandwidth


def families() -> list:
    """Module names of every benchmark family, in file-name order."""
    here = Path(__file__).resolve().parent
    return [f"bench.{path.stem}" for path in sorted(here.glob("bench_*.py"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and repeats per family")
    add_smoke_arg(parser)
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--json-only", action="store_true",
                        help="print the results as JSON on stdout instead of the table")
    parser.add_argument("--no-anchors", action="store_true",
                        help="skip third-party anchors (FlashInfer, vLLM)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    forwarded = ["--device", str(device)] + (["--quick"] if args.quick else []) \
        + (["--smoke"] if args.smoke else []) \
        + (["--no-anchors"] if args.no_anchors else []) + ["--results-dir", str(args.results_dir)]

    started = time.perf_counter()
    rows, failed = [], []
    for name in families():
        try:
            module = importlib.import_module(name)
            rows += module.main(forwarded, emit=False)
        except Exception:  # one broken family must not hide the others' numbers
            failed.append(name)
            log(f"{name} failed:\n{traceback.format_exc()}")
    elapsed = time.perf_counter() - started

    copy_gbps = measure_copy_bandwidth(device) if device.type == "cuda" else None
    meta = environment(device, copy_gbps)
    meta["families"] = families()
    meta["failed"] = failed
    meta["elapsed_s"] = elapsed
    paths = write_results(rows, "all", device, meta, results_dir=args.results_dir)
    log("wrote " + ", ".join(str(p) for p in paths))

    if args.json_only:
        print(json.dumps({"environment": meta, "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        title = f"dspark_ops benchmarks on {meta['device_name']} ({device}, " \
                f"{meta['threads']} threads)"
        if copy_gbps:
            title += f", copy bandwidth {copy_gbps:.0f} GB/s"
        print_table(rows, title=title, wide=args.wide)
        print(f"{len(rows)} rows in {elapsed:.1f} s" + (f"; FAILED: {', '.join(failed)}"
                                                         if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
