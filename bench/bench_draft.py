"""Benchmark of the drafting ops (docs/semantics.md §3.2-3.3) against the reference and eager
PyTorch.

Rows:

* ``markov_draft``     — the Markov head's sequential walk over the ``G`` block slots, with
                         temperature 1 (``sampled``), temperature 0 (``greedy``) and half of
                         the requests greedy (``mixed``);
* ``rnn_draft``        — the RNN head at the same shape with ``d = 2560`` (Qwen3-4B's hidden
                         size);
* ``draft_confidence`` — the confidence head at ``B = 64, G = 7, d = 2560, r = 256``.

Every row times the same inputs with:

* ``ours``          — the ``dspark_ops`` op;
* ``ref``           — ``dspark_ops.reference``, the semantics of record (float64 head, Philox
                      draws; on GPU it runs on the device too); ``match`` counts the draft
                      tokens that equal its tokens;
* ``eager-torch``   — the loop an engine writes around its draft head, with torch's own RNG
                      (:func:`eager_markov_step`): per slot ``W1[prev]``, ``W1[prev] @ W2.T`` in
                      the weight dtype, the base logits added into the float32 ``draft_logits``
                      row, ``softmax(z / T)``, the exponential race ``argmax(p / E)`` (vLLM's
                      sampler; ``argmax z`` for greedy, both and ``torch.where`` for mixed) and
                      the token stored: about ten launches per slot. Whether the batch is all
                      greedy, all sampled or mixed is host knowledge (as vLLM's sampling
                      metadata), so no host synchronisation. ``draft_confidence``: ``cat``,
                      matmul, bias, temperature and sigmoid;
* ``torch.compile`` — the same per-slot step under ``torch.compile`` (one compiled graph called
                      ``G`` times); only for the ``sampled`` default row (each variant compiles
                      a graph of its own), not with ``--quick`` or ``--no-anchors``. Compile
                      failures are printed.

Inputs: base logits ``2 * N(0, 1)``; ``W1``, ``W2`` entries ``N(0, 1) / r^(1/4)`` (so the bias
``W2 . W1[x]`` has unit variance); random anchors, seeds and positions.

Columns besides the times: ``dtypes`` (base logits / weights), ``match`` (draft tokens equal to
the reference's, of ``B * G``), ``dz`` (largest ``|draft_logits - reference|`` over the slots
whose drafted prefix equals the reference's; on CUDA the head accumulates in float32, so a few
ulps are expected; ``draft_confidence``: of the confidences, and ``eager dz`` eager-torch's, which
computes in the weight dtype); on GPU ``launches`` (device kernels and copies of one call,
ours/eager-torch, default row only), ``MB`` (bytes the op must move: ``W2`` once per slot,
``G * V * r`` elements, plus the base logits read, the float32 draft logits written and the
embedded ``W1`` rows; ``rnn_draft`` adds the joint weight once per slot and the hidden states),
GB/s, ``% copy`` (of the measured copy bandwidth, the roofline of docs/semantics.md §4) and
``floor us`` (those bytes at the copy bandwidth).

Run from the repository root: ``python bench/bench_draft.py [--quick] [--device D]
[--json-only]`` (or ``python -m bench`` for every family).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

if __package__ in (None, ""):
    # Run as a script: make `bench` and `dspark_ops` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import dspark_ops
from dspark_ops import reference
from bench.common import has_kernel, log, report_once, synchronize
from bench.report import Row, family_arg_parser, family_main, finish_row, format_us
from bench.timing import Timing, count_launches, measure, measure_copy_bandwidth

GREEDY_TEMPERATURE = reference.GREEDY_TEMPERATURE
VARIANTS = ("sampled", "greedy", "mixed")
HIDDEN = 2560  # Qwen3-4B

# Default shape: B=64, G=7, V=151936, r=256, bf16 (docs/semantics.md §4 at G=7). CPU keeps the
# vocabulary, which sets the cost (W2 is read once per slot), at a small batch.
# bf16_logits: one more sampled markov_draft row at the default batch with
# draft_logits_dtype=torch.bfloat16 (half the draft_logits write).
GPU_PLAN = dict(batch=64, block=7, vocab=151936, rank=256, batches=(1, 256), rnn_batch=64,
                confidence_batch=64, compile=True, bf16_logits=True)
GPU_QUICK = dict(GPU_PLAN, batches=(), compile=False)
CPU_PLAN = dict(batch=4, block=7, vocab=151936, rank=256, batches=(), rnn_batch=4,
                confidence_batch=64, compile=True, bf16_logits=True)
CPU_QUICK = dict(CPU_PLAN, batch=2, variants=("sampled", "greedy"), rnn_batch=None,
                 compile=False, bf16_logits=False)

_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


# --------------------------------------------------------------------------------------------
# Inputs


@functools.lru_cache(maxsize=4)
def markov_weights(vocab: int, rank: int, dtype: torch.dtype, device: torch.device):
    """``(W1, W2)`` ``[V, r]`` with ``N(0, 1) / r^(1/4)`` entries; cached, since making two
    151936 x 256 matrices takes about a second on a CPU and every row uses the same ones."""
    generator = torch.Generator(device=device).manual_seed(4321)
    scale = rank ** -0.25
    return tuple((torch.randn(vocab, rank, generator=generator, device=device) * scale).to(dtype)
                 for _ in range(2))


@dataclasses.dataclass
class DraftCase:
    """One set of ``markov_draft`` / ``rnn_draft`` inputs and how it was made."""

    base_logits: torch.Tensor  # [B, G, V]
    anchor: torch.Tensor  # int64 [B]
    w1: torch.Tensor  # [V, r]
    w2: torch.Tensor  # [V, r]
    temperature: torch.Tensor  # float32 [B]
    seed: torch.Tensor  # int64 [B]
    position: torch.Tensor  # int64 [B]
    variant: str
    hidden: Optional[torch.Tensor] = None  # [B, G, d] (rnn_draft)
    joint_weight: Optional[torch.Tensor] = None  # [3r, 2r + d]
    joint_bias: Optional[torch.Tensor] = None  # [3r]
    logits_dtype: torch.dtype = torch.float32  # draft_logits_dtype of ours and the reference

    @property
    def batch(self) -> int:
        return self.base_logits.shape[0]

    @property
    def block(self) -> int:
        return self.base_logits.shape[1]

    @property
    def vocab(self) -> int:
        return self.base_logits.shape[2]

    @property
    def rank(self) -> int:
        return self.w1.shape[1]

    @property
    def shape(self) -> str:
        text = f"B={self.batch} G={self.block} V={self.vocab} r={self.rank}"
        return text + (f" d={self.hidden.shape[-1]}" if self.hidden is not None else "")

    @property
    def dtypes(self) -> str:
        return f"{_SHORT[self.base_logits.dtype]}/{_SHORT[self.w1.dtype]}"

    def markov_args(self):
        return (self.base_logits, self.anchor, self.w1, self.w2, self.temperature, self.seed,
                self.position)

    def rnn_args(self):
        return (self.base_logits, self.anchor, self.hidden, self.w1, self.w2, self.joint_weight,
                self.joint_bias, self.temperature, self.seed, self.position)


def make_draft_inputs(batch: int, block: int, vocab: int, rank: int, *,
                      variant: str = "sampled", temperature: float = 1.0,
                      dtype: torch.dtype = torch.bfloat16,
                      base_dtype: Optional[torch.dtype] = None, hidden: Optional[int] = None,
                      device="cpu", seed: int = 0) -> DraftCase:
    """Inputs for ``dspark_ops.markov_draft`` (and ``rnn_draft`` when ``hidden`` is given).

    Parameters
    ----------
    batch, block, vocab, rank : int
        ``B``, ``G``, ``V`` and ``r``.
    variant : {"sampled", "greedy", "mixed"}
        Every request at ``temperature``, every request greedy (``T = 0``), or the even
        requests greedy and the odd ones at ``temperature``.
    dtype : torch.dtype
        Weights (``W1``, ``W2``, the joint weight and bias, the hidden states).
    base_dtype : torch.dtype, optional
        Base logits; default ``dtype``.
    hidden : int, optional
        ``d``: also make the RNN head's hidden states and joint weight.
    device : str or torch.device
        Where the tensors are made (with a seeded generator).
    seed : int
        Seeds the generator; the per-request ``seed`` tensor is drawn from it too.

    Returns
    -------
    DraftCase
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    w1, w2 = markov_weights(vocab, rank, dtype, device)
    base = torch.randn(batch, block, vocab, generator=generator, device=device).mul_(2.0)
    t = torch.full((batch,), temperature, dtype=torch.float32, device=device)
    if variant == "greedy":
        t.zero_()
    elif variant == "mixed":
        t[::2] = 0.0
    case = DraftCase(
        base_logits=base.to(base_dtype or dtype),
        anchor=torch.randint(0, vocab, (batch,), generator=generator, device=device),
        w1=w1, w2=w2, temperature=t,
        seed=torch.randint(0, 2**62, (batch,), generator=generator, device=device),
        position=torch.randint(0, 8192, (batch,), generator=generator, device=device),
        variant=variant,
    )
    if hidden is not None:
        def randn(*shape, scale=1.0):
            x = torch.randn(*shape, generator=generator, device=device)
            return (x * scale).to(dtype)

        case.hidden = randn(batch, block, hidden)
        case.joint_weight = randn(3 * rank, 2 * rank + hidden, scale=(2 * rank + hidden) ** -0.5)
        case.joint_bias = randn(3 * rank, scale=0.1)
    return case


@dataclasses.dataclass
class ConfidenceCase:
    """One set of ``draft_confidence`` inputs."""

    hidden: torch.Tensor  # [B, G, d]
    prev_tokens: torch.Tensor  # int64 [B, G]
    w1: torch.Tensor  # [V, r]
    weight: torch.Tensor  # [d + r]
    bias: torch.Tensor  # [1]
    calib_temperature: torch.Tensor  # float32 [G]

    @property
    def shape(self) -> str:
        batch, block, hidden = self.hidden.shape
        return f"B={batch} G={block} d={hidden} r={self.w1.shape[1]}"

    def args(self):
        return (self.hidden, self.prev_tokens, self.w1, self.weight, self.bias,
                self.calib_temperature)


def make_confidence_inputs(batch: int, block: int, hidden: int, vocab: int, rank: int, *,
                           dtype: torch.dtype = torch.bfloat16, device="cpu",
                           seed: int = 0) -> ConfidenceCase:
    """Inputs for ``dspark_ops.draft_confidence`` (``W1`` shared with the Markov rows)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    w1, _ = markov_weights(vocab, rank, dtype, device)
    return ConfidenceCase(
        hidden=torch.randn(batch, block, hidden, generator=generator, device=device).to(dtype),
        prev_tokens=torch.randint(0, vocab, (batch, block), generator=generator, device=device),
        w1=w1,
        weight=(torch.randn(hidden + rank, generator=generator, device=device)
                * (hidden + rank) ** -0.5).to(dtype),
        bias=torch.full((1,), 0.5, device=device).to(dtype),
        calib_temperature=torch.linspace(1.0, 1.6, block, device=device),
    )


# --------------------------------------------------------------------------------------------
# Eager PyTorch


def _eager_sample(z, inv_t, greedy, mode: str):
    """The token of each row of float32 ``z [B, V]``: argmax (``mode="greedy"``), the
    exponential race ``argmax softmax(z / T) / E`` (``"sampled"``), or both and ``torch.where``
    (``"mixed"``)."""
    if mode == "greedy":
        return z.argmax(-1)
    probs = torch.softmax(z * inv_t, -1)
    token = probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)
    if mode == "mixed":
        token = torch.where(greedy, z.argmax(-1), token)
    return token


def eager_markov_step(base_j, prev, w1, w2, inv_t, greedy, out_j, mode: str):
    """One slot of the Markov walk as an engine writes it; ``z`` goes to ``out_j`` (float32).

    ``inv_t`` is ``[B, 1]`` (1 where greedy), ``greedy`` bool ``[B]``; ``mode`` is the case's
    variant, which the engine knows on the host (as vLLM's sampling metadata does).
    """
    bias = w1[prev] @ w2.T  # embedding + GEMM, in the weight dtype
    out_j.copy_(base_j)
    out_j.add_(bias)
    return _eager_sample(out_j, inv_t, greedy, mode)


def eager_rnn_step(base_j, prev, hidden_j, state, w1, w2, joint_weight, joint_bias, inv_t,
                   greedy, out_j, mode: str):
    """One slot of the RNN walk in the weight dtype; returns ``(token, new state)``."""
    rank = w1.shape[1]
    u = torch.cat([state, w1[prev], hidden_j], -1)
    gate, candidate, output = torch.addmm(joint_bias, u, joint_weight.T).split(rank, -1)
    gate = torch.sigmoid(gate)
    new_state = gate * state + (1 - gate) * torch.tanh(candidate)
    out_j.copy_(base_j)
    out_j.add_(torch.tanh(output) @ w2.T)
    return _eager_sample(out_j, inv_t, greedy, mode), new_state


def _eager_walk(case: DraftCase, step: Callable):
    """``step(j, prev, inv_t, greedy, out_j) -> token`` once per slot; returns
    ``(tokens [B, G], float32 logits [B, G, V])``."""
    greedy = ~(case.temperature > GREEDY_TEMPERATURE)
    inv_t = torch.where(greedy, 1.0, 1.0 / case.temperature)[:, None]
    logits = torch.empty(case.base_logits.shape, dtype=torch.float32,
                         device=case.base_logits.device)
    tokens = torch.empty(case.batch, case.block, dtype=torch.int64, device=logits.device)
    prev = case.anchor
    for j in range(case.block):
        prev = step(j, prev, inv_t, greedy, logits[:, j])
        tokens[:, j] = prev
    return tokens, logits


def eager_markov_draft(case: DraftCase, step: Callable = eager_markov_step):
    """The Markov head's block with ``step`` (:func:`eager_markov_step` or a compiled version)
    called once per slot."""
    return _eager_walk(case, lambda j, prev, inv_t, greedy, out_j: step(
        case.base_logits[:, j], prev, case.w1, case.w2, inv_t, greedy, out_j, case.variant))


def eager_rnn_draft(case: DraftCase):
    """The RNN head's block with :func:`eager_rnn_step` once per slot."""
    state = torch.zeros(case.batch, case.rank, dtype=case.w1.dtype, device=case.w1.device)

    def step(j, prev, inv_t, greedy, out_j):
        nonlocal state
        token, state = eager_rnn_step(case.base_logits[:, j], prev, case.hidden[:, j], state,
                                      case.w1, case.w2, case.joint_weight, case.joint_bias,
                                      inv_t, greedy, out_j, case.variant)
        return token

    return _eager_walk(case, step)


def eager_draft_confidence(hidden, prev_tokens, w1, weight, bias, calib_temperature):
    """``sigmoid((cat([h, W1[x]]) @ w + b) / tau)`` in the weight dtype, float32 out."""
    features = torch.cat([hidden, w1[prev_tokens]], -1)
    logit = (features @ weight + bias).float()
    return torch.sigmoid(logit / calib_temperature)


# --------------------------------------------------------------------------------------------
# Measurement


def markov_bytes(case: DraftCase) -> int:
    """Bytes ``markov_draft`` must move: W2 once per slot, base logits in, float32 (or bfloat16,
    ``case.logits_dtype``) logits out,
    the ``B * G`` embedded W1 rows (docs/semantics.md §4); ``rnn_draft`` adds the joint weight once
    per slot and the hidden states."""
    batch, block, vocab, rank = case.batch, case.block, case.vocab, case.rank
    w = case.w1.element_size()
    total = (block * vocab * rank * w + case.base_logits.numel() * case.base_logits.element_size()
             + batch * block * vocab * case.logits_dtype.itemsize + batch * block * rank * w)
    if case.hidden is not None:
        total += block * (case.joint_weight.numel() + case.joint_bias.numel()) * w
        total += case.hidden.numel() * case.hidden.element_size()
    return total


def confidence_bytes(case: ConfidenceCase) -> int:
    """Hidden states and W1 rows in, weight, float32 confidences out."""
    return (case.hidden.numel() * case.hidden.element_size()
            + case.prev_tokens.numel() * case.w1.shape[1] * case.w1.element_size()
            + case.weight.numel() * case.weight.element_size() + case.hidden.shape[0]
            * case.hidden.shape[1] * 4)


def _timings(device: torch.device, quick: bool) -> Timing:
    # A CPU call at the default shape takes about 0.1 s: a few calls each.
    return Timing.for_device(device, quick, cpu_seconds=(1.0, 0.5), cpu_quick_seconds=(0.2, 0.05))


def _ours(op: str, fn: Callable, device: torch.device):
    """``(fn, fn())``, or ``(None, None)`` (said once) when the build has no kernel of ``op``
    for the device or the call fails."""
    if not has_kernel(op, device.type):
        report_once(f"no-kernel-{op}-{device.type}",
                    f"ours: dspark_ops.{op} has no {device.type.upper()} kernel in this build; "
                    f"not timed (the other competitors still are)")
        return None, None
    try:
        out = fn()
        synchronize(device)
        return fn, out
    except Exception as error:
        log(f"  ours: not run ({type(error).__name__}: {error})")
        return None, None


def _try_count(fn: Callable, device: torch.device) -> Optional[int]:
    try:
        return count_launches(fn, device)
    except Exception as error:
        log(f"  launch count: not measured ({type(error).__name__}: {error})")
        return None


def _compare(row: Row, out, want) -> None:
    """``match`` and ``dz`` columns: ours against the reference."""
    if out is None:
        row.extra["match"], row.extra["dz"] = None, None
        return
    tokens, logits = (t.to(want.tokens.device) for t in out)
    row.extra["match"] = f"{int((tokens == want.tokens).sum())}/{tokens.numel()}"
    same = same_prefix(tokens, want.tokens)
    dz = max_logit_difference(logits[same].float(), want.draft_logits[same].float())
    row.extra["dz"] = f"{dz:.1e}"


def same_prefix(tokens: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """bool ``[B, G]``: whether ``x_1..x_j`` agree, i.e. slot ``j`` saw the same previous
    token in both (slot 0, conditioned on the anchor, always)."""
    same = torch.ones_like(tokens, dtype=torch.bool)
    if tokens.shape[1] > 1:
        same[:, 1:] = (tokens == other).long().cumprod(1)[:, :-1].bool()
    return same


def max_logit_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` where equal values (infinities included) and NaN pairs count as 0 and a
    NaN against a number as infinity."""
    if a.numel() == 0:
        return 0.0
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = (a - b).abs().nan_to_num(nan=float("inf"))
    return torch.where(same, 0.0, diff).max().item()


def bench_walk(case: DraftCase, device: torch.device, timing: Timing,
               copy_gbps: Optional[float], *, compile_it: bool = False,
               default_row: bool = False) -> Row:
    """Times one ``markov_draft`` (or, with ``case.hidden``, ``rnn_draft``) input set with every
    competitor; ``compile_it``: also the eager Markov step under torch.compile."""
    rnn = case.hidden is not None
    op = "rnn_draft" if rnn else "markov_draft"
    args = case.rnn_args() if rnn else case.markov_args()
    eager = eager_rnn_draft if rnn else eager_markov_draft

    dtype = dict(draft_logits_dtype=case.logits_dtype)

    def ref():
        return getattr(reference, op)(*args, **dtype)

    ours, out = _ours(op, lambda: getattr(dspark_ops, op)(*args, **dtype), device)
    want = ref()
    row = Row(op=op, shape=case.shape, variant=_variant_label(case))
    row.extra["dtypes"] = case.dtypes
    _compare(row, out, want)
    del want, out

    competitors = {"ours": ours, "ref": ref, "eager-torch": lambda: eager(case)}
    if device.type == "cuda" and default_row:  # how many launches each takes
        counts = [None if fn is None else _try_count(fn, device)
                  for fn in (ours, lambda: eager(case))]
        row.extra["launches"] = "/".join("-" if c is None else str(c) for c in counts)
    if compile_it and not rnn:
        compiled, started = None, time.perf_counter()
        try:
            step = torch.compile(eager_markov_step, dynamic=False)
            eager_markov_draft(case, step)  # compiles
            synchronize(device)
            compiled = lambda: eager_markov_draft(case, step)  # noqa: E731
            log(f"  torch.compile: compiled in {time.perf_counter() - started:.1f} s")
        except Exception as error:
            first_line = (str(error).splitlines() or [""])[0]
            log(f"  torch.compile: failed after {time.perf_counter() - started:.1f} s "
                f"({type(error).__name__}: {first_line})")
        competitors["torch.compile"] = compiled
    measure(row, competitors, device, timing)
    _finish(row, device, markov_bytes(case), copy_gbps)
    return row


def bench_confidence(case: ConfidenceCase, device: torch.device, timing: Timing,
                     copy_gbps: Optional[float]) -> Row:
    """Times one ``draft_confidence`` input set against the reference and eager PyTorch."""
    args = case.args()

    def ref():
        return reference.draft_confidence(*args)

    ours, out = _ours("draft_confidence", lambda: dspark_ops.draft_confidence(*args), device)
    want = ref()
    row = Row(op="draft_confidence", shape=case.shape, variant="calibrated")
    row.extra["dtypes"] = f"{_SHORT[case.hidden.dtype]}/{_SHORT[case.w1.dtype]}"
    eager_out = eager_draft_confidence(*args)
    # Confidences are float32 from a float64 (CPU) or float32 (CUDA) dot product: compare with
    # a tolerance; eager computes in the weight dtype, shown for scale.
    row.extra["dz"] = None if out is None else f"{(out - want).abs().max().item():.1e}"
    row.extra["eager dz"] = f"{(eager_out - want).abs().max().item():.1e}"
    del want, out, eager_out
    measure(row, {"ours": ours, "ref": ref, "eager-torch": lambda: eager_draft_confidence(*args)},
            device, timing)
    _finish(row, device, confidence_bytes(case), copy_gbps)
    return row


def _finish(row: Row, device: torch.device, nbytes: int, copy_gbps: Optional[float]) -> None:
    if device.type != "cuda":
        return
    row.bytes_moved = nbytes
    if copy_gbps:
        row.extra["floor us"] = nbytes / (copy_gbps * 1e9) * 1e6
    finish_row(row, copy_gbps)


def _variant_label(case: DraftCase) -> str:
    suffix = " bf16-logits" if case.logits_dtype == torch.bfloat16 else ""
    if case.variant == "greedy":
        return "greedy" + suffix
    t = float(case.temperature.max())
    return f"{case.variant} T={t:g}{suffix}"


def plan(device: torch.device, quick: bool) -> dict:
    """The shapes to run on ``device``."""
    if device.type == "cuda":
        return GPU_QUICK if quick else GPU_PLAN
    return CPU_QUICK if quick else CPU_PLAN


def run(device: torch.device, quick: bool = False, use_compile: bool = True,
        checkpoint: Optional[Callable[[List[Row]], None]] = None) -> List[Row]:
    """Runs every planned row on ``device`` and returns the rows.

    ``checkpoint(rows)`` is called after each row, so an interrupted run keeps what it measured.
    """
    torch.manual_seed(0)  # eager-torch draws from torch's default generator
    copy_gbps = None
    if device.type == "cuda":
        copy_gbps = measure_copy_bandwidth(device)
        log(f"copy bandwidth ({device}): {copy_gbps:.0f} GB/s (read + write)")
    timing = _timings(device, quick)
    p = plan(device, quick)
    shape = dict(block=p["block"], vocab=p["vocab"], rank=p["rank"])
    rows: List[Row] = []

    def done(row: Row, started: float) -> None:
        rows.append(row)
        anchors = ", ".join(f"{k} {format_us(v)} us" for k, v in row.anchors.items())
        log(f"  {row.op} {row.shape} {row.variant}: ours {format_us(row.ours_us)} us, "
            f"ref {format_us(row.reference_us)} us" + (f", {anchors}" if anchors else "")
            + f" [{time.perf_counter() - started:.1f} s]")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows)

    specs = [dict(batch=p["batch"], variant=v) for v in p.get("variants", VARIANTS)]
    specs += [dict(batch=b, variant="sampled") for b in p["batches"]]
    if p.get("bf16_logits"):
        specs.append(dict(batch=p["batch"], variant="sampled", logits_dtype=torch.bfloat16))
    for i, spec in enumerate(specs):
        started = time.perf_counter()
        case = make_draft_inputs(spec["batch"], **shape, variant=spec["variant"], device=device,
                                 seed=0 if "logits_dtype" in spec else i)
        case.logits_dtype = spec.get("logits_dtype", torch.float32)
        compile_it = p["compile"] and use_compile and i == 0
        row = bench_walk(case, device, timing, copy_gbps, compile_it=compile_it,
                         default_row=i == 0)
        del case
        done(row, started)

    if p["rnn_batch"]:
        started = time.perf_counter()
        case = make_draft_inputs(p["rnn_batch"], **shape, hidden=HIDDEN, device=device,
                                 seed=100)
        row = bench_walk(case, device, timing, copy_gbps)
        del case
        done(row, started)

    started = time.perf_counter()
    case = make_confidence_inputs(p["confidence_batch"], p["block"], HIDDEN, p["vocab"],
                                  p["rank"], device=device, seed=200)
    done(bench_confidence(case, device, timing, copy_gbps), started)
    del case
    markov_weights.cache_clear()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    return family_arg_parser(
        __doc__.split("\n")[0],
        quick_help="the default shape only (CPU: B = 2, markov_draft sampled and greedy, no "
                   "rnn_draft); no torch.compile, no batch sweep; fewer repeats",
        anchors_help="skip torch.compile (its first call compiles for seconds to a minute)",
    ).parse_args(argv)


def main(argv=None, *, emit: bool = True) -> List[Row]:
    """Command-line entry point; returns the rows (``emit=False``: print nothing to stdout)."""
    return family_main(
        "draft", parse_args(argv),
        lambda device, args, checkpoint: run(device, quick=args.quick,
                                             use_compile=not args.no_anchors,
                                             checkpoint=checkpoint),
        emit=emit)


if __name__ == "__main__":
    main()
