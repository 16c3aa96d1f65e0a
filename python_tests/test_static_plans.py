"""The emulator's launch records, plan-only mode and occupancy query, which the static model
(bench/static/plans.py) takes its launch plans from."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from bench.static.model import H200, occupancy
from bench.static.plans import emulator_name, parse_records

pytestmark = pytest.mark.sim

SLOT = "draft_slot_kernel<__nv_bfloat16, __nv_bfloat16, false>"


@pytest.fixture
def plan_only(sim):
    """Plan-only mode for the test, with no kernel resources, switched off after."""
    sim.clear_launch_log()
    sim.set_plan_only(True)
    try:
        yield sim
    finally:
        sim.set_plan_only(False)
        sim.set_kernel_resources("")
        sim.clear_launch_log()


def append_args(batch=3, rows=4, length=16, heads=2, dim=8):
    cache = [torch.zeros(batch, length, heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(batch, rows, heads, dim).to(torch.bfloat16) for _ in range(2)]
    return (*cache, *new, torch.full((batch,), rows, dtype=torch.int32),
            torch.full((batch,), 2, dtype=torch.int32))


def draft_args(batch, vocab, rank=32, block=1):
    bf16, i64 = dict(dtype=torch.bfloat16), dict(dtype=torch.int64)
    return (torch.empty(batch, block, vocab, **bf16), torch.zeros(batch, **i64),
            torch.empty(vocab, rank, **bf16), torch.empty(vocab, rank, **bf16),
            torch.ones(batch), torch.zeros(batch, **i64), torch.zeros(batch, **i64))


def test_records_of_a_run(sim):
    sim.clear_launch_log()
    args = append_args()
    sim.append_context_kv(*args)
    records = parse_records(sim.launch_records())
    assert records == [{"kernel": "append_context_kv_kernel<short unsigned int>",
                        "grid": [3, 1, 1], "block": [256, 1, 1], "shared": 0,
                        "dependent": False, "fields": {}, "ran": True}]
    # The counts of launch_log are kept beside the records; a clear empties both.
    assert sim.launch_log() == "append_context_kv_kernel<short unsigned int>\t1\n"
    sim.clear_launch_log()
    assert sim.launch_records() == "" and sim.launch_log() == ""


def test_plan_only_records_the_same_launches_and_runs_no_block(sim):
    sim.clear_launch_log()
    ran = append_args()
    sim.append_context_kv(*ran)
    ran_records = parse_records(sim.launch_records())
    assert torch.equal(ran[0][:, 2:6], ran[2])            # the rows were copied
    sim.clear_launch_log()
    planned = append_args()
    sim.set_plan_only(True)
    try:
        sim.append_context_kv(*planned)
    finally:
        sim.set_plan_only(False)
    plan_records = parse_records(sim.launch_records())
    assert [dict(r, ran=True) for r in plan_records] == ran_records
    assert [r["ran"] for r in plan_records] == [False]
    # No block ran: the caches and lengths are as they were.
    assert not planned[0].any() and not planned[1].any()
    assert planned[5].tolist() == [2, 2, 2]


def test_multi_kernel_plans_keep_order_fields_and_dependence(plan_only):
    """verify: the statistics kernel, then the emit kernel as a dependent launch, with the chunk
    plan in both parameter structs; the same plan as when the kernels run."""
    batch, block, vocab = 2, 3, 5000
    args = (torch.randn(batch, block + 1, vocab).to(torch.bfloat16),
            torch.zeros(batch, block, dtype=torch.int64),
            torch.full((batch,), block, dtype=torch.int32), torch.ones(batch),
            torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
            torch.randn(batch, block, vocab))
    plan_only.verify(*args)
    planned = parse_records(plan_only.launch_records())
    plan_only.clear_launch_log()
    plan_only.set_plan_only(False)
    plan_only.verify(*args)
    ran = parse_records(plan_only.launch_records())
    assert [dict(r, ran=True) for r in planned] == ran
    assert [r["kernel"] for r in ran] == ["verify_row_stats_kernel<__nv_bfloat16, float>",
                                          "verify_emit_kernel<__nv_bfloat16, float>"]
    assert [r["dependent"] for r in ran] == [False, True]
    chunks = ran[0]["fields"]["num_chunks"]
    # one block per (request, chunk) item of every row: rows on y, so row j starts before j + 1
    assert ran[0]["grid"] == [batch * chunks, block + 1, 1]
    assert ran[0]["fields"] == ran[1]["fields"]
    assert chunks * ran[0]["fields"]["chunk"] >= vocab


@pytest.mark.parametrize("regs", [1, 32, 40, 64, 72, 95, 128, 168, 255])
@pytest.mark.parametrize("static_shared", [1024, 5120])
def test_occupancy_query_is_the_models_calculator(plan_only, regs, static_shared):
    plan_only.set_kernel_resources(f"{SLOT}\t{regs}\t{static_shared}\n")
    for threads in (32, 100, 128, 256, 512, 1024):
        for dynamic in (0, 1000, 36864, 45456, 73728, 100000, 232448 - static_shared):
            want = occupancy(regs, threads, static_shared + dynamic).blocks_per_sm
            assert plan_only.occupancy(SLOT, threads, dynamic) == want, (threads, dynamic)


def test_occupancy_without_resources_counts_threads_and_dynamic_shared_only(plan_only):
    assert plan_only.occupancy(SLOT, 256, 0) == 8
    assert plan_only.occupancy(SLOT, 256, 100 * 1024) == 2      # 228 KB / (100 KB + 1 KB)
    assert plan_only.occupancy(SLOT, 64, 0) == 32                # block slots


def test_resources_of_an_unknown_kernel_are_refused(plan_only):
    with pytest.raises(ValueError, match="set_kernel_resources: no registered kernel 'nope<1>'"):
        plan_only.set_kernel_resources("nope<1>\t32\t1024\n")
    with pytest.raises(ValueError, match="not 'instantiation<TAB>registers<TAB>shared'"):
        plan_only.set_kernel_resources(f"{SLOT} 32 1024\n")
    with pytest.raises(ValueError, match="occupancy: no registered kernel 'nope<1>'"):
        plan_only.occupancy("nope<1>", 256, 0)


@pytest.mark.parametrize("regs", [64, 128, 168])
def test_the_draft_grid_follows_the_binarys_registers(plan_only, regs):
    """The slot kernel's grid is sized by the occupancy query: one full wave of resident blocks
    (shared by the groups), so it changes with the registers the binary gives the kernel."""
    batch, vocab = 8, 300 * 128
    plan_only.set_kernel_resources(f"{SLOT}\t{regs}\t1024\n")
    plan_only.markov_draft(*draft_args(batch, vocab))
    (slot,) = [r for r in parse_records(plan_only.launch_records()) if r["kernel"] == SLOT]
    per_sm = occupancy(regs, 256, 1024 + slot["shared"]).blocks_per_sm
    assert slot["grid"] == [min(per_sm * H200.sms, slot["fields"]["num_tiles"]), 1, 1]
    assert slot["fields"]["group_size"] == 8 and slot["fields"]["num_tiles"] == 300


def test_plan_only_is_not_left_on(sim):
    # A fresh test runs the kernels (the fixture's reset does not touch the mode; plan_only
    # switches it off after each test): append writes the cache.
    args = append_args()
    sim.append_context_kv(*args)
    assert args[0].any()


def test_emulator_names_of_demangled_kernels():
    cases = {
        "void dspark_ops::kernels::append_context_kv_kernel<unsigned short>"
        "(dspark_ops::kernels::AppendParams)": "append_context_kv_kernel<short unsigned int>",
        "void dspark_ops::kernels::pack_verify_inputs_kernel<long, int>(long const*, int const*)":
            "pack_verify_inputs_kernel<long int, int>",
        "dspark_ops::kernels::philox_uniform_kernel(long const*, long const*, unsigned int, "
        "long, long, float*)": "philox_uniform_kernel",
        "void dspark_ops::kernels::schedule_kernel<2, false>(dspark_ops::kernels::"
        "ScheduleParams)": "schedule_kernel<2, false>",
        "void dspark_ops::kernels::draft_slot_kernel<__nv_bfloat16, float, true>"
        "(dspark_ops::kernels::DraftParams)": "draft_slot_kernel<__nv_bfloat16, float, true>",
    }
    for demangled, name in cases.items():
        assert emulator_name(demangled) == name


def test_every_kernel_of_the_binary_is_an_emulated_kernel(sim):
    """The names the planner matches: every kernel of the built extension's sm_90 code is a
    kernel the emulator registered, so each has its registers in the occupancy query."""
    from bench.static.binary import cuda_tool, default_so, demangled_names, parse_resource_usage
    try:
        tool, so = cuda_tool("cuobjdump"), default_so()
    except FileNotFoundError:
        pytest.skip("no cuobjdump or no built extension")
    out = subprocess.run([tool, "--dump-resource-usage", "-arch", "sm_90", str(so)],
                         capture_output=True, text=True)
    resources = parse_resource_usage(out.stdout)
    if not resources:
        pytest.skip("the built extension has no sm_90 code")
    registered = set(sim.kernel_names().splitlines())
    names = {emulator_name(d) for d in demangled_names(list(resources)).values()}
    assert names <= registered, sorted(names - registered)
    assert {n for n in registered if "selftest" not in n} <= names


def test_records_are_json_lines(plan_only):
    plan_only.schedule_verify(torch.rand(4, 3), torch.ones(5))
    lines = plan_only.launch_records().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["kernel"].startswith("schedule_kernel<0, ") and record["block"][0] == 1024
