"""Timing: one call's median time, a row's competitors in interleaved rounds, copy bandwidth.

Timing on CUDA uses CUDA events around each call with a 256 MB write between calls, so every
call starts with a cold L2 (the H200's is 50 MB, and at small batches a whole input set fits in
it); the median of many calls is reported. On CPU it uses ``torch.utils.benchmark.Timer`` with
the current torch thread count. :func:`measure` times a row's competitors in interleaved rounds
(so a burst of load hits all of them alike), reports the median of the round medians and their
spread, re-measures a noisy row once, and records how busy the other processes kept the CPU.
Measurements that were not taken are ``None`` and print as "-".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from bench.common import log, synchronize
from bench.row import Row


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

# Larger than any current GPU's L2 (H100/H200: 50 MB, B200: 126 MB), as triton's do_bench uses.
_L2_FLUSH_BYTES = 256 * 1024**2
_COPY_BYTES = 1024**3


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

# ``--smoke`` (the GPU check's dry run): every row's code runs, each competitor is timed by one
# call, and nothing is re-measured. The times mean nothing; the point is that no path is broken.
_smoke = False


def set_smoke(enabled: bool) -> None:
    """Switches smoke timing on or off for every later ``measure`` in this process."""
    global _smoke
    _smoke = enabled


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


def measure(row: Row, competitors: Dict[str, Optional[Callable[[], Any]]], device: torch.device,
            timing: "Timing", *, budgets: Optional[Dict[str, dict]] = None) -> Row:
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
    spreads: Dict[str, Optional[float]] = {name: None for name in live}
    for name, fn in live.items() if _smoke else ():
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples[name].append((time.perf_counter() - start) * 1e6)
    for attempt in range(0 if _smoke else 2):
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


def count_launches(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    """Device-side activities (kernels, copies, memsets) of one call of ``fn``, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def warn_if_busy(device: torch.device) -> None:
    """Logs a warning when other processes already keep the CPU cores busy (CPU runs only)."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        log(f"warning: load average {load:.1f} on {cores} cores before starting; CPU times of "
            f"the eager competitors (many small ops, each a thread barrier) may be inflated")
