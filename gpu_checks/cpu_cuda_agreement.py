"""CPU-vs-CUDA agreement of ``dspark_ops.verify`` on the same inputs and seeds (docs/semantics.md
§2, §5).

Inputs are generated on the CPU, then the op runs on the CPU and on the GPU. Per request, the
emitted tokens, ``num_accepted`` and ``valid`` must all be equal; the only allowed differences
are float-rounding near-ties (an acceptance test or a race between candidates decided in the
last bit), which are vanishingly rare, so a config passes when at least ``--threshold`` (99.5 %)
of its requests agree. Exits 1 when any config (or the total) falls below it, 0 otherwise, and
0 with "skipped: no GPU" where there is no CUDA device.

Drafting (docs/semantics.md §3.2-3.3): ``markov_draft`` and ``rnn_draft`` on the same inputs and
seeds. The CUDA head accumulates in float32 (tensor cores for 16-bit weights); the CPU's tokens
are those of a float64 head (float32 with a proven error bound, float64 where that cannot decide),
so tokens agree except at near-ties, and a request's later slots diverge after a differing
token. Per slot the section reports the fraction of identical tokens and the largest
``|draft_logits difference|`` over the requests whose drafted prefix (``x_0..x_j``) is
identical, relative to the largest ``|draft_logit|`` of the slot; ``draft_confidence``: the
largest difference of the confidences. A drafting config fails when slot 0's tokens agree on
less than ``--draft-threshold`` (95 %) of the requests or slot 0's relative logit error exceeds
``--draft-rtol`` (1e-3).

``--cpu-only`` (a dry run where there is no GPU) compares the CPU with itself, at small batches
unless given, to exercise the script.

Run from the repository root: ``python -m gpu_checks.cpu_cuda_agreement [--out summary.json]``.
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
from bench.bench_draft import (
    make_confidence_inputs, make_draft_inputs, markov_weights, max_logit_difference, same_prefix,
)
from bench.bench_verify import make_verify_inputs
from bench.common import device_name, device_slug
from bench.report import RESULTS_DIR

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
    ("top-k 50 top-p 0.9 + logprobs, bf16/f32 V=151936", "sampled", V_LARGE, torch.bfloat16,
     torch.float32, "filters"),
]

# Drafting: name, op, variant, vocab, rank, weight dtype, hidden size (rnn_draft).
DRAFT_CONFIGS = [
    ("markov sampled bf16 V=151936 r=256", "markov", "sampled", V_LARGE, 256, torch.bfloat16,
     None),
    ("markov greedy bf16 V=151936 r=256", "markov", "greedy", V_LARGE, 256, torch.bfloat16, None),
    ("markov mixed f32 V=4096 r=8", "markov", "mixed", V_SMALL, 8, torch.float32, None),
    ("markov sampled f16 V=4096 r=1024", "markov", "sampled", V_SMALL, 1024, torch.float16, None),
    ("rnn sampled bf16 V=4096 r=64 d=512", "rnn", "sampled", V_SMALL, 64, torch.bfloat16, 512),
    ("rnn mixed f32 V=4096 r=256 d=256", "rnn", "mixed", V_SMALL, 256, torch.float32, 256),
]
# draft_confidence: name, hidden size, rank, dtype.
CONFIDENCE_CONFIGS = [
    ("confidence bf16 d=2560 r=256", 2560, 256, torch.bfloat16),
    ("confidence f32 d=512 r=8", 512, 8, torch.float32),
]


def build_inputs(variant, vocab, target_dtype, draft_dtype, tweak, batch, block, seed) -> Dict:
    """CPU inputs of one config as keyword arguments of ``dspark_ops.verify``."""
    case = make_verify_inputs(batch, block, vocab, variant=variant, target_dtype=target_dtype,
                              draft_dtype=draft_dtype or torch.float32, device="cpu", seed=seed,
                              filters=tweak == "filters")
    kwargs = dict(target_logits=case.target_logits, draft_tokens=case.draft_tokens,
                  num_draft=case.num_draft, temperature=case.temperature, seed=case.seed,
                  position=case.position, draft_logits=case.draft_logits,
                  **(case.filters or {}))
    if tweak == "filters":
        kwargs["return_logprobs"] = True
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
    return [t.cpu() for t in out[:3]]  # tokens, num_accepted, valid


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


def _to(device, values):
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def compare_draft_config(config, devices, batch: int, block: int, seed: int, threshold: float,
                         rtol: float) -> Dict:
    """Runs one drafting config on both devices; returns its agreement summary."""
    name, op, variant, vocab, rank, dtype, hidden = config
    case = make_draft_inputs(batch, block, vocab, rank, variant=variant, dtype=dtype,
                             hidden=hidden, device="cpu", seed=seed)
    fn = dspark_ops.markov_draft if op == "markov" else dspark_ops.rnn_draft
    args = case.markov_args() if op == "markov" else case.rnn_args()
    (tok_a, z_a), (tok_b, z_b) = ([t.cpu() for t in fn(*_to(d, args))] for d in devices)
    same = tok_a == tok_b
    prefix = same_prefix(tok_a, tok_b)  # slot j's logits depend on x_j: compare where it agrees
    slot_agree, slot_rel = [], []
    for j in range(block):
        za, zb = z_a[:, j][prefix[:, j]], z_b[:, j][prefix[:, j]]
        finite = za[torch.isfinite(za)]
        scale_j = finite.abs().max().item() if finite.numel() else 1.0
        slot_agree.append(float(same[:, j].float().mean()))
        slot_rel.append(max_logit_difference(za, zb) / max(scale_j, 1e-30))
    passed = not slot_agree or (slot_agree[0] >= threshold and slot_rel[0] <= rtol)
    return dict(name=name, requests=batch, block=block, slot_token_agreement=slot_agree,
                slot_logit_rel_error=slot_rel,
                requests_identical=int(same.all(1).sum()), passed=passed)


def compare_confidence_config(config, devices, batch: int, block: int, seed: int) -> Dict:
    name, hidden, rank, dtype = config
    case = make_confidence_inputs(batch, block, hidden, V_LARGE, rank, dtype=dtype, device="cpu",
                                  seed=seed)
    a, b = (dspark_ops.draft_confidence(*_to(d, case.args())).cpu() for d in devices)
    return dict(name=name, requests=batch, block=block,
                max_abs_difference=(a - b).abs().max().item())


def run_draft_section(devices, args) -> Dict:
    """Every drafting config; prints one line per config and returns the section's summary."""
    results, confidence = [], []
    for i, config in enumerate(DRAFT_CONFIGS):
        result = compare_draft_config(config, devices, args.draft_batch, args.draft_block,
                                      args.seed + 5000 + 1000 * i, args.draft_threshold,
                                      args.draft_rtol)
        results.append(result)
        agree = " ".join(f"{100 * a:.1f}" for a in result["slot_token_agreement"])
        rel0 = result["slot_logit_rel_error"][0] if result["slot_logit_rel_error"] else 0.0
        print(f"{result['name']:<42} B={result['requests']:<4} slot tokens agree % [{agree}], "
              f"slot-0 rel err {rel0:.1e} (max over slots "
              f"{max(result['slot_logit_rel_error'], default=0.0):.1e}); "
              f"{'ok' if result['passed'] else 'FAIL'}", flush=True)
    for i, config in enumerate(CONFIDENCE_CONFIGS):
        result = compare_confidence_config(config, devices, args.draft_batch, args.draft_block,
                                           args.seed + 9000 + 1000 * i)
        confidence.append(result)
        print(f"{result['name']:<42} B={result['requests']:<4} max |difference| "
              f"{result['max_abs_difference']:.1e}", flush=True)
    markov_weights.cache_clear()
    failing = [r["name"] for r in results if not r["passed"]]
    return dict(threshold=args.draft_threshold, rtol=args.draft_rtol, configs=results,
                confidence=confidence, failing_configs=failing, passed=not failing)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON summary path (default build/bench-results/"
                             "cpu_cuda_agreement_<gpu>.json)")
    parser.add_argument("--batch", type=int, default=None,
                        help="requests per config (default 256; 16 with --cpu-only)")
    parser.add_argument("--block", type=int, default=8, help="draft tokens per request (G)")
    parser.add_argument("--threshold", type=float, default=0.995,
                        help="minimum fraction of agreeing requests, per config and in total")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-batch", type=int, default=None,
                        help="requests per drafting config (default 64; 8 with --cpu-only)")
    parser.add_argument("--draft-block", type=int, default=7, help="drafting block size (G)")
    parser.add_argument("--draft-threshold", type=float, default=0.95,
                        help="minimum fraction of identical slot-0 draft tokens, per config")
    parser.add_argument("--draft-rtol", type=float, default=1e-3,
                        help="largest slot-0 draft-logit difference relative to the logits' scale")
    parser.add_argument("--cpu-only", action="store_true",
                        help="dry run: compare the CPU with itself (default batches 16 and 8)")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = 16 if args.cpu_only else 256
    if args.draft_batch is None:
        args.draft_batch = 8 if args.cpu_only else 64

    if args.cpu_only:
        devices = (torch.device("cpu"), torch.device("cpu"))
    elif not torch.cuda.is_available():
        print("cpu_cuda_agreement: skipped: no GPU")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"skipped": "no GPU"}) + "\n")
        return 0
    else:
        devices = (torch.device("cpu"), torch.device("cuda", torch.cuda.current_device()))
    cuda = devices[1]

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
    verify_passed = not failing and agree >= args.threshold * total
    print(f"verify total: {agree}/{total} agree ({100 * agree / total:.3f} %), "
          f"{total - agree} mismatches; {'PASS' if verify_passed else 'FAIL'} "
          f"(threshold {100 * args.threshold:.1f} %)", flush=True)

    draft = run_draft_section(devices, args)
    passed = verify_passed and draft["passed"]
    summary = dict(
        gpu=device_name(cuda) if cuda.type == "cuda" else "none (--cpu-only)",
        cpu=device_name(devices[0]), torch=torch.__version__,
        threshold=args.threshold, batch=args.batch, block=args.block, seed=args.seed,
        requests=total, agree=agree, rate=agree / total, mismatch_count=total - agree,
        failing_configs=failing + draft["failing_configs"], passed=passed,
        verify_passed=verify_passed, elapsed_s=time.perf_counter() - started,
        configs=results, draft=draft,
    )
    out = args.out or RESULTS_DIR / f"cpu_cuda_agreement_{device_slug(cuda)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"verify {agree}/{total} requests agree ({100 * agree / total:.3f} %); drafting "
          f"{len(draft['configs']) - len(draft['failing_configs'])}/{len(draft['configs'])} "
          f"configs pass (slot-0 tokens >= {100 * args.draft_threshold:.0f} %, slot-0 rel err "
          f"<= {args.draft_rtol:g}); {'PASS' if passed else 'FAIL'} in "
          f"{summary['elapsed_s']:.1f} s; wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
