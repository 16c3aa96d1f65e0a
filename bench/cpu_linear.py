"""What the few-row products (:mod:`dspark_ops.models.cpu_linear`) buy on this machine: each of
SmolLM2-135M-Instruct's weight shapes at 1-16 rows, ``linear`` against ``weight @ x.T``, and the
whole target's step by width through :class:`dspark_ops.hf.HFTarget` with and without them.

    python -m bench.cpu_linear [--threads 2] [--repeats 25] [--json ...] [--chart ...]

Each product is timed interleaved with its rival (medians of ``--repeats``; for one row, the
rival is ``weight @ x.T`` over the row twice, which is what the rule computes against a wide
weight). The steps are one ``HFTarget`` forward of ``n`` new tokens after a 128-token prompt, the
two settings interleaved. The rule is fixed; this benchmark is how to check it on another
machine before trusting a cost table: where the ``rule`` column is not the faster one, the rule
is wrong there. Writes the JSON and a PNG chart (the time ratio per shape and row count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from bench.common import device_name, write_json

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
WIDTHS = (1, 2, 3, 4, 6, 8)


def _time(fn, repeats: int, rival) -> tuple:
    """Medians (seconds) of ``fn`` and ``rival``, run alternately."""
    ours, theirs = [], []
    for _ in range(2):  # warm both paths
        fn(), rival()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        rival()
        theirs.append(time.perf_counter() - start)
    return statistics.median(ours), statistics.median(theirs)


def products(model, repeats: int) -> list:
    """Per distinct weight shape and row count: ``linear`` and ``weight @ x.T`` in ms, and
    whether the rule picks the latter."""
    from dspark_ops.models.cpu_linear import uses_rule

    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault(tuple(module.weight.shape), (name, module.weight.detach()))
    rows_out = []
    for shape, (name, weight) in sorted(shapes.items()):
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            two = torch.cat([x, x]) if rows == 1 else x
            count = max(5, repeats // 4) if weight.shape[0] >= 8192 else repeats
            transposed, linear = _time(lambda: (weight @ two.t()).t()[:rows], count,
                                       lambda: F.linear(x, weight))
            rows_out.append({"weight": name, "shape": list(shape), "rows": rows,
                             "linear_ms": linear * 1e3, "weight_x_t_ms": transposed * 1e3,
                             "rule_uses_weight_x_t": uses_rule(rows, shape[0])})
    return rows_out


def steps(model, repeats: int) -> list:
    """The target's step for each width, ms, with and without the few-row products."""
    from dspark_ops.hf import HFTarget
    from dspark_ops.steps import prefill

    targets = {True: HFTarget(model, [-1], few_row_linears=True),
               False: HFTarget(model, [-1], few_row_linears=False)}
    prompt = list(range(100, 228))
    rows = []
    with torch.no_grad():
        for width in WIDTHS:
            timings = {True: [], False: []}
            for _ in range(repeats):
                for rule, target in targets.items():
                    _, _, cache, cache_len = prefill(target, [prompt], 256, "cpu")
                    ids = torch.randint(0, 1000, (1, width))
                    start = time.perf_counter()
                    target(ids, torch.tensor([width], dtype=torch.int32), cache, cache_len)
                    timings[rule].append(time.perf_counter() - start)
            rows.append({"width": width,
                         "linear_ms": statistics.median(timings[False]) * 1e3,
                         "few_row_ms": statistics.median(timings[True]) * 1e3})
    for target in targets.values():
        target.close()
    return rows


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (grid, curve) = plt.subplots(1, 2, figsize=(12, 4.2),
                                      gridspec_kw={"width_ratios": [1.5, 1]})
    shapes = []
    for row in results["products"]:
        if row["weight"] not in [s[0] for s in shapes]:
            shapes.append((row["weight"], tuple(row["shape"])))
    ratio = [[0.0] * len(ROWS) for _ in shapes]
    chosen = [[False] * len(ROWS) for _ in shapes]
    for row in results["products"]:
        i = [s[0] for s in shapes].index(row["weight"])
        j = ROWS.index(row["rows"])
        ratio[i][j] = row["linear_ms"] / row["weight_x_t_ms"]
        chosen[i][j] = row["rule_uses_weight_x_t"]
    image = grid.imshow(ratio, cmap="RdBu", vmin=0.25, vmax=1.75, aspect="auto")
    for i in range(len(shapes)):
        for j in range(len(ROWS)):
            grid.text(j, i, f"{ratio[i][j]:.1f}" + ("*" if chosen[i][j] else ""),
                      ha="center", va="center", fontsize=7)
    grid.set_xticks(range(len(ROWS)), ROWS)
    grid.set_yticks(range(len(shapes)), [f"{s[0].split('.')[-1]} {s[1][0]}x{s[1][1]}"
                                         for s in shapes], fontsize=7)
    grid.set_xlabel("rows")
    grid.set_title("linear time / (weight @ x.T) time; * = the rule's choice", fontsize=9)
    fig.colorbar(image, ax=grid)
    widths = [r["width"] for r in results["steps"]]
    curve.plot(widths, [r["linear_ms"] for r in results["steps"]], "o-", color="#607d8b",
               label="linear")
    curve.plot(widths, [r["few_row_ms"] for r in results["steps"]], "o-", color="#c62828",
               label="few-row products")
    curve.set_xlabel("new tokens in the forward")
    curve.set_ylabel("target step, ms")
    curve.set_ylim(bottom=0)
    curve.set_title("SmolLM2-135M step (128-token context)", fontsize=9)
    curve.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", default="bench/results/cpu_linear_smollm2.json")
    parser.add_argument("--chart", default="docs/cpu_linear_smollm2.png")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.backends.mkl.is_available():
        print("note: torch here is not built on MKL, so the rule does not engage: the step "
              "columns will agree")
    torch.set_num_threads(args.threads)
    from dspark_ops import smollm2
    from dspark_ops.models.cpu_linear import RULE

    model, _ = smollm2.load()
    print("products by weight shape and rows ...", flush=True)
    results = {"model": "SmolLM2-135M-Instruct (float32)",
               "machine": f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores, "
                          f"{args.threads} threads, torch {torch.__version__}",
               "command": " ".join(["python -m bench.cpu_linear",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "rule": RULE, "repeats": args.repeats}
    results["products"] = products(model, args.repeats)
    print("the target's step by width ...", flush=True)
    results["steps"] = steps(model, max(3, args.repeats // 2))
    print(f"{'weight':28s} {'rows':>4s} {'linear':>8s} {'W@x.T':>8s} rule")
    for row in results["products"]:
        print(f"{row['weight']:28s} {row['rows']:4d} {row['linear_ms']:8.3f} "
              f"{row['weight_x_t_ms']:8.3f} {'W@x.T' if row['rule_uses_weight_x_t'] else ''}")
    print(f"{'width':>5s} {'linear ms':>10s} {'few-row ms':>10s}")
    for row in results["steps"]:
        print(f"{row['width']:5d} {row['linear_ms']:10.1f} {row['few_row_ms']:10.1f}")
    write_json(args.json, results)
    if args.chart:
        chart(results, args.chart)
        print(f"chart: {args.chart}")
    return results


if __name__ == "__main__":
    main()
