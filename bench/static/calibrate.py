"""``python -m bench.static.calibrate``: re-fits the static model's FITTED constants
(bench/static/model.py) to measured times, from a model snapshot and benchmark results alone.

    python -m bench.static.calibrate --model static_sm90.json --bench all_nvidia-h200.json

Every term a snapshot records is either independent of the fitted constants (memory, issue,
Little's-law latency, launches) or a count times them (each kernel's chain and serial chain,
each library call's FLOPs), so an op's time can be recomputed for other constants without the
binary or the emulator. (Verify's expected makespan was scheduled at the snapshot's constants;
its rows and tails on the critical path are kept.) The fit: a grid around the current values,
the smallest worst |log(model / measured)| over the table's rows (TABLE), ties by the RMS. It
prints the constants and the rows; the values go into Hardware by hand, with the docs' table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from bench.static.measured import find_measured, load_bench
from bench.static.model import Chain, Hardware

# The rows of docs/performance-model.md's H200 table: (op, the model row's variant, a prefix of
# its shape). The constants below are fitted to them; the snapshot's other matched rows check.
TABLE: List[Tuple[str, str, str]] = [
    ("verify", "greedy a=0.69", "B=64 G=8 V=151936"),
    ("verify", "sampled a=0.65", "B=64 G=8 V=151936"),
    ("verify", "sampled a=0.88 top-k 50 top-p 0.9", "B=64 G=8 V=151936"),
    ("markov_draft", "sampled", "B=64 G=7 V=151936 r=256"),
    ("markov_draft", "greedy", "B=64 G=7 V=151936 r=256"),
    ("rnn_draft", "sampled", "B=64 G=7 V=151936 r=256 d=2560"),
    ("draft_confidence", "calibrated", "B=64 G=7 d=2560 r=256"),
    ("block_draft_attention", "bf16", "B=64 G=8 Hq=32 Hkv=8 D=128 ctx=4096"),
    ("append_context_kv", "bf16", "B=64 n<=9 Hkv=8 D=128 ctx=4096"),
    ("schedule_verify", "one-stage", "B=256 G=16"),
    ("dspark_loss", "bf16 vocabulary pass + cuBLAS products", "N=3584 V=151936 d=2560 r=256"),
]

FITTED = ("dram_dependent_s", "l2_dependent_s", "fence_s", "dependent_instr_s", "gemm_fraction")
# Multiples of each constant's current value the grid tries.
STEPS = (0.7, 0.85, 1.0, 1.15, 1.3)


def table_row(rows: Sequence[dict], op: str, variant: str, shape: str) -> dict:
    found = [r for r in rows if r["op"] == op and r["variant"] == variant
             and r["shape"].startswith(shape)]
    if len(found) != 1:
        raise KeyError(f"{op} {variant} {shape}: {len(found)} model rows")
    return found[0]


def modelled_us(row: dict, hw: Hardware, recorded: Hardware) -> float:
    """The op's time under `hw` from a snapshot row computed under `recorded`."""
    total = hw.op_entry_s * 1e6
    for k in row["kernels"]:
        chain = Chain(**k["chain"]).time_s(hw) * 1e6
        serial = Chain(**k["serial_chain"])
        overhead = k["overhead_us"] + (serial.time_s(hw) - serial.time_s(recorded)) * 1e6
        total += k["launches"] * (max(k["memory_us"], k["issue_us"], k["latency_us"], chain)
                                  + overhead)
    for call in row["library"]:
        compute = call["flops"] / (hw.gemm_fraction * hw.gemm_bf16_flops)
        per_call = max(compute, call["dram_bytes"] / hw.dram_bytes_per_s) + hw.launch_s
        total += call["calls"] * per_call * 1e6
    return total


def fit(pairs: Sequence[Tuple[dict, float]], recorded: Hardware
        ) -> Tuple[Hardware, float, float]:
    """(constants, worst |log ratio|, RMS of log ratios) of the best grid point."""
    best: Optional[Tuple[Tuple[float, float], Hardware]] = None
    for steps in itertools.product(STEPS, repeat=len(FITTED)):
        hw = dataclasses.replace(recorded, **{name: getattr(recorded, name) * step
                                              for name, step in zip(FITTED, steps)})
        logs = [math.log(modelled_us(row, hw, recorded) / us) for row, us in pairs]
        score = (max(abs(v) for v in logs), math.sqrt(sum(v * v for v in logs) / len(logs)))
        if best is None or score < best[0]:
            best = (score, hw)
    (worst, rms), hw = best
    return hw, worst, rms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static.calibrate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="static_sm90.json")
    parser.add_argument("--bench", type=Path, nargs="+", required=True,
                        help="GPU benchmark JSON (python -m bench's all_<device>.json)")
    args = parser.parse_args(argv)
    snapshot = json.loads(args.model.read_text())
    recorded = Hardware(**snapshot["hardware"])
    measured = load_bench(args.bench)
    if not measured:
        print("calibrate: no GPU measurements in --bench", file=sys.stderr)
        return 1
    pairs = []
    for op, variant, shape in TABLE:
        row = table_row(snapshot["rows"], op, variant, shape)
        got = find_measured(row["match"], measured)
        if got is None:
            print(f"calibrate: no measurement for {op} {variant} {shape}", file=sys.stderr)
            return 1
        pairs.append((row, got["ours_us"]))
    hw, worst, rms = fit(pairs, recorded)
    print(f"MODEL constants fitted to {len(pairs)} measured rows ({len(FITTED)} parameters): "
          f"worst {100 * (math.exp(worst) - 1):.0f} %, RMS {100 * rms:.0f} % (log ratio)")
    for name in FITTED:
        print(f"  {name:<20}{getattr(hw, name):.3g}   (snapshot: {getattr(recorded, name):.3g})")
    fitted = {id(row) for row, _ in pairs}
    print(f"{'op / shape / variant':<70}{'measured us':>12}{'MODEL us':>10}{'ratio':>7}")
    for row in snapshot["rows"]:
        got = find_measured(row.get("match"), measured)
        if got is None:
            continue
        us = modelled_us(row, hw, recorded)
        label = f"{row['op']} {row['shape']} {row['variant']}"
        print(f"{label[:69]:<70}{got['ours_us']:>12.1f}{us:>10.1f}{us / got['ours_us']:>7.2f}"
              f"{'' if id(row) in fitted else '  (check: not fitted)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
