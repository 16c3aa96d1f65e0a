"""The trainer's GPU path in a few steps, on the tiny random target of the trainer's tests:
``python -m dspark_ops.train`` on CUDA in bfloat16 (flex attention compiled, its backward, the
autocast of the target and the fused loss), for a DSpark draft with a draft vocabulary and a
DFlash draft, then each packed with ``python -m dspark_ops.release`` and loaded back.

    python -m gpu_checks.train_smoke --out DIR [--device cuda] [--dtype bfloat16] [--steps 6]

It needs no model files, so it runs before SmolLM2's arrive and tells within a minute whether the
trainer works on this GPU. Writes ``DIR/train_smoke.json`` (per draft: steps, final loss, seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_target(out: str):
    # The trainer's tests build the tiny target and its data; reuse them rather than a copy.
    sys.path.insert(0, os.path.join(ROOT, "python_tests"))
    from cases.training import TARGET_LAYERS, VOCAB, save_target, write_greedy_data

    target = save_target(os.path.join(out, "target"))
    data = write_greedy_data(target, os.path.join(out, "data.jsonl"), count=24, new_tokens=32)
    return target, data, list(TARGET_LAYERS), VOCAB


def _train(argv: List[str]) -> None:
    from dspark_ops.train.trainer import main as train_main

    train_main(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_checks.train_smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="work folder (target, data, drafts, JSON)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device")
    os.makedirs(args.out, exist_ok=True)
    target, data, layers, vocab = _tiny_target(args.out)
    results = {}
    for arch, extra in (("dspark", ["--markov-rank", "16", "--draft-vocab", str(vocab // 2)]),
                        ("dflash", [])):
        out = os.path.join(args.out, arch)
        began = time.perf_counter()
        _train(["--target", target, "--data", data, "--out", out, "--arch", arch,
                "--num-layers", "1", "--block-size", "4", "--anchors", "8",
                "--target-layers", *layers, "--batch-tokens", "256", "--min-loss-tokens", "4",
                "--max-steps", str(args.steps), "--lr", "3e-3", "--device", args.device,
                "--dtype", args.dtype, "--no-progress", *extra])
        seconds = time.perf_counter() - began
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if len(rows) != args.steps:
            raise SystemExit(f"{arch}: {len(rows)} metrics rows for {args.steps} steps")
        bad = [r["step"] for r in rows if not math.isfinite(r["loss"])]
        if bad:
            raise SystemExit(f"{arch}: the loss is not finite at steps {bad}")
        release = os.path.join(args.out, f"{arch}.safetensors")
        from dspark_ops.release import main as release_main

        release_main([os.path.join(out, "step_latest"), "--target", target, "--out", release])
        from gpu_checks.smollm2_transfer import check_release

        check_release(release, target)
        results[arch] = {"steps": len(rows), "first_loss": rows[0]["loss"],
                         "final_loss": rows[-1]["loss"], "seconds": round(seconds, 1),
                         "peak_memory_mib": max(r["peak_memory_mib"] for r in rows)}
        print(f"{arch}: {json.dumps(results[arch])}", flush=True)
    with open(os.path.join(args.out, "train_smoke.json"), "w") as f:
        json.dump({"device": args.device, "dtype": args.dtype, "drafts": results}, f, indent=1)


if __name__ == "__main__":
    main()
