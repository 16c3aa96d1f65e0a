"""Where a speculative decoding round spends its time: SmolLM2-135M-Instruct on the CPU with a
trained draft, every part of a round next to the target forward.

    python -m bench.round_profile [--draft runs/smollm2/dspark/step_latest] [--prompts 4]
        [--max-new-tokens 96] [--threads 2] [--scheduler fixed]

The decoder labels each part of a round for ``torch.profiler`` (``dspark_ops.<part>``): the draft
forward (block hidden states over the cached context), the draft's LM head, Markov drafting
(``markov_draft``/``rnn_draft``), the confidence head, scheduling, packing the ragged verify batch,
the target forward (split into transformers' model call, feature hooks included, and this
library's 4-D mask and cache bookkeeping), ``verify``, the commit (``append_context_kv`` and the
position updates) and the round's one host sync. Prints milliseconds per round and each part's
share, with plain decoding's time per token (one target forward of one token) measured in the
same run for scale. The profiler adds its own overhead per op; the round totals measured without
it (``RoundStats``) are printed beside.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional, Sequence

import torch

PARTS = ("draft_forward", "draft_lm_head", "markov_drafting", "confidence", "schedule",
         "pack_verify_inputs", "target_forward", "hf_model", "hf_mask_and_cache", "verify",
         "commit", "host_sync")
INSIDE_TARGET = ("hf_model", "hf_mask_and_cache")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.round_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="runs/smollm2/dspark/step_latest")
    parser.add_argument("--prompts-file", default="runs/smollm2/prompts/eval_code.jsonl")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scheduler", default="fixed", choices=("fixed", "confidence"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ops import smollm2
    from dspark_ops.prompts import chat_prompt, stop_token_ids
    from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
    from dspark_ops.hf import HFTarget
    from dspark_ops.models import DSparkDraft

    torch.set_num_threads(args.threads)
    path = smollm2.ensure_hf_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not os.path.isdir(args.draft):
        raise SystemExit(f"--draft {args.draft}: no such directory (python -m "
                         "bench.smollm2_train trains one)")
    draft = DSparkDraft.from_pretrained(args.draft, dtype=torch.float32).eval()
    calib = None
    calib_file = os.path.join(args.draft, "calibration.json")
    if args.scheduler == "confidence" and os.path.isfile(calib_file):
        with open(calib_file) as f:
            calib = torch.tensor(json.load(f)["calib_temperature"], dtype=torch.float32)
    stop = stop_token_ids(model, tokenizer)
    target = HFTarget(model, draft.config.target_layer_ids)
    decoder = SpeculativeDecoder(target, draft, scheduler=args.scheduler, eos_token_id=stop,
                                 calib_temperature=calib)
    with open(args.prompts_file) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()][:args.prompts]
    prompts = [chat_prompt(tokenizer, t) for t in texts]

    with torch.no_grad():
        decoder.generate([prompts[0][:16]], 8)  # first-call costs out
        rounds, tokens, plain_seconds, plain_tokens = [], 0, 0.0, 0
        unprofiled = []
        for prompt in prompts:  # without the profiler: the true round times
            out = decoder.generate([prompt], args.max_new_tokens)
            unprofiled += [r.draft_seconds + r.verify_seconds for r in out.rounds]
            started = time.perf_counter()
            plain = generate_target_only(target, [prompt], args.max_new_tokens,
                                         eos_token_id=stop)[0]
            plain_seconds += time.perf_counter() - started
            plain_tokens += len(plain)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as trace:
            for prompt in prompts:
                out = decoder.generate([prompt], args.max_new_tokens)
                rounds += out.rounds
                tokens += len(out.tokens[0])
    target.close()

    totals = {part: 0.0 for part in PARTS}
    for event in trace.key_averages():
        if event.key.startswith("dspark_ops."):
            name = event.key[len("dspark_ops."):]
            if name in totals:
                totals[name] += event.cpu_time_total / 1e3  # ms
    n = len(rounds)
    per_round = {part: ms / n for part, ms in totals.items()}
    round_ms = sum(v for k, v in per_round.items() if k not in INSIDE_TARGET)
    tau = sum(a + 1 for r in rounds for a in r.accepted) / max(n, 1)
    plain_ms = plain_seconds * 1e3 / max(plain_tokens, 1)
    true_round_ms = 1e3 * sum(unprofiled) / max(len(unprofiled), 1)
    result = {"draft": os.path.realpath(args.draft), "scheduler": args.scheduler,
              "threads": args.threads, "rounds": n, "tokens": tokens, "tau": tau,
              "ms_per_round_profiled": round_ms, "ms_per_round_unprofiled": true_round_ms,
              "plain_ms_per_token": plain_ms, "parts_ms_per_round": per_round}
    print(f"{n} rounds, tau {tau:.2f}; a round: {true_round_ms:.1f} ms without the profiler "
          f"({round_ms:.1f} ms with it); plain decoding {plain_ms:.1f} ms per token; "
          f"break-even tau {true_round_ms / plain_ms:.2f}")
    print(f"{'part':26s} {'ms/round':>9s} {'share':>7s}")
    for part in PARTS:
        indent = "  " if part in INSIDE_TARGET else ""
        print(f"{indent + part:26s} {per_round[part]:9.2f} {per_round[part] / round_ms:7.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
