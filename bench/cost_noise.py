"""How far apart two profiles of one cost table land on this machine, by estimator: the prices
``dspark_ops.profile_costs`` writes (the median plain step times every entry's median ratio to
the plain step of its own repetition) against entry-by-entry medians, from the same timings.

    python -m bench.cost_noise [--dspark releases/smollm2-135m-instruct/dspark.safetensors]
        [--profiles 3] [--repeats 15] [--window 5 9] [--threads 2]
        [--json bench/results/cost_noise_smollm2.json]

SmolLM2-135M-Instruct with a DSpark draft. ``--profiles`` runs of ``--repeats`` repetitions
each (``dspark_ops.costs.time_rounds``, the raw timings kept); every ``--window`` consecutive
repetitions of every run make one simulated profile, priced both ways. What the goodput rule
decides on is the ratio of a width's price to the plain step's, so the report is the spread of
``t(w) / t(1)`` over the simulated profiles: the narrower, the fewer decisions a profile's luck
makes. Nothing here is a speed claim.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

#: The widths reported (a verify of 1, 3 and 7 drafts).
WIDTHS = (2, 4, 8)


def entrywise(rows: List[List[float]]) -> List[float]:
    """Ratios to the plain step of entry-by-entry medians (the estimate before)."""
    plain = statistics.median(r[0] for r in rows)
    return [statistics.median(r[w] for r in rows) / plain for w in range(len(rows[0]))]


def per_repetition(rows: List[List[float]]) -> List[float]:
    """Ratios to the plain step of the library's prices (``dspark_ops.costs.estimate_costs``:
    medians of each entry's ratio to its own repetition's plain step)."""
    from dspark_ops.costs import estimate_costs

    prices = estimate_costs({"key": {}, "target": {1: rows},
                             "draft": {1: [[]] * len(rows)}}).target_seconds[1]
    return [price / prices[0] for price in prices]


def spread(runs: List[List[List[float]]], window: int) -> Dict[str, dict]:
    """Per estimator and width: the quartiles and range of ``t(w) / t(1)`` over every window of
    ``window`` consecutive repetitions of every run."""
    report = {}
    for name, estimate in (("per-repetition ratios", per_repetition),
                           ("entry-by-entry medians", entrywise)):
        estimates = [estimate(rows[start:start + window]) for rows in runs
                     for start in range(len(rows) - window + 1)]
        widths = {}
        for w in WIDTHS:
            values = sorted(e[w - 1] for e in estimates)
            quartile = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
            widths[f"t({w})/t(1)"] = {"min": values[0], "q1": quartile[0],
                                      "median": statistics.median(values), "q3": quartile[2],
                                      "max": values[-1]}
        report[name] = {"profiles": len(estimates), "widths": widths}
    return report


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cost_noise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dspark", default="releases/smollm2-135m-instruct/dspark.safetensors")
    parser.add_argument("--profiles", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--window", type=int, nargs="+", default=[5, 9])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="bench/results/cost_noise_smollm2.json")
    args = parser.parse_args(argv)
    if min(args.profiles, args.repeats, args.threads, *args.window) < 1:
        raise SystemExit("--profiles, --repeats, --threads and --window must be >= 1")
    if max(args.window) > args.repeats:
        raise SystemExit(f"--window {max(args.window)} is longer than --repeats {args.repeats}")
    if not os.path.exists(args.dspark):
        raise SystemExit(f"--dspark {args.dspark}: no such draft")

    import torch
    from transformers import AutoModelForCausalLM

    from bench.common import device_name, write_json
    from bench.e2e import _load_draft
    from dspark_ops import smollm2
    from dspark_ops.costs import time_rounds
    from dspark_ops.hf import HFTarget
    from dspark_ops.proposers import make_proposer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2.ensure_hf_dir(), dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = _load_draft(args.dspark, model)
    target = HFTarget(model, draft.config.target_layer_ids)
    proposer = make_proposer(draft)
    runs, seconds = [], []
    for run in range(args.profiles):
        began = time.perf_counter()
        timings = time_rounds(target, proposer, repeats=args.repeats, seed=run)
        seconds.append(time.perf_counter() - began)
        runs.append(timings["target"][1])
    results = {
        "what": "spread of t(w)/t(1) over simulated profiles (windows of consecutive "
                "repetitions), SmolLM2-135M-Instruct, batch 1, by estimator",
        "command": "python -m bench.cost_noise " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "machine": f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores, "
                   f"{args.threads} threads, torch {torch.__version__}",
        "draft": args.dspark, "threads": args.threads, "profiles": args.profiles,
        "repeats": args.repeats, "profile_seconds": seconds,
        "plain_step_ms": [1e3 * statistics.median(r[0] for r in rows) for rows in runs],
        "windows": {str(w): spread(runs, w) for w in args.window},
        "timings": runs,
    }
    write_json(args.json, results)
    for window, report in results["windows"].items():
        for name, entry in report.items():
            cells = "  ".join(f"{w} {v['min']:.2f} [{v['q1']:.2f} {v['median']:.2f} "
                              f"{v['q3']:.2f}] {v['max']:.2f}"
                              for w, v in entry["widths"].items())
            print(f"{window:>2} reps, {name:22s} ({entry['profiles']:2d} profiles): {cells}")
    print(f"plain step, ms: {', '.join(f'{v:.1f}' for v in results['plain_step_ms'])}; "
          f"wrote {args.json}")


if __name__ == "__main__":
    main()
