"""Benchmark of the scheduling ops (docs/semantics.md §3.4) against the reference and eager
PyTorch.

Rows, at ``B`` in {64, 256, 1024} and ``G`` in {7, 16}:

* ``schedule_verify``    — Algorithm 1 (one stage, fresh confidences);
* ``plan_verify_budget`` — stage 1 of the production scheduler, on stale confidences;
* ``allocate_verify``    — stage 2, on fresh confidences, with the budget stage 1 returned;
* ``plan+allocate``      — both stages back to back, timed as one;
* ``pack_verify_inputs`` — the ragged target batch for the lengths ``schedule_verify`` chose.

Every row times the same inputs with:

* ``ours``        — the ``dspark_ops`` op (``plan+allocate``: the two ops);
* ``ref``         — ``dspark_ops.reference``, the semantics of record: a step-by-step Python loop
                    on the host, timed with few repeats;
* ``eager-torch`` — the same algorithm as a user would vectorise it in eager PyTorch (see
                    :func:`eager_schedule_verify` and its siblings): ``cumprod`` survivals, one
                    ``torch.sort`` of a composite 64-bit key that carries the tie rule, fixed-point
                    ``cumsum`` of the sorted survivals, ``Theta`` for every admission count, the
                    first non-improving admission (or the best one) by ``argmax``, and
                    ``scatter_reduce`` for the lengths; packing by a ``scatter`` to
                    ``cu_seqlens[b] + j``. None of it syncs with the host (no ``.item()``, no
                    data-dependent shapes).

Before timing, each row checks that eager-torch returns the same lengths (budget, packed batch)
as ours, so both do the same work; ``match`` counts requests whose lengths (``plan``: the
budget; ``pack``: the packed tokens) equal the reference's.

Inputs: per-request acceptance level ``U(0.5, 0.95)``; conditional confidences
``c = clamp(level + 0.1 * N(0, 1), 0, 1)``, fresh for the current step and drawn again around the
same levels for the stale ones stage 1 sees. ``step_rate`` has ``M = B * (G + 1) + 1`` entries,
built from a step time that rises slowly (+50 % in all) up to a knee at ``8 * B`` tokens (the
KV-cache reads, which grow with ``B``, keep verification memory-bound for several tokens per
request) and grows like ``n`` past it (steps per second fall like ``1 / n``), with small jags
every 64 tokens (a partly filled 64-token tile costs up to ``0.4 / knee`` of the step time more).
Algorithm 1 stops at one of the jags; the two-stage scheduler's global search looks past them.

Columns besides the times: ``mean l`` (mean ``num_verify`` of the row's lengths; ``plan``: of
the allocation its budget gives), ``match``; on GPU also ``graph us`` (a CUDA graph of 20 calls
replayed, divided by 20: the kernel time without the host's launch overhead, where the event
times of ``ours us`` are per call with the host running ahead), ``launches`` (device kernels and
copies of one call of ours, counted with the profiler) and ``target`` (at ``B = 256, G = 16``,
whether the row meets the target docs/semantics.md §4 sets for the scheduling ops).

Run from the repository root: ``python bench/bench_schedule.py [--quick] [--device D]
[--json-only]`` (or ``python -m bench`` for every family).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
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
from bench.common import log, report_once, synchronize
from bench.report import Row, family_arg_parser, family_main, format_us
from bench.timing import Timing, count_launches, measure

BATCHES = (64, 256, 1024)
BLOCKS = (7, 16)
QUICK_BATCHES = (64, 256)
QUICK_BLOCKS = (7,)

# docs/semantics.md §4: scheduling ops launch-bound, one launch, <= 10 us; judged at this shape.
TARGET_SHAPE = (256, 16)
TARGET_US = 10.0
GRAPH_CALLS = 20

VOCAB = 151936
SURVIVAL_SCALE = reference.SURVIVAL_SCALE  # fixed point of expected tokens (2^32)
_ONE_BITS = 0x3F800000  # bits of 1.0f
_INELIGIBLE = torch.iinfo(torch.int64).max  # sorts after every eligible key


# --------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class ScheduleCase:
    """One set of scheduling inputs."""

    confidence: torch.Tensor  # float32 [B, G], the current step's
    stale_confidence: torch.Tensor  # float32 [B, G], what stage 1 is fed (an older step's)
    step_rate: torch.Tensor  # float32 [M], M = B * (G + 1) + 1
    anchor: torch.Tensor  # int64 [B]
    draft_tokens: torch.Tensor  # int64 [B, G]
    position: torch.Tensor  # int64 [B]

    @property
    def batch(self) -> int:
        return self.confidence.shape[0]

    @property
    def block(self) -> int:
        return self.confidence.shape[1]

    @property
    def shape(self) -> str:
        return f"B={self.batch} G={self.block} M={self.step_rate.numel()}"


def make_step_rate(batch: int, capacity: int, device="cpu") -> torch.Tensor:
    """A realistic ``step_rate[n]`` (steps per second) for ``n < capacity`` verify tokens.

    Step time ``t(n) = t0 (1 + 0.5 n / knee)`` up to the knee at ``8 * batch`` tokens,
    ``1.5 t0 n / knee`` past it (continuous there), times ``1 + 0.4 u(n) / knee`` with ``u(n)``
    the unused share of the last 64-token tile (0 at multiples of 64, 63/64 just past them).
    ``t0`` = 10 ms. ``step_rate[0]`` repeats ``step_rate[1]``.
    """
    knee = 8.0 * batch
    n = torch.arange(capacity, dtype=torch.float64).clamp_min_(1.0)
    smooth = torch.maximum(1.0 + 0.5 * n / knee, 1.5 * n / knee)
    unused = (torch.ceil(n / 64.0) * 64.0 - n) / 64.0
    seconds = 0.010 * smooth * (1.0 + 0.4 * unused / knee)
    return (1.0 / seconds).to(device=device, dtype=torch.float32)


def make_schedule_inputs(batch: int, block: int, *, device="cpu", seed: int = 0) -> ScheduleCase:
    """Inputs for the scheduling ops with per-request acceptance levels.

    Parameters
    ----------
    batch, block : int
        ``B`` and ``G``.
    device : str or torch.device
        Where the tensors live (generated on the CPU with a seeded generator, then moved, so
        every device sees the same values).
    seed : int
        Seeds the generator.

    Returns
    -------
    ScheduleCase
    """
    generator = torch.Generator().manual_seed(seed)
    level = torch.rand(batch, 1, generator=generator) * 0.45 + 0.5

    def confidences():
        noise = torch.randn(batch, block, generator=generator) * 0.1
        return (level + noise).clamp_(0.0, 1.0)

    confidence, stale = confidences(), confidences()
    capacity = batch * (block + 1) + 1
    case = ScheduleCase(
        confidence=confidence,
        stale_confidence=stale,
        step_rate=make_step_rate(batch, capacity),
        anchor=torch.randint(0, VOCAB, (batch,), generator=generator),
        draft_tokens=torch.randint(0, VOCAB, (batch, block), generator=generator),
        position=torch.randint(0, 32768, (batch,), generator=generator),
    )
    return ScheduleCase(**{f.name: getattr(case, f.name).to(device)
                           for f in dataclasses.fields(case)})


# --------------------------------------------------------------------------------------------
# Eager PyTorch versions


def _ranked(confidence: torch.Tensor):
    """Sorted survivals in admission order: (keys, fixed-point survivals, eligible count).

    One 64-bit key per pair ``(r, j)``, ascending = survival descending, then ``j``, then ``r``:
    ``(bits(1.0) - bits(a)) << 32 | (j * B + r)`` (non-negative floats order like their bits).
    Pairs with survival 0 get the largest key.
    """
    batch, block = confidence.shape
    # Left-to-right float32 products, as the kernels multiply (torch.cumprod may accumulate in
    # double on CPU or scan in parallel on CUDA, which rounds differently).
    a = reference.survivals(confidence.clamp(0.0, 1.0)).t().reshape(-1)  # index j * B + r
    index = torch.arange(batch * block, device=a.device)
    key = ((_ONE_BITS - a.view(torch.int32).long()) << 32) | index
    key = torch.where(a > 0, key, _INELIGIBLE)
    key = torch.sort(key).values
    survival = (_ONE_BITS - (key >> 32)).int().view(torch.float32)
    fixed = torch.round(survival.double() * SURVIVAL_SCALE).long()
    eligible = key != _INELIGIBLE
    return key, torch.where(eligible, fixed, 0), eligible.sum()


def _theta(fixed: torch.Tensor, eligible: torch.Tensor, step_rate: torch.Tensor, batch: int):
    """Theta after k = 0..P admissions, and which k are allowed (eligible pairs, N < M)."""
    tau = torch.cat([fixed.new_zeros(1), fixed.cumsum(0)]) + batch * SURVIVAL_SCALE
    k = torch.arange(tau.numel(), device=tau.device)
    capacity = step_rate.numel()
    tokens = (batch + k).clamp_max(capacity - 1)
    theta = tau.double() * step_rate.double()[tokens]
    return theta, (k <= eligible) & (batch + k < capacity)


def _lengths(key: torch.Tensor, admitted: torch.Tensor, batch: int) -> torch.Tensor:
    """num_verify from the first ``admitted`` ranked pairs: 1 + the largest admitted position."""
    index = key & 0xFFFFFFFF
    rank = torch.arange(key.numel(), device=key.device)
    length = torch.where(rank < admitted, index // batch + 1, 0)
    out = torch.zeros(batch, dtype=torch.int64, device=key.device)
    return out.scatter_reduce_(0, index.remainder(batch), length, "amax").int()


def eager_schedule_verify(confidence: torch.Tensor, step_rate: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 vectorised: Theta for every admission count, stop at the first that does not
    strictly improve on the one before. Returns int32 ``[B]``."""
    batch = confidence.shape[0]
    key, fixed, eligible = _ranked(confidence)
    theta, allowed = _theta(fixed, eligible, step_rate, batch)
    # stop[k - 1]: admission k fails; a final True makes "admit everything" the fallback.
    stop = ~((theta[1:] > theta[:-1]) & allowed[1:])
    stop = torch.cat([stop, stop.new_ones(1)])
    admitted = torch.argmax(stop.byte())  # the first True
    return _lengths(key, admitted, batch)


def eager_plan_verify_budget(confidence: torch.Tensor, step_rate: torch.Tensor) -> torch.Tensor:
    """Global argmax of Theta over the budget (ties to the smaller). Returns int32 ``[1]``."""
    batch = confidence.shape[0]
    _, fixed, eligible = _ranked(confidence)
    theta, allowed = _theta(fixed, eligible, step_rate, batch)
    best = torch.argmax(torch.where(allowed, theta, -math.inf))  # first of equal maxima
    return (best + batch).int().reshape(1)


def eager_allocate_verify(confidence: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Admits the top ``budget - B`` eligible pairs. Returns int32 ``[B]``."""
    batch = confidence.shape[0]
    key, _, eligible = _ranked(confidence)
    admitted = torch.minimum((budget[0].long() - batch).clamp_min(0), eligible)
    return _lengths(key, admitted, batch)


def eager_pack_verify_inputs(anchor, draft_tokens, num_verify, position):
    """``[x0, x_1..x_l]`` of every request scattered to ``cu_seqlens[b] + j``; the padded tail
    stays 0. Returns ``(input_ids, positions, cu_seqlens)`` like the op."""
    batch, block = draft_tokens.shape
    size = batch * (block + 1)
    lengths = num_verify.long() + 1
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    j = torch.arange(block + 1, device=anchor.device)
    keep = j < lengths[:, None]
    # Slots past a request's length all go to one spare entry that is cut off afterwards.
    target = torch.where(keep, cu[:-1, None] + j, size).reshape(-1)
    ids = torch.cat([anchor.long()[:, None], draft_tokens.long()], 1).reshape(-1)
    pos = (position.long()[:, None] + j).reshape(-1)
    ids = ids.new_zeros(size + 1).scatter_(0, target, ids)[:size]
    pos = pos.new_zeros(size + 1).scatter_(0, target, pos)[:size]
    return ids, pos, cu.int()


# --------------------------------------------------------------------------------------------
# GPU-only measurements


def time_cuda_graph(fn: Callable[[], object], device: torch.device, calls: int = GRAPH_CALLS,
                    replays: int = 50) -> float:
    """Median seconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls.

    The host only launches the graph, so this is the device time of back-to-back kernels
    without the per-call host overhead (Python, dispatcher, launch).
    """
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        for start, end in zip(starts, ends):
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize(device)
        seconds = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3
        del graph
    return seconds / calls


def _try(label: str, fn: Callable[[], object]):
    """``fn()``, or None (and a log line) when it fails."""
    try:
        return fn()
    except Exception as error:
        log(f"  {label}: not measured ({type(error).__name__}: {error})")
        return None


# --------------------------------------------------------------------------------------------
# Measurement


def _timings(device: torch.device, quick: bool) -> Timing:
    """Ours and eager-torch (``others``); the Python reference has its own, see below."""
    if device.type == "cuda":
        if quick:
            return Timing(dict(rep_ms=30, warmup_ms=10), dict(rep_ms=20, warmup_ms=5))
        return Timing(dict(rep_ms=100, warmup_ms=25), dict(rep_ms=50, warmup_ms=10))
    if quick:
        return Timing(dict(min_run_time=0.1), dict(min_run_time=0.1))
    return Timing(dict(min_run_time=0.25), dict(min_run_time=0.2))


def _reference_timing(device: torch.device) -> dict:
    """A few calls of the slow Python reference. On CPU it runs a few calls whatever
    min_run_time says (one to size a block, then blocks until the time is spent); a tiny value
    keeps it at that."""
    if device.type == "cuda":
        return dict(rep_ms=1, warmup_ms=1, min_reps=3, max_reps=3)
    return dict(min_run_time=0.01)


@dataclasses.dataclass
class Competitors:
    """One row: the op's name, what its inputs are, and its three competitors."""

    op: str
    variant: str
    ours: Callable[[], object]
    eager: Callable[[], object]
    ref: Callable[[], object]
    single_op: bool = True  # the §4 target applies to one op call


def _competitors(case: ScheduleCase, num_verify: torch.Tensor,
                 budget: torch.Tensor) -> List[Competitors]:
    c, stale, rate = case.confidence, case.stale_confidence, case.step_rate
    pack_args = (case.anchor, case.draft_tokens, num_verify, case.position)
    return [
        Competitors(
            "schedule_verify", "one-stage, fresh c",
            lambda: dspark_ops.schedule_verify(c, rate),
            lambda: eager_schedule_verify(c, rate),
            lambda: reference.schedule_verify(c, rate)),
        Competitors(
            "plan_verify_budget", "stage 1, stale c",
            lambda: dspark_ops.plan_verify_budget(stale, rate),
            lambda: eager_plan_verify_budget(stale, rate),
            lambda: reference.plan_verify_budget(stale, rate)),
        Competitors(
            "allocate_verify", "stage 2, fresh c",
            lambda: dspark_ops.allocate_verify(c, budget),
            lambda: eager_allocate_verify(c, budget),
            lambda: reference.allocate_verify(c, budget)),
        Competitors(
            "plan+allocate", "two-stage",
            lambda: dspark_ops.allocate_verify(c, dspark_ops.plan_verify_budget(stale, rate)),
            lambda: eager_allocate_verify(c, eager_plan_verify_budget(stale, rate)),
            lambda: reference.allocate_verify(c, reference.plan_verify_budget(stale, rate)),
            single_op=False),
        Competitors(
            "pack_verify_inputs", "lengths of schedule",
            lambda: dspark_ops.pack_verify_inputs(*pack_args),
            lambda: eager_pack_verify_inputs(*pack_args),
            lambda: reference.pack_verify_inputs(*pack_args)),
    ]


def _per_request(op: str, out, batch: int) -> torch.Tensor:
    """What ``match`` compares, as one row per request (bool-comparable tensors on the CPU)."""
    if op == "plan_verify_budget":
        return out.cpu().expand(batch)
    if op == "pack_verify_inputs":
        ids, pos, cu = (t.cpu().long() for t in out)
        # Each request's packed slots, padded to G + 1 (the rest of the buffer is padding).
        size = ids.numel() // batch
        j = torch.arange(size)
        slot = (cu[:-1, None] + j).clamp_max(ids.numel() - 1)
        length = (cu[1:] - cu[:-1])[:, None]
        keep = j < length
        return torch.cat([torch.where(keep, ids[slot], -1), torch.where(keep, pos[slot], -1),
                          length], 1)
    return out.cpu()


def _same(op: str, a, b) -> bool:
    """Whether two competitors' whole outputs agree (pack: padding included)."""
    if op == "pack_verify_inputs":
        return all(torch.equal(x.cpu().long(), y.cpu().long()) for x, y in zip(a, b))
    return torch.equal(a.cpu().long(), b.cpu().long())


def bench_case(case: ScheduleCase, device: torch.device, timing: Timing) -> List[Row]:
    """Times one input set with every competitor and returns its rows (one per op)."""
    batch, block = case.batch, case.block
    num_verify = dspark_ops.schedule_verify(case.confidence, case.step_rate)
    budget = dspark_ops.plan_verify_budget(case.stale_confidence, case.step_rate)
    allocation = dspark_ops.allocate_verify(case.confidence, budget)
    synchronize(device)

    rows = []
    for comp in _competitors(case, num_verify, budget):
        ours_out, eager_out, ref_out = comp.ours(), comp.eager(), comp.ref()
        synchronize(device)
        # The eager version must do the same work as ours, or its time says nothing.
        if not _same(comp.op, eager_out, ours_out):
            differ = (_per_request(comp.op, eager_out, batch)
                      != _per_request(comp.op, ours_out, batch)).reshape(batch, -1).any(1)
            log(f"WARNING {comp.op} {case.shape}: eager-torch differs from ours in "
                f"{int(differ.sum())}/{batch} requests; its time is not a like-for-like comparison")
        same_ref = (_per_request(comp.op, ours_out, batch)
                    == _per_request(comp.op, ref_out, batch)).reshape(batch, -1).all(1)

        row = Row(op=comp.op, shape=case.shape, variant=comp.variant)
        lengths = {"plan_verify_budget": allocation, "allocate_verify": allocation,
                   "plan+allocate": allocation}.get(comp.op, num_verify)
        row.extra["mean l"] = lengths.float().mean().item()
        row.extra["match"] = f"{int(same_ref.sum())}/{batch}"

        measure(row, {"ours": comp.ours, "ref": comp.ref, "eager-torch": comp.eager}, device,
                timing, budgets={"ref": _reference_timing(device)})

        if device.type == "cuda":
            row.extra["graph us"] = _try(
                "graph", lambda: time_cuda_graph(comp.ours, device) * 1e6)
            row.extra["launches"] = _try("launches", lambda: count_launches(comp.ours, device))
            row.extra["target"] = None
            if comp.single_op and (batch, block) == TARGET_SHAPE and row.ours_us is not None:
                met = row.ours_us <= TARGET_US and row.extra["launches"] in (1, None)
                row.extra["target"] = "met" if met else "not met"
        rows.append(row)
    return rows


def plan(quick: bool):
    """The (B, G) shapes to run."""
    batches, blocks = (QUICK_BATCHES, QUICK_BLOCKS) if quick else (BATCHES, BLOCKS)
    return [(b, g) for b in batches for g in blocks]


def run(device: torch.device, quick: bool = False,
        checkpoint: Optional[Callable[[List[Row]], None]] = None) -> List[Row]:
    """Runs every planned shape on ``device`` and returns the rows.

    ``checkpoint(rows)`` is called after each shape, so an interrupted run keeps what it measured.
    """
    report_once("schedule-anchors", "anchor TensorRT-LLM scheduler: not benchmarked here "
                "(no standalone op); eager-torch stands in for user code")
    timing = _timings(device, quick)
    rows: List[Row] = []
    for batch, block in plan(quick):
        started = time.perf_counter()
        case = make_schedule_inputs(batch, block, device=device, seed=1000 * batch + block)
        case_rows = bench_case(case, device, timing)
        rows += case_rows
        for row in case_rows:
            log(f"  {row.op} {row.shape}: ours {format_us(row.ours_us)} us, "
                f"ref {format_us(row.reference_us)} us, eager-torch {format_us(row.anchors['eager-torch'])} us")
        log(f"  [{case.shape}: {time.perf_counter() - started:.1f} s]")
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    return family_arg_parser(
        __doc__.split("\n")[0],
        quick_help="B in {64, 256}, G = 7 only, fewer repeats",
        anchors_help="accepted for python -m bench; this family has no third-party anchors",
    ).parse_args(argv)


def main(argv=None, *, emit: bool = True) -> List[Row]:
    """Command-line entry point; returns the rows (``emit=False``: print nothing to stdout)."""
    return family_main(
        "schedule", parse_args(argv),
        lambda device, args, checkpoint: run(device, quick=args.quick, checkpoint=checkpoint),
        emit=emit, copy_bandwidth=False)


if __name__ == "__main__":
    main()
