"""Per-op GPU profile at the headline shapes: where each op's time goes, measured (not the
static model). For each op:

  eager_cold_us   the benchmarks' method: the L2 flushed (a 256 MiB fill), events around one
                  eager call; median
  eager_warm_us   events around calls back to back, no flush, per call (a warm L2; the host is
                  exposed where its per-call work exceeds the device's)
  host_us         the host's enqueue time per call while the GPU is kept busy
  graph_cold_us   one call captured in a CUDA graph, the L2 flushed, events around a replay
  graph_warm_us   several calls in one graph, replayed, per call (a captured decode step)
  kernels         torch.profiler's device activities of flushed calls: per kernel its launches
                  and device time per call; per call busy (the kernels' sum), span (first start
                  to last end: span - busy = the gaps between the op's kernels) and head (the
                  flush's end to the first kernel: the host's exposure at the first launch)

and verify's sweep over G (sampled, acceptance about 0.95, B 64): the slope of time against G is
what one more row per request costs. verify decides rows independently: one more row is C more
(row, chunk) items per request streamed by the grid and one more decision per request, not a
longer chain of dependent rows (kernels/verify.cuh), so the slope is bandwidth and items, and
the intercept the launches, the last row's decision and the race of row j*. Each op names the static model's row it is
the measurement of, so ``python -m gpu_checks.model_vs_measured --profile`` sets the model's
per-kernel times beside these (docs/performance-model.md, "Calibration").

    python -m gpu_checks.profile_ops --out DIR             # a GPU: DIR/profile_ops.json
    python -m gpu_checks.profile_ops --out DIR --dry-run   # the CPU, tiny shapes, a few calls

The dry run exercises every case, the timing code's CPU side and the profiler table, and writes
the same JSON (device "cpu", no graph timings), so a script error costs no GPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

import dspark_ops
from bench import bench_attention, bench_draft, bench_loss, bench_schedule, bench_verify

# Larger than the L2 of any current GPU, as bench/timing.py flushes it.
FLUSH_BYTES = 256 * 1024**2
CHAIN_BLOCKS = (1, 2, 4, 8)   # verify's G sweep


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes one run profiles: the headline ones on a GPU, tiny ones for the dry run."""
    batch: int
    block: int
    vocab: int
    rank: int
    hidden: int
    context: int
    schedule: Tuple[int, int]
    loss: Dict[str, int]


HEADLINE = Shapes(batch=64, block=8, vocab=151936, rank=256, hidden=2560, context=4096,
                  schedule=(256, 16), loss=bench_loss.GPU_SHAPE)
TINY = Shapes(batch=2, block=2, vocab=512, rank=32, hidden=64, context=64, schedule=(4, 3),
              loss=dict(rows=14, vocab=512, width=64, rank=16))


@dataclasses.dataclass
class Case:
    """One op at one shape: ``build`` makes its inputs and returns the call; ``model`` names
    the static model's row it measures (op, variant, shape), if one does."""
    name: str
    build: Callable[[], Callable[[], object]]
    model: Optional[Tuple[str, str, str]] = None
    graphable: bool = True     # the loss runs autograd: not captured
    heavy: bool = False        # tens of ms a call: fewer repetitions


def cases(shapes: Shapes, device: torch.device) -> List[Case]:
    s = shapes
    shape_v = f"B={s.batch} G={s.block} V={s.vocab}"

    def verify(variant, *, block=s.block, acceptance=0.7, filters=False, seed=0):
        def build():
            case = bench_verify.make_verify_inputs(s.batch, block, s.vocab, variant=variant,
                                                   acceptance=acceptance, device=device,
                                                   seed=seed, filters=filters)
            kwargs = dict(draft_logits=case.draft_logits, **(case.filters or {}))
            return lambda: dspark_ops.verify(*case.args(), **kwargs)
        return build

    def draft(variant, *, rnn=False):
        def build():
            case = bench_draft.make_draft_inputs(s.batch, s.block - 1, s.vocab, s.rank,
                                                 variant=variant, device=device,
                                                 hidden=s.hidden if rnn else None)
            kwargs = dict(draft_logits_dtype=case.logits_dtype)
            if rnn:
                return lambda: dspark_ops.rnn_draft(*case.rnn_args(), **kwargs)
            return lambda: dspark_ops.markov_draft(*case.markov_args(), **kwargs)
        return build

    def confidence():
        case = bench_draft.make_confidence_inputs(s.batch, s.block - 1, s.hidden, s.vocab, s.rank,
                                                  device=device)
        return lambda: dspark_ops.draft_confidence(*case.args())

    def attention():
        case = bench_attention.make_attention_inputs(s.batch, s.context, torch.bfloat16,
                                                     device=device)
        return lambda: dspark_ops.block_draft_attention(*case.args(),
                                                        window=bench_attention.WINDOW)

    def append():
        case = bench_attention.make_append_inputs(s.batch, s.context, torch.bfloat16,
                                                  device=device)
        lengths = case.start.clone()

        def call():  # as the benchmark calls it: the lengths reset, then the append
            lengths.copy_(case.start)
            dspark_ops.append_context_kv(case.k_cache, case.v_cache, case.k_new, case.v_new,
                                         case.num_new, lengths)
        return call

    def schedule():
        case = bench_schedule.make_schedule_inputs(*s.schedule, device=device)
        return lambda: dspark_ops.schedule_verify(case.confidence, case.step_rate)

    def loss():
        args = bench_loss.make_inputs(**s.loss, dtype=torch.bfloat16, device=device)
        return bench_loss.step_with(bench_loss.ours_loss)(args)

    draft_shape = f"B={s.batch} G={s.block - 1} V={s.vocab} r={s.rank}"
    found = [
        Case("verify_greedy", verify("greedy"), ("verify", "greedy a=0.69", shape_v)),
        Case("verify_sampled", verify("sampled"), ("verify", "sampled a=0.65", shape_v)),
        Case("verify_topk50_topp0.9", verify("sampled", filters=True),
             ("verify", "sampled a=0.88 top-k 50 top-p 0.9", shape_v)),
        Case("markov_sampled", draft("sampled"), ("markov_draft", "sampled", draft_shape)),
        Case("markov_greedy", draft("greedy"), ("markov_draft", "greedy", draft_shape)),
        Case("rnn_sampled", draft("sampled", rnn=True),
             ("rnn_draft", "sampled", f"{draft_shape} d={s.hidden}")),
        Case("draft_confidence", confidence,
             ("draft_confidence", "calibrated",
              f"B={s.batch} G={s.block - 1} d={s.hidden} r={s.rank}")),
        Case("block_draft_attention", attention,
             ("block_draft_attention", "bf16", f"B={s.batch} G=8 Hq=32 Hkv=8 D=128 "
                                               f"ctx={s.context}")),
        Case("append_context_kv", append,
             ("append_context_kv", "bf16", f"B={s.batch} n<=9 Hkv=8 D=128 ctx={s.context}")),
        Case("schedule_verify", schedule,
             ("schedule_verify", "one-stage", f"B={s.schedule[0]} G={s.schedule[1]}")),
        Case("dspark_loss_fwd_bwd", loss,
             ("dspark_loss", "bf16 vocabulary pass + cuBLAS products",
              f"N={s.loss['rows']} V={s.loss['vocab']} d={s.loss['width']} r={s.loss['rank']}"),
             graphable=False, heavy=True),
    ]
    # The G sweep: near-full acceptance, so every request decides about G + 1 rows.
    found += [Case(f"verify_chain_G{g}", verify("sampled", block=g, acceptance=0.95, seed=g))
              for g in CHAIN_BLOCKS if g <= max(s.block, 2)]
    return found


# ------------------------------------------------------------------------------------------------
# Timing


class Meter:
    """The timings of one device: CUDA events on a GPU, the wall clock on the CPU (dry run)."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        self.cuda = device.type == "cuda"
        self.flush_buffer = torch.empty(FLUSH_BYTES // 4 if self.cuda else 1024,
                                        dtype=torch.float32, device=device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        self.flush_buffer.zero_()

    def _spans_us(self, before: Callable[[], None], body: Callable[[], object],
                  reps: int, per: int = 1) -> float:
        """Median µs per `per` calls of body, each measured span preceded by before()."""
        spans = []
        if self.cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            for i in range(reps):
                before()
                starts[i].record()
                body()
                ends[i].record()
            self.sync()
            spans = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        else:
            for _ in range(reps):
                before()
                t0 = time.perf_counter()
                body()
                spans.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(spans) / per

    def flush_us(self) -> float:
        return self._spans_us(lambda: None, self.flush, self.repeats)

    def eager_cold_us(self, fn) -> float:
        return self._spans_us(self.flush, fn, self.repeats)

    def eager_warm_us(self, fn, calls: int) -> float:
        def burst():
            for _ in range(calls):
                fn()
        return self._spans_us(self.sync, burst, 3, per=calls)

    def host_us(self, fn, calls: int) -> float:
        """Enqueue time per call with the GPU busy, so the host never waits for it."""
        self.sync()
        if self.cuda:
            torch.cuda._sleep(int(2e8))  # about 0.1 s of spinning ahead of the calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) * 1e6 / calls
        self.sync()
        return host

    def capture(self, fn, calls: int):
        """A CUDA graph of `calls` calls (warmed up on a side stream first, as capture needs)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        keep = []
        with torch.cuda.graph(graph):
            for _ in range(calls):
                keep.append(fn())
        graph.replay()
        self.sync()
        return graph, keep

    def graph_us(self, fn, calls: int) -> Dict[str, float]:
        graph, keep = self.capture(fn, 1)
        cold = self._spans_us(self.flush, graph.replay, self.repeats)
        del graph, keep
        graph, keep = self.capture(fn, calls)
        warm = self._spans_us(graph.replay, graph.replay, 3, per=calls)
        del graph, keep
        return {"graph_cold_us": cold, "graph_warm_us": warm}

    def kernels(self, fn, calls: int) -> dict:
        """Per kernel launches and µs per call, and per call busy / span / head, from the
        profiler's device activities of `calls` flushed calls (on the CPU: its operators)."""
        from torch.profiler import ProfilerActivity, profile
        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        self.sync()
        with profile(activities=[activity]) as prof:
            for _ in range(calls):
                self.flush()
                fn()
            self.sync()
        kind = torch.autograd.DeviceType.CUDA if self.cuda else torch.autograd.DeviceType.CPU
        events = sorted((e for e in prof.events() if e.device_type == kind),
                        key=lambda e: e.time_range.start)
        if not self.cuda:  # top-level operators only: nested ones would be counted twice
            events = [e for e in events if e.cpu_parent is None]
        per_call: List[List] = []
        heads: List[float] = []
        flush_end = None
        for event in events:
            if self._is_flush(event):
                per_call.append([])
                flush_end = event.time_range.end
                continue
            if not per_call:
                continue
            if not per_call[-1] and flush_end is not None:
                heads.append(event.time_range.start - flush_end)
            per_call[-1].append(event)
        per_call = [c for c in per_call if c]
        n = max(1, len(per_call))
        by_name: Dict[str, List[float]] = {}
        for call in per_call:
            for event in call:
                by_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
        table = sorted(({"kernel": name, "launches_per_call": len(times) / n,
                         "mean_us": statistics.mean(times), "us_per_call": sum(times) / n}
                        for name, times in by_name.items()), key=lambda r: -r["us_per_call"])

        def median(values):
            return statistics.median(values) if values else None
        return {
            "calls": len(per_call),
            "launches_per_call": median([len(c) for c in per_call]),
            "busy_us": median([sum(e.time_range.elapsed_us() for e in c) for c in per_call]),
            "span_us": median([max(e.time_range.end for e in c) - min(e.time_range.start
                                                                      for e in c)
                               for c in per_call]),
            "head_us": median(heads),
            "table": table,
        }

    def _is_flush(self, event) -> bool:
        if self.cuda:  # the fill kernel of the 256 MiB buffer, far longer than any of ours
            return "FillFunctor" in event.name and event.time_range.elapsed_us() > 20
        return event.name == "aten::zero_"


def profile_case(case: Case, meter: Meter) -> dict:
    row: dict = {"model": list(case.model) if case.model else None}
    started = time.perf_counter()
    try:
        fn = case.build()
        for _ in range(2 if case.heavy else 5):  # first-call allocations, caches
            fn()
        meter.sync()
        calls = 3 if case.heavy else 10
        row["eager_cold_us"] = meter.eager_cold_us(fn)
        sweep = case.name.startswith("verify_chain_")
        if not sweep:
            row["eager_warm_us"] = meter.eager_warm_us(fn, calls)
            row["host_us"] = meter.host_us(fn, calls)
            if case.graphable and meter.cuda:
                try:
                    row.update(meter.graph_us(fn, calls))
                except RuntimeError as error:
                    row["graph_error"] = f"{type(error).__name__}: {error}"[:300]
                    meter.sync()
        row["kernels"] = meter.kernels(fn, 1 if case.heavy else 3)
    except Exception as error:  # noqa: BLE001 - one op's failure must not lose the others
        row["error"] = f"{type(error).__name__}: {error}"[:500]
        print(traceback.format_exc(), file=sys.stderr)
    row["seconds"] = time.perf_counter() - started
    return row


def chain_slope(ops: Dict[str, dict]) -> Optional[dict]:
    """Least-squares eager_cold = intercept + slope * G over verify's sweep: the slope is one
    more row per request (its C items and its decision; every request decides about G + 1
    rows, each independently of the others)."""
    points = [(int(name.rsplit("G", 1)[1]), row["eager_cold_us"]) for name, row in ops.items()
              if name.startswith("verify_chain_G") and "eager_cold_us" in row]
    if len(points) < 2:
        return None
    mean_g = statistics.mean(g for g, _ in points)
    mean_t = statistics.mean(t for _, t in points)
    slope = (sum((g - mean_g) * (t - mean_t) for g, t in points)
             / sum((g - mean_g) ** 2 for g, _ in points))
    return {"points": points, "us_per_row": slope, "intercept_us": mean_t - slope * mean_g}


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_checks.profile_ops",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/profile-ops"),
                        help="folder for profile_ops.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="the CPU at tiny shapes: checks the script, writes the same JSON")
    parser.add_argument("--ops", nargs="*", help="only the cases whose names contain these")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("profile_ops: no GPU (use --dry-run on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda",
                                                                   torch.cuda.current_device())
    shapes = TINY if args.dry_run else HEADLINE
    meter = Meter(device, repeats=3 if args.dry_run else 10)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "kind": "MEASURED" + (" (dry run on the CPU at tiny shapes: no timing meaning)"
                              if args.dry_run else ""),
        "environment": {"device": str(device),
                        "device_name": (torch.cuda.get_device_name(device) if meter.cuda
                                        else "cpu"),
                        "torch": torch.__version__, "flush_us": meter.flush_us(),
                        "shapes": dataclasses.asdict(shapes)},
        "ops": {},
    }
    started = time.perf_counter()
    failed = 0
    for case in cases(shapes, device):
        if args.ops and not any(o in case.name for o in args.ops):
            continue
        row = profile_case(case, meter)
        result["ops"][case.name] = row
        failed += "error" in row
        k = row.get("kernels") or {}
        print(f"{case.name:<26} cold {_fmt(row.get('eager_cold_us')):>9}  warm "
              f"{_fmt(row.get('eager_warm_us')):>9}  host {_fmt(row.get('host_us')):>7}  graph "
              f"{_fmt(row.get('graph_cold_us')):>9} / {_fmt(row.get('graph_warm_us')):>9}  busy "
              f"{_fmt(k.get('busy_us')):>9}  span {_fmt(k.get('span_us')):>9}  head "
              f"{_fmt(k.get('head_us')):>6}  launches {k.get('launches_per_call')}  "
              f"[{row['seconds']:.1f} s]" + (f"  ERROR {row['error']}" if "error" in row else ""),
              flush=True)
        if meter.cuda:
            torch.cuda.empty_cache()
    result["verify_chain"] = chain_slope(result["ops"])
    result["elapsed_s"] = time.perf_counter() - started
    path = args.out / "profile_ops.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    chain = result["verify_chain"]
    if chain:
        print(f"verify, one more row per request: {chain['us_per_row']:.1f} us per row of G "
              f"(intercept {chain['intercept_us']:.1f} us)")
    print(f"wrote {path} in {result['elapsed_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
