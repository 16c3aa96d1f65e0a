"""The static performance model (bench/static): SASS loop finder, per-iteration path counting,
occupancy arithmetic, the choice of bound, and loud failure on unexpected loop structure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.static import kernels, sass
from bench.static.model import (H200, Chain, LibraryCall, Occupancy, Term, bound_of, launch_time,
                                occupancy)

ROOT = Path(__file__).resolve().parent.parent

# A kernel with a prologue, an outer loop around an inner loop whose body has a rarely taken
# branch, and an out-of-line block that jumps back into the body (not a loop).
FIXTURE = """
        Function : _Z4testPf
        /*0000*/                   S2R R0, SR_TID.X ;                     /* 0x0 */
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;    /* 0x0 */
        /*0020*/              @P0 BRA 0x100 ;                             /* 0x0 */
        /*0030*/                   IMAD.MOV.U32 R2, RZ, RZ, RZ ;          /* 0x0 */
        /*0040*/                   LDG.E.128 R4, desc[UR4][R2.64] ;       /* 0x0 */
        /*0050*/                   FADD R8, R4, R5 ;                      /* 0x0 */
        /*0060*/                   FSETP.GT.AND P1, PT, R8, R9, PT ;      /* 0x0 */
        /*0070*/              @P1 BRA 0x90 ;                              /* 0x0 */
        /*0080*/                   MUFU.EX2 R9, R8 ;                      /* 0x0 */
        /*0090*/                   IADD3 R2, R2, 0x10, RZ ;               /* 0x0 */
        /*00a0*/                   ISETP.LT.AND P2, PT, R2, 0x100, PT ;   /* 0x0 */
        /*00b0*/              @P2 BRA 0x40 ;                              /* 0x0 */
        /*00c0*/                   IADD3 R0, R0, 0x1, RZ ;                /* 0x0 */
        /*00d0*/                   ISETP.LT.AND P3, PT, R0, 0x8, PT ;     /* 0x0 */
        /*00e0*/              @P3 BRA 0x30 ;                              /* 0x0 */
        /*00f0*/                   EXIT ;                                 /* 0x0 */
        /*0100*/                   STG.E [R2.64], R0 ;                    /* 0x0 */
        /*0110*/                   BRA 0x30 ;                             /* 0x0 */
        /*0120*/                   BRA 0x120;                             /* 0x0 */
"""


def loops_of(text=FIXTURE):
    funcs = sass.parse_functions(text)
    cfg = sass.CFG(funcs["_Z4testPf"])
    return cfg, sorted(cfg.loops, key=lambda l: len(l.blocks))


def test_loop_finder_finds_nested_natural_loops():
    cfg, loops = loops_of()
    assert len(loops) == 2  # the jump back from 0x110 and the self-branch at 0x120 are not loops
    inner, outer = loops
    assert cfg.blocks[inner.header].start == 0x40
    assert cfg.blocks[outer.header].start == 0x30
    assert inner.parent is outer and outer.children == [inner]
    assert [i.addr for i in inner.instrs(cfg)] == list(range(0x40, 0xc0, 0x10))
    assert [i.addr for i in outer.instrs(cfg)] == list(range(0x30, 0xf0, 0x10))


def test_path_counts_the_cheapest_iteration_with_the_work():
    cfg, (inner, outer) = loops_of()
    fast = sass.iteration_path(cfg, inner, {r"^LDG\.E\.128": 1})
    assert len(fast) == 7  # the MUFU.EX2 branch is skipped
    slow = sass.iteration_path(cfg, inner, {r"^LDG\.E\.128": 1, r"^MUFU": 1})
    assert len(slow) == 8
    assert sass.count(slow.instrs, r"^MUFU") == 1
    # The outer loop's own path: the inner loop collapsed at zero cost.
    assert len(sass.iteration_path(cfg, outer, {})) == 4
    with pytest.raises(sass.StructureError):
        sass.iteration_path(cfg, inner, {r"^HMMA": 1})


def test_bytes_in_flight_and_loaded_bytes():
    cfg, (inner, _) = loops_of()
    path = sass.iteration_path(cfg, inner, {r"^LDG": 1})
    assert sass.loaded_bytes(path) == 16
    assert sass.bytes_in_flight(path) == 16


def test_nvdisasm_labels_are_resolved():
    text = """
        .text._Z1kv:
        /*0000*/                   MOV R0, RZ ;
        .L_x_1:
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0020*/                   ISETP.LT.AND P0, PT, R0, 0x4, PT ;
        /*0030*/              @P0 BRA `(.L_x_1) ;
        /*0040*/                   EXIT ;
    """
    funcs = sass.parse_functions(text)
    cfg = sass.CFG(funcs["_Z1kv"])
    assert len(cfg.loops) == 1 and cfg.blocks[cfg.loops[0].header].start == 0x10


def test_occupancy_hand_computed_cases():
    # 80 registers x 256 threads: 2560 registers per warp, 6 warps per partition, 24 warps: 3.
    occ = occupancy(80, 256, 1024)
    assert occ.blocks_per_sm == 3 and occ.limiter == "registers"
    # 161 registers x 128 threads: 5376 per warp, 3 per partition, 12 warps: 3 blocks.
    assert occupancy(161, 128, 40192).blocks_per_sm == 3
    # 255 registers: 8192 per warp, 2 per partition: two blocks of 4 warps.
    assert occupancy(255, 128, 77056).blocks_per_sm == 2
    # Registers are split over four partitions: 80 registers x one warp gives 4 x 6 = 24 blocks,
    # not 65536 / 2560 = 25.
    assert occupancy(80, 32, 0).blocks_per_sm == 24
    # Small kernels are capped by warps (64 per SM) or blocks (32 per SM).
    assert occupancy(32, 1024, 1024).blocks_per_sm == 2
    assert occupancy(16, 32, 0).blocks_per_sm == 32
    # Shared memory: 100 KB per block leaves room for two.
    occ = occupancy(32, 128, 100 * 1024)
    assert occ.blocks_per_sm == 2 and occ.limiter == "shared memory"


def _term(instrs_per_elem, elements, in_flight=64):
    return Term("t", instrs_per_elem, 1, elements, in_flight, in_flight)


def test_predicted_time_picks_the_right_bound():
    occ = Occupancy(4, "registers", 32, {})
    blocks = 4 * H200.sms
    # Few instructions, many bytes, plenty in flight: memory-bound.
    args = dict(blocks=blocks, threads=256, occ=occ, latency_s=H200.dram_latency_s)
    m, i, l, o, _ = launch_time(terms=[_term(2, 1e8, 256)], dram_bytes=4e8, **args)
    assert bound_of(m, i, l, o) == "memory" and m == pytest.approx(4e8 / H200.dram_bytes_per_s)
    # Many instructions per element: issue-bound.
    m, i, l, o, _ = launch_time(terms=[_term(400, 1e8, 256)], dram_bytes=4e8, **args)
    assert bound_of(m, i, l, o) == "issue"
    assert i == pytest.approx(1e8 / 32 * 400 / H200.sms / (4 * H200.clock_hz))
    # Two bytes in flight per thread cannot cover the latency: latency-bound.
    m, i, l, o, _ = launch_time(terms=[_term(2, 1e8, 2)], dram_bytes=4e8, **args)
    assert bound_of(m, i, l, o) == "latency"
    # Almost nothing to do: the launch dominates.
    m, i, l, o, _ = launch_time(terms=[_term(2, 1e3, 16)], dram_bytes=1e3, **args)
    assert bound_of(m, i, l, o) == "overhead" and o == pytest.approx(H200.launch_s)
    # A dependent launch pays only its wait for the grid before it.
    *_, o, _ = launch_time(terms=[_term(2, 1e3, 16)], dram_bytes=1e3, dependent=True, **args)
    assert o == pytest.approx(H200.dependent_launch_s) and o < H200.launch_s


def test_missing_expected_loop_raises():
    funcs = sass.parse_functions(FIXTURE)

    class FakeBinary:
        def cfg(self, name):
            return sass.CFG(funcs[name])

    k = kernels.KernelInfo("_Z4testPf", 32, 1024, 0, 0)
    ok = kernels.LoopSpec("loads", {r"^LDG\.E\.128": 1}, 4, (r"^LDG\.E\.128", 1))
    loop, path, unroll, n = kernels._select_loop(FakeBinary(), k, ok)
    assert unroll == 1 and n == 1 and len(path) == 7
    gone = kernels.LoopSpec("mma", {r"^HMMA": 2}, 4, (r"^HMMA", 2))
    with pytest.raises(sass.StructureError, match="no loop with the expected work"):
        kernels._select_loop(FakeBinary(), k, gone)
    odd = kernels.LoopSpec("loads", {r"^LDG\.E\.128": 1}, 4, (r"^LDG\.E\.128", 2))
    with pytest.raises(sass.StructureError, match="not a multiple"):
        kernels._select_loop(FakeBinary(), k, odd)


def test_vote_fraction_first_tile_and_tail():
    # Every call of a block's first tile runs the vote block; later ones rarely.
    assert kernels.vote_fraction(264, 264, 128, 1.0) == pytest.approx(1.0)
    f = kernels.vote_fraction(264, 1187, 128, kernels.KEY_BOUND_SLACK)
    assert 264 / 1187 < f < 264 / 1187 + 0.005
    # The second round of 264 tiles: 264 x 128 rows known per request, 128 pairs per call.
    second = 1 - (1 - 1 / (264 * 128)) ** 128
    assert kernels.vote_fraction(264, 528, 128, 1.0) == pytest.approx((1 + second) / 2)
    # A larger grid knows more before its later tiles, so those vote in less often.
    assert kernels.vote_fraction(528, 2 * 1187, 128, 1.0) - 528 / 2374 < f - 264 / 1187


def test_extra_term():
    funcs = sass.parse_functions(FIXTURE)

    class FakeBinary:
        def cfg(self, name):
            return sass.CFG(funcs[name])

    k = kernels.KernelInfo("_Z4testPf", 32, 1024, 0, 0)
    base = kernels.LoopSpec("loads", {r"^LDG\.E\.128": 1}, 4, (r"^LDG\.E\.128", 1))
    # The MUFU.EX2 branch adds one instruction to the 7 of the cheapest iteration.
    t = kernels.extra_term(FakeBinary(), k, base, "exp", {r"^MUFU": 1}, 100)
    assert t.path_instrs == 1 and t.elems_per_iter == 4 and t.elements == 100


def test_merge_rounds_of_the_schedule():
    # Runs of G keys double until one run holds all B * G: ceil(log2 B) rounds.
    assert kernels.merge_rounds(256, 16) == [16 << k for k in range(8)]
    assert len(kernels.merge_rounds(1024, 32)) == 10
    assert kernels.merge_rounds(1, 32) == []
    assert len(kernels.merge_rounds(3, 5)) == 2


def _built_so():
    from bench.static.binary import default_so
    try:
        so = default_so()
    except FileNotFoundError:
        return None
    out = subprocess.run(["python3", "-c", "from bench.static.binary import cuda_tool;"
                          "print(cuda_tool('cuobjdump'))"], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode:
        return None
    listing = subprocess.run([out.stdout.strip(), "--list-elf", str(so)], capture_output=True,
                             text=True)
    return so if ".sm_90." in listing.stdout else None


def test_kernel_constants_resolve_across_files(tmp_path):
    # A .cuh constant built from one a family's _launch.h defines (read after it), a chain, a
    # name defined twice, and an expression that is not an integer one.
    (tmp_path / "a.cuh").write_text("constexpr int kTile = 16 * kWarps;\n"
                                    "constexpr int kTwice = 3;\n"
                                    "constexpr int kBad = sizeof(float);\n")
    (tmp_path / "a_launch.h").write_text("constexpr int kThreads = 256;\n"
                                         "constexpr int kWarps = kThreads / 32;\n"
                                         "constexpr int kTwice = 5;\n")
    values = kernels._kernel_constants(tmp_path)
    assert values["kTile"] == 128 and values["kWarps"] == 8 and values["kTwice"] == 3
    assert "kBad" not in values
    assert kernels.constant("kTileRows") == 16 * kernels.constant("kDraftWarps")


@pytest.mark.skipif(_built_so() is None, reason="no CUDA build with sm_90 code here")
def test_real_binary_end_to_end(tmp_path):
    res = subprocess.run([sys.executable, "-m", "bench.static", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "MODEL" in res.stdout
    data = json.loads((tmp_path / "static_sm90.json").read_text())
    assert data["kind"].startswith("MODEL")
    rows = {(r["op"], r["variant"]): r for r in data["rows"]}
    greedy = rows[("verify", "greedy a=1 (every row)")]
    assert greedy["floor_us"] == pytest.approx(64 * 9 * 151936 * 2 / 4.3e12 * 1e6)
    stats = greedy["kernels"][0]
    assert stats["regs"] > 0 and stats["local_bytes"] == 0
    # The emit kernel is a programmatic dependent launch (its launcher says so in the plan).
    assert greedy["kernels"][1]["overhead_us"] == pytest.approx(H200.dependent_launch_s * 1e6)
    assert greedy["kernels"][0]["overhead_us"] >= H200.launch_s * 1e6
    # The target row alone: kTargetGroups groups of 8 elements a thread per iteration.
    assert stats["loops"][0]["elems_per_iter"] == (kernels.constant("kTargetGroups")
                                                  * kernels.constant("kElementsPerThread"))
    for row in data["rows"]:
        assert row["model_us"] > 0 and row["bound"] in ("memory", "issue", "latency", "chain",
                                                        "overhead", "library")
        # The op's time: its launches (the glue fills nothing: test_glue_fills_nothing_per_call),
        # the library calls it makes, and the benchmark's entry per call.
        assert row["model_us"] == pytest.approx(sum(k["total_us"] for k in row["kernels"])
                                                + sum(c["total_us"] for c in row["library"])
                                                + H200.op_entry_s * 1e6)
    assert (tmp_path / "static_sm90.csv").read_text().startswith("kind,op,shape")
    # The vote-skipping epilogue states its assumed fractions.
    slot = rows[("markov_draft", "sampled")]["kernels"][0]
    loops = [t["loop"] for t in slot["loops"]]
    assert any("logarithms" in name and "assumed" in name for name in loops)
    assert any("reductions" in name and "assumed" in name for name in loops)
    # The loss's plan: full chunks, then the last chunk's rows, every row once.
    loss = rows[("dspark_loss", "bf16 vocabulary pass + cuBLAS products")]["kernels"]
    assert sum(k["launches"] * k["blocks"] for k in loss) == 512 * 7


def test_cpu_only_binary_is_refused(tmp_path):
    from bench.static.binary import Binary, NoDeviceCode, cuda_tool
    try:
        cuda_tool("cuobjdump")
    except FileNotFoundError:
        pytest.skip("no cuobjdump")
    fake = tmp_path / "_C.so"
    fake.write_bytes(b"\x7fELF not a fat binary")
    with pytest.raises(NoDeviceCode):
        Binary(fake)
    res = subprocess.run([sys.executable, "-m", "bench.static", "--so", str(fake),
                          "--results-dir", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode != 0 and "no sm_90" in res.stderr



# ------------------------------------------------------------------------------------------------
# The calibrated terms: critical paths (Chain), verify's schedule of row chains, library calls.


def test_chain_time_counts_every_kind_of_wait():
    chain = Chain(dram_waits=2, l2_waits=3, fences=1, dependent_instrs=100, barrier_stages=4)
    assert chain.time_s() == pytest.approx(
        2 * H200.dram_dependent_s + 3 * H200.l2_dependent_s + H200.fence_s
        + 100 * H200.dependent_instr_s + 4 * H200.barrier_stage_s)
    # Per-row parts compose: a row's chain over 9 rows, then a tail.
    total = chain.scaled(9) + Chain(fences=1)
    assert total.fences == 10 and total.dram_waits == 18
    assert total.time_s() == pytest.approx(9 * chain.time_s() + H200.fence_s)


def _fake_launch(count, chain, dram_bytes=1e3):
    kernel = kernels.KernelInfo("_Z4testPf", 32, 1024, 0, 0)
    return kernels.Launch(kernel, "test", 256, 4 * H200.sms, 0, [_term(2, 1e3, 256)], dram_bytes,
                          count=count, chain=chain)


def test_chain_is_a_bound_and_every_launch_pays_its_launch():
    # A chain of 100 HBM waits outlasts the launch's memory, issue and latency: it is the bound,
    # beside them (not added to them), and each of the 7 launches (one per draft slot) pays it
    # and its own launch.
    chain = Chain(dram_waits=100)
    one = kernels.evaluate(_fake_launch(1, chain))
    assert one.bound == "chain"
    assert one.time_s == pytest.approx(chain.time_s() + H200.launch_s)
    seven = kernels.evaluate(_fake_launch(7, chain))
    assert seven.total_s == pytest.approx(7 * (chain.time_s() + H200.launch_s))
    # A launch with much memory and a short chain stays memory-bound at the same time as before.
    big = kernels.evaluate(_fake_launch(1, Chain(dram_waits=1), dram_bytes=4e9))
    assert big.bound == "memory"
    assert big.time_s == pytest.approx(4e9 / H200.dram_bytes_per_s + H200.launch_s)


def test_verify_item_chain_waits_once_per_iteration_or_ring_batch():
    # 9504-element chunks (V = 151936 over 16), 256 threads: five groups of 8 (the target row
    # alone) cover the chunk in one iteration, one HBM wait; three groups (with the draft row)
    # need two iterations; 8192 elements in four groups, exactly one.
    assert kernels.verify_item_chain(9504, 256, 5, 8).dram_waits == 1
    assert kernels.verify_item_chain(9504, 256, 3, 8).dram_waits == 2
    assert kernels.verify_item_chain(8192, 256, 4, 8).dram_waits == 1
    # Through the ring (draft rows): a bf16 + float32 chunk's three iterations of two groups in
    # one batch with three stages, in two with two stages (the emulated L4), three with one.
    assert [kernels.verify_item_chain(9504, 256, 2, 8, s).dram_waits for s in (3, 2, 1)] == \
        [1, 2, 3]
    assert kernels.verify_item_chain(9504, 256, 2, 8, 4).dram_waits == 1
    # No sequentially consistent fence: the scalars' round trip, and the acq_rel arrival's
    # membar (the partial's store) and atomic are the item's L2 waits.
    item = kernels.verify_item_chain(9504, 256, 3, 8)
    assert item.fences == 0 and item.l2_waits == 3
    assert kernels.verify_decide_chain(greedy=False).dependent_instrs == kernels.PHILOX_CHAIN
    assert kernels.verify_decide_chain(greedy=True).dependent_instrs == 0


def test_rows_decided_is_a_distribution_with_the_floor_s_mean():
    for alpha in (0.0, 0.3, 0.7, 1.0):
        probs = kernels.rows_decided(alpha, 8)
        assert len(probs) == 9 and sum(probs) == pytest.approx(1.0)
        mean = sum(k * p for k, p in enumerate(probs, start=1))
        assert mean == pytest.approx(sum(alpha ** i for i in range(9)))


def test_draft_slot_chain_exposes_only_what_the_ring_and_prefetch_do_not_cover():
    # The busiest warp's 5 tiles of B = 64 in one sweep of 8 column tiles, 8 k chunks at r 256.
    # With 8 ring stages and long epilogue calls every W2 chunk and base-logit load is covered:
    # only the inputs' row waits.
    hw = H200
    chain = kernels.draft_slot_chain(5, 8, 8, 1, 8, 240.0, 330.0, 4500.0)
    assert chain.dram_waits == 1
    assert chain.dependent_instrs == 5 * 4500.0
    assert chain.fences == 2 and chain.l2_waits == 2
    # Four stages for eight chunks: once per tile the chunk 4 ahead waits for what 3 chunks'
    # products leave of the latency.
    four = kernels.draft_slot_chain(5, 8, 4, 1, 8, 40.0, 330.0, 3000.0)
    left = 1 - 3 * 40.0 * hw.dependent_instr_s / hw.dram_dependent_s
    assert four.dram_waits == pytest.approx(1 + 5 * left)
    # Two sweeps of four column tiles (three blocks per SM): the ring runs through each tile's
    # chunks twice, so that wait comes once per sweep.
    swept = kernels.draft_slot_chain(3, 8, 4, 2, 4, 40.0, 330.0, 3000.0)
    assert swept.dram_waits == pytest.approx(1 + 3 * 2 * left)
    assert swept.dependent_instrs == 3 * 3000.0
    # Short epilogue calls leave part of each later base-logit load exposed (two calls ahead).
    short = kernels.draft_slot_chain(1, 1, 8, 1, 8, 1000.0, 100.0, 1800.0)
    per_load = 1 - 2 * 100.0 * hw.dependent_instr_s / hw.dram_dependent_s
    assert short.dram_waits == pytest.approx(1 + 6 * per_load)
    # The same calls in two sweeps of four: each sweep's last two loads are exposed.
    assert kernels.draft_slot_chain(1, 1, 8, 2, 4, 1000.0, 100.0, 1800.0).dram_waits == \
        pytest.approx(1 + 2 * 2 * per_load)
    # Float32 weights (no ring): a wait per chunk.
    assert kernels.draft_slot_chain(2, 8, 0, 1, 1, 500.0, 330.0, 1000.0).dram_waits == 1 + 2 * 8


def test_attention_split_chain_waits_once_per_ring_of_tiles_per_round():
    # 64 tiles, a ring of 3 (2 in flight), 2 rounds: the prologue's wait and one per 2 tiles,
    # one barrier per tile.
    chain = kernels.attention_split_chain(64, 3, 2)
    assert chain.dram_waits == 2 * (1 + 64 / 2) and chain.barrier_stages == 2 * (64 + 1)
    assert kernels.attention_split_chain(64, 2, 1).dram_waits == 1 + 64


def test_head_segment_rounds_follow_the_kernel_s_rounds():
    """head_segment_rounds against head_mma_segment's loops (kernels/draft_rnn_head.cuh) written
    out step by step: for every segment length up to 40 whole steps a warp, with and without a
    partial last step, the most rounds (one HBM wait each) any warp makes."""
    warps = 8

    def kernel_rounds(warp: int, columns: int, most: int) -> int:
        whole = columns // 16
        step, rounds = warp, 0
        for size in [most] + [n for n in (4, 2, 1) if n < most]:
            while step + (size - 1) * warps < whole:
                step, rounds = step + size * warps, rounds + 1
        assert step >= whole  # every whole step taken
        return rounds + (16 * step < columns)  # the partial last step, if it is this warp's

    for most in (2, 4, 7, 8):
        for columns in [16 * whole + tail for whole in range(40 * warps) for tail in (0, 7)]:
            busiest = max(kernel_rounds(w, columns, most) for w in range(warps))
            assert len(kernels.head_segment_rounds(columns, warps, most)) == busiest, \
                (most, columns)
    # d 2560: 20 steps a warp in rounds of 7, 7, 4 and 2; 3 steps wait twice, 4 steps once.
    assert kernels.head_segment_rounds(2560, warps, 7) == [7, 7, 4, 2]
    assert kernels.head_rounds(3, 4) == [2, 1] and kernels.head_rounds(4, 4) == [4]


def test_load_phases_count_the_loads_an_mma_waits_on():
    """A run of loads issued since the previous MMA is one HBM round trip, waited on by the next
    MMA: all loads first is one trip, loads interleaved step by step one a step, and a round
    whose last loads come after its first MMA (the head's round of 8 at 80 registers) two."""
    def body(ops):
        return [sass.Instr(16 * i, op) for i, op in enumerate(ops)]

    ld, mma, alu = "LDG.E.CONSTANT R0, desc[UR4][R2.64]", "HMMA.16816.F32.BF16 R4, R8, R12, R4", \
        "FADD R1, R1, R1"
    assert kernels.load_phases(body([ld] * 12 + [mma] * 2), r"^LDG\.", r"^HMMA") == 1
    assert kernels.load_phases(body([ld, ld, mma, alu, ld, mma, ld, ld, mma]),
                               r"^LDG\.", r"^HMMA") == 3
    assert kernels.load_phases(body([ld] * 38 + [mma] + [ld] * 10 + [mma] * 7),
                               r"^LDG\.", r"^HMMA") == 2
    assert kernels.load_phases(body([mma, alu, mma]), r"^LDG\.", r"^HMMA") == 0


def test_loss_products_are_the_op_s_floating_point_operations():
    # Per chunk: three products with the LM head (z, t, d h) and three with W2 (the bias, d u,
    # d W2): 6 n V (d + r), the 9.2 TFLOP of docs/semantics.md §4 over N = 3584 rows.
    n, V, d, r = 441, 151936, 2560, 256
    for softcap in (False, True):
        calls = kernels.loss_chunk_products(n, V, d, r, softcap, 1)
        assert sum(c.flops for c in calls) == pytest.approx(6 * n * V * (d + r))
    assert 6 * 3584 * V * (d + r) == pytest.approx(9.2e12, rel=0.01)
    # A product runs at the stated fraction of the bf16 GEMM rate unless its bytes take longer.
    z = next(c for c in kernels.loss_chunk_products(n, V, d, r, False, 8)
             if c.name.startswith("z += h W^T"))
    assert z.time_s() == pytest.approx(z.flops / (H200.gemm_fraction * H200.gemm_bf16_flops)
                                       + H200.launch_s)
    assert z.total_s() == pytest.approx(8 * z.time_s())
    copy = LibraryCall("copy", 0.0, 1e9)
    assert copy.time_s() == pytest.approx(1e9 / H200.dram_bytes_per_s + H200.launch_s)


def test_loss_products_read_z_and_the_float32_sum_where_the_code_does():
    # Nine chunks over N = 3584: eight of 399 rows, then one of 392.
    V, d, r = 151936, 2560, 256
    groups = [(399, 8), (392, 1)]
    calls = [c for i, (n, count) in enumerate(groups)
             for c in kernels.loss_chunk_products(n, V, d, r, False, count, first=i == 0)]
    assert sum(c.flops * c.count for c in calls) == pytest.approx(6 * 3584 * V * (d + r))
    by_name = {}
    for c in calls:
        by_name.setdefault(c.name.split(" (")[0], []).append(c)
    # Without a cap the bias product writes z and the head's product reads it back (beta = 1):
    # z's second read and write inside the compute-bound product, hidden by its FLOPs.
    for (n, _), bias, head in zip(groups, by_name["z = u W2^T"], by_name["z += h W^T"]):
        assert bias.dram_bytes == pytest.approx((n * r + V * r + n * V) * 2)
        assert head.dram_bytes == pytest.approx((n * d + V * d + 2 * n * V) * 2)
        assert head.flops / (H200.gemm_fraction * H200.gemm_bf16_flops) > (
            head.dram_bytes / H200.dram_bytes_per_s)
    # grad_w2: one float32-output product per chunk; the sum written by the first chunk's and
    # read and written by each later one, never rounded to 16 bits or added by another kernel.
    grad = [c for c in calls if "grad_w2" in c.name]
    assert sum(c.count for c in grad) == 9 and all(c.flops > 0 for c in grad)
    first, rest = grad[0], grad[1:]
    assert first.count == 1 and "+=" not in first.name
    assert first.dram_bytes == pytest.approx(399 * (V + r) * 2 + V * r * 4)
    assert [(c.count, c.dram_bytes) for c in rest] == [
        (7, pytest.approx(399 * (V + r) * 2 + 2 * V * r * 4)),
        (1, pytest.approx(392 * (V + r) * 2 + 2 * V * r * 4))]


# --- bench.philox_pruning: the share of the slot kernel's tiles exact Philox pruning could skip --

def _pruning_logits(rows, vocab, high_rows=(), gap=30.0):
    """Rows whose token 0 stands ``gap`` above the rest, except ``high_rows``, where token 17
    (the second 16-row block) is as high as token 0."""
    import torch
    logits = torch.zeros(rows, vocab)
    logits[:, 0] = gap
    for r in high_rows:
        logits[r, 17] = gap
    return logits


def test_philox_pruning_counts_tiles_over_all_eight_requests():
    """A tile is skipped only when each of its eight requests rules out all 16 of its tokens:
    one request with a live token in block 1 keeps that tile for its whole group."""
    import torch
    from bench.philox_pruning import MAX_GUMBEL_OFFSET, skip_shares
    gen = torch.Generator().manual_seed(0)
    vocab = 64  # four 16-row blocks
    logits = _pruning_logits(8, vocab, high_rows=(3,))
    best = torch.full((8,), 30.0)
    shares = skip_shares(logits, 1.0, generator=gen, best_key=best)
    # Tokens: every token at 0 is ruled out (0 + 22.87 < 30), the ones at 30 are not.
    assert shares["tokens"] == pytest.approx((8 * vocab - 9) / (8 * vocab))
    # Blocks: block 0 lives in every row, block 1 in row 3 only.
    assert shares["blocks_of_16"] == pytest.approx((8 * 4 - 9) / (8 * 4))
    # Tiles (one group of eight): blocks 2 and 3 only.
    assert shares["tiles_16x8"] == pytest.approx(2 / 4)
    # Within the bound's reach nothing is ruled out.
    near = skip_shares(logits, 1.0, generator=gen, best_key=best - 30 + MAX_GUMBEL_OFFSET - 1e-3)
    assert near == {"tokens": 0.0, "blocks_of_16": 0.0, "tiles_16x8": 0.0}


def test_philox_pruning_temperature_and_tail():
    """Temperature scales the logits before the bound; a vocabulary tail short of 16 rows counts
    as ruled out (the kernel's rows past the vocabulary draw nothing); sampled best keys are at
    least the row's largest scaled logit less a few nats."""
    import torch
    from bench.philox_pruning import sampled_best_keys, skip_shares
    gen = torch.Generator().manual_seed(1)
    logits = _pruning_logits(16, 40, gap=20.0)  # 20 < 22.87: nothing ruled out at T 1
    cold = skip_shares(logits, 0.5, generator=gen, best_key=torch.full((16,), 40.0))
    warm = skip_shares(logits, 1.0, generator=gen, best_key=torch.full((16,), 20.0))
    assert warm["tokens"] == 0.0 and warm["tiles_16x8"] == 0.0
    assert cold["tokens"] == pytest.approx(39 / 40)
    assert cold["tiles_16x8"] == pytest.approx(2 / 3)  # blocks 1 and the 8-row tail
    best = sampled_best_keys(logits, 1.0, gen)
    assert bool((best >= 20.0 - 6).all()) and bool((best <= 20.0 + 25).all())
    with pytest.raises(ValueError, match="'logits'"):
        skip_shares(logits[:7], 1.0, generator=gen)
    with pytest.raises(ValueError, match="'temperature'"):
        skip_shares(logits, 0.0, generator=gen)


def test_philox_pruning_command(tmp_path):
    """The command over a tiny transformers target writes its shares per temperature."""
    import json as _json
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bench import philox_pruning
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "target")
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(3):
            ids = [(7 * i + j) % 96 for j in range(20)]
            f.write(_json.dumps({"input_ids": ids, "loss_mask": [0] * 5 + [1] * 15}) + "\n")
    out = tmp_path / "shares.json"
    assert philox_pruning.main(["--data", str(data), "--target", str(tmp_path / "target"),
                                "--every", "2", "--threads", "1", "--temperatures", "1.0", "0.1",
                                "--json", str(out)]) == 0
    result = _json.loads(out.read_text())
    assert result["positions"] == 3 * 8 and result["vocab"] == 96
    shares = result["temperatures"]
    assert set(shares) == {"1.0", "0.1"}
    # A random tiny model's logits are flat: at T 1 nothing is ruled out, at T 0.1 more is.
    assert shares["1.0"]["tokens"] <= shares["0.1"]["tokens"]
    assert all(0.0 <= v <= 1.0 for s in shares.values() for v in s.values())
    with pytest.raises(SystemExit):
        philox_pruning.main(["--data", str(data), "--every", "0"])
