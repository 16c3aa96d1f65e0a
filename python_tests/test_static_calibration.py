"""The calibrated static model against the one H200 run: the committed model snapshot
(bench/results/static_sm90.json, a MODEL) and the committed measurements
(bench/results/all_nvidia-h200.json) agree within 25 % on every row of the table in
docs/performance-model.md, "Against an H200". Reads committed JSON only: no GPU, no build."""

import json
from pathlib import Path

import pytest

from gpu_checks.model_vs_measured import find_measured, kernel_key, load_bench
from gpu_checks.profile_ops import chain_slope

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"

# The table's rows: (op, the model row's variant, a prefix of its shape). The five constants
# marked FITTED in bench/static/model.py were fitted to these eleven rows.
TABLE = [
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
TOLERANCE = 0.25


def model_rows():
    data = json.loads((RESULTS / "static_sm90.json").read_text())
    assert data["kind"].startswith("MODEL")
    return data["rows"]


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
