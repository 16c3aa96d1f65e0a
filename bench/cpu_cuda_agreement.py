"""CPU-vs-CUDA agreement of ``dspark_ops.verify`` on the same inputs and seeds (SPEC §2, §5).

Inputs are generated on the CPU, then the op runs on the CPU and on the GPU. Per request, the
emitted tokens, ``num_accepted`` and ``valid`` must all be equal; the only allowed differences
are float-rounding near-ties (an acceptance test or a race between candidates decided in the
last bit), which are vanishingly rare, so a config passes when at least ``--threshold`` (99.5 %)
of its requests agree. Exits 1 when any config (or the total) falls below it, 0 otherwise, and
0 with "skipped: no GPU" where there is no CUDA device.

Run from the repository root: ``python bench/cpu_cuda_agreement.py [--out summary.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import dspark_ops
from bench.bench_verify import make_verify_inputs
from bench.common import RESULTS_DIR, device_name, device_slug

V_LARGE, V_SMALL = 151936, 4096

# name, variant, vocab, target dtype, draft dtype, layout/temperature tweak
CONFIGS = [
    ("greedy bf16 V=151936", "greedy", V_LARGE, torch.bfloat16, None, None),
    ("greedy f32 V=4096", "greedy", V_SMALL, torch.float32, None, None),
    ("sampled bf16/f32 V=151936", "sampled", V_LARGE, torch.bfloat16, torch.float32, None),
    ("sampled f32/f32 V=4096", "sampled", V_SMALL, torch.float32, torch.float32, None),
    ("sampled bf16/bf16 V=4096", "sampled", V_SMALL, torch.bfloat16, torch.bfloat16, None),
    ("one-hot bf16 V=151936", "one-hot", V_LARGE, torch.bfloat16, None, None),
    ("one-hot f32 V=4096", "one-hot", V_SMALL, torch.float32, None, None),
    ("mixed T, draft T=1, f16/f32 V=4096", "sampled", V_SMALL, torch.float16, torch.float32,
     "mixed"),
    ("ragged, num_draft 0..G, bf16/f32 V=4096", "sampled", V_SMALL, torch.bfloat16,
     torch.float32, "ragged"),
]


def build_inputs(variant, vocab, target_dtype, draft_dtype, tweak, batch, block, seed) -> Dict:
    """CPU inputs of one config as keyword arguments of ``dspark_ops.verify``."""
    case = make_verify_inputs(batch, block, vocab, variant=variant, target_dtype=target_dtype,
                              draft_dtype=draft_dtype or torch.float32, device="cpu", seed=seed)
    kwargs = dict(target_logits=case.target_logits, draft_tokens=case.draft_tokens,
                  num_draft=case.num_draft, temperature=case.temperature, seed=case.seed,
                  position=case.position, draft_logits=case.draft_logits)
    generator = torch.Generator().manual_seed(seed + 1)
    if tweak == "mixed":
        # Greedy and sampled requests in one launch; drafts were sampled at T = 1.
        choices = torch.tensor([0.0, 0.6, 1.0, 1.4])
        kwargs["temperature"] = choices[torch.randint(0, 4, (batch,), generator=generator)]
        kwargs["draft_temperature"] = torch.ones(batch)
    elif tweak == "ragged":
        # Flattened [sum(n+1), V] target rows, as a target forward over a ragged batch gives.
        num_draft = torch.randint(0, block + 1, (batch,), generator=generator, dtype=torch.int32)
        rows = [case.target_logits[b, : int(n) + 1] for b, n in enumerate(num_draft)]
        starts = torch.cumsum(num_draft + 1, 0) - (num_draft + 1)
        kwargs.update(target_logits=torch.cat(rows), num_draft=num_draft,
                      target_start=starts.int())
    return kwargs


def run_on(device: torch.device, kwargs: Dict):
    moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    out = dspark_ops.verify(**moved)
    return [t.cpu() for t in out]


def compare_config(config, devices, batch: int, block: int, seed: int) -> Dict:
    """Runs one config on both devices; returns its agreement summary."""
    name, variant, vocab, target_dtype, draft_dtype, tweak = config
    kwargs = build_inputs(variant, vocab, target_dtype, draft_dtype, tweak, batch, block, seed)
    (tok_a, acc_a, val_a), (tok_b, acc_b, val_b) = (run_on(d, kwargs) for d in devices)
    agree = (tok_a == tok_b).all(1) & (acc_a == acc_b) & (val_a == val_b)
    mismatches = [
        dict(request=int(i), num_accepted=[int(acc_a[i]), int(acc_b[i])],
             valid=[bool(val_a[i]), bool(val_b[i])],
             tokens=[tok_a[i].tolist(), tok_b[i].tolist()])
        for i in torch.nonzero(~agree).flatten().tolist()
    ]
    return dict(name=name, requests=batch, agree=int(agree.sum()),
                rate=float(agree.float().mean()),
                tokens_agree=int((tok_a == tok_b).all(1).sum()),
                num_accepted_agree=int((acc_a == acc_b).sum()),
                valid_agree=int((val_a == val_b).sum()),
                mean_accepted=float(acc_a.float().mean()),
                invalid=int((~val_a).sum()), mismatches=mismatches[:10],
                mismatch_count=len(mismatches))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON summary path (default bench/results/"
                             "cpu_cuda_agreement_<gpu>.json)")
    parser.add_argument("--batch", type=int, default=256, help="requests per config")
    parser.add_argument("--block", type=int, default=8, help="draft tokens per request (G)")
    parser.add_argument("--threshold", type=float, default=0.995,
                        help="minimum fraction of agreeing requests, per config and in total")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("cpu_cuda_agreement: skipped: no GPU")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"skipped": "no GPU"}) + "\n")
        return 0
    cuda = torch.device("cuda", torch.cuda.current_device())
    devices = (torch.device("cpu"), cuda)

    started = time.perf_counter()
    results: List[Dict] = []
    for i, config in enumerate(CONFIGS):
        result = compare_config(config, devices, args.batch, args.block, args.seed + 1000 * i)
        results.append(result)
        print(f"{result['name']:<42} {result['agree']:>5}/{result['requests']:<5} agree "
              f"({100 * result['rate']:.2f} %), mismatches {result['mismatch_count']}, "
              f"mean accepted {result['mean_accepted']:.2f}", flush=True)

    total = sum(r["requests"] for r in results)
    agree = sum(r["agree"] for r in results)
    failing = [r["name"] for r in results if r["rate"] < args.threshold]
    passed = not failing and agree >= args.threshold * total
    summary = dict(
        gpu=device_name(cuda), cpu=device_name(devices[0]), torch=torch.__version__,
        threshold=args.threshold, batch=args.batch, block=args.block, seed=args.seed,
        requests=total, agree=agree, rate=agree / total, mismatch_count=total - agree,
        failing_configs=failing, passed=passed, elapsed_s=time.perf_counter() - started,
        configs=results,
    )
    out = args.out or RESULTS_DIR / f"cpu_cuda_agreement_{device_slug(cuda)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"total: {agree}/{total} agree ({100 * agree / total:.3f} %), "
          f"{total - agree} mismatches; {'PASS' if passed else 'FAIL'} "
          f"(threshold {100 * args.threshold:.1f} %); wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
