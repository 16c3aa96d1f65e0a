"""Shared benchmark harness: timing, copy bandwidth, result rows, the table and result files.

Timing on CUDA uses CUDA events around each call with a 256 MB write between calls, so every
call starts with a cold L2 (the H200's is 50 MB, and at small batches a whole input set fits in
it); the median of many calls is reported. On CPU it uses ``torch.utils.benchmark.Timer`` with
the current torch thread count. :func:`measure` times a row's competitors in interleaved rounds
(so a burst of load hits all of them alike), reports the median of the round medians and their
spread, re-measures a noisy row once, and records how busy the other processes kept the CPU.
Measurements that were not taken are ``None`` and print as "-".
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch


def _use_the_build_cuda_root() -> None:
    """One CUDA root: torch.utils.benchmark imports torch's extension helper, which guesses a
    toolkit root of its own (and logs it) when CUDA_HOME is unset; give it the one the extension
    was built with."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    try:
        from dspark_ops._build_info import BUILD_INFO
    except ImportError:
        return
    if BUILD_INFO.get("cuda_home"):
        os.environ["CUDA_HOME"] = BUILD_INFO["cuda_home"]


_use_the_build_cuda_root()

# Where runs write their JSON/CSV: build/ is ignored by git, so benchmarking leaves the checkout
# clean. bench/results/ holds the committed snapshots (``--results-dir bench/results``).
RESULTS_DIR = Path(__file__).resolve().parents[1] / "build" / "bench-results"
SNAPSHOT_DIR = Path(__file__).resolve().parent / "results"

# Larger than any current GPU's L2 (H100/H200: 50 MB, B200: 126 MB), as triton's do_bench uses.
_L2_FLUSH_BYTES = 256 * 1024**2
_COPY_BYTES = 1024**3


# --------------------------------------------------------------------------------------------
# Devices


def resolve_device(name: str = "auto") -> torch.device:
    """The device to benchmark on.

    Parameters
    ----------
    name : str
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Returns
    -------
    torch.device
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench: --device {name} was asked for but no CUDA device is available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    """Human-readable name of the device (GPU model, or the CPU model where the OS says it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_slug(device: torch.device) -> str:
    """``device_name`` reduced to ``[a-z0-9-]`` for file names (e.g. ``nvidia-h200``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return slug or device.type


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the table (or the JSON with --json-only)."""
    print(message, file=sys.stderr, flush=True)


_reported: set = set()


def report_once(key: str, message: str) -> None:
    """Logs ``message`` the first time ``key`` is seen in this process (anchor status lines)."""
    if key not in _reported:
        _reported.add(key)
        log(message)


# --------------------------------------------------------------------------------------------
# Timing


@functools.lru_cache(maxsize=None)
def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


def _time_cuda(fn: Callable[[], Any], device: torch.device, warmup_ms: float, rep_ms: float,
               min_reps: int, max_reps: int, warm: bool = False) -> float:
    flush = _l2_flush_buffer(device)
    if not warm:
        fn()  # compile / allocate outside the measurement
        torch.cuda.synchronize(device)

    # Rough per-call cost (flush included) to size the warm-up and the number of repeats.
    probes = 1 if warm else 3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(probes):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    estimate_ms = max(start.elapsed_time(end) / probes, 1e-3)

    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    reps = min(max_reps, max(min_reps, int(rep_ms / estimate_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        # The flush also lets the host run ahead, so the events time the kernels, not launches.
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3


def _time_cpu(fn: Callable[[], Any], min_run_time: float, warm: bool = False) -> float:
    from torch.utils import benchmark

    if not warm:
        fn()  # first-call allocations stay out of the measurement
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median


def time_op(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float = 25.0,
            rep_ms: float = 100.0, min_reps: int = 10, max_reps: int = 2000,
            min_run_time: float = 0.3, warm: bool = False) -> float:
    """Median wall time of one call of ``fn``, in seconds.

    Parameters
    ----------
    fn : callable
        Takes no arguments; launches the work on ``device``.
    device : torch.device
        Where ``fn`` runs.
    warmup_ms, rep_ms : float
        CUDA only: warm-up time and measurement time to aim for (the call count follows from a
        first estimate, clamped to ``[min_reps, max_reps]``).
    min_reps, max_reps : int
        CUDA only: bounds on the number of timed calls.
    min_run_time : float
        CPU only: seconds of measurement for ``Timer.blocked_autorange``.
    warm : bool
        ``fn`` already ran here: skip the untimed first call (and, on CUDA, size the repeats
        from one probe call instead of three).

    Returns
    -------
    float
        Median seconds per call. On CUDA each call is timed with events and starts with a
        cold L2; on CPU the current ``torch.get_num_threads()`` is used.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            return _time_cuda(fn, device, warmup_ms, rep_ms, min_reps, max_reps, warm)
    return _time_cpu(fn, min_run_time, warm)


class LoadMeter:
    """CPU time the *other* processes used while it ran, in cores (Linux; ``None`` elsewhere).

    The machine-wide busy time (``/proc/stat``) minus this process's own CPU time, over the wall
    time: 1.0 means another process kept one core busy throughout. Unlike the load average,
    which trails by a minute, it covers exactly the measured interval.
    """

    def __init__(self) -> None:
        self._start = self._now()

    @staticmethod
    def _busy_seconds() -> Optional[float]:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _now(self):
        times = os.times()
        return time.perf_counter(), self._busy_seconds(), times.user + times.system

    def others_cores(self) -> Optional[float]:
        wall0, busy0, own0 = self._start
        wall1, busy1, own1 = self._now()
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return None
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))


# A row is re-measured once, then flagged, when a competitor's rounds differ by more than this
# fraction of their median; and flagged when other processes used more than this many cores.
NOISY_SPREAD = 0.25
BUSY_CORES = 0.5


def _spread(samples: Sequence[float]) -> Optional[float]:
    """Interquartile range of the round times over their median; ``None`` below two rounds."""
    if len(samples) < 2:
        return None
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def _decisive(samples: Dict[str, List[float]]) -> List[str]:
    """The competitors a row's ratio rests on: ours and the fastest other one."""
    others = {n: statistics.median(v) for n, v in samples.items() if v and n != "ours"}
    return ["ours"] + ([min(others, key=others.get)] if others else [])


def measure(row: "Row", competitors: Dict[str, Optional[Callable[[], Any]]], device: torch.device,
            timing: "Timing", *, budgets: Optional[Dict[str, dict]] = None) -> "Row":
    """Times a row's competitors on the same inputs, interleaved, and fills the row in.

    Parameters
    ----------
    row : Row
        Gets ``ours_us`` (competitor ``"ours"``), ``reference_us`` (``"ref"``), one anchor per
        other name, and ``spread``, ``others_load``, ``rounds`` and ``flags``.
    competitors : dict
        Name -> callable without arguments; ``None`` (or one that raises on its first call) is
        not measured and prints as "-".
    device : torch.device
    timing : Timing
        Budgets (``time_op`` keywords) for ``"ours"`` and for the others, and the round count:
        each round times every competitor once with ``1 / rounds`` of its budget, in an order
        rotated from round to round.
    budgets : dict, optional
        Per-name budgets that override ``timing``'s.

    Returns
    -------
    Row
        The same row. Each time is the median of its round medians. When the spread over the
        rounds of ours or of the fastest other competitor (the two the ratio rests on) exceeds
        ``NOISY_SPREAD``, the rounds are run once more and all are kept; a row still that noisy is
        flagged ``noisy``, and one measured while other processes used more than ``BUSY_CORES``
        cores is flagged ``busy``.
    """
    budgets = budgets or {}
    live: Dict[str, Callable[[], Any]] = {}
    for name, fn in competitors.items():
        if fn is None:
            continue
        try:  # compile / allocate outside the measurement; a competitor that fails is left out
            fn()
            synchronize(device)
            live[name] = fn
        except Exception as error:
            log(f"  {name}: not measured ({type(error).__name__}: {error})")
    samples: Dict[str, List[float]] = {name: [] for name in live}
    meter = LoadMeter()
    rounds = timing.rounds
    for attempt in range(2):
        for r in range(rounds):
            names = list(live)
            names = names[r % len(names):] + names[: r % len(names)] if names else names
            for name in names:
                budget = dict(budgets.get(name) or (timing.ours if name == "ours" else timing.others))
                for key in ("min_run_time", "rep_ms", "warmup_ms"):
                    if key in budget:
                        budget[key] = budget[key] / rounds
                if device.type == "cuda":  # the rounds together make up the repeats
                    budget["min_reps"] = max(2, budget.get("min_reps", 10) // rounds)
                budget["warm"] = True
                try:
                    samples[name].append(time_op(live[name], device, **budget) * 1e6)
                except Exception as error:
                    log(f"  {name}: round {r} failed ({type(error).__name__}: {error})")
        spreads = {name: _spread(values) for name, values in samples.items()}
        if attempt == 0 and any((spreads.get(n) or 0.0) > NOISY_SPREAD for n in _decisive(samples)):
            log(f"  {row.op} {row.shape} {row.variant}: spread "
                + ", ".join(f"{n} {100 * (v or 0):.0f}%" for n, v in spreads.items())
                + "; measuring again")
            continue
        break
    medians = {name: statistics.median(v) if v else None for name, v in samples.items()}
    for name in competitors:
        value = medians.get(name)
        if name == "ours":
            row.ours_us = value
        elif name == "ref":
            row.reference_us = value
        else:
            row.anchors[name] = value
    row.spread = {name: v for name, v in spreads.items() if v is not None}
    row.rounds = max((len(v) for v in samples.values()), default=0)
    row.others_load = meter.others_cores() if device.type == "cpu" else None
    if any(row.spread.get(n, 0.0) > NOISY_SPREAD for n in _decisive(samples)):
        row.flags.append("noisy")
    if row.others_load is not None and row.others_load > BUSY_CORES:
        row.flags.append("busy")
    return row


@functools.lru_cache(maxsize=None)
def measure_copy_bandwidth(device: torch.device) -> float:
    """Achieved bandwidth of a large same-device copy, counting bytes read plus bytes written.

    Parameters
    ----------
    device : torch.device

    Returns
    -------
    float
        GB/s (1e9 bytes per second): ``2 * nbytes / time`` for a 1 GiB copy on CUDA, 256 MiB on
        CPU. This is the practical memory roofline that "% copy" columns refer to.
    """
    nbytes = _COPY_BYTES if device.type == "cuda" else _COPY_BYTES // 4
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device, rep_ms=200.0, min_run_time=0.5)
    return 2 * nbytes / seconds / 1e9


# --------------------------------------------------------------------------------------------
# Rows, table, files


@dataclasses.dataclass
class Row:
    """One benchmark measurement.

    Attributes
    ----------
    op, shape, variant : str
        What was timed (``shape`` is a short human-readable string).
    ours_us : float or None
        Median time of the dspark_ops kernel, microseconds.
    reference_us : float or None
        Median time of the eager reference (``dspark_ops.reference``) on the same inputs.
    bytes_moved : int or None
        Bytes the op must move at minimum (GPU rows); gives ``gbps`` and ``pct_copy``.
    gbps, pct_copy : float or None
        Achieved bandwidth from ``bytes_moved / ours_us`` and its share of the measured copy
        bandwidth; filled in by :func:`finish_row`.
    anchors : dict
        Anchor name -> median microseconds (``None``: not measured).
    extra : dict
        Family-specific columns printed after ``variant`` (e.g. mean accepted length); each key
        has an entry in ``LEGEND``.
    spread : dict
        Competitor name -> interquartile range of its round times over their median.
    others_load : float or None
        Cores other processes kept busy during the row's measurement (CPU rows).
    rounds : int
        Interleaved rounds per competitor.
    flags : list of str
        ``noisy`` / ``busy`` (see :func:`measure`): read that row's ratios with care.
    """

    op: str
    shape: str
    variant: str
    ours_us: Optional[float] = None
    reference_us: Optional[float] = None
    bytes_moved: Optional[int] = None
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    anchors: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    spread: Dict[str, float] = dataclasses.field(default_factory=dict)
    others_load: Optional[float] = None
    rounds: int = 0
    flags: List[str] = dataclasses.field(default_factory=list)

    @property
    def speedup(self) -> Optional[float]:
        """Reference time over our time."""
        return _ratio(self.reference_us, self.ours_us)

    @property
    def best_baseline(self) -> tuple:
        """(name, microseconds) of the fastest competitor other than ours: the reference or an
        anchor; ``(None, None)`` when none was measured."""
        timed = {**{"ref": self.reference_us}, **self.anchors}
        timed = {k: v for k, v in timed.items() if v is not None}
        if not timed:
            return None, None
        name = min(timed, key=timed.get)
        return name, timed[name]

    def anchor_speedup(self, name: str) -> Optional[float]:
        """Anchor time over our time."""
        return _ratio(self.anchors.get(name), self.ours_us)

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["speedup"] = self.speedup
        out["anchor_speedup"] = {name: self.anchor_speedup(name) for name in self.anchors}
        out["best_baseline"], out["best_baseline_us"] = self.best_baseline
        out["speedup_vs_best"] = _ratio(out["best_baseline_us"], self.ours_us)
        return out


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def finish_row(row: Row, copy_gbps: Optional[float]) -> Row:
    """Fills ``gbps`` and ``pct_copy`` from ``bytes_moved``, ``ours_us`` and the copy bandwidth."""
    if row.bytes_moved is not None and row.ours_us:
        row.gbps = row.bytes_moved / (row.ours_us * 1e-6) / 1e9
        if copy_gbps:
            row.pct_copy = 100.0 * row.gbps / copy_gbps
    return row


@dataclasses.dataclass
class Timing:
    """How hard to time each competitor: ``time_op`` keyword arguments (ours gets the most)."""

    ours: dict
    others: dict
    rounds: int = 5

    @classmethod
    def for_device(cls, device: torch.device, quick: bool, *, cpu_seconds, cpu_quick_seconds):
        """The GPU repetitions every family uses; on CPU ``min_run_time`` seconds for (ours,
        others), a family's own choice since its calls take from microseconds to seconds."""
        if device.type == "cuda":
            if quick:
                return cls(dict(rep_ms=30, warmup_ms=10), dict(rep_ms=20, warmup_ms=5, min_reps=5),
                           rounds=3)
            return cls(dict(rep_ms=100, warmup_ms=25), dict(rep_ms=50, warmup_ms=10, min_reps=5))
        ours, others = cpu_quick_seconds if quick else cpu_seconds
        return cls(dict(min_run_time=ours), dict(min_run_time=others), rounds=3 if quick else 5)


def has_kernel(op: str, device_type: str) -> bool:
    """Whether this build registers a kernel of ``torch.ops.dspark_ops.<op>`` for the device."""
    from dspark_ops._library import op_backends

    return device_type.upper() in op_backends(op)


def count_launches(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    """Device-side activities (kernels, copies, memsets) of one call of ``fn``, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def family_main(name: str, args: argparse.Namespace, run: Callable[..., List[Row]], *,
                emit: bool = True, copy_bandwidth: bool = True,
                after_table: Optional[Callable[[List[Row], torch.device], None]] = None) -> List[Row]:
    """What every ``bench_<family>.main`` does around its ``run``.

    Resolves the device, calls ``run(device, args, checkpoint)`` (``checkpoint(rows)`` writes the
    rows measured so far, so a killed run keeps them), writes the results and prints the table
    (or JSON with ``--json-only``). ``copy_bandwidth``: measure it (once, on GPU) for the
    ``% copy`` column.
    """
    device = resolve_device(args.device)
    log(f"bench {name} on {device} ({torch.get_num_threads()} threads)")
    warn_if_busy(device)

    @functools.lru_cache(maxsize=None)
    def meta():  # measured once: the copy bandwidth takes a 1 GiB copy
        measure = copy_bandwidth and device.type == "cuda"
        return environment(device, measure_copy_bandwidth(device) if measure else None)

    def checkpoint(rows):
        return write_results(rows, name, device, meta(), results_dir=args.results_dir)

    rows = run(device, args, checkpoint)
    log("wrote " + ", ".join(str(p) for p in checkpoint(rows)))
    if emit:
        if args.json_only:
            print(json.dumps({"environment": meta(), "rows": [r.to_dict() for r in rows]},
                             indent=2))
        else:
            print_table(rows, title=f"{name} on {meta()['device_name']} ({device})",
                        wide=args.wide)
            if after_table is not None:
                after_table(rows, device)
    return rows


def format_us(value: Optional[float]) -> str:
    """Microseconds for progress lines; "-" when not measured."""
    return "-" if value is None else f"{value:.1f}"


def family_arg_parser(description: str, quick_help: str, anchors_help: str) -> argparse.ArgumentParser:
    """The command line every ``bench_<family>.py`` shares (``python -m bench`` passes it on)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--json-only", action="store_true",
                        help="print the results as JSON on stdout instead of the table")
    parser.add_argument("--no-anchors", action="store_true", help=anchors_help)
    add_output_args(parser)
    return parser


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--wide`` and ``--results-dir``, shared by the families and ``python -m bench``."""
    parser.add_argument("--wide", action="store_true",
                        help="print every competitor and family column, not only the best one")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help=f"where the JSON and CSV results go (default {RESULTS_DIR}, ignored "
                             f"by git; {SNAPSHOT_DIR} holds the committed snapshots)")


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_extra(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return _fmt(value, 2 if abs(value) < 100 else 0)
    return _fmt(value)


# Every column either table can print, explained under the table.
LEGEND = {
    "op": "the dspark_ops op timed",
    "shape": "input sizes (B requests, G block, V vocabulary, L context, H heads, D head dim, ...)",
    "variant": "input kind: dtypes, greedy or sampled, acceptance rate a~, filters, ...",
    "ours us": "median microseconds per call of the dspark_ops op (median of the round medians)",
    "spread": "ours: interquartile range of the round times / their median, %",
    "best": "the fastest other competitor: ref (dspark_ops.reference, eager) or an anchor",
    "best us": "its median microseconds per call",
    "x": "that competitor's time over ours (> 1: ours is faster)",
    "ref us": "the pure-PyTorch reference (dspark_ops.reference), median microseconds",
    "GB/s": "bytes the op must move / our time",
    "% copy": "GB/s over the measured same-device copy bandwidth",
    "MB": "bytes the op must move at minimum, MB",
    "load": "cores other processes kept busy while the row was measured (CPU)",
    "flags": f"noisy: ours' or best's spread > {100 * NOISY_SPREAD:.0f}% even after a re-measure;"
             f"\n{'':13}busy: load > {BUSY_CORES} cores. Trust such rows' ratios less",
    # Family columns (Row.extra)
    "dtypes": "input dtypes (bf16, f16, f32; target/draft or hidden/weights)",
    "acc.len": "mean accepted draft tokens per request in this input set",
    "alpha": "accepted / tested draft tokens",
    "match": "requests (or tokens) whose output equals the reference's, of all",
    "MB all": "bytes of every input row, MB (what an unfused kernel reads)",
    "dz": "max |draft_logits - reference| over the tokens that match",
    "eager dz": "the same for the eager PyTorch competitor",
    "err": "max |output - reference| (floats)",
    "launches": "device activities (kernels, copies, memsets) per call, by the profiler",
    "floor us": "bytes the op must move / measured copy bandwidth, microseconds",
    "mean l": "mean verify length chosen per request",
    "graph us": "ours inside a CUDA graph, microseconds (launch overhead removed)",
    "target": "the op's own goal for this shape: met / not met",
}


def _width(header, cells):
    return max(6, len(header), *(len(c) for c in cells)) if cells else len(header)


def _flags(row: Row) -> str:
    return ",".join(row.flags)


def _columns(rows: Sequence[Row], wide: bool = False):
    """(header, width, align, getter) for every column the rows need."""
    extras: List[str] = []
    anchors: List[str] = []
    for row in rows:
        extras += [k for k in row.extra if k not in extras]
        anchors += [k for k in row.anchors if k not in anchors]
    unexplained = [k for k in extras if k not in LEGEND]
    if unexplained:
        raise KeyError(f"bench: columns without a LEGEND entry: {unexplained}")
    gpu = any(r.bytes_moved is not None for r in rows)
    cpu = any(r.others_load is not None for r in rows)

    specs = [
        ("op", "<", lambda r: r.op),
        ("shape", "<", lambda r: r.shape),
        ("variant", "<", lambda r: r.variant),
    ]
    if wide:
        specs += [(k, ">", (lambda r, k=k: _fmt_extra(r.extra.get(k)))) for k in extras]
    specs += [
        ("ours us", ">", lambda r: _fmt(r.ours_us)),
        ("spread", ">", lambda r: _fmt(None if "ours" not in r.spread else 100 * r.spread["ours"], 0)),
    ]
    if wide:
        specs += [
            ("ref us", ">", lambda r: _fmt(r.reference_us)),
            ("x", ">", lambda r: _fmt(r.speedup, 2)),
        ]
        for name in anchors:
            specs += [
                (f"{name} us", ">", (lambda r, n=name: _fmt(r.anchors.get(n)))),
                ("x", ">", (lambda r, n=name: _fmt(r.anchor_speedup(n), 2))),
            ]
    else:
        specs += [
            ("best", "<", lambda r: _fmt(r.best_baseline[0])),
            ("best us", ">", lambda r: _fmt(r.best_baseline[1])),
            ("x", ">", lambda r: _fmt(_ratio(r.best_baseline[1], r.ours_us), 2)),
        ]
    if gpu:
        if wide:
            specs += [("MB", ">", lambda r: _fmt(None if r.bytes_moved is None
                                                 else r.bytes_moved / 1e6))]
        specs += [
            ("GB/s", ">", lambda r: _fmt(r.gbps, 0)),
            ("% copy", ">", lambda r: _fmt(r.pct_copy)),
        ]
    if cpu:
        specs += [("load", ">", lambda r: _fmt(r.others_load, 1))]
    specs += [("flags", "<", _flags)]
    return [(header, _width(header, [get(r) for r in rows]), align, get)
            for header, align, get in specs]


def format_table(rows: Sequence[Row], title: Optional[str] = None, wide: bool = False) -> str:
    """Fixed-width table, one line per row, then a legend of its columns; absent values are "-".

    Parameters
    ----------
    rows : sequence of Row
    title : str, optional
        A line printed above the header.
    wide : bool
        Every competitor and family column (``--wide``); by default only ours, the fastest other
        competitor and the ratio.

    Returns
    -------
    str
    """
    columns = _columns(rows, wide)
    header = "  ".join(f"{h:{a}{w}}" for h, w, a, _ in columns)
    lines = [title] if title else []
    lines += [header, "-" * len(header)]
    for row in rows:
        lines.append("  ".join(f"{get(row):{a}{w}}" for _, w, a, get in columns).rstrip())
    flagged = sum(1 for r in rows if r.flags)
    lines.append("")
    explained = []
    for header, _, _, _ in columns:
        key = header[:-3] if header.endswith(" us") and header not in LEGEND else header
        if header in explained:
            continue
        explained.append(header)
        text = LEGEND.get(header) or (f"anchor {key}: median microseconds per call"
                                      if header.endswith(" us") else "")
        lines.append(f"  {header:<10} {text}")
    rounds = max((r.rounds for r in rows), default=0)
    lines.append(f"  (each time: the median of {rounds} interleaved rounds; {flagged} of "
                 f"{len(rows)} rows flagged)")
    return "\n".join(lines)


def print_table(rows: Sequence[Row], title: Optional[str] = None, file=None,
                wide: bool = False) -> None:
    """Prints :func:`format_table` to ``file`` (stdout by default)."""
    print(format_table(rows, title, wide), file=file or sys.stdout, flush=True)


def environment(device: torch.device, copy_gbps: Optional[float] = None) -> Dict[str, Any]:
    """What a result file needs to be read later: device, versions, threads, copy bandwidth."""
    env = {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "copy_gbps": copy_gbps,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "timer": "cuda events, L2 flushed, median" if device.type == "cuda"
        else "torch.utils.benchmark blocked_autorange, median",
    }
    if hasattr(os, "getloadavg"):
        # CPU timings of multi-op eager code degrade badly when other processes share the cores.
        env["load_average"] = [round(x, 2) for x in os.getloadavg()]
    try:
        import dspark_ops

        env["dspark_ops"] = dspark_ops.__version__
    except ImportError:
        pass
    return env


def warn_if_busy(device: torch.device) -> None:
    """Logs a warning when other processes already keep the CPU cores busy (CPU runs only)."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        log(f"warning: load average {load:.1f} on {cores} cores before starting; CPU times of "
            f"the eager competitors (many small ops, each a thread barrier) may be inflated")


def write_results(rows: Iterable[Row], name: str, device: Optional[torch.device] = None,
                  meta: Optional[Dict[str, Any]] = None,
                  results_dir: Optional[Path] = None) -> List[Path]:
    """Writes rows to ``<results_dir>/<name>_<device-slug>.json`` and ``.csv``.

    Parameters
    ----------
    rows : iterable of Row
    name : str
        Benchmark family (``verify``) or ``all`` for the combined run.
    device : torch.device, optional
        Names the files; default: CUDA when available, else CPU.
    meta : dict, optional
        Stored under ``"environment"`` in the JSON (see :func:`environment`).
    results_dir : Path, optional
        Default ``RESULTS_DIR`` (under build/, ignored by git).

    Returns
    -------
    list of Path
        The JSON and CSV paths written.
    """
    rows = list(rows)
    device = device or resolve_device("auto")
    results_dir = Path(results_dir or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_dir / f"{name}_{device_slug(device)}"
    json_path, csv_path = stem.with_suffix(".json"), stem.with_suffix(".csv")

    payload = {"environment": meta or environment(device), "rows": [r.to_dict() for r in rows]}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")

    extras, anchors = [], []
    for row in rows:
        extras += [k for k in row.extra if k not in extras]
        anchors += [k for k in row.anchors if k not in anchors]
    fields = ["op", "shape", "variant", *extras, "ours_us", "reference_us", "speedup"]
    for name_ in anchors:
        fields += [f"{name_}_us", f"speedup_vs_{name_}"]
    fields += ["best_baseline", "best_baseline_us", "speedup_vs_best", "spread_ours", "others_load",
               "rounds", "flags", "bytes_moved", "gbps", "pct_copy"]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            record = {
                "op": row.op, "shape": row.shape, "variant": row.variant,
                "ours_us": row.ours_us, "reference_us": row.reference_us,
                "speedup": row.speedup, "bytes_moved": row.bytes_moved, "gbps": row.gbps,
                "pct_copy": row.pct_copy, "spread_ours": row.spread.get("ours"),
                "others_load": row.others_load, "rounds": row.rounds,
                "flags": " ".join(row.flags),
            }
            record["best_baseline"], record["best_baseline_us"] = row.best_baseline
            record["speedup_vs_best"] = _ratio(record["best_baseline_us"], row.ours_us)
            record.update({k: row.extra.get(k) for k in extras})
            for name_ in anchors:
                record[f"{name_}_us"] = row.anchors.get(name_)
                record[f"speedup_vs_{name_}"] = row.anchor_speedup(name_)
            writer.writerow({k: ("" if v is None else v) for k, v in record.items()})
    return [json_path, csv_path]
