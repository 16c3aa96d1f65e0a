"""Benchmark of dspark_loss (docs/semantics.md §3.7): forward + backward time and peak memory
against the eager formula and a chunked eager loss.

Rows (CPU: ``N = 2048, V = 49152, d = 576, r = 64`` float32, SmolLM2's vocabulary and width;
GPU: ``N = 3584, V = 151936, d = 2560, r = 256`` bfloat16, DeepSpec's Qwen3-4B shape):

* ``dspark``  — the three-term loss (Markov head, target, confidence head), LM head frozen;
* ``dspark cap30`` — the same with Gemma4's logit soft cap (``logit_softcap=30``), beside the
                 uncapped row: what the cap costs (a tanh per element and pass, and the Markov
                 bias in its own chunk of scratch);
* ``dflash``  — cross-entropy only (no Markov head, no target).

Every row times one forward + backward of the same inputs with:

* ``ours``     — ``dspark_ops.dspark_loss`` (default chunking);
* ``ref``      — ``dspark_ops.reference.dspark_loss``, the eager formula (what DeepSpec's loss
                 computes), holding several ``[N, V]`` tensors;
* ``chunked``  — the same eager formula a chunk of 512 rows at a time, each chunk's backward run
                 right away (the way Liger's fused linear cross-entropy bounds memory, in eager
                 PyTorch);
* ``liger``, ``cce`` — Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy,
                 ``dflash`` rows on CUDA, when importable (their absence is printed).

Extra columns: ``peak MB`` (the most memory the call held beyond its inputs: CPU from the
profiler's allocator events, CUDA from ``max_memory_allocated``), the same for ``ref`` and
``chunked``, and ``err`` (|loss - reference loss| / |reference loss|).

Run from the repository root: ``python bench/bench_loss.py [--quick] [--device D]`` (or
``python -m bench`` for every family).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import dspark_ops
from dspark_ops import reference
from bench.memory import peak_memory_bytes
from bench.common import log, report_once
from bench.report import Row, family_arg_parser, family_main, format_us
from bench.timing import Timing, measure

CPU_SHAPE = dict(rows=2048, vocab=49_152, width=576, rank=64)
CPU_QUICK_SHAPE = dict(rows=512, vocab=49_152, width=576, rank=64)
GPU_SHAPE = dict(rows=3584, vocab=151_936, width=2560, rank=256)
CHUNK = 512



SOFTCAP = 30.0  # Gemma4's final_logit_softcapping


def make_inputs(rows, vocab, width, rank, *, dtype, device, dflash=False, seed=0,
                logit_softcap=None):
    """Inputs shaped as a training step's: hidden states whose logits have a spread like a
    trained draft's, a target sharing most of the draft's direction, weights exp(-k/4) over
    blocks of 7 with a few padding rows; ``logit_softcap`` passed to every loss."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen) * (3 / width ** 0.5)
    args = {
        "hidden": hidden.to(dtype).to(device),
        "lm_head_weight": torch.randn(vocab, width, generator=gen).to(dtype).to(device),
        "labels": torch.randint(0, vocab, (rows,), generator=gen).to(device),
        "weights": (torch.exp(-(torch.arange(rows) % 7) / 4.0)
                    * (torch.rand(rows, generator=gen) > 0.1)).to(device),
    }
    if dflash:
        return dict(args, ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)
    target = 0.8 * hidden + torch.randn(rows, width, generator=gen) * (1.8 / width ** 0.5)
    args["target_hidden"] = target.to(dtype).to(device)
    latent = torch.randn(rows, rank, generator=gen) / rank ** 0.5
    args["markov_latent"] = latent.to(dtype).to(device)
    args["markov_w2"] = (torch.randn(vocab, rank, generator=gen) * 0.5).to(dtype).to(device)
    args["confidence_logits"] = torch.randn(rows, generator=gen).to(device)
    if logit_softcap is not None:
        args["logit_softcap"] = logit_softcap
    return args


TRAINABLE = ("hidden", "markov_latent", "markov_w2", "confidence_logits")


def _leaves(args):
    out = dict(args)
    for name in TRAINABLE:
        if name in out:
            out[name] = out[name].detach().requires_grad_(True)
    return out


def step_with(loss_fn: Callable, backward: bool = True) -> Callable[[dict], Callable]:
    """One forward + backward from fresh leaves (``backward=False``: loss_fn runs its own)."""
    def make(args):
        def step():
            a = _leaves(args)
            loss = loss_fn(a)
            if backward:
                loss.backward()
            return loss.detach()
        return step
    return make


POSITIONAL = ("hidden", "lm_head_weight", "labels", "weights")


def _call(fn, a):
    rest = {k: v for k, v in a.items() if k not in POSITIONAL}
    return fn(*(a[k] for k in POSITIONAL), **rest).loss


def ours_loss(a):
    return _call(dspark_ops.dspark_loss, a)


def ref_loss(a):
    return _call(reference.dspark_loss, a)


def chunked_loss(a):
    """The eager formula over chunks of rows with the global denominator, each chunk's backward
    run at once (the graph of one chunk alive at a time); returns the summed loss, detached."""
    rows = a["hidden"].shape[0]
    denominator = a["weights"].sum() + 1e-6
    total = torch.zeros((), device=a["hidden"].device)
    for start in range(0, rows, CHUNK):
        part = {k: (v[start:start + CHUNK] if isinstance(v, torch.Tensor) and k not in
                    ("lm_head_weight", "markov_w2") else v) for k, v in a.items()}
        loss = ref_loss({**part, "denominators": denominator})
        loss.backward()
        total += loss.detach()
    return total


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    return peak_memory_bytes(fn, device) / 1e6


def _anchor_factories(device: torch.device, use_anchors: bool) -> dict:
    """CE-only anchors: Liger's fused linear cross-entropy and Cut Cross-Entropy (CUDA)."""
    factories = {}
    if not use_anchors:
        report_once("loss-anchors", "anchors liger, cce: skipped (--no-anchors)")
        return factories
    if device.type != "cuda":
        report_once("loss-anchors", "anchors liger, cce: CUDA only, not measured on CPU")
        return factories
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        factories["liger"] = lambda a: liger(a["lm_head_weight"], a["hidden"], a["labels"])
    except ImportError:
        report_once("loss-liger", "anchor liger: liger_kernel not importable, not measured")
    try:
        from cut_cross_entropy import linear_cross_entropy

        factories["cce"] = lambda a: linear_cross_entropy(a["hidden"], a["lm_head_weight"],
                                                          a["labels"], reduction="sum")
    except ImportError:
        report_once("loss-cce", "anchor cce: cut_cross_entropy not importable, not measured")
    return factories


def bench_row(variant: str, shape: dict, dtype, device, timing: Timing, anchors: dict) -> Row:
    args = make_inputs(**shape, dtype=dtype, device=device, dflash=variant == "dflash",
                       logit_softcap=SOFTCAP if variant.endswith("cap30") else None)
    label = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    row = Row(op="dspark_loss", variant=f"{variant} {label} fwd+bwd",
              shape="N={rows} V={vocab} d={width}".format(**shape)
              + ("" if variant == "dflash" else " r={rank}".format(**shape)))
    steps = {"ours": step_with(ours_loss)(args), "ref": step_with(ref_loss)(args),
             "chunked": step_with(chunked_loss, backward=False)(args)}
    if variant == "dflash":
        for name, fn in anchors.items():
            steps[name] = step_with(fn)(args)
    ours_value, ref_value = steps["ours"](), steps["ref"]()
    row.extra["err"] = abs(ours_value - ref_value).item() / max(abs(ref_value).item(), 1e-30)
    for name, key in (("ours", "peak MB"), ("ref", "ref MB"), ("chunked", "chunked MB")):
        row.extra[key] = peak_memory_mb(steps[name], device)
    measure(row, steps, device, timing)
    return row


def run(device: torch.device, quick: bool = False, use_anchors: bool = True,
        checkpoint: Optional[Callable[[List[Row]], None]] = None) -> List[Row]:
    if device.type == "cuda":
        shape, dtype = GPU_SHAPE, torch.bfloat16
    else:
        shape, dtype = (CPU_QUICK_SHAPE if quick else CPU_SHAPE), torch.float32
    timing = Timing.for_device(device, quick, cpu_seconds=(2.0, 2.0), cpu_quick_seconds=(0.5, 0.5))
    anchors = _anchor_factories(device, use_anchors)
    rows: List[Row] = []
    for variant in ("dspark", "dspark cap30", "dflash"):
        started = time.perf_counter()
        row = bench_row(variant, shape, dtype, device, timing, anchors)
        rows.append(row)
        log(f"  {row.op} {row.shape} {row.variant}: ours {format_us(row.ours_us)} us "
            f"({row.extra['peak MB']:.0f} MB), ref {format_us(row.reference_us)} us "
            f"({row.extra['ref MB']:.0f} MB) [{time.perf_counter() - started:.1f} s]")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    return family_arg_parser(
        __doc__.split("\n")[0],
        quick_help="CPU: N = 512 rows instead of 2048; fewer repeats",
        anchors_help="skip Liger-Kernel and Cut Cross-Entropy",
    ).parse_args(argv)


def _print_memory(rows: List[Row], device: torch.device) -> None:
    for row in rows:
        ref, ours = row.extra.get("ref MB"), row.extra.get("peak MB")
        if ref and ours:
            print(f"{row.shape} {row.variant}: peak memory ref / ours = {ref / ours:.1f} x, "
                  f"time ref / ours = {row.speedup or float('nan'):.2f} x")


def main(argv=None, *, emit: bool = True) -> List[Row]:
    """Command-line entry point; returns the rows (``emit=False``: print nothing to stdout)."""
    return family_main(
        "loss", parse_args(argv),
        lambda device, args, checkpoint: run(device, quick=args.quick,
                                             use_anchors=not args.no_anchors,
                                             checkpoint=checkpoint),
        emit=emit, after_table=_print_memory)


if __name__ == "__main__":
    main()
