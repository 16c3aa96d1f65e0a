"""The goodput rule against every fixed block length, simulated on a measured cost table: seconds
where ``bench.oracle_sweep`` takes minutes, and no timing noise, so a change to the rule shows
its effect at once (the sweep on the real model then confirms it).

    python -m bench.goodput_sim [--cost-table TABLE.json] [--alphas 0 0.3 0.5 0.7 0.9]
        [--prompts 2] [--max-new-tokens 48] [--seeds 40] [--profile-skew 1.0] [--json OUT.json]

Each request is an oracle draft as ``bench.oracle_sweep``'s
(:class:`dspark_ops.proposers.OracleProposer`): continuation index ``i`` is drafted right with
probability ``alpha``, fixed per seed, so every method sees the same right and wrong indices.
A round of the goodput rule runs :class:`dspark_ops.goodput.GoodputPolicy` (before drafting:
``k``, or the plain step, or a probe) and :func:`dspark_ops.goodput.verify_lengths` on the
policy's estimates (after drafting), then costs ``draft(k) + target(1, verified + 1)`` seconds
from the table and emits the accepted drafts and one more token; a fixed ``k`` verifies every
drafted slot. One policy per ``alpha`` and seed is kept across the ``--prompts`` requests, as
the sweep keeps one decoder. The table's timings are the truth here. With ``--profile-skew F``
the rule prices rounds with the table times ``F`` (a table profiled in a spell ``F`` times
slower) and corrects its copy online from the true timings, as the decoder does; the fixed
``k`` are timed by the truth either way.

``--cost-table`` is a table ``python -m dspark_ops.profile`` wrote (batch 1 is read); without it,
the table committed with the oracle sweep (``bench/results/oracle_sweep_smollm2.json``). Prints
per ``alpha``: tokens/s of plain, the best fixed ``k`` and goodput, and goodput's ratios to both
(means over ``--seeds``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import Dict, List, Optional, Sequence

import torch

from dspark_ops.costs import CostTable
from dspark_ops.goodput import GoodputPolicy, verify_lengths

SWEEP = os.path.join(os.path.dirname(__file__), "results", "oracle_sweep_smollm2.json")


def sweep_table(path: str = SWEEP) -> CostTable:
    """The batch-1 cost table the oracle sweep measured (its JSON's ``cost_table_ms``)."""
    with open(path) as f:
        ms = json.load(f)["cost_table_ms"]
    return CostTable({"source": path}, {1: [t / 1e3 for t in ms["target_by_width"]]},
                     [t / 1e3 for t in ms["draft_by_slots"]])


def decode_seconds(costs: CostTable, right: Sequence[bool], tokens: int,
                   policy: Optional[GoodputPolicy] = None, fixed_k: Optional[int] = None) -> float:
    """Seconds to emit ``tokens`` tokens (the prefill's first included) of one request whose
    continuation index ``i`` drafts right where ``right[i]``: with ``policy`` (the goodput rule)
    or every round drafting and verifying ``fixed_k`` slots. The policy prices rounds with its
    own table (``policy.costs``); where that is not ``costs``, it is corrected online from the
    true timings."""
    if (policy is None) == (fixed_k is None):
        raise ValueError("decode_seconds: give exactly one of 'policy' and 'fixed_k'")
    if policy is not None:
        policy.begin(1)
    done, seconds = 1, costs.target(1, 1)
    believed = policy.costs if policy is not None else costs
    learn = believed is not costs
    active = torch.tensor([True])
    while done < tokens:
        limit = tokens - done - 1  # drafting past the last needed token cannot pay
        k = min(fixed_k, limit) if fixed_k is not None else policy.drafts_to_propose(1, [0], limit)
        if k == 0:
            seconds += costs.target(1, 1)
            if learn:
                believed.observe_target(1, 1, costs._row(1)[0])
            done += 1
            continue
        if fixed_k is not None:
            verified = k
        else:
            confidence = policy.estimated_confidence(1, k, "cpu")
            verified = int(verify_lengths(confidence, active, believed)[0])
        accepted = 0
        while accepted < verified and right[done + accepted]:
            accepted += 1
        # the decoder pads to the width its table prices cheapest, and pays that width's time
        width = believed.cheapest_width(1, verified + 1)
        step = costs._row(1)[width - 1]
        seconds += costs.draft(k) + step
        if learn:
            believed.observe_draft(k, costs.draft(k))
            believed.observe_target(1, width, step)
        if policy is not None and verified:
            policy.observe(0, verified, accepted)
        done += accepted + 1
    return seconds


def simulate(costs: CostTable, alphas: Sequence[float], prompts: int, tokens: int, seeds: int,
             max_drafts: int = 7, profile_skew: float = 1.0) -> List[Dict[str, float]]:
    """Per ``alpha``: mean tokens/s of plain, each fixed ``k``, and goodput, over ``seeds``;
    with ``profile_skew`` != 1 the rule starts from the table times that (module doc)."""
    if max_drafts > costs.max_drafts:
        raise ValueError(f"the cost table prices at most {costs.max_drafts} drafts")
    plain = 1.0 / costs.target(1, 1)
    rows = []
    for alpha in alphas:
        fixed = {k: [] for k in range(1, max_drafts + 1)}
        goodput = []
        for seed in range(seeds):
            believed = costs if profile_skew == 1.0 else CostTable(  # a copy, priced F times
                costs.key, costs.target_seconds, costs.draft_seconds, speed=profile_skew)
            policy = GoodputPolicy(believed, max_drafts)
            spent = {k: 0.0 for k in fixed}
            spent_goodput = 0.0
            for prompt in range(prompts):
                rng = random.Random(1000 * seed + prompt)
                right = [rng.random() < alpha for _ in range(tokens + max_drafts)]
                spent_goodput += decode_seconds(costs, right, tokens, policy=policy)
                for k in fixed:
                    spent[k] += decode_seconds(costs, right, tokens, fixed_k=k)
            goodput.append(prompts * tokens / spent_goodput)
            for k in fixed:
                fixed[k].append(prompts * tokens / spent[k])
        means = {k: statistics.mean(v) for k, v in fixed.items()}
        best = max(means, key=means.get)
        rate = statistics.mean(goodput)
        rows.append({"alpha": alpha, "plain_tokens_per_s": plain,
                     "fixed_tokens_per_s": means, "best_fixed_k": best,
                     "goodput_tokens_per_s": rate, "goodput_vs_best_fixed": rate / means[best],
                     "goodput_vs_plain": rate / plain})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput_sim",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-table", help="a cost table JSON (default: the oracle sweep's)")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--prompts", type=int, default=2, help="requests per policy")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--profile-skew", type=float, default=1.0,
                        help="the rule starts from the table times this, corrected online")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if any(not 0 <= a <= 1 for a in args.alphas):
        parser.error(f"'--alphas' must be in [0, 1], got {args.alphas}")
    if args.prompts < 1 or args.max_new_tokens < 2 or args.seeds < 1:
        parser.error("'--prompts' and '--seeds' must be >= 1, '--max-new-tokens' >= 2")
    if not args.profile_skew > 0:
        parser.error(f"'--profile-skew' must be > 0, got {args.profile_skew}")
    costs = CostTable.load(args.cost_table) if args.cost_table else sweep_table()
    rows = simulate(costs, args.alphas, args.prompts, args.max_new_tokens, args.seeds,
                    min(7, costs.max_drafts), args.profile_skew)
    print(f"{'alpha':>5} {'plain':>7} {'best fixed':>12} {'goodput':>8} {'/best':>6} {'/plain':>7}")
    for r in rows:
        print(f"{r['alpha']:>5.2f} {r['plain_tokens_per_s']:>7.1f} "
              f"{r['fixed_tokens_per_s'][r['best_fixed_k']]:>7.1f} (k={r['best_fixed_k']}) "
              f"{r['goodput_tokens_per_s']:>8.1f} {r['goodput_vs_best_fixed']:>6.3f} "
              f"{r['goodput_vs_plain']:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            words = sys.argv[1:] if argv is None else list(argv)
            json.dump({"command": " ".join(["python -m bench.goodput_sim", *words]),
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
