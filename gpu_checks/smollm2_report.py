"""What ``gpu_checks/train_smollm2.sh`` records of its runs on the GPU machine, as JSON.

    python -m gpu_checks.smollm2_report budget RUN_DIR TRAIN_LOG OUT_JSON
    python -m gpu_checks.smollm2_report data TRAIN_DATA OUT_JSON [--key value ...]
    python -m gpu_checks.smollm2_report files OUT_JSON FILE...
    python -m gpu_checks.smollm2_report summary LOGS_DIR OUT_DIR RUN_NAME

``budget`` reads a trainer's ``metrics.jsonl`` back (steps, tokens, seconds of steps, final loss
and tau, peak memory) and fails when a loss is not finite or the trainer did not finish; ``data``
counts the training data; ``files`` records sizes and sha256 sums; ``summary`` gathers the step
table (``steps.tsv``) and every JSON of the logs folder into ``summary.json`` and prints it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import sys
from typing import List, Optional, Sequence


def _dump(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


def budget(run: str, log: str, out: str) -> None:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: missing; the trainer wrote no step (see {log})")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no steps (see {log})")
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    bad = [r["step"] for r in rows if not math.isfinite(r["loss"])]
    last = rows[-20:]
    seconds = sum(r["seconds"] for r in rows)
    # The first step holds flex attention's compilation: the rate is of the steps after it.
    rest = rows[1:] or rows
    record = {
        "steps": len(rows), "tokens": int(sum(r["tokens"] for r in rows)),
        "train_seconds": seconds, "first_step_seconds": rows[0]["seconds"],
        "tokens_per_second": sum(r["tokens"] for r in rest) / max(1e-9, sum(r["seconds"]
                                                                            for r in rest)),
        "final_loss": sum(r["loss"] for r in last) / len(last),
        "final_tau_probabilistic": sum(r.get("tau_probabilistic") or 0 for r in last) / len(last),
        "peak_memory_mib": max(r["peak_memory_mib"] for r in rows),
        "finished": "done:" in text, "nonfinite_steps": bad[:20],
        # torch warns here when flex attention recompiles too often or runs unfused
        "warnings": sorted({line.strip()[:200] for line in text.splitlines()
                            if "Warning" in line or "recompile" in line.lower()})[:10]}
    _dump(out, record)
    print(json.dumps({k: record[k] for k in ("steps", "tokens", "train_seconds", "final_loss",
                                             "finished")}))
    if bad:
        raise SystemExit(f"{run}: the loss is not finite at steps {bad[:10]}")
    if not record["finished"] or "Traceback" in text:
        raise SystemExit(f"{run}: the trainer did not finish cleanly (see {log})")


def data(path: str, out: str, extra: List[str]) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    record = {"samples": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
              "response_tokens": sum(sum(r["loss_mask"]) for r in rows)}
    if len(extra) % 2:
        raise SystemExit(f"data: settings come as --key value pairs, got {extra}")
    for key, value in zip(extra[::2], extra[1::2]):
        record[key.lstrip("-").replace("-", "_")] = value
    _dump(out, record)
    print(json.dumps(record))


def files(out: str, paths: Sequence[str]) -> None:
    record = {}
    for path in paths:
        with open(path, "rb") as f:
            record[os.path.basename(path)] = {"bytes": os.path.getsize(path),
                                              "sha256": hashlib.sha256(f.read()).hexdigest()}
    _dump(out, record)


def summary(logs: str, out: str, run: str) -> dict:
    steps = [line.split("\t") for line in open(os.path.join(logs, "steps.tsv")).read().splitlines()
             if line]
    result = {"run": run, "steps": {n: {"status": s, "seconds": int(t)} for n, s, t in steps},
              "ok": all(s == "ok" for _, s, _ in steps)}
    gpu = os.path.join(logs, "nvidia-smi.txt")
    if os.path.exists(gpu):
        names = [line.split("|")[1].strip() for line in open(gpu)
                 if "NVIDIA" in line and "|" in line and "Driver" not in line
                 and "MiB" not in line]
        result["gpu"] = names[0] if names else None
    for name in ("train_smoke", "data", "releases"):
        path = os.path.join(logs, name + ".json")
        if os.path.exists(path):
            result[name] = json.load(open(path))
    for path in sorted(glob.glob(os.path.join(logs, "budget_*.json"))):
        result.setdefault("budget", {})[os.path.basename(path)[7:-5]] = json.load(open(path))
    keys = ("num_samples", "mean_accepted_length", "mean_verified_drafts", "speedup",
            "speculative_tokens_per_second", "plain_tokens_per_second",
            "greedy_identical_to_plain")
    for path in sorted(glob.glob(os.path.join(logs, "eval_*.json"))):
        rows = json.load(open(path))["results"]
        result.setdefault("eval", {})[os.path.basename(path)[5:-5]] = {
            os.path.basename(r["file"]).rsplit(".", 1)[0]: {k: r[k] for k in keys if k in r}
            for r in rows}
    _dump(os.path.join(logs, "summary.json"), result)
    _dump(os.path.join(out, "summary.json"), result)

    print(f"\n=== SmolLM2 drafts, {run}: summary ===")
    print(f"{'step':<22}{'status':<26}{'seconds':>8}")
    for name, status, seconds in steps:
        print(f"{name:<22}{status:<26}{seconds:>8}")
    if "data" in result:
        d = result["data"]
        print(f"data: {d['samples']} samples, {d['tokens']} tokens, {d['response_tokens']} "
              "response tokens")
    for arch, b in result.get("budget", {}).items():
        print(f"{arch}: {b['steps']} steps, {b['tokens']} tokens, {b['train_seconds']:.0f} s of "
              f"steps (first {b['first_step_seconds']:.0f} s, then "
              f"{b['tokens_per_second']:.0f} tokens/s), final loss {b['final_loss']:.3f}, "
              f"tau_prob {b['final_tau_probabilistic']:.2f}, peak {b['peak_memory_mib']:.0f} MiB"
              + (f"; {len(b['warnings'])} warning lines" if b["warnings"] else ""))
    for name, r in result.get("releases", {}).items():
        print(f"{name}: {r['bytes'] / 2**20:.1f} MiB, sha256 {r['sha256'][:16]}...")
    for arch, per_file in result.get("eval", {}).items():
        for name, r in per_file.items():
            print(f"eval {arch:<7}{name:<12}tau {r['mean_accepted_length']:.2f}  speed-up "
                  f"{r['speedup']:.2f}  greedy identical {r.get('greedy_identical_to_plain')}")
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = __doc__.split("\n\n")[1]
    if not argv:
        raise SystemExit("usage:\n" + usage)
    command, rest = argv[0], argv[1:]
    if command == "budget" and len(rest) == 3:
        budget(*rest)
    elif command == "data" and len(rest) >= 2:
        data(rest[0], rest[1], rest[2:])
    elif command == "files" and len(rest) >= 2:
        files(rest[0], rest[1:])
    elif command == "summary" and len(rest) == 3:
        summary(*rest)
    else:
        raise SystemExit(f"unknown command or wrong arguments: {' '.join(argv)}\nusage:\n{usage}")


if __name__ == "__main__":
    main()
