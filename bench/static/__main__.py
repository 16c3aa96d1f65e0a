"""``python -m bench.static``: a static performance MODEL of the CUDA kernels (an estimate from
the compiled sm_90 code, not a measurement). See docs/performance-model.md.

For every kernel at the benchmark/floor shapes of docs/semantics.md §4: registers, spills, shared
memory, occupancy, SASS instructions per element of the hot loop, bytes moved and in flight, and
a predicted time max(memory, issue, latency) + overheads next to the floor (bytes over the
measured copy bandwidth).

The assumed H200 (SMs, registers, shared memory, clock, HBM bandwidth and latencies, launch and
barrier overheads) is bench/static/model.py's Hardware; docs/performance-model.md gives its
numbers and how each term is computed. Per-iteration instructions are counted along the
cheapest path through the loop body that still has the expected work; caches, dependency stalls,
bank conflicts, tensor-core throughput and host-side dispatch are not modelled.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from bench.static import kernels
from bench.static.binary import Binary, NoDeviceCode, default_so
from bench.static.model import H200
from bench.static.plans import EmulatorUnavailable
from bench.static.sass import StructureError

TITLE = ("MODEL, not a measurement: static estimate from the sm_90 SASS of {so} "
         "(H200: {sms} SMs, {bw:.1f} TB/s, {ghz:.2f} GHz, DRAM latency {lat:.0f} ns)")


def _demangle(names: List[str]) -> Dict[str, str]:
    out = {n: n for n in names}
    tool = shutil.which("c++filt")
    if tool and names:
        res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
        lines = res.stdout.splitlines()
        if len(lines) == len(names):
            out = dict(zip(names, lines))
    short = {}
    for mangled, full in out.items():
        s = full.replace("dspark_ops::kernels::", "").replace("__nv_bfloat16", "bf16")
        s = re.sub(r"^void\s+", "", s)
        s = re.sub(r"\(.*\)$", "", s)
        short[mangled] = s
    return short


def _shown(path: Path) -> str:
    """The binary's path relative to the working directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def run_model(so: Path) -> dict:
    started = time.perf_counter()
    binary = Binary(so)
    ops = kernels.all_ops(binary)
    names = _demangle([l.kernel.name for op in ops for l in op.launches])
    rows = []
    for op in ops:
        launches = [kernels.evaluate(l) for l in op.launches]
        # The op's own kernels, the library calls it makes, and the benchmark's per-call entry.
        model_s = sum(r.total_s for r in launches) + sum(c.total_s() for c in op.library) \
            + H200.op_entry_s
        floor_s = op.floor_bytes / H200.dram_bytes_per_s
        judged_floor_s = max(floor_s, H200.launch_s) if op.launch_bound else floor_s
        worst = max(launches, key=lambda r: r.total_s)
        library_s = sum(c.total_s() for c in op.library)
        rows.append({
            "op": op.op, "shape": op.shape, "variant": op.variant,
            "floor_bytes": op.floor_bytes, "floor_us": floor_s * 1e6,
            "floor_note": "launch-bound: floor = one launch" if op.launch_bound else "",
            "judged_floor_us": judged_floor_s * 1e6,
            "model_us": model_s * 1e6, "model_over_floor": model_s / judged_floor_s,
            "bound": "library" if library_s > worst.total_s else worst.bound,
            "match": op.match, "entry_us": H200.op_entry_s * 1e6,
            "library": [{"call": c.name, "calls": c.count, "flops": c.flops,
                         "dram_bytes": c.dram_bytes, "total_us": c.total_s() * 1e6}
                        for c in op.library],
            "kernels": [{
                "kernel": names[r.kernel], "mangled": r.kernel, "role": r.label,
                "launches": r.count, "regs": r.regs, "local_bytes": r.local_bytes,
                "static_smem": r.static_smem, "dynamic_smem": r.dynamic_smem,
                "threads": r.threads, "blocks": r.blocks,
                "blocks_per_sm": r.occ.blocks_per_sm, "occupancy": r.occ.fraction,
                "limiter": r.occ.limiter,
                "loops": [{"loop": t.name, "instrs_per_iter": t.path_instrs,
                           "elems_per_iter": t.elems_per_iter,
                           "instr_per_elem": t.instr_per_elem, "elements": t.elements,
                           "in_flight_bytes_per_thread": t.in_flight,
                           "loaded_bytes_per_iter": t.loads_per_iter,
                           "matching_loops": t.candidates} for t in r.terms],
                "dram_bytes": r.dram_bytes, "in_flight_bytes_per_sm": r.in_flight_per_sm,
                "memory_us": r.memory_s * 1e6, "issue_us": r.issue_s * 1e6,
                "latency_us": r.latency_s * 1e6, "chain_us": r.chain_s * 1e6,
                "chain": dataclasses.asdict(r.chain), "overhead_us": r.overhead_s * 1e6,
                "serial_chain": dataclasses.asdict(r.serial_chain),
                "time_us": r.time_s * 1e6, "total_us": r.total_s * 1e6, "bound": r.bound,
                "note": r.note,
            } for r in launches],
        })
    return {
        "kind": "MODEL (static estimate, not a measurement)",
        "binary": _shown(so), "arch": binary.arch,
        "hardware": {k: getattr(H200, k) for k in H200.__dataclass_fields__},
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
    }


def _fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(result: dict, out=sys.stdout) -> None:
    hw = result["hardware"]
    print(TITLE.format(so=Path(result["binary"]).name, sms=hw["sms"],
                       bw=hw["dram_bytes_per_s"] / 1e12, ghz=hw["clock_hz"] / 1e9,
                       lat=hw["dram_latency_s"] * 1e9), file=out)
    head = (f"{'kernel':<44}{'shape / launches':<36}{'regs':>5}{'occ':>9}{'instr/el':>9}"
            f"{'MB':>9}{'floor us':>9}{'model us':>9}{'mdl/flr':>8}  bound")
    print(head, file=out)
    print("-" * len(head), file=out)
    for row in result["rows"]:
        print(f"{row['op']:<44}{(row['shape'] + ' ' + row['variant'])[:35]:<36}{'':>5}{'':>9}"
              f"{'':>9}{row['floor_bytes'] / 1e6:>9.1f}{row['judged_floor_us']:>9.1f}"
              f"{row['model_us']:>9.1f}{row['model_over_floor']:>8.2f}  {row['bound']}", file=out)
        for k in row["kernels"]:
            ipe = "/".join(_fmt(t["instr_per_elem"], 1) for t in k["loops"]) or "-"
            occ = f"{k['blocks_per_sm']}b {100 * k['occupancy']:.0f}%"
            grid = f"x{k['launches']} grid {k['blocks']}x{k['threads']}"
            print(f"  {k['kernel'][:42]:<42}{grid[:35]:<36}{k['regs']:>5}{occ:>9}{ipe[:8]:>9}"
                  f"{k['dram_bytes'] * k['launches'] / 1e6:>9.1f}{'':>9}{k['total_us']:>9.1f}"
                  f"{'':>8}  {k['bound']}", file=out)
        for c in row.get("library", []):
            print(f"  {('library: ' + c['call'])[:42]:<42}{('x' + str(c['calls']))[:35]:<36}"
                  f"{'':>5}{'':>9}{'':>9}{c['dram_bytes'] * c['calls'] / 1e6:>9.1f}{'':>9}"
                  f"{c['total_us']:>9.1f}{'':>8}  library", file=out)
    print("instr/el: SASS instructions per element of each costed loop (per thread; '/' "
          "separates loops); occ: resident blocks per SM and warp occupancy; bound: the largest "
          "of memory, issue, latency, chain (a warp's or block's dependent path, counted from "
          "the code), or overhead (launch + work a block does in series); library: cuBLAS/ATen "
          "calls at a stated rate. "
          "MODEL output, not measured.", file=out)


def write_results(result: dict, folder: Path) -> List[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    js = folder / "static_sm90.json"
    js.write_text(json.dumps(result, indent=1) + "\n")
    cs = folder / "static_sm90.csv"
    with cs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "op", "shape", "variant", "kernel", "launches", "regs", "local_bytes",
                    "static_smem", "dynamic_smem", "threads", "blocks", "blocks_per_sm",
                    "occupancy", "instr_per_elem", "dram_bytes", "in_flight_per_sm",
                    "floor_us", "model_us", "model_over_floor", "memory_us", "issue_us",
                    "latency_us", "chain_us", "overhead_us", "bound"])
        for row in result["rows"]:
            w.writerow(["MODEL", row["op"], row["shape"], row["variant"], "(op total)", "", "",
                        "", "", "", "", "", "", "", "", f"{row['floor_bytes']:.0f}", "",
                        f"{row['judged_floor_us']:.2f}", f"{row['model_us']:.2f}",
                        f"{row['model_over_floor']:.3f}", "", "", "", "", "", row["bound"]])
            for k in row["kernels"]:
                w.writerow(["MODEL", row["op"], row["shape"], row["variant"], k["kernel"],
                            k["launches"], k["regs"], k["local_bytes"], k["static_smem"],
                            k["dynamic_smem"], k["threads"], k["blocks"], k["blocks_per_sm"],
                            f"{k['occupancy']:.3f}",
                            "/".join(f"{t['instr_per_elem']:.2f}" for t in k["loops"]),
                            f"{k['dram_bytes'] * k['launches']:.0f}",
                            f"{k['in_flight_bytes_per_sm']:.0f}", "", f"{k['total_us']:.2f}", "",
                            f"{k['memory_us']:.2f}", f"{k['issue_us']:.2f}",
                            f"{k['latency_us']:.2f}", f"{k['chain_us']:.2f}",
                            f"{k['overhead_us']:.2f}", k["bound"]])
    return [js, cs]


def compare(old: dict, new: dict, out=sys.stdout) -> None:
    """Before/after ratios per row (new / old) of the model's times and key kernel numbers."""
    print(f"MODEL before/after: {old['binary']} -> {new['binary']} "
          "(ratios new/old; < 1 is faster)", file=out)
    index = {(r["op"], r["shape"], r["variant"]): r for r in old["rows"]}
    print(f"{'op / kernel':<58}{'old us':>9}{'new us':>9}{'new/old':>8}  regs old->new, "
          "instr/el old->new", file=out)
    for row in new["rows"]:
        before = index.get((row["op"], row["shape"], row["variant"]))
        label = f"{row['op']} {row['shape']} {row['variant']}"
        if before is None:
            print(f"{label[:57]:<58}{'-':>9}{row['model_us']:>9.1f}{'-':>8}  (new row)", file=out)
            continue
        print(f"{label[:57]:<58}{before['model_us']:>9.1f}{row['model_us']:>9.1f}"
              f"{row['model_us'] / before['model_us']:>8.2f}", file=out)
        old_k = {k["role"]: k for k in before["kernels"]}
        same_count = len(before["kernels"]) == len(row["kernels"])
        for n, k in enumerate(row["kernels"]):
            # By role, else (a kernel whose algorithm changed) by position in the op.
            o = old_k.get(k["role"]) or (before["kernels"][n] if same_count else None)
            if o is None:
                continue
            ipe_o = "/".join(_fmt(t["instr_per_elem"]) for t in o["loops"]) or "-"
            ipe_n = "/".join(_fmt(t["instr_per_elem"]) for t in k["loops"]) or "-"
            ratio = k["total_us"] / o["total_us"] if o["total_us"] else float("nan")
            print(f"  {k['kernel'][:55]:<56}{o['total_us']:>9.1f}{k['total_us']:>9.1f}"
                  f"{ratio:>8.2f}  {o['regs']}->{k['regs']}, {ipe_o}->{ipe_n}", file=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--so", type=Path, help="extension binary to model (default: the "
                        "checkout's built dspark_ops/_C*.so)")
    parser.add_argument("--results-dir", type=Path, default=Path("build/bench-results"),
                        help="where static_sm90.json/.csv go (default: build/bench-results)")
    parser.add_argument("--compare", type=Path, metavar="OLD.json",
                        help="also print new/old ratios against an earlier static_sm90.json")
    parser.add_argument("--json-only", action="store_true", help="print the JSON, not the table")
    args = parser.parse_args(argv)
    try:
        so = args.so or default_so()
        if not Path(so).exists():
            raise FileNotFoundError(f"{so} does not exist")
        result = run_model(Path(so))
    except (NoDeviceCode, EmulatorUnavailable) as error:
        print(f"bench.static: {error}", file=sys.stderr)
        return 2
    except StructureError as error:
        print(f"bench.static: MODEL FAILED, the compiled code does not have the expected "
              f"structure: {error}", file=sys.stderr)
        return 3
    except FileNotFoundError as error:
        print(f"bench.static: {error}", file=sys.stderr)
        return 2
    paths = write_results(result, args.results_dir)
    if args.json_only:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
        print(f"wrote {', '.join(str(p) for p in paths)} in {result['elapsed_s']:.1f} s",
              file=sys.stderr)
    if args.compare:
        compare(json.loads(args.compare.read_text()), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
