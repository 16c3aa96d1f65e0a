"""``python -m dspark_ops.eval``: DeepSpec's offline evaluation on a transformers target with a
DSpark, DFlash or Eagle3 draft (:func:`dspark_ops.load_draft`; Eagle3 and DFlash drafts run
with ``--scheduler fixed``), against plain target decoding on the same prompts and seeds.

Each data file is DeepSpec's format, one ``{"turns": [...]}`` object per line; the first turn
is the prompt, as the user's turn through the target tokenizer's chat template (assistant turn
opened, thinking off), as DeepSpec's evaluator uses it. Per file it prints and writes to JSON:

- ``mean_accepted_length``: tokens emitted per request-round, accepted drafts + 1 (the paper's
  tau, Table 1);
- ``mean_verified_drafts``: drafts verified per request-round (G with ``--scheduler fixed``);
- ``accept_rate_by_position``: accepted / verified drafts at each block slot;
- ``speedup``: plain decoding time / speculative time, same prompts, seeds and stop tokens;
- tokens per second and target forwards of both.

Example::

    python -m dspark_ops.eval --target qwen3-8b --draft dspark-qwen3-8b \\
        --data eval_datasets/gsm8k.jsonl eval_datasets/mt-bench.jsonl --temperature 1 \\
        --max-new-tokens 2048 --output results.json

Paths are local; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional, Sequence

import torch

from . import _cli
from .prompts import chat_prompt


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_model_arguments(parser)
    parser.add_argument("--data", nargs="+", required=True, help="DeepSpec .jsonl file(s)")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="the first N prompts of each file")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts decoded together (DeepSpec's evaluator: 1)")
    parser.add_argument("--output", default="dspark_eval.json", help="JSON results file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def read_first_turns(path: str) -> List[str]:
    """The first turn of every ``{"turns": [...]}`` line of a DeepSpec data file."""
    turns = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            value = row.get("turns") if isinstance(row, dict) else None
            if not (isinstance(value, list) and value and all(isinstance(t, str) for t in value)):
                raise SystemExit(f"{path}:{number}: expected a non-empty string list 'turns'")
            turns.append(value[0])
    if not turns:
        raise SystemExit(f"{path}: no prompts")
    return turns


def evaluate_file(models: _cli.Models, path: str, args: argparse.Namespace) -> dict:
    turns = read_first_turns(path)[: args.max_samples]
    prompts = [chat_prompt(models.tokenizer, t) for t in turns]
    block = models.decoder.block_size
    request_rounds = emitted = verified_total = 0
    verified_at, accepted_at = [0] * block, [0] * block
    spec_seconds = plain_seconds = 0.0
    spec_tokens = plain_tokens = spec_forwards = plain_forwards = 0
    identical = True
    batches = range(0, len(prompts), args.batch_size)
    for start in _cli.progress(batches, len(batches), os.path.basename(path),
                               not args.no_progress):
        batch = prompts[start: start + args.batch_size]
        result = _cli.compare(models, batch, args, first_seed=args.seed + start)
        for stats in result.speculative.rounds:
            for accepted, verified in zip(stats.accepted, stats.num_verify):
                request_rounds += 1
                emitted += accepted + 1
                verified_total += verified
                for k in range(verified):
                    verified_at[k] += 1
                    accepted_at[k] += k < accepted
        spec_seconds += result.speculative_seconds
        plain_seconds += result.plain_seconds
        spec_tokens += sum(len(t) for t in result.speculative.tokens)
        plain_tokens += sum(len(t) for t in result.plain_tokens)
        spec_forwards += result.speculative_forwards
        plain_forwards += result.plain_forwards
        identical &= result.speculative.tokens == result.plain_tokens
    rounds = max(request_rounds, 1)
    row = {
        "file": path,
        "num_samples": len(prompts),
        "mean_accepted_length": emitted / rounds,
        "mean_verified_drafts": verified_total / rounds,
        "accept_rate_by_position": [a / v if v else None for a, v in zip(accepted_at,
                                                                          verified_at)],
        "request_rounds": request_rounds,
        "speculative_tokens": spec_tokens,
        "plain_tokens": plain_tokens,
        "speculative_seconds": spec_seconds,
        "plain_seconds": plain_seconds,
        "speculative_tokens_per_second": spec_tokens / spec_seconds if spec_seconds else None,
        "plain_tokens_per_second": plain_tokens / plain_seconds if plain_seconds else None,
        "speedup": _cli.speedup(plain_seconds, spec_seconds),
        "speculative_target_forwards": spec_forwards,
        "plain_target_forwards": plain_forwards,
    }
    if args.temperature == 0.0:
        row["greedy_identical_to_plain"] = identical
    return row


@torch.no_grad()
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    models = _cli.load_models(args)
    _cli.warm_up(models, args)
    settings = {k: v for k, v in vars(args).items() if k not in ("data", "output", "no_progress")}
    settings.update(block_size=models.decoder.block_size, scheduler=models.decoder.scheduler,
                    draft_kind=_cli.draft_kind(models.draft))
    print(f"{'file':<24} {'samples':>7} {'tau':>6} {'verified/round':>14} {'speed-up':>8} "
          f"{'tok/s spec':>10} {'tok/s plain':>11}")
    results = []
    for path in args.data:
        row = evaluate_file(models, path, args)
        results.append(row)
        print(f"{os.path.basename(path):<24} {row['num_samples']:>7} "
              f"{row['mean_accepted_length']:>6.2f} {row['mean_verified_drafts']:>14.2f} "
              f"{row['speedup']:>8.2f} {row['speculative_tokens_per_second']:>10.1f} "
              f"{row['plain_tokens_per_second']:>11.1f}", flush=True)
    with open(args.output, "w") as f:
        json.dump({"target": args.target, "draft": args.draft, "settings": settings,
                   "results": results}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
