"""Reporting: the fixed-width table of result rows (:mod:`bench.row`) and its legend, the
JSON/CSV result files, and the command line and ``main`` every ``bench_<family>.py`` shares."""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from bench.common import device_name, device_slug, log, resolve_device
from bench.row import Row, ratio
from bench.timing import BUSY_CORES, NOISY_SPREAD, measure_copy_bandwidth, set_smoke, warn_if_busy

# Where runs write their JSON/CSV: build/ is ignored by git, so benchmarking leaves the checkout
# clean. bench/results/ holds the committed snapshots (``--results-dir bench/results``).
RESULTS_DIR = Path(__file__).resolve().parents[1] / "build" / "bench-results"
SNAPSHOT_DIR = Path(__file__).resolve().parent / "results"


def finish_row(row: Row, copy_gbps: Optional[float]) -> Row:
    """Fills ``gbps`` and ``pct_copy`` from ``bytes_moved``, ``ours_us`` and the copy bandwidth."""
    if row.bytes_moved is not None and row.ours_us:
        row.gbps = row.bytes_moved / (row.ours_us * 1e-6) / 1e9
        if copy_gbps:
            row.pct_copy = 100.0 * row.gbps / copy_gbps
    return row


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
    if args.smoke:
        args.quick = True
        set_smoke(True)
    log(f"bench {name} on {device} ({torch.get_num_threads()} threads)"
        + (", smoke run: times mean nothing" if args.smoke else ""))
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
    add_smoke_arg(parser)
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--json-only", action="store_true",
                        help="print the results as JSON on stdout instead of the table")
    parser.add_argument("--no-anchors", action="store_true", help=anchors_help)
    add_output_args(parser)
    return parser


def add_smoke_arg(parser: argparse.ArgumentParser) -> None:
    """``--smoke``: the ``--quick`` rows, each competitor called once; times are meaningless."""
    parser.add_argument("--smoke", action="store_true",
                        help="run every --quick row's code once, each competitor timed by a single "
                             "call (checks that nothing is broken; the times mean nothing)")


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
    "peak MB": "ours: most memory held during the call beyond its inputs, MB",
    "ref MB": "the same for the reference (ref)",
    "chunked MB": "the same for the chunked eager loss",
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
            ("x", ">", lambda r: _fmt(ratio(r.best_baseline[1], r.ours_us), 2)),
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
            record["speedup_vs_best"] = ratio(record["best_baseline_us"], row.ours_us)
            record.update({k: row.extra.get(k) for k in extras})
            for name_ in anchors:
                record[f"{name_}_us"] = row.anchors.get(name_)
                record[f"speedup_vs_{name_}"] = row.anchor_speedup(name_)
            writer.writerow({k: ("" if v is None else v) for k, v in record.items()})
    return [json_path, csv_path]
