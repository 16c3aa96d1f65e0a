"""Per-kernel knowledge the model needs: which loop is hot and what one iteration of it does, and
the bytes each launch moves at a given shape. The launch configurations (grid, block, dynamic
shared memory, launches per call) are not here: each op's real glue and launchers plan them in the
SIMT emulator (bench/static/plans.py), and the few kernel constants the model needs are read from
csrc/kernels/ (`constant`). If the compiled code no longer has the expected loop (no loop of the
kernel has the expected work on one path), the model raises StructureError instead of reporting
numbers for the wrong code: update the selector here together with the kernel."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Tuple

from pathlib import Path

from bench.static import sass
from bench.static.binary import Binary, KernelInfo
from bench.static.model import (H200, Chain, LaunchResult, LibraryCall, Term, bound_of,
                                launch_time, occupancy)
from bench.static.plans import Launch as PlanLaunch
from bench.static.plans import Plan, Planner

KERNELS = Path(__file__).resolve().parents[2] / "csrc" / "kernels"

BF16, F32 = 2, 4
# Philox-4x32 round multiplies (0xD2511F53, 0xCD9E8D57): 20 per block, a few hoisted out of loops.
PHILOX = r"re:IMAD\.(WIDE|HI)\.U32.*-0x(2daee0ad|326172a9)"
PHILOX_PER_BLOCK = 16
BF16_HIGH = r"re:PRMT.*0x7632"                  # upper bf16 of a 32-bit word -> float


@dataclasses.dataclass
class LoopSpec:
    """Selects the hot loop and says what one source-level iteration of it does.

    need: minimum count per anchor (see sass.matches) on one path through the loop body.
    elems: elements one thread handles per source-level iteration.
    unroll: (anchor, count per source-level iteration): the compiler's unrolling is the count
    on the chosen path divided by this, and must be a whole number.
    """
    name: str
    need: Dict[str, int]
    elems: float
    unroll: Tuple[str, int]
    innermost: bool = True
    loads: Optional[str] = None   # which global loads carry the data (default: all)
    # "shortest": the loop with the cheapest matching path; "densest": the fewest instructions
    # per source-level iteration (an unrolled main loop over its remainder loop, for loops whose
    # trip count is at least the unrolling at the modelled shapes).
    pick: str = "shortest"


def select_loop(binary: Binary, kernel: KernelInfo, spec: LoopSpec):
    key = (kernel.name, spec.name, tuple(sorted(spec.need.items())), spec.unroll, spec.innermost,
           spec.pick)
    cache = binary.__dict__.setdefault("_loop_cache", {})
    if key not in cache:
        cache[key] = _select_loop(binary, kernel, spec)
    return cache[key]


def _select_loop(binary: Binary, kernel: KernelInfo, spec: LoopSpec):
    cfg = binary.cfg(kernel.name)
    found = []
    for loop in cfg.loops:
        try:
            found.append((loop, sass.iteration_path(cfg, loop, spec.need)))
        except sass.StructureError:
            continue
    if spec.innermost:
        ids = {id(l) for l, _ in found}

        def has_inner(loop):
            return any(id(c) in ids or has_inner(c) for c in loop.children)
        found = [(l, p) for l, p in found if not has_inner(l)]
    if not found:
        raise sass.StructureError(
            f"{kernel.name}: no loop with the expected work for '{spec.name}' {spec.need}; "
            "the kernel changed: update bench/static/kernels.py")
    anchor, per_iter = spec.unroll
    if spec.pick == "densest":
        def per_source_iter(lp):
            got = sass.count(lp[1].instrs, anchor)
            return len(lp[1]) / (got // per_iter) if got >= per_iter else float("inf")
        loop, path = min(found, key=per_source_iter)
    else:
        loop, path = min(found, key=lambda lp: len(lp[1]))
    got = sass.count(path.instrs, anchor)
    if got == 0 or got % per_iter:
        raise sass.StructureError(
            f"{kernel.name}: '{spec.name}' path has {got} x {anchor}, not a multiple of "
            f"{per_iter}; the loop structure changed")
    unroll = got // per_iter
    return loop, path, unroll, len(found)


def term(binary: Binary, kernel: KernelInfo, spec: LoopSpec, elements: float) -> Term:
    _, path, unroll, candidates = select_loop(binary, kernel, spec)
    return Term(spec.name, len(path), spec.elems * unroll, elements,
                sass.bytes_in_flight(path, spec.loads), sass.loaded_bytes(path, spec.loads),
                candidates)


def extra_term(binary: Binary, kernel: KernelInfo, base: LoopSpec, name: str,
               extra: Dict[str, int], elements: float, copies: int = 1) -> Term:
    """The instructions a conditional block of the loop adds to its iteration: the cheapest path
    with base.need plus ``extra`` less the cheapest with base.need alone, per iteration of the
    base loop, times ``copies`` when the iteration holds that many alike blocks and ``extra``
    asks for one (a path search with one block's anchors stays small); ``elements`` are those
    whose iterations run it (a stated fraction)."""
    _, path, unroll, candidates = select_loop(binary, kernel, base)
    both = dataclasses.replace(base, name=name, need={**base.need, **extra})
    _, with_block, _, _ = select_loop(binary, kernel, both)
    return Term(name, (len(with_block) - len(path)) * copies, base.elems * unroll, elements, 0, 0,
                candidates)


@dataclasses.dataclass
class Launch:
    """What a builder says about one launch; evaluated against the binary by `evaluate`."""
    kernel: KernelInfo
    label: str
    threads: int
    blocks: int
    dynamic_smem: int
    terms: List[Term]
    dram_bytes: float
    count: int = 1
    latency_s: Optional[float] = H200.dram_latency_s
    imbalance: float = 1.0
    barrier_stages: float = 0
    note: str = ""
    load_bytes: Optional[float] = None  # bytes the latency bound waits for (default: dram_bytes)
    serial_s: float = 0.0   # work one block does alone after the parallel part (seconds)
    serial_chain: Chain = Chain()  # ... and its part counted as a Chain (the schedule's phases)
    dependent: bool = False  # a programmatic dependent launch (DSPARK_LAUNCH_DEPENDENT)
    chain: Chain = Chain()   # the launch's critical path (see Chain), counted from the code


def occ_of(kernel: KernelInfo, threads: int, dynamic_smem: int):
    return occupancy(kernel.regs, threads, kernel.shared + dynamic_smem)


def evaluate(launch: Launch) -> LaunchResult:
    k = launch.kernel
    occ = occ_of(k, launch.threads, launch.dynamic_smem)
    memory, issue, latency, overhead, flight = launch_time(
        blocks=launch.blocks, threads=launch.threads, occ=occ, terms=launch.terms,
        dram_bytes=launch.dram_bytes, latency_s=launch.latency_s, imbalance=launch.imbalance,
        load_bytes=launch.load_bytes, serial_s=launch.serial_s + launch.serial_chain.time_s(),
        barrier_stages=launch.barrier_stages, dependent=launch.dependent)
    chain_s = launch.chain.time_s()
    return LaunchResult(k.name, launch.label, launch.count, k.regs, k.local, k.static_smem,
                        launch.dynamic_smem, launch.threads, launch.blocks, occ, launch.terms,
                        launch.dram_bytes, memory, issue, latency, overhead,
                        bound_of(memory, issue, latency, overhead, chain_s), flight, launch.note,
                        launch.chain, chain_s, launch.serial_chain)


@dataclasses.dataclass
class Op:
    """One benchmark/floor shape: its launches and its floor."""
    op: str
    shape: str
    variant: str
    floor_bytes: float
    launches: List[Launch]
    launch_bound: bool = False   # docs/semantics.md §4: "launch-bound: one launch"
    match: Optional[dict] = None  # how to find the benchmark's row: op, shape params, variant
    library: List[LibraryCall] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# Launch plans and the kernels' constants come from the real code: each op is called in the SIMT
# emulator's plan-only mode at the modelled shape (bench/static/plans.py), which records the grid,
# block, dynamic shared memory and plan fields of every launch its glue and launchers make; what a
# launch does not say (how a kernel splits its work inside a block) is computed from the kernel
# headers' constants, read by `constant`.

_CONSTANTS: Optional[Dict[str, int]] = None


def constant(name: str) -> int:
    """An integer constant of the kernel headers (``constexpr int kName = expression;`` in
    csrc/kernels/), its expression evaluated over the headers' other constants, wherever in the
    folder they are defined (a family's ``<family>_launch.h`` and its ``.cuh`` use each other's)."""
    global _CONSTANTS
    if _CONSTANTS is None:
        _CONSTANTS = _kernel_constants()
    if name not in _CONSTANTS:
        raise sass.StructureError(f"no constant {name} in csrc/kernels/: the kernel changed; "
                                  "update bench/static/kernels.py")
    return _CONSTANTS[name]


def _kernel_constants(folder: Path = KERNELS) -> Dict[str, int]:
    """{name: value} of the folder's integer constants. Expressions are evaluated in passes until
    none more can be (one whose names are not all known waits for a later pass); of two definitions
    of a name (function-local constants may repeat one), the first that evaluates counts."""
    pending: List[Tuple[str, str]] = []
    for path in sorted(folder.glob("*.cuh")) + sorted(folder.glob("*.h")):
        for m in re.finditer(r"constexpr\s+(?:int|int64_t|unsigned)\s+(k\w+)\s*=\s*([^;]+);",
                             path.read_text()):
            expr = m.group(2).strip()
            if re.fullmatch(r"[\w\s*+/()-]+", expr):
                pending.append((m.group(1), expr.replace("/", "//")))
    values: Dict[str, int] = {}
    progress = True
    while pending and progress:
        progress, waiting = False, []
        for name, expr in pending:
            if name in values:
                continue
            try:
                values[name] = int(eval(expr, {"__builtins__": {}}, dict(values)))  # noqa: S307
                progress = True
            except NameError:
                waiting.append((name, expr))
            except Exception:  # not an integer expression after all
                continue
        pending = waiting
    return values


def kernel_launch(plan: Plan, kernel: str) -> Tuple[PlanLaunch, int]:
    """(the launch, how many times) of ``kernel`` in ``plan``; StructureError when the real code
    does not launch it (or launches it with more than one configuration)."""
    try:
        return plan.one(kernel)
    except ValueError as error:
        raise sass.StructureError(f"{error}; update bench/static/kernels.py") from None


def kernel_launches(plan: Plan, kernel: str) -> List[Tuple[PlanLaunch, int]]:
    """The launches of ``kernel`` in ``plan`` grouped by configuration (e.g. a block walk's first
    launch and its dependent ones), each (a launch, how many); StructureError when the real code
    does not launch it."""
    found = plan.groups(kernel)
    if not found:
        raise sass.StructureError(f"the plan launches no {kernel}; update bench/static/kernels.py")
    return found


def planned(launch: PlanLaunch, label: str, terms: List[Term], dram_bytes: float,
            count: int = 1, **kwargs) -> Launch:
    """A model Launch with the recorded launch's kernel, block, grid and shared memory."""
    return Launch(launch.kernel, label, launch.threads, launch.blocks, launch.shared, terms,
                  dram_bytes, count=count, dependent=launch.dependent, **kwargs)


# ------------------------------------------------------------------------------------------------
# verify (csrc/kernels/verify.cuh, csrc/cuda/verify_launch.cu)


def rows_decided(alpha: float, block: int) -> List[float]:
    """P(a request's blocks decide k rows), k = 1 .. block + 1: rows up to and including the
    first rejection, or every drafted row and the bonus row."""
    probs = [alpha ** (k - 1) * (1 - alpha) for k in range(1, block + 1)]
    return probs + [alpha ** block]


# One Philox-4x32-10 draw on thread 0's decision path: ten rounds of a dependent multiply, its
# high half and the key's XOR (common/philox.h).
PHILOX_CHAIN = 10 * 3


# One compare-exchange stage of a warp's bitonic sort (filter floors): a shuffle, the lane test,
# a min, a max and a select, each waiting for the one before.
SORT_STAGE_INSTRS = 5
# ASSUMED: one digit of a radix descent over about k candidates on chip (filter.cuh's
# descend_digit): clearing the 2,048 buckets (8 a thread), the candidates' shared atomics, each
# thread's 8 buckets summed, a block scan and a min-reduction (about 60 instructions between
# them) and the bucket choice: about 120 dependent instructions besides its four barriers.
DIGIT_INSTRS = 120


def verify_item_chain(chunk: int, threads: int, groups: int, elems_per_thread: int,
                      stages: int = 1) -> Chain:
    """One (row, chunk) item of verify_row_stats_kernel, the block's path: the request's scalars
    with the mark and the decider's draft-id loads (issued together: one L2 round trip) and the
    barrier that shares the skip; its chunk in iterations of `groups` 16-byte loads per row and
    thread, all issued before any is used; the block reduction (three barriers); the partial's
    store and the arrival, one acq_rel atomic: MEMBAR.ALL.GPU, ATOM, CCTL.IVALL in the SASS.
    ASSUMED: that membar (not the sequentially consistent MEMBAR.SC.GPU the fitted fence_s
    prices) waits for the thread's own outstanding store, the partial, so it costs one L2 round
    trip, and the atomic another.

    The HBM waits: one per iteration in registers (stages = 1). With draft rows the iterations
    go through the ring, `stages` of them in flight: iteration k is issued stages - 1 iterations
    before its use, so while an iteration's folding is short against the HBM latency, the
    iterations arrive in batches of `stages`, one wait each."""
    iterations = -(-chunk // (threads * elems_per_thread * groups))
    return Chain(l2_waits=3, dram_waits=-(-iterations // stages), barrier_stages=4)


def verify_decide_chain(greedy: bool) -> Chain:
    """What the last block of a row adds: the C partials merged from L2 (one round trip), two
    barriers, thread 0's Philox draw (sampled), the result's store."""
    return Chain(l2_waits=1, barrier_stages=2, dependent_instrs=0 if greedy else PHILOX_CHAIN)


def verify_op(binary: Binary, planner: Planner, batch: int, block: int, vocab: int,
              variant: str, alpha: float = 0.7, filtered: bool = False,
              bench_variant: Optional[str] = None) -> Op:
    """variant: greedy or sampled, with acceptance alpha (alpha = 1: every row is read, the
    floor's first case). bench_variant: the benchmark row this shape reproduces (its inputs
    realise the acceptance alpha), if any."""
    greedy = variant == "greedy"
    plan = planner.verify(batch, block, vocab, sampled=not greedy, filtered=filtered)
    # bf16 target rows; float32 draft rows (greedy passes none: the same instantiation).
    stats_launch, _ = kernel_launch(plan, "verify_row_stats_kernel<__nv_bfloat16, float>")
    emit_launch, _ = kernel_launch(plan, "verify_emit_kernel<__nv_bfloat16, float>")
    stats, emit = stats_launch.kernel, emit_launch.kernel
    chunks = stats_launch.fields["num_chunks"]
    threads = stats_launch.threads
    rows = block + 1
    elems = constant("kElementsPerThread")
    t_rows = sum(alpha ** i for i in range(rows))        # rows up to the first rejection
    d_rows = 0.0 if greedy else sum(alpha ** i for i in range(block))
    floor = batch * vocab * (t_rows * BF16 + d_rows * F32)
    # bf16 target beside a float32 draft: the mixed pair's group count (stats_groups).
    groups = constant("kTargetGroups") if greedy else constant("kMixedStatsGroups")
    if greedy:
        stream = LoopSpec("stream target row", {r"^LDG\.E\.128": groups, BF16_HIGH: 4 * groups,
                                                r"^FSETP\.GT": 8 * groups}, 8, (BF16_HIGH, 4))
    else:
        # Both rows through the ring (stream_rows_staged): per group a later iteration's three
        # 16-byte copies (target, two of the draft) and this one's three 16-byte reads back, and
        # the wait for this iteration's copies with stages - 1 groups left pending (the branch of
        # copy_async_wait_upto the planned depth takes).
        stream = LoopSpec("stream target+draft rows (ring)",
                          {r"^LDGSTS\.E\.BYPASS\.128": 3 * groups, r"^LDS\.128": 3 * groups,
                           BF16_HIGH: 4 * groups, r"^FSETP\.GT": 16 * groups,
                           r"^MUFU\.EX2": 16 * groups,
                           f"re:DEPBAR\\.LE SB0, 0x{stats_launch.fields['stages'] - 1:x}\\b": 1},
                          8, (BF16_HIGH, 4), loads=r"^LDGSTS")
    stats_bytes = batch * vocab * (t_rows * BF16 + d_rows * F32)

    # Rows are decided independently: a (row, chunk) item's block streams its chunk, publishes
    # its partial and leaves; the row's last block decides it. No block waits for another, so
    # the grid's critical path is the items the busiest resident slot runs one after another:
    # the items of needed rows (up to the first rejection; blocks start row-major, so a
    # request's later rows start after its earlier ones were decided and are skipped: the
    # run-ahead is assumed nil), the skipped items (their request's scalars and the mark), and
    # the rows' decisions, the grid's items spread evenly over its slots; then the decision of
    # the last row, which waits for everything.
    chunk = vocab // chunks + (vocab % chunks > 0)
    chunk = -(-chunk // 16) * 16                          # chunks start at multiples of 16
    # The ring's depth (draft rows only; the glue plans it for the device: plan_verify_rings).
    stages = 1 if greedy else stats_launch.fields["stages"]
    item = verify_item_chain(chunk, threads, groups, elems, stages)
    skip = Chain(l2_waits=1, barrier_stages=1)
    decide = verify_decide_chain(greedy)
    note = "rows decided independently: items in series per resident slot"
    gather_terms = []
    if filtered:
        # top-k 50 + top-p 0.9 (k <= kVerifyTopK): every item of a filtered row adds its chunk's
        # floor (a bitonic sort of each warp's 32 thread maxima: five stages of shuffles, then one
        # barrier) and the gather of its tokens at or above it: the chunk read again (from L2:
        # the block just streamed it) in the streaming pass's groups, one wait per iteration,
        # its instructions counted from the gather loop (ASSUMED: the hot path, no candidate). The decider reads the C floors (one L2
        # round trip) and the C candidate lists in batches of kCandidateBatch loads per thread (one round
        # trip each), then both thresholds' digits on chip: top-k's kFilterDigits and top-p's
        # kFilterDigits, four barriers each, the lists' three and the kept weight's reduction.
        tgroups = constant("kTargetGroups")
        gather_spec = LoopSpec("candidates: gather pass",
                               {r"^LDG\.E\.128": tgroups, BF16_HIGH: 4 * tgroups,
                                r"^FSETP\.GE": 8 * tgroups}, 8, (BF16_HIGH, 4),
                               loads=r"^LDG\.E\.128")
        gather = term(binary, stats, gather_spec, batch * vocab * t_rows)
        gather_terms = [gather]
        gather_waits = math.ceil(chunk * BF16 / (threads * gather.in_flight))
        sort_stages = sum(range(1, 6))                       # 15 compare-exchange stages
        # The gather's instructions are issue (its term), as the streaming pass's are: the
        # chain counts its wait, the sort's dependent stages and the barrier.
        item = item + Chain(l2_waits=gather_waits, barrier_stages=1,
                            dependent_instrs=SORT_STAGE_INSTRS * sort_stages)
        digits = constant("kFilterDigits")
        lists = chunks * constant("kChunkCandidates")
        batches = math.ceil(lists / (threads * constant("kCandidateBatch")))
        decide = decide + Chain(l2_waits=1 + batches,
                                dependent_instrs=2 * digits * DIGIT_INSTRS,
                                barrier_stages=4 * (2 * digits) + 3 + 2)
        note += ("; each filtered item gathers its chunk's top-k candidates (from L2), each "
                 "decided row's filters run on the C lists on chip")
    slots = occ_of(stats, threads, stats_launch.shared).blocks_per_sm * H200.sms
    needed = batch * chunks * t_rows
    skipped = batch * chunks * rows - needed
    decided = batch * t_rows
    stats_chain = (item.scaled(needed / slots) + skip.scaled(skipped / slots)
                   + decide.scaled(decided / slots) + decide)
    note += (f": {needed / slots:.1f} items, {skipped / slots:.1f} skipped and "
             f"{decided / slots:.2f} decisions per slot ({slots} resident blocks), then the "
             "last row's decision")
    stats_terms = [term(binary, stats, stream, batch * vocab * t_rows)] + gather_terms

    # The emit kernel: block 0 of a request reads the mark and row j*'s result (two L2 round
    # trips) and, greedy, writes the outputs. Sampled, each of the C blocks races its chunk of
    # row j* over max(p - q, 0), read again (ASSUMED from HBM: rows stream row-major, so a
    # request's final row is rarely still in L2), then publishes its partial and arrives; the
    # last merges the C partials and writes.
    emit_terms, emit_bytes = [], 0.0
    emit_chain = Chain(l2_waits=2, barrier_stages=1)
    if not greedy:
        p_draft = 1 - alpha ** block       # rejected at a drafted row: race over max(p - q, 0)
        # The race's ring (thread_race): its depth is the emit launch's shared memory over one
        # stage's (8 bf16 target and 8 float32 draft elements a thread), as the glue planned it.
        race_stages = emit_launch.shared // (threads * elems * (BF16 + F32))
        wait = f"re:DEPBAR\\.LE SB0, 0x{race_stages - 1:x}\\b"
        with_q = LoopSpec("race p-q (draft row, ring)",
                          {r"^LDGSTS\.E\.BYPASS\.128": 3, r"^LDS\.128": 3, r"^MUFU\.EX2": 16,
                           PHILOX: 2 * PHILOX_PER_BLOCK, wait: 1}, 8, (r"^LDS\.128", 3),
                          loads=r"^LDGSTS")
        no_q = LoopSpec("race p (bonus row, ring)",
                        {r"^LDGSTS\.E\.BYPASS\.128": 1, r"^LDS\.128": 1, r"^MUFU\.EX2": 8,
                         PHILOX: 2 * PHILOX_PER_BLOCK, wait: 1}, 8, (r"^LDS\.128", 1),
                        loads=r"^LDGSTS")
        emit_terms = [term(binary, emit, with_q, batch * vocab * p_draft),
                      term(binary, emit, no_q, batch * vocab * (1 - p_draft))]
        emit_bytes = batch * vocab * (BF16 + F32 * p_draft)
        # race_chunk: the chunk in thread_race's iterations (8 elements a thread, its Philox and
        # exponentials in series), arriving through the ring in batches of race_stages, an HBM
        # wait each (as verify_item_chain's); two block reductions, the partial's arrival
        # (acq_rel: two L2 round trips, as an item's); the last block's merge of the C partials
        # from L2 and two more reductions (twelve barriers in all).
        race = emit_terms[0]
        race_iters = math.ceil(chunk / (threads * elems))
        per_iter = race.path_instrs * elems / race.elems_per_iter
        emit_chain = emit_chain + Chain(dram_waits=math.ceil(race_iters / race_stages),
                                        dependent_instrs=race_iters * per_iter,
                                        l2_waits=3, barrier_stages=12)
    launches = [planned(stats_launch, "row items: statistics + decide"
                        + (" + filters" if filtered else ""),
                        stats_terms, stats_bytes + batch * rows * 8 + batch * 16,
                        chain=stats_chain, note=note)]
    launches.append(planned(emit_launch, "emit (greedy: the argmax of row j*)" if greedy else
                            "emit (race on row j*)", emit_terms, emit_bytes, chain=emit_chain))
    shape = f"B={batch} G={block} V={vocab}"
    label = ("greedy" if greedy else "sampled") + f" a={alpha:g}" + \
        (" (every row)" if alpha == 1 else "") + (" top-k 50 top-p 0.9" if filtered else "")
    bench = None if bench_variant is None else dict(
        op="verify", params=dict(B=batch, G=block, V=vocab), variant=bench_variant)
    # No fill: common/stream_counters.h keeps the counters in a buffer per stream that the kernels
    # return to zero (filled once when made; per call only under CUDA-graph capture).
    return Op("verify", shape, label, floor, launches, match=bench)


# ------------------------------------------------------------------------------------------------
# markov_draft / rnn_draft (csrc/kernels/draft*.cuh, csrc/cuda/draft_launch.cu)

# Slack of key_bound over -log(u) (draft_slot.cuh: within 0.06), as a factor on the chance to pass.
KEY_BOUND_SLACK = math.exp(0.06)


def vote_fraction(grid_tiles: int, tiles: int, tile_rows: int, slack: float) -> float:
    """ASSUMPTION: the expected fraction of the epilogue's warp calls (16 rows x 8 requests) in
    which some lane's token may still win, so the warp runs the vote-guarded block.

    A block's first tile knows no best key yet (it folds the grid's maxima in at the start of a
    tile, and every block starts together): all of its calls run the block. In the r-th later
    round of tiles about n = r * grid_tiles * tile_rows rows per request are known, and a row
    whose key is exchangeable with theirs beats their best key with probability about 1/n (times
    `slack` for the key bound's margin), so a call of 128 (row, request) pairs runs the block with
    probability 1 - (1 - slack / n)^128. Independent of the logits' scale for exchangeable rows;
    rows sorted by logit, or adversarial inputs, would run it more often.
    """
    done, calls, round_ = 0, 0.0, 0
    while done < tiles:
        n_tiles = min(grid_tiles, tiles - done)
        if round_ == 0:
            p = 1.0
        else:
            known = round_ * grid_tiles * tile_rows
            p = 1.0 - (1.0 - min(1.0, slack / known)) ** (16 * 8)
        calls += n_tiles * p
        done += n_tiles
        round_ += 1
    return calls / tiles


def warp_tile_shares(vocab: int, grid_tiles: int, warps: int) -> List[int]:
    """16-row tiles (one MMA's rows) per block of draft_slot_kernel: warp w of block x takes
    tiles w * grid + x, then every warps * grid-th."""
    warp_tiles, stride = (vocab + 15) // 16, warps * grid_tiles
    return [sum(max(0, (warp_tiles - (w * grid_tiles + x) + stride - 1) // stride)
                for w in range(warps)) for x in range(grid_tiles)]


def exposed(cover_s: float, hw=H200) -> float:
    """The share of an HBM wait left on a warp's path when `cover_s` of its own work runs
    between the load's issue and its use."""
    return max(0.0, 1.0 - cover_s / hw.dram_dependent_s)


def draft_slot_chain(warp_tiles: int, chunks: int, stages: int, sweeps: int, sweep_tiles: int,
                     chunk_instrs: float, call_instrs: float, per_tile_instrs: float,
                     hw=H200) -> Chain:
    """The busiest warp's path through one draft_slot_kernel launch (see draft_op): the group's
    inputs (a token from L2, then a row from HBM; the W2 ring's first chunks load beside them),
    then per tile the tile's instructions in series and what of its loads they do not cover, then
    the arrival's fences and atomic and the last block's read of the maxima.

    A tile's column tiles go in `sweeps` sweeps of up to `sweep_tiles`: each sweep streams the
    tile's `chunks` W2 chunks for its products, then makes its epilogue calls. The W2 ring holds
    `stages` chunks of the warp's stream, each issued when the chunk `stages` before it is used:
    a sweep's first chunks are issued during the sweep before's last products and load during its
    epilogue calls, and with more chunks than stages the chunk `stages` ahead waits once per sweep
    for what `stages - 1` chunks' products leave of the latency (the later ones follow it at the
    products' pace). The base logits load two column tiles ahead: a sweep's first two during its
    products, each later one during two epilogue calls. A float32-weight tile (no ring, `stages`
    0, one sweep) loads its W2 rows four k at a time and uses them at once: one wait per chunk."""
    dep = hw.dependent_instr_s
    products_s = chunks * chunk_instrs * dep
    call_s = call_instrs * dep
    if stages == 0:
        w2_waits = float(chunks)
    else:
        w2_waits = sweeps * (exposed(sweep_tiles * call_s, hw) + (
            exposed((stages - 1) * chunk_instrs * dep, hw) if chunks > stages else 0.0))
    base_waits = exposed(products_s, hw)
    if sweep_tiles > 1:
        base_waits += exposed(products_s + call_s, hw)
    base_waits += max(0, sweep_tiles - 2) * exposed(2 * call_s, hw)
    return Chain(l2_waits=2, dram_waits=1, fences=2, barrier_stages=3) + Chain(
        dram_waits=w2_waits + sweeps * base_waits, dependent_instrs=per_tile_instrs).scaled(
            warp_tiles)


def attention_split_chain(tiles: int, stages: int, rounds: int) -> Chain:
    """A split block's path (see attention_op): the Q tile and the ring's first tiles, then per
    tile one barrier; a tile is waited for when the `stages - 1` tiles in flight before it have
    been used, so HBM latency shows once per `stages - 1` tiles, over `rounds` rounds of resident
    blocks on the busiest SM."""
    return Chain(dram_waits=1 + tiles / (stages - 1), barrier_stages=tiles + 1).scaled(rounds)


def draft_op(binary: Binary, planner: Planner, batch: int, block: int, vocab: int, rank: int,
             rnn: bool, sampled: bool = True, hidden: int = 2560, filtered: bool = False) -> Op:
    plan = planner.draft(batch, block, vocab, rank, rnn=rnn, sampled=sampled, hidden=hidden,
                         filtered=filtered)
    passes = 2 if rnn else 1
    # bf16 weights and base logits. The walk's first launch is an ordinary one, every later one a
    # programmatic dependent launch (kernels/draft.cuh): one configuration each.
    slot_name = f"draft_slot_kernel<__nv_bfloat16, __nv_bfloat16, {str(rnn).lower()}>"
    slot_groups = kernel_launches(plan, slot_name)
    slot_launch = slot_groups[0][0]
    slot = slot_launch.kernel
    grid_tiles, groups = slot_launch.grid[0], slot_launch.grid[1]
    group, tiles = slot_launch.fields["group_size"], slot_launch.fields["num_tiles"]
    warps = slot_launch.threads // 32
    # The warps walk 16-row tiles interleaved over the grid: the busiest block's share.
    imbalance = max(warp_tile_shares(vocab, grid_tiles, warps)) / ((vocab + 15) // 16 / grid_tiles)
    ct = (min(group, batch) + 7) // 8                    # MMA column tiles (n8) per block
    k_chunk = constant("kKChunk")
    chunks = (rank + k_chunk - 1) // k_chunk
    stages = slot_launch.fields["stages"]
    # A tile's column tiles in sweeps (kernels/draft_slot.cuh, sweep_tiles): kSweepTiles at a time
    # with 16-bit weights (three blocks per SM). Each sweep streams the tile's W2 chunks through
    # the ring again (the later times mostly from L2).
    sweep_ct = min(ct, constant("kSweepTiles"))
    sweeps = (ct + sweep_ct - 1) // sweep_ct  # a partial last sweep is priced as a full one
    # Per k chunk: its fragments from the ring (two LDS.128), the MMAs, the refill (eight 4-byte
    # cp.async: each lane's words land in its MMAs' register order). The loop of a full sweep.
    mma = LoopSpec("W2 ring x inputs (mma.sync)",
                   {r"^HMMA": 2 * sweep_ct * passes, r"^LDGSTS": 8},
                   16 * k_chunk / 32, (r"^HMMA", 2 * sweep_ct * passes), loads=r"^LDGSTS")
    # z is stored through a row pointer kept in shared memory (a generic ST.E).
    store = r"^ST\.E$"
    need = {store: 4 * sweep_ct}
    if sampled:
        need[PHILOX] = PHILOX_PER_BLOCK * sweep_ct  # one Philox block per lane and column tile
    epi = LoopSpec("epilogue: store z, key bounds", need, 16 * 8 * sweep_ct / 32,
                   (store, 4 * sweep_ct), innermost=False)
    # W2 from HBM once per group: a tile's later sweeps re-read its chunks from L2 (ASSUMED to hit:
    # a tile's chunks come back a sweep, a few microseconds, after they were first read).
    w2 = vocab * rank * BF16 * groups
    slot_bytes = w2 + batch * vocab * BF16 + batch * vocab * F32 + batch * rank * BF16
    # The ring keeps `stages` chunks (32 bytes a lane each) in flight across the loop's
    # iterations, more than one iteration's path shows.
    mma_term = term(binary, slot, mma, vocab * rank * groups * sweeps)
    mma_term = dataclasses.replace(mma_term, in_flight=max(mma_term.in_flight, 32 * stages))
    terms = [mma_term, term(binary, slot, epi, vocab * batch)]
    # The epilogue's two warp votes: the logarithms (log1pf and logf: two exponent extractions per
    # element, 4 elements per lane) and the reductions + global atomicMax (2 per call). Their
    # fractions of warp calls are ASSUMPTIONS (vote_fraction); each warp runs exactly one first
    # tile, so the busiest SM's extra tiles (imbalance) are late ones that rarely vote in: the
    # vote blocks' elements are divided by the imbalance. One column tile's share of the
    # epilogue's anchors with its vote block, times ct: a path search over all tiles' anchors at
    # once grows too large with the bf16 store path.
    epi_tile = dataclasses.replace(epi, need={a: n // sweep_ct for a, n in epi.need.items()},
                                   unroll=(store, 4))
    tile_rows = constant("kTileRows")
    f_red = vote_fraction(grid_tiles, tiles, tile_rows, 1.0)
    f_log = vote_fraction(grid_tiles, tiles, tile_rows, KEY_BOUND_SLACK) if sampled else 0.0
    if sampled:
        terms.append(extra_term(binary, slot, epi_tile,
                                f"epilogue: logarithms ({100 * f_log:.1f}% "
                                "of warp calls, assumed)", {r"^I2FP\.F32\.S32": 8},
                                vocab * batch * f_log / imbalance, copies=sweep_ct))
    terms.append(extra_term(binary, slot, epi_tile, f"epilogue: reductions + atomicMax "
                            f"({100 * f_red:.1f}% of warp calls, assumed)",
                            {r"^ATOMG\.E\.MAX": 2}, vocab * batch * f_red / imbalance,
                            copies=sweep_ct))
    note = (f"vote blocks assumed in {100 * f_log:.1f}% (logarithms) / {100 * f_red:.1f}% "
            "(reductions) of warp calls: every call of a block's first tile, ~1/n later")
    # The busiest warp's path through the slot (kernels/draft_slot.cuh, draft_slot_kernel): the
    # group's inputs (the previous token, from L2, then its W1 row or the head's activation), then
    # per 16-row tile its chunks' products from the W2 ring and its epilogue calls, every
    # instruction in series, with what the ring and the base-logit prefetch leave exposed
    # (draft_slot_chain); last the arrival (a fence, the returning atomic) and the last block's
    # fence and reads of the group's maxima from L2.
    busiest_warp_tiles = math.ceil((vocab + 15) // 16 / (warps * grid_tiles))  # warp 0, block 0
    per_tile_elems = 16 * 8 * ct / 32                    # epilogue elements per lane and tile
    call_instrs = sum(t.instr_per_elem * per_tile_elems * t.elements / (vocab * batch)
                      for t in terms[1:]) / ct
    chunk_instrs = mma_term.instr_per_elem * 16 * k_chunk / 32
    per_tile_instrs = call_instrs * ct + chunk_instrs * chunks * sweeps
    slot_chain = draft_slot_chain(busiest_warp_tiles, chunks, stages, sweeps, sweep_ct,
                                  chunk_instrs, call_instrs, per_tile_instrs)
    launches = []
    if rnn:
        rows = 3 * rank
        width = 2 * rank + hidden
        # The tensor-core head: a block per 16 rows x 8 requests, its warps splitting the
        # 16-column steps. A warp's step: one m16n8k16 (16 rows x 8 requests x 16 columns: 64
        # multiply-adds a lane) from four 32-bit J loads and two of the inputs; rounds of
        # kHeadRound16 steps (head_mma_segment). The modelled loop is the bf16 hidden segment's
        # (exact in bf16: one MMA a step), d of the 2r + d columns; the float32 state's r
        # columns take three MMAs a step.
        head_groups = kernel_launches(plan, "rnn_head_mma_kernel<__nv_bfloat16>")
        head_launch = head_groups[0][0]
        round16, round_float = constant("kHeadRound16"), constant("kHeadRoundFloat")
        macs = LoopSpec("J x [s; W1[x]; h] (mma.sync, pair loads)",
                        {r"^HMMA": round16, r"^LDG\.E\.CONSTANT$": 6 * round16}, 64,
                        (r"^HMMA", 1), loads=r"^LDG\.E\.CONSTANT$")
        head_bytes = rows * width * BF16 + batch * hidden * BF16 + batch * rank * (BF16 + 2 * F32) \
            + batch * rows * F32
        # A warp's path: the previous token (L2), then per input segment (s, W1[x], h: r, r
        # and d columns) its share of the 16-column steps in rounds (head_segment_rounds), each
        # round's HBM round trips counted in its SASS (head_round_trips); then the block's
        # barrier and warp 0's sum. The float32 state's rounds stop at kHeadRoundFloat steps,
        # the bf16 inputs' at kHeadRound16.
        head_warps = head_launch.threads // 32
        head_waits = 0
        for columns, most, three_parts in ((rank, round_float, True), (rank, round16, False),
                                           (hidden, round16, False)):
            for size in head_segment_rounds(columns, head_warps, most):
                head_waits += head_round_trips(binary, head_launch.kernel, size, three_parts)
        head_terms = [term(binary, head_launch.kernel, macs, rows * width * batch)]
        for launch, count in head_groups:
            launches.append(planned(launch, "rnn head [g;c;o]" + (", dependent" if launch.dependent
                                                                  else ""),
                                    head_terms, head_bytes, count=count,
                                    chain=Chain(l2_waits=1, dram_waits=head_waits,
                                                barrier_stages=1),
                                    note="J read once from HBM, L2 serves the batch blocks"))
    for slot_launch, slot_count in slot_groups:
        launches.append(planned(slot_launch,
                                f"slot: W2 ring mma + sample ({groups} group(s) of {group}, "
                                f"{stages} stages)" + (", dependent" if slot_launch.dependent
                                                       else ""),
                                terms, slot_bytes, count=slot_count, imbalance=imbalance,
                                load_bytes=w2 * sweeps + batch * vocab * BF16, chain=slot_chain,
                                note=note + f"; busiest warp: {busiest_warp_tiles} tiles"))
    if filtered:
        # float32 draft rows (the default draft_logits dtype).
        filt_launch, filt_count = kernel_launch(plan, "draft_filter_kernel<float>")
        filt = filt_launch.kernel
        # Two 16-byte loads per 8 elements.
        load = (r"^LDG\.E\.128", 2)
        scan = LoopSpec("row max", {load[0]: load[1]}, 8, load)
        redraw = LoopSpec("drop + redraw", {load[0]: load[1], r"^STG\.E$": 8,
                                            PHILOX: 2 * PHILOX_PER_BLOCK}, 8, (r"^STG\.E$", 8))
        # The candidates' gather from the floor the threads' maxima give (a warp-aggregated
        # ATOMS.ADD, costed as if every iteration took it).
        gather = LoopSpec("gather candidates", {load[0]: load[1], r"^ATOMS\.ADD$": 1}, 8, load)
        n = batch * vocab
        note = ("the slot's rows (B*V*4, below the 50 MB L2) are read 3 times from L2 (max, "
                "gather from the floor, redraw) and rewritten")
        launches.append(planned(filt_launch, "top-k filter + redraw (block per request)",
                                [term(binary, filt, spec, n) for spec in (scan, gather, redraw)],
                                batch * vocab * F32, count=filt_count,
                                latency_s=H200.l2_latency_s, load_bytes=3 * batch * vocab * F32,
                                note=note))
    floor = block * vocab * rank * BF16 + batch * block * vocab * (BF16 + F32)
    op = "rnn_draft" if rnn else "markov_draft"
    shape = f"B={batch} G={block} V={vocab} r={rank}" + (f" d={hidden}" if rnn else "")
    variant = ("sampled" if sampled else "greedy") + (" top-k" if filtered else "")
    return Op(op, shape, variant, floor, launches,
              match=None if filtered else dict(op=op, params=dict(B=batch, G=block, V=vocab,
                                                                    r=rank),
                                               variant="sampled" if sampled else "greedy"))


def head_rounds(steps: int, most: int) -> List[int]:
    """The rounds of a warp's ``steps`` 16-column steps of one input segment in
    rnn_head_mma_kernel (kernels/draft_rnn_head.cuh, head_mma_segment), by size: rounds of
    ``most`` steps while a whole one is left, then at most one round each of 4, 2 and 1 steps
    (those below ``most``)."""
    rounds, rest = [most] * (steps // most), steps % most
    for size in (4, 2, 1):
        if size < most and rest >= size:
            rounds.append(size)
            rest -= size
    return rounds


def head_segment_rounds(columns: int, warps: int, most: int) -> List[int]:
    """The rounds (head_rounds) of the warp of rnn_head_mma_kernel that makes the most over one
    input segment of ``columns``: warps take ceil or floor of the 16-column steps over ``warps``,
    and a share one step shorter may need more rounds (3 steps: 2 + 1; 4 steps: one round of 4).
    The partial last step, if any, is one more single step, for a warp with a floor share when
    the shares differ."""
    whole, partial = divmod(columns, 16)
    candidates = [head_rounds(n, most) for n in {-(-whole // warps), whole // warps}]
    if partial:
        candidates.append(head_rounds(whole // warps, most) + [1])
    return max(candidates, key=len)


def load_phases(instrs, load: str, use: str) -> int:
    """The HBM round trips of one straight-line loop body in which ``use`` instructions (the
    MMAs) consume ``load`` results: a run of loads issued since the previous use is waited on by
    the next use, and the loads after that use issue only once it has its operands."""
    phases, pending = 0, False
    for ins in instrs:
        if sass.matches(ins, load):
            pending = True
        elif sass.matches(ins, use) and pending:
            phases, pending = phases + 1, False
    return phases


def head_round_trips(binary: Binary, kernel: KernelInfo, size: int, three_parts: bool) -> int:
    """HBM round trips of one round of ``size`` steps of head_mma_segment, counted in its SASS
    (load_phases): 16-bit inputs take one MMA and six 32-bit loads a step, float32 inputs
    (``three_parts``) three MMAs, four 32-bit J loads and two 64-bit input loads. A round whose
    last loads ptxas issues only after its first MMA (short of registers) costs two."""
    mmas = 3 * size if three_parts else size
    need = {r"^HMMA": mmas, r"^LDG\.E\.CONSTANT$": (4 if three_parts else 6) * size}
    if three_parts:
        need[r"^LDG\.E\.64\.CONSTANT$"] = 2 * size
    spec = LoopSpec(f"head round of {size} ({'float32' if three_parts else '16-bit'} input)",
                    need, 64 * size, (r"^HMMA", mmas))
    _, path, _, _ = select_loop(binary, kernel, spec)
    return load_phases(path.instrs, r"^LDG\.", r"^HMMA")


def confidence_op(binary: Binary, planner: Planner, batch: int, block: int, hidden: int,
                  vocab: int, rank: int) -> Op:
    plan = planner.confidence(batch, block, hidden, vocab, rank)
    launch, _ = kernel_launch(plan, "draft_confidence_kernel<__nv_bfloat16, __nv_bfloat16>")
    rows = batch * block
    nbytes = rows * hidden * BF16 + rows * rank * BF16 + (hidden + rank) * BF16 + rows * 12
    # A lane's 16-byte row loads in rounds of kConfidenceLoads, two rounds per iteration, each
    # issued a round before it is summed; the weights read back from shared memory.
    loads = constant("kConfidenceLoads")
    vec = 16 // BF16
    streamed = LoopSpec("row . staged weights (16-byte loads, two rounds)",
                        {r"^LDG\.E\.128": 2 * loads, r"^FFMA": 2 * loads * vec}, 2 * loads * vec,
                        (r"^LDG\.E\.128", 2 * loads))
    # A block's path (kernels/draft_confidence.cuh, row_products): the weights' asynchronous copies,
    # the hidden row's first two rounds and the W1 row's first round are issued before the one
    # barrier; the W1 row waits for its token (L2) first. Each later pair of rounds of a row is
    # issued when the pair before it is summed: one more HBM wait.
    def pairs_of_rounds(n: int) -> int:
        return -(-(-(-n // (32 * vec))) // (2 * loads))
    hidden_waits = max(1, pairs_of_rounds(hidden))
    markov_first = Chain(l2_waits=1, dram_waits=1)
    head = max(Chain(dram_waits=hidden_waits), markov_first, key=lambda c: c.time_s())
    chain = head + Chain(dram_waits=max(0, pairs_of_rounds(rank) - 1), barrier_stages=1)
    launches = [planned(launch, "stage weights (async), dot + sigmoid (warp per row)",
                        [term(binary, launch.kernel, streamed, rows * (hidden + rank))], nbytes,
                        chain=chain, note="weights staged whole beside the rows' loads; "
                                          f"{hidden_waits} HBM wait(s) of the hidden row")]
    return Op("draft_confidence", f"B={batch} G={block} d={hidden} r={rank}", "calibrated",
              nbytes, launches, launch_bound=True,
              match=dict(op="draft_confidence", params=dict(B=batch, G=block, d=hidden, r=rank),
                         variant=""))


# ------------------------------------------------------------------------------------------------
# block_draft_attention, append_context_kv (csrc/kernels/attention.cuh, cuda/attention_launch.cu)


def attention_op(binary: Binary, planner: Planner, batch: int, block: int, heads: int,
                 kv_heads: int, dim: int, length: int) -> Op:
    plan = planner.attention(batch, block, heads, kv_heads, dim, length)
    merge_launch, _ = kernel_launch(plan, f"block_attention_merge_kernel<__nv_bfloat16, {dim}>")
    stages, keys = merge_launch.fields["stages"], merge_launch.fields["tile_keys"]
    split_launch, _ = kernel_launch(
        plan, f"block_attention_split_kernel<__nv_bfloat16, {dim}, {stages}>")
    split, merge = split_launch.kernel, merge_launch.kernel
    splits = split_launch.fields["splits"]
    groups = split_launch.grid[1] // kv_heads           # grid (splits, Hkv x row groups, B)
    rows = block * (heads // kv_heads)
    kper = dim // 32                                    # merge: floats per lane and row
    # One maximum over all splits (lanes over splits, a scaling loop over them); the block keys'
    # values in their own loop (a score shuffled in from lane n).
    merge_new = LoopSpec("splits: scale partial outputs", {r"^MUFU\.EX2": 1, r"^FFMA": kper,
                                                          r"^LDG": kper + 1}, kper,
                         (r"^MUFU\.EX2", 1))
    values = LoopSpec("block keys: fold v", {r"^SHFL\.IDX": 1, r"^MUFU\.EX2": 1, r"^LDG": kper},
                      kper, (r"^MUFU\.EX2", 1), pick="densest")
    kv = 2 * batch * length * kv_heads * dim * BF16
    partial = batch * kv_heads * rows * splits * (dim + 2) * F32
    q = batch * block * heads * dim * BF16
    # Per tile of `keys` context rows a warp (one 16-row tile of the block's 32 query rows, half
    # of the output columns) does S = Q K^T over all the keys (dim/16 x keys/8 MMAs) and O += P V
    # over its columns (keys/16 x dim/16), with its fragments by ldmatrix (LDSM); the block's
    # threads copy the tile's K and V rows by cp.async (LDGSTS, outstanding until the DEPBAR of
    # their group).
    mmas = dim * keys // 128 + dim * keys // 256
    tile = LoopSpec("K/V tile: S=QK^T, softmax, O+=PV", {r"^HMMA": mmas,
                                                         r"^LDGSTS": keys * dim // 512},
                    keys * dim * 2 / split_launch.threads, (r"^HMMA", mmas), loads=r"^LDGSTS")
    split_elems = batch * kv_heads * groups * length * dim * 2
    # A block's path (kernels/attention.cuh, the split kernel's tile loop): a ring of `stages`
    # tiles, `stages - 1` in flight while one is used, one barrier per tile. The busiest SM runs
    # its blocks in ceil(blocks on it / resident) rounds.
    split_tiles = math.ceil(split_launch.fields["split_length"] / keys)
    resident = occ_of(split, split_launch.threads, split_launch.shared).blocks_per_sm
    rounds = math.ceil(math.ceil(split_launch.blocks / H200.sms) / resident)
    split_chain = attention_split_chain(split_tiles, stages, rounds)
    launches = [planned(split_launch, f"split-KV ({splits} split(s), {groups} row group(s)/head)",
                        [term(binary, split, tile, split_elems)], kv + partial + q,
                        load_bytes=kv + q, chain=split_chain,
                        note=f"32 query rows per block, {stages}-tile ring of {keys} rows; "
                             f"{rounds} round(s) of {split_tiles} tiles per block")]
    out_rows = batch * block * heads
    merge_bytes = partial + out_rows * dim * BF16 + q + 2 * batch * block * kv_heads * dim * BF16
    # Block keys' scores and values in loops unrolled by 4 (G >= 4 at the modelled shapes: the
    # unrolled loop, not its remainder); the splits' scaling loop runs `splits` times (its
    # remainder loop when fewer than 4).
    scores = LoopSpec("block keys: q.k", {r"^SHFL\.BFLY": 5}, kper, (r"^SHFL\.BFLY", 5),
                      pick="densest")
    if splits >= 4:
        merge_new = dataclasses.replace(merge_new, pick="densest")
    merge_terms = [term(binary, merge, scores, out_rows * block * dim),
                   term(binary, merge, merge_new, out_rows * splits * dim),
                   term(binary, merge, values, out_rows * block * dim)]
    # A warp's path: the splits' maxima, then their partial outputs (L2: just written), the block
    # keys' new K/V rows from HBM.
    launches.append(planned(merge_launch, "merge splits + block keys (warp per row)",
                            merge_terms, merge_bytes, chain=Chain(l2_waits=2, dram_waits=1)))
    return Op("block_draft_attention",
              f"B={batch} G={block} Hq={heads} Hkv={kv_heads} D={dim} ctx={length}", "bf16", kv,
              launches, match=dict(op="block_draft_attention",
                                   params=dict(B=batch, G=block, Hq=heads, Hkv=kv_heads, D=dim,
                                               ctx=length), variant="bf16"))


def append_op(binary: Binary, planner: Planner, batch: int, rows: int, kv_heads: int, dim: int,
              context: int) -> Op:
    plan = planner.append(batch, rows, kv_heads, dim, context)
    # bf16 rows are copied as 16-bit units.
    launch, _ = kernel_launch(plan, "append_context_kv_kernel<short unsigned int>")
    # Each thread with 4 K and 4 V 16-byte chunks in flight (aligned rows).
    copy = LoopSpec("copy 4 K + 4 V 16-byte chunks", {r"^LDG\.E\.128": 8, r"^ST\.E\.128": 8},
                    2 * 4 * 8, (r"^ST\.E\.128", 8), loads=r"^LDG\.E\.128")
    elems = 2 * batch * rows * kv_heads * dim
    nbytes = 2 * elems * BF16 + batch * 12
    # A block's path: the request's kept rows and position (one HBM wait), then its copy
    # iterations, each loading 4 K and 4 V 16-byte chunks per thread before storing them.
    per_block = 2 * rows * kv_heads * dim
    copies = math.ceil(per_block / (launch.threads * copy.elems))
    launches = [planned(launch, "copy kept rows (block per request)",
                        [term(binary, launch.kernel, copy, elems)], nbytes,
                        load_bytes=elems * BF16, chain=Chain(dram_waits=1 + copies))]
    return Op("append_context_kv", f"B={batch} n<={rows} Hkv={kv_heads} D={dim} ctx={context}",
              "bf16", nbytes, launches, launch_bound=True,
              match=dict(op="append_context_kv", params=dict(B=batch, Hkv=kv_heads, D=dim,
                                                            ctx=context), variant="bf16"))


# ------------------------------------------------------------------------------------------------
# scheduling (csrc/kernels/schedule.cuh, csrc/cuda/schedule_launch.cu)

SMEM_LATENCY_S = 33 / H200.clock_hz  # ASSUMPTION: one dependent shared-memory load, ~33 clocks


def merge_rounds(batch: int, block: int) -> List[int]:
    """Run widths of the merge rounds: G, 2G, ... while below the B * G keys."""
    widths, width = [], block
    while width < batch * block:
        widths.append(width)
        width *= 2
    return widths


def schedule_op(binary: Binary, planner: Planner, batch: int, block: int) -> Op:
    """The merge of per-request sorted runs (schedule.cuh): ceil(log2 B) rounds, a thread's
    kMergeItems outputs per segment after one merge-path binary search."""
    plan = planner.schedule(batch, block)
    # schedule_verify's mode (0); the keys in shared memory (true) or in global memory.
    found = [l for l in plan.launches if l.name.startswith("schedule_kernel<0, ")]
    if len(found) != 1:
        raise sass.StructureError(f"schedule_verify launched {[l.name for l in plan.launches]}; "
                                  "the model expects one schedule_kernel<0, ...>: update "
                                  "bench/static/kernels.py")
    launch = found[0]
    shared = launch.name.endswith("true>")
    k = launch.kernel
    items, chunks_per_thread = constant("kMergeItems"), constant("kMergeChunks")
    pairs = batch * block
    segments = math.ceil(pairs / items)
    per_thread = min(chunks_per_thread, math.ceil(segments / launch.threads))
    widths = merge_rounds(batch, block)
    # 64-bit pair keys: a segment's 8 outputs are four 16-byte stores.
    load, store = (r"^LDS\.64", r"^STS\.128") if shared else (r"^LDG\.E\.64", r"^STG\.E\.128")
    rounds_need = {r"^BAR": 2 if shared else 1, store: 4 * per_thread, load: 8 * per_thread}
    # One source-level iteration = one segment; the unrolled chunks are the unrolling.
    round_spec = LoopSpec(f"merge round: {items} outputs per segment", rounds_need, items,
                          (store, 4), innermost=not shared)
    search = LoopSpec("merge-path search step", {load: 2}, 1, (load, 2))
    steps = [max(1, math.ceil(math.log2(w + 1))) for w in widths]   # run A holds w keys
    # Critical path of a round: the dependent search steps, then the dependent merge steps.
    chain = sum(s + items for s in steps)
    latency = H200.l2_latency_s if not shared else SMEM_LATENCY_S
    nbytes = pairs * F32 + batch * 8
    # One block: its phases follow each other. The merge rounds issue at the SM's rate (issue)
    # with their dependent shared loads (the merge chain); beyond them a thread walks every other
    # phase in series (its request's pair keys from HBM with its first step rates beside them,
    # the block reductions and scan, theta over its ranks, the lengths' atomics, which nothing
    # waits for): at the modelled shapes their loops run one to a few times, so that path is
    # taken as every instruction of the kernel outside the merge round's loop, once. Both are
    # work the block does after (not beside) the merge: serial.
    merge_loop, _, _, _ = select_loop(binary, k, round_spec)
    cfg = binary.cfg(k.name)
    straight = sum(len(b.instrs) for b in cfg.blocks) - len(merge_loop.instrs(cfg))
    launches = [planned(launch, "survival keys, merge of sorted runs, scan, lengths (one block)",
                        [term(binary, k, round_spec, len(widths) * pairs),
                         term(binary, k, search, segments * sum(steps))],
                        0, latency_s=None, barrier_stages=0,
                        serial_s=chain * latency,
                        serial_chain=Chain(dram_waits=1, dependent_instrs=straight),
                        note=f"{pairs} keys in {'shared memory' if shared else 'global (L2)'}, "
                             f"{len(widths)} merge rounds, {chain} dependent "
                             f"{'shared' if shared else 'L2'} loads on the critical path "
                             f"(assumed latency each), then {straight} instructions in series")]
    return Op("schedule_verify", f"B={batch} G={block}", "one-stage", nbytes, launches,
              launch_bound=True,
              match=dict(op="schedule_verify", params=dict(B=batch, G=block), variant=""))


# ------------------------------------------------------------------------------------------------
# dspark_loss (csrc/kernels/loss.cuh, csrc/args/loss_args.cpp)


def loss_op(binary: Binary, planner: Planner, rows: int, vocab: int, hidden: int, rank: int,
            softcap: bool = False) -> Op:
    """The vocabulary pass of dspark_loss (forward + gradients, LM head frozen, bf16): one launch
    per row chunk, a block per row, three loops over the row. The chunk's matrix products are
    cuBLAS calls whose code the model does not read: library calls priced by their FLOPs and
    bytes (loss_chunk_products); the row's floor is the pass's own bytes.

    ``softcap``: Gemma4's logit soft cap (the kernel's kCap instantiation): the Markov bias is a
    third row read by every loop beside z and t, each loop computes a tanh per z and t element
    (an exponential and a reciprocal in SASS), the gradient loop writes the bias row too, and the
    chunk holds three rows of scratch per row instead of two."""
    plan = planner.loss(rows, vocab, softcap)
    name = f"dspark_loss_kernel<__nv_bfloat16, {str(softcap).lower()}>"
    groups = plan.groups(name)      # full chunks, then the last chunk's rows when fewer
    if not groups:
        kernel_launch(plan, name)   # raises: the plan does not launch it
    # Rows of 16-byte multiples (V = 151936 in bf16): 16-byte loads of 8 values per tensor and
    # iteration. The first two loops have the same anchors; the cheaper path is charged for both
    # (the logsumexp loop's is a few % longer).
    ldg, mufu, rcp, stg = r"^LDG\.E\.128", r"^MUFU\.EX2", r"^MUFU\.RCP", r"^STG\.E\.U16"
    if softcap:
        # z, bias, t per iteration; per element exp(z - lse), exp(t - lse) and two tanh.
        need = {ldg: 3, mufu: 32, rcp: 16}
        streams, writes = 3, 2
    else:
        need = {ldg: 2, mufu: 16}
        streams, writes = 2, 1
    loads = streams
    lse = LoopSpec("online logsumexps of z and t", need, 8, (ldg, loads), loads=ldg)
    l1 = LoopSpec("p, q: |p - q|, <s,p>, <s,q>", need, 8, (ldg, loads), loads=ldg)
    grad = LoopSpec("write d loss / d z" + (" and d loss / d bias" if softcap else ""),
                    {**need, stg: 8 * writes}, 8, (ldg, loads), loads=ldg)
    # Every stream read by each of the three loops; z (and the bias) written once.
    per_element = 3 * streams + writes
    launches = []
    for launch, count in groups:
        chunk = launch.blocks   # a block per row of the chunk
        elements = chunk * vocab
        launches.append(planned(
            launch, "vocabulary pass (block per row, one launch per chunk)",
            [term(binary, launch.kernel, spec, elements) for spec in (lse, l1, grad)],
            per_element * elements * BF16, count=count, barrier_stages=4,
            note=f"{count} chunk(s) of {chunk} rows; the products: library calls"))
    variant = "dspark cap30 bf16 fwd+bwd" if softcap else "dspark bf16 fwd+bwd"
    library = []
    for i, (launch, count) in enumerate(groups):
        # The first group holds the first chunk, whose grad_w2 product starts the sum.
        library += loss_chunk_products(launch.blocks, vocab, hidden, rank, softcap, count,
                                       first=i == 0)
    # The float32 grad_w2 rounded to bf16 once at the end.
    library.append(LibraryCall("grad_w2 -> bf16", 0.0, vocab * rank * (F32 + BF16)))
    return Op("dspark_loss", f"N={rows} V={vocab} d={hidden} r={rank}",
              "bf16 vocabulary pass + cuBLAS products" + (", soft cap" if softcap else ""),
              per_element * rows * vocab * BF16, launches, library=library,
              match=dict(op="dspark_loss", params=dict(N=rows, V=vocab, d=hidden, r=rank),
                         variant=variant))


def loss_chunk_products(n: int, vocab: int, hidden: int, rank: int, softcap: bool,
                        count: int, first: bool = False) -> List[LibraryCall]:
    """The ATen calls of ``count`` chunks of n rows in run_dspark_loss (csrc/args/loss_args.cpp),
    with a target and a Markov bias, gradients of h and u and W2 (the LM head frozen), bf16, on
    CUDA: each product's FLOPs and the bytes of its operands and result. Without a cap the bias
    is the first product into z and the head's product adds W h to it (addmm_, beta = 1: z read
    once more); with a soft cap the bias is its own product (bias_apart). grad_w2's float32 sum
    takes each chunk's product from cuBLAS's float32 output (aten::mm.dtype for the first chunk
    when ``first``, addmm.dtype reading and writing the sum for the others)."""
    w, w2 = vocab * hidden * BF16, vocab * rank * BF16
    logits = n * vocab * BF16
    h, u = n * hidden * BF16, n * rank * BF16
    head = 2.0 * n * vocab * hidden          # a product with the LM head (K = d or N = d)
    latent = 2.0 * n * vocab * rank          # a product with W2
    grad_sum = vocab * rank * F32
    if softcap:
        draft = [LibraryCall("z = h W^T", head, h + w + logits, count),
                 LibraryCall("bias = u W2^T", latent, u + w2 + logits, count)]
    else:
        draft = [LibraryCall("z = u W2^T (the bias)", latent, u + w2 + logits, count),
                 LibraryCall("z += h W^T (addmm_)", head, h + w + 2 * logits, count)]
    calls = draft + [
        LibraryCall("t = g W^T", head, h + w + logits, count),
        LibraryCall("d h = dz W", head, logits + w + h, count),
        LibraryCall("d u = dz W2", latent, logits + w2 + u, count),
    ]
    if first:
        calls.append(LibraryCall("grad_w2 = dz^T u (float32 out)", latent,
                                 logits + u + grad_sum, 1))
    if count > first:
        calls.append(LibraryCall("grad_w2 += dz^T u (float32 out)", latent,
                                 logits + u + 2 * grad_sum, count - first))
    return calls


NOT_MODELLED = {
    "plan_verify_budget": "one block of schedule_kernel in its plan mode (schedule.cuh); the "
                          "model reads the kernel in schedule_verify's mode only",
    "allocate_verify": "one block of schedule_kernel in its allocate mode (schedule.cuh); the "
                       "model reads the kernel in schedule_verify's mode only",
    "pack_verify_inputs": "one block of pack_verify_inputs_kernel (schedule.cuh) writing "
                          "B x (G + 1) ids and positions: launch latency",
    "philox_uniform": "one thread per uniform writing N x count floats (random.cuh); the "
                      "sampling kernels draw their uniforms inline",
}


def all_ops(binary: Binary, planner: Optional[Planner] = None) -> List[Op]:
    """The benchmark/floor shapes of docs/semantics.md §4 (and the benchmarks' defaults), each
    op's launches planned by the real code in the emulator (``planner``: one for ``binary`` by
    default)."""
    p = planner or Planner(binary)
    B, G, V, R = 64, 8, 151936, 256
    return [
        verify_op(binary, p, B, G, V, "greedy", alpha=1.0),
        # The acceptance the benchmark's inputs realise (bench/results/verify_<device>.json,
        # extra.alpha; tuned for 0.7 per position, the filtered distributions agree more).
        verify_op(binary, p, B, G, V, "greedy", alpha=0.69, bench_variant="greedy a~0.7"),
        verify_op(binary, p, B, G, V, "sampled", alpha=0.65, bench_variant="sampled a~0.7"),
        verify_op(binary, p, B, G, V, "sampled", alpha=1.0),
        verify_op(binary, p, B, G, V, "sampled", alpha=0.88, filtered=True,
                  bench_variant="sampled a~0.7 top-k"),
        draft_op(binary, p, B, G, V, R, rnn=False),
        draft_op(binary, p, B, 7, V, R, rnn=False),
        draft_op(binary, p, B, 7, V, R, rnn=False, sampled=False),
        draft_op(binary, p, B, 7, V, R, rnn=True),
        draft_op(binary, p, B, G, V, R, rnn=False, filtered=True),
        confidence_op(binary, p, B, 7, 2560, V, R),
        attention_op(binary, p, B, G, 32, 8, 128, 4096),
        attention_op(binary, p, B, G, 32, 8, 64, 4096),
        attention_op(binary, p, B, G, 32, 8, 256, 4096),
        attention_op(binary, p, B, G, 16, 2, 512, 4096),  # Gemma4's global layers
        append_op(binary, p, B, 9, 8, 128, 4096),
        append_op(binary, p, B, 9, 2, 512, 4096),
        schedule_op(binary, p, 256, 16),
        schedule_op(binary, p, 1024, 16),
        loss_op(binary, p, 512 * 7, V, 2560, R),
        loss_op(binary, p, 512 * 7, V, 2560, R, softcap=True),
    ] + check_ops(binary, p)


def check_ops(binary: Binary, p: Planner) -> List[Op]:
    """Shapes the H200 run measured beside the headline ones (docs/performance-model.md,
    "Calibration"): the calibration's constants were not fitted to them, so they check it. Each
    verify row takes the acceptance its benchmark inputs realised."""
    V, R = 151936, 256
    return [
        verify_op(binary, p, 64, 8, V, "sampled", alpha=0.29, bench_variant="sampled a~0.3"),
        verify_op(binary, p, 64, 8, V, "sampled", alpha=0.96, bench_variant="sampled a~0.95"),
        verify_op(binary, p, 1, 8, V, "sampled", alpha=0.0, bench_variant="sampled a~0.7"),
        verify_op(binary, p, 8, 8, V, "sampled", alpha=0.87, bench_variant="sampled a~0.7"),
        verify_op(binary, p, 256, 8, V, "sampled", alpha=0.71, bench_variant="sampled a~0.7"),
        draft_op(binary, p, 1, 7, V, R, rnn=False),
        draft_op(binary, p, 256, 7, V, R, rnn=False),
        attention_op(binary, p, 1, 8, 32, 8, 128, 4096),
        attention_op(binary, p, 16, 8, 32, 8, 128, 4096),
        attention_op(binary, p, 64, 8, 32, 8, 128, 1024),
        attention_op(binary, p, 64, 8, 32, 8, 128, 16384),
        append_op(binary, p, 1, 9, 8, 128, 4096),
        append_op(binary, p, 16, 9, 8, 128, 4096),
        schedule_op(binary, p, 64, 7),
        schedule_op(binary, p, 64, 16),
        schedule_op(binary, p, 256, 7),
        schedule_op(binary, p, 1024, 7),
    ]
