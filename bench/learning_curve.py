"""How acceptance grew with the training budget: the drafts that ``bench.smollm2_train`` trained,
read back from their training logs (``OUT/<arch>/metrics.jsonl``, one row per step).

    python -m bench.learning_curve [--runs runs/smollm2]
        [--json bench/results/smollm2_learning_curve.json]
        [--chart docs/smollm2_learning_curve.png] [--chart-only]

Per draft: DeepSpec's ``tau_probabilistic`` (1 + the sum over block positions of the probability
that the draft's whole prefix up to there matches the target's answer, on each step's training
batch) and ``accept_rate@0`` (the first position alone), averaged over windows of ``--window``
steps, against the training tokens seen so far; and what the run's last doubling of tokens bought
(tau of the last window minus tau of the window ending nearest half the tokens; the learning
rate decays to zero over that doubling, as the schedule does at any budget).
These are training-batch figures (the answers the draft learns from), not held-out decoding:
``bench.e2e`` measures that. Measures nothing new; the training run is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, Optional, Sequence

ARCHS = ("dspark", "dflash", "eagle3")


def read_curve(path: str, window: int) -> Dict[str, list]:
    """Windowed means of one training log: tokens seen at each window's end, tau, accept@0."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    if not rows:
        raise SystemExit(f"bench.learning_curve: {path} has no steps")
    seen, tokens = 0, []
    for row in rows:
        seen += int(row["tokens"])
        tokens.append(seen)
    curve: Dict[str, list] = {"tokens": [], "tau": [], "accept_rate@0": [], "lr": []}
    for end in range(window, len(rows) + 1, window):
        chunk = rows[end - window:end]
        curve["tokens"].append(tokens[end - 1])
        curve["tau"].append(sum(r["tau_probabilistic"] for r in chunk) / window)
        curve["accept_rate@0"].append(sum(r["accept_rate@0"] for r in chunk) / window)
        curve["lr"].append(chunk[-1]["lr"])
    # What the last doubling of the budget bought: the last window against the window that ended
    # nearest to half the tokens.
    half = min(range(len(curve["tokens"])), key=lambda i: abs(curve["tokens"][i] - seen / 2))
    gain = curve["tau"][-1] - curve["tau"][half] if curve["tau"] else float("nan")
    return {"steps": len(rows), "tokens_total": seen, "window": window, "curve": curve,
            "tau_gain_last_doubling": gain,
            "tau_last_window": curve["tau"][-1] if curve["tau"] else None}


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"dspark": "#c62828", "dflash": "#64b5f6", "eagle3": "#8e24aa"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for arch, entry in results["drafts"].items():
        c = entry["curve"]
        left.plot(c["tokens"], c["tau"], marker="o", markersize=3, color=colours.get(arch),
                  label=f"{arch} ({entry['tau_gain_last_doubling']:+.2f} in the last doubling)")
        right.plot(c["tokens"], c["accept_rate@0"], marker="o", markersize=3,
                   color=colours.get(arch), label=arch)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training tokens seen")
        ax.grid(alpha=0.3)
    left.set_ylabel("tau (probabilistic, training batches)")
    left.set_title("Tokens per round the draft would give")
    left.legend(fontsize=8)
    right.set_ylabel("P(first draft token right)")
    right.set_title("First position")
    right.legend(fontsize=8)
    fig.suptitle(results["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(results: dict) -> None:
    for arch, e in results["drafts"].items():
        print(f"{arch:7s} steps {e['steps']:4d} tokens {e['tokens_total']:8d} "
              f"tau(last {e['window']} steps) {e['tau_last_window']:.3f} "
              f"gain in the last doubling of tokens {e['tau_gain_last_doubling']:+.3f}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.learning_curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs/smollm2", help="bench.smollm2_train's --out")
    parser.add_argument("--window", type=int, default=15, help="steps per averaged point")
    parser.add_argument("--json", default="bench/results/smollm2_learning_curve.json")
    parser.add_argument("--chart", default="docs/smollm2_learning_curve.png")
    parser.add_argument("--chart-only", action="store_true",
                        help="draw --chart from the results in --json, reading no run")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct drafts trained by "
                        "bench.smollm2_train (one CPU thread each)",
                        help="the chart's title (how the drafts were trained)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be at least 1, got {args.window}")
    if args.chart_only:
        with open(args.json) as f:
            results = json.load(f)
    else:
        drafts: Dict[str, dict] = {}
        for arch in ARCHS:
            path = os.path.join(args.runs, arch, "metrics.jsonl")
            if os.path.isfile(path):
                drafts[arch] = read_curve(path, args.window)
        if not drafts:
            raise SystemExit(f"bench.learning_curve: no {', '.join(ARCHS)} training log under "
                             f"{args.runs}/<arch>/metrics.jsonl; run python -m bench.smollm2_train")
        results = {"title": args.title, "runs": args.runs, "drafts": drafts}
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.chart:
        chart(results, args.chart)
    print_summary(results)
    return results


if __name__ == "__main__":
    main()
