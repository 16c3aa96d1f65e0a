"""The calibrated static model against the one H200 run: the committed model snapshot
(bench/results/static_sm90.json, a MODEL) and the committed measurements
(bench/results/all_nvidia-h200.json) agree within 25 % on every row of the table in
docs/performance-model.md, "Against an H200". Reads committed JSON only: no GPU, no build."""

import json
import math
from pathlib import Path

import pytest

from bench.static.calibrate import TABLE, fit, modelled_us, table_row
from bench.static.model import Hardware
from bench.static.measured import find_measured, load_bench
from gpu_checks.model_vs_measured import kernel_key
from gpu_checks.profile_ops import chain_slope

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"

TOLERANCE = 0.25


def snapshot():
    data = json.loads((RESULTS / "static_sm90.json").read_text())
    assert data["kind"].startswith("MODEL")
    return data


def model_rows():
    return snapshot()["rows"]


def table_pairs(rows, measured):
    """(label, model µs, measured µs) per table row; every one must be found once."""
    pairs = []
    for op, variant, shape in TABLE:
        found = [r for r in rows if r["op"] == op and r["variant"] == variant
                 and r["shape"].startswith(shape)]
        assert len(found) == 1, f"{op} {variant} {shape}: {len(found)} model rows"
        got = find_measured(found[0]["match"], measured)
        assert got is not None, f"{op} {variant} {shape}: no H200 row matches"
        pairs.append((f"{op} {variant} {shape}", found[0]["model_us"], got["ours_us"]))
    return pairs


def test_measurements_are_the_h200_run():
    data = json.loads((RESULTS / "all_nvidia-h200.json").read_text())
    assert data["environment"]["device_name"] == "NVIDIA H200"
    assert "L2 flushed" in data["environment"]["timer"]


def test_calibrated_model_reproduces_every_table_row():
    measured = load_bench([RESULTS / "all_nvidia-h200.json"])
    off = [f"{label}: model {model:.1f} us / measured {us:.1f} us = {model / us:.2f}"
           for label, model, us in table_pairs(model_rows(), measured)
           if not 1 - TOLERANCE <= model / us <= 1 + TOLERANCE]
    assert not off, "\n".join(off)



def test_profiled_kernels_meet_the_model_s_by_name():
    # The profiler's demangled names against bench.static's short ones.
    assert kernel_key("void dspark_ops::kernels::draft_slot_kernel<__nv_bfloat16, __nv_bfloat16, "
                      "false>(dspark_ops::kernels::DraftParams)") == \
        kernel_key("draft_slot_kernel<bf16, bf16, false>")
    assert kernel_key("verify_emit_kernel<bf16, float>") != kernel_key(
        "verify_row_stats_kernel<bf16, float>")


def test_verify_chain_slope_is_the_cost_of_one_more_row():
    ops = {f"verify_chain_G{g}": {"eager_cold_us": 30.0 + 15.0 * g} for g in (1, 2, 4, 8)}
    ops["verify_sampled"] = {"eager_cold_us": 999.0}   # not part of the sweep
    chain = chain_slope(ops)
    assert chain["us_per_row"] == pytest.approx(15.0)
    assert chain["intercept_us"] == pytest.approx(30.0)
    assert chain_slope({"verify_chain_G8": {"eager_cold_us": 1.0}}) is None


def test_a_snapshot_row_is_recomputed_for_other_constants():
    # Every term a snapshot records is fixed or a count times the fitted constants: at the
    # snapshot's own constants the recomputation gives every row's model time back.
    data = snapshot()
    recorded = Hardware(**data["hardware"])
    for row in data["rows"]:
        assert modelled_us(row, recorded, recorded) == pytest.approx(row["model_us"], rel=1e-9)
    # Doubling the fence adds its fences on each launch's chain where the chain is the bound.
    row = next(r for r in data["rows"] if r["variant"] == "greedy a=0.69")
    slower = Hardware(**{**data["hardware"], "fence_s": 2 * recorded.fence_s})
    stats = row["kernels"][0]
    assert stats["bound"] == "chain"
    assert modelled_us(row, slower, recorded) - row["model_us"] == pytest.approx(
        stats["chain"]["fences"] * recorded.fence_s * 1e6, rel=1e-6)
    # The schedule kernel's phases after its merge are work in series beside no other bound:
    # a dependent instruction twice as long adds their instructions once more.
    row = next(r for r in data["rows"] if r["op"] == "schedule_verify")
    serial = row["kernels"][0]["serial_chain"]
    assert serial["dependent_instrs"] > 0
    slower = Hardware(**{**data["hardware"],
                         "dependent_instr_s": 2 * recorded.dependent_instr_s})
    assert modelled_us(row, slower, recorded) - row["model_us"] == pytest.approx(
        serial["dependent_instrs"] * recorded.dependent_instr_s * 1e6, rel=1e-6)


def test_refit_on_the_committed_run_is_no_worse_than_the_snapshot():
    # The grid holds the snapshot's own constants, so the refit's worst row is at most theirs.
    measured = load_bench([RESULTS / "all_nvidia-h200.json"])
    data = snapshot()
    pairs = [(table_row(data["rows"], *key), us)
             for key, (_, _, us) in zip(TABLE, table_pairs(data["rows"], measured))]
    current = max(abs(math.log(row["model_us"] / us)) for row, us in pairs)
    _, worst, _ = fit(pairs, Hardware(**data["hardware"]))
    assert worst <= current + 1e-12 and worst < math.log(1 + TOLERANCE)
