"""Shared benchmark harness: timing, copy bandwidth, result rows, the table and result files.

Timing on CUDA uses CUDA events around each call with a 256 MB write between calls, so every
call starts with a cold L2 (the H200's is 50 MB, and at small batches a whole input set fits in
it); the median of many calls is reported. On CPU it uses ``torch.utils.benchmark.Timer`` with
the current torch thread count. Measurements that were not taken are ``None`` and print as "-".
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

RESULTS_DIR = Path(__file__).resolve().parent / "results"

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
               min_reps: int, max_reps: int) -> float:
    flush = _l2_flush_buffer(device)
    fn()  # compile / allocate outside the measurement
    torch.cuda.synchronize(device)

    # Rough per-call cost (flush included) to size the warm-up and the number of repeats.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    estimate_ms = max(start.elapsed_time(end) / 3, 1e-3)

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


def _time_cpu(fn: Callable[[], Any], min_run_time: float) -> float:
    from torch.utils import benchmark

    fn()  # first-call allocations stay out of the measurement
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.blocked_autorange(min_run_time=min_run_time).median


def time_op(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float = 25.0,
            rep_ms: float = 100.0, min_reps: int = 10, max_reps: int = 2000,
            min_run_time: float = 0.3) -> float:
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

    Returns
    -------
    float
        Median seconds per call. On CUDA each call is timed with events and starts with a
        cold L2; on CPU the current ``torch.get_num_threads()`` is used.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            return _time_cuda(fn, device, warmup_ms, rep_ms, min_reps, max_reps)
    return _time_cpu(fn, min_run_time)


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
        Family-specific columns printed after ``variant`` (e.g. mean accepted length).
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

    @property
    def speedup(self) -> Optional[float]:
        """Reference time over our time."""
        return _ratio(self.reference_us, self.ours_us)

    def anchor_speedup(self, name: str) -> Optional[float]:
        """Anchor time over our time."""
        return _ratio(self.anchors.get(name), self.ours_us)

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["speedup"] = self.speedup
        out["anchor_speedup"] = {name: self.anchor_speedup(name) for name in self.anchors}
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

    @classmethod
    def for_device(cls, device: torch.device, quick: bool, *, cpu_seconds, cpu_quick_seconds):
        """The GPU repetitions every family uses; on CPU ``min_run_time`` seconds for (ours,
        others), a family's own choice since its calls take from microseconds to seconds."""
        if device.type == "cuda":
            if quick:
                return cls(dict(rep_ms=30, warmup_ms=10), dict(rep_ms=20, warmup_ms=5, min_reps=5))
            return cls(dict(rep_ms=100, warmup_ms=25), dict(rep_ms=50, warmup_ms=10, min_reps=5))
        ours, others = cpu_quick_seconds if quick else cpu_seconds
        return cls(dict(min_run_time=ours), dict(min_run_time=others))


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


def try_time(label: str, fn: Optional[Callable], device: torch.device, **kw) -> Optional[float]:
    """Median microseconds, or None (and a log line) when ``fn`` is absent or fails."""
    if fn is None:
        return None
    try:
        return time_op(fn, device, **kw) * 1e6
    except Exception as error:
        log(f"  {label}: not measured ({type(error).__name__}: {error})")
        return None


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
        return write_results(rows, name, device, meta())

    rows = run(device, args, checkpoint)
    log("wrote " + ", ".join(str(p) for p in checkpoint(rows)))
    if emit:
        if args.json_only:
            print(json.dumps({"environment": meta(), "rows": [r.to_dict() for r in rows]},
                             indent=2))
        else:
            print_table(rows, title=f"{name} on {meta()['device_name']} ({device})")
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
    return parser


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


def _columns(rows: Sequence[Row]):
    """(header, width, align, getter) for every column the rows need."""
    extras: List[str] = []
    anchors: List[str] = []
    for row in rows:
        extras += [k for k in row.extra if k not in extras]
        anchors += [k for k in row.anchors if k not in anchors]

    def width(header, cells, minimum=6):
        return max(minimum, len(header), *(len(c) for c in cells)) if cells else len(header)

    specs = [
        ("op", "<", lambda r: r.op),
        ("shape", "<", lambda r: r.shape),
        ("variant", "<", lambda r: r.variant),
    ]
    specs += [(k, ">", (lambda r, k=k: _fmt_extra(r.extra.get(k)))) for k in extras]
    specs += [
        ("ours us", ">", lambda r: _fmt(r.ours_us)),
        ("ref us", ">", lambda r: _fmt(r.reference_us)),
        ("x", ">", lambda r: _fmt(r.speedup, 2)),
    ]
    for name in anchors:
        specs += [
            (f"{name} us", ">", (lambda r, n=name: _fmt(r.anchors.get(n)))),
            ("x", ">", (lambda r, n=name: _fmt(r.anchor_speedup(n), 2))),
        ]
    specs += [
        ("MB", ">", lambda r: _fmt(None if r.bytes_moved is None else r.bytes_moved / 1e6)),
        ("GB/s", ">", lambda r: _fmt(r.gbps, 0)),
        ("% copy", ">", lambda r: _fmt(r.pct_copy)),
    ]
    return [
        (header, width(header, [get(r) for r in rows]), align, get)
        for header, align, get in specs
    ]


def format_table(rows: Sequence[Row], title: Optional[str] = None) -> str:
    """Fixed-width table, one line per row; absent values print as "-".

    Parameters
    ----------
    rows : sequence of Row
    title : str, optional
        A line printed above the header.

    Returns
    -------
    str
    """
    columns = _columns(rows)
    header = "  ".join(f"{h:{a}{w}}" for h, w, a, _ in columns)
    lines = [title] if title else []
    lines += [header, "-" * len(header)]
    for row in rows:
        lines.append("  ".join(f"{get(row):{a}{w}}" for _, w, a, get in columns))
    lines.append("times: median microseconds per call; x: that time over ours (>1: ours is faster);"
                 " MB: bytes the op must move; % copy: of the measured copy bandwidth")
    return "\n".join(lines)


def print_table(rows: Sequence[Row], title: Optional[str] = None, file=None) -> None:
    """Prints :func:`format_table` to ``file`` (stdout by default)."""
    print(format_table(rows, title), file=file or sys.stdout, flush=True)


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
                  meta: Optional[Dict[str, Any]] = None) -> List[Path]:
    """Writes rows to ``bench/results/<name>_<device-slug>.json`` and ``.csv``.

    Parameters
    ----------
    rows : iterable of Row
    name : str
        Benchmark family (``verify``) or ``all`` for the combined run.
    device : torch.device, optional
        Names the files; default: CUDA when available, else CPU.
    meta : dict, optional
        Stored under ``"environment"`` in the JSON (see :func:`environment`).

    Returns
    -------
    list of Path
        The JSON and CSV paths written.
    """
    rows = list(rows)
    device = device or resolve_device("auto")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"{name}_{device_slug(device)}"
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
    fields += ["bytes_moved", "gbps", "pct_copy"]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            record = {
                "op": row.op, "shape": row.shape, "variant": row.variant,
                "ours_us": row.ours_us, "reference_us": row.reference_us,
                "speedup": row.speedup, "bytes_moved": row.bytes_moved, "gbps": row.gbps,
                "pct_copy": row.pct_copy,
            }
            record.update({k: row.extra.get(k) for k in extras})
            for name_ in anchors:
                record[f"{name_}_us"] = row.anchors.get(name_)
                record[f"speedup_vs_{name_}"] = row.anchor_speedup(name_)
            writer.writerow({k: ("" if v is None else v) for k, v in record.items()})
    return [json_path, csv_path]
