"""Per-kernel knowledge the model needs, read from csrc/kernels/*.cuh and csrc/cuda/*.cu: launch
configuration, which loop is hot and what one iteration of it does, and the bytes each launch
moves at a given shape. If the compiled code no longer has the expected loop (no loop of the
kernel has the expected work on one path), the model raises StructureError instead of reporting
numbers for the wrong code: update the selector here together with the kernel."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Tuple

from bench.static import sass
from bench.static.binary import Binary, KernelInfo
from bench.static.model import (H200, LaunchResult, Term, bound_of, launch_time, occupancy)

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


def first_matching(binary: Binary, kernel: KernelInfo, specs: List[LoopSpec]) -> int:
    """Index of the first spec whose loop the kernel has (the newest code's first); the newest's
    StructureError when none has."""
    first_error = None
    for k, spec in enumerate(specs):
        try:
            select_loop(binary, kernel, spec)
            return k
        except sass.StructureError as error:
            first_error = first_error or error
    raise first_error


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
    serial_round_trips: float = 0
    barrier_stages: float = 0
    note: str = ""
    load_bytes: Optional[float] = None  # bytes the latency bound waits for (default: dram_bytes)
    serial_s: float = 0.0   # work one block does alone on the critical path (verify's filters)
    dependent: bool = False  # a programmatic dependent launch (see is_dependent_launch)


def occ_of(kernel: KernelInfo, threads: int, dynamic_smem: int):
    return occupancy(kernel.regs, threads, kernel.shared + dynamic_smem)


def evaluate(launch: Launch) -> LaunchResult:
    k = launch.kernel
    occ = occ_of(k, launch.threads, launch.dynamic_smem)
    memory, issue, latency, overhead, flight = launch_time(
        blocks=launch.blocks, threads=launch.threads, occ=occ, terms=launch.terms,
        dram_bytes=launch.dram_bytes, latency_s=launch.latency_s, imbalance=launch.imbalance,
        load_bytes=launch.load_bytes, serial_s=launch.serial_s,
        serial_round_trips=launch.serial_round_trips, barrier_stages=launch.barrier_stages,
        dependent=launch.dependent)
    return LaunchResult(k.name, launch.label, launch.count, k.regs, k.local, k.static_smem,
                        launch.dynamic_smem, launch.threads, launch.blocks, occ, launch.terms,
                        launch.dram_bytes, memory, issue, latency, overhead,
                        bound_of(memory, issue, latency, overhead), flight, launch.note)


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


# ------------------------------------------------------------------------------------------------
# verify (csrc/kernels/verify.cuh, csrc/cuda/verify_cuda.cu)

VERIFY_THREADS = 256


VERIFY_MAX_CHUNKS = 16


def verify_plan_of_vocab_alone(binary: Binary, emit: KernelInfo) -> bool:
    """Whether the build splits the vocabulary by V alone (batch-invariant chunks). It came with
    padded targets read in place, whose row index is the emit kernel's one 32-bit division by a
    runtime value (I2F.U32.RP); earlier builds' emit kernel has none."""
    cfg = binary.cfg(emit.name)
    return sass.count((i for b in cfg.blocks for i in b.instrs), r"^I2F\.U32\.RP") > 0


def verify_grid(binary: Binary, stats: KernelInfo, batch: int, vocab: int, filters: bool,
                vocab_alone: bool = False):
    from bench.static.model import H200 as hw
    if vocab_alone:
        # verify.cuh verify_chunk: min(16, ceil(V / 1024)) chunks, a multiple of 16 long.
        wanted = min((vocab + 1023) // 1024, VERIFY_MAX_CHUNKS)
        chunk = ((vocab + wanted - 1) // wanted + 15) // 16 * 16
        return (vocab + chunk - 1) // chunk, chunk
    dyn = filter_shared_bytes() if filters else 0
    bps = occ_of(stats, VERIFY_THREADS, dyn).blocks_per_sm
    resident = bps * hw.sms
    chunks = min(max(resident // batch, 1), (vocab + 1023) // 1024)
    chunk = ((vocab + chunks - 1) // chunks + 15) // 16 * 16
    return (vocab + chunk - 1) // chunk, chunk


def filter_shared_bytes() -> int:
    # FilterShared (kernels/filter.cuh): count[2048]*4 + weight[2048]*8 + 2560*(4+4) + 32*8 +
    # 32*4 + 8 + 4, padded to 8.
    buckets = 2048
    size = buckets * 4 + buckets * 8 + 2560 * 4 + 2560 * 4 + 32 * 8 + 32 * 4
    size = (size + 7) // 8 * 8 + 8 + 4
    return (size + 7) // 8 * 8


def gather_loops(binary: Binary, kernel: KernelInfo, load: str, loads: int) -> int:
    """Loops of a filter kernel that gather candidates: `loads` row loads and a shared ATOMS.ADD
    (two since top-k's floor: the floor's gather and the fallback's)."""
    cfg = binary.cfg(kernel.name)
    return sum(1 for loop in cfg.loops
               if sass.count(loop.instrs(cfg), load) == loads
               and sass.count(loop.instrs(cfg), r"^ATOMS\.ADD$") > 0)


def is_dependent_launch(binary: Binary, kernel: KernelInfo) -> bool:
    """Whether the kernel waits for the grid before it (griddepcontrol.wait, SASS ACQBULK): it is
    launched as a programmatic dependent launch (kernels/launch.cuh)."""
    cfg = binary.cfg(kernel.name)
    return sass.count((i for b in cfg.blocks for i in b.instrs), r"^ACQBULK") > 0


def _has_loop(binary: Binary, kernel: KernelInfo, spec: LoopSpec) -> bool:
    try:
        select_loop(binary, kernel, spec)
        return True
    except sass.StructureError:
        return False


def one_block_pass_s(t: Term, threads: int) -> float:
    """One block alone over a loop of t.elements elements: issue of its warps on the four
    schedulers, or one L2 round trip per iteration when each iteration waits for its loads."""
    iterations = math.ceil(t.elements / (threads * t.elems_per_iter))
    warps_per_scheduler = math.ceil(threads / 32 / H200.partitions)
    issue = iterations * t.path_instrs * warps_per_scheduler / H200.clock_hz
    latency = iterations * H200.l2_latency_s if t.in_flight else 0.0
    return max(issue, latency)


def verify_op(binary: Binary, batch: int, block: int, vocab: int, variant: str,
              alpha: float = 0.7, filtered: bool = False) -> Op:
    """variant: greedy or sampled, with acceptance alpha (alpha = 1: every row is read, the
    floor's first case)."""
    stats = binary.find(r"verify_row_stats_kernelI13__nv_bfloat16fE")
    emit = binary.find(r"verify_emit_kernelI13__nv_bfloat16fE")
    chunks, _ = verify_grid(binary, stats, batch, vocab, filtered,
                            vocab_alone=verify_plan_of_vocab_alone(binary, emit))
    blocks = chunks * batch
    greedy = variant == "greedy"
    rows = block + 1
    t_rows = sum(alpha ** i for i in range(rows))        # rows up to the first rejection
    d_rows = 0.0 if greedy else sum(alpha ** i for i in range(block))
    floor = batch * vocab * (t_rows * BF16 + d_rows * F32)
    if greedy:
        stream = LoopSpec("stream target row", {r"^LDG\.E\.128": 2, BF16_HIGH: 8,
                                                r"^FSETP\.GT": 16}, 16, (BF16_HIGH, 8))
    else:
        stream = LoopSpec("stream target+draft rows",
                          {r"^LDG\.E\.128": 6, BF16_HIGH: 8, r"^FSETP\.GT": 32,
                           r"^MUFU\.EX2": 32}, 16, (BF16_HIGH, 8))
    stats_bytes = batch * vocab * (t_rows * BF16 + d_rows * F32)
    serial_s, note = 0.0, "one fence+atomic per row a block walks"
    if filtered:
        # top-k + top-p (kernels/filter.cuh): the deciding block passes over the row twice (first
        # digit by count, then the gather), from L2, before the next row can be decided; since
        # top-k's floor (the warps' maxima the streaming blocks publish), once: the gather from
        # the floor (a second gather loop, the fallback's, is then in the binary).
        hist = LoopSpec("filter: first-digit histogram", {r"^LDG\.E\.128": 1,
                                                          r"^ATOMS\.POPC\.INC": 8}, 8,
                        (r"^LDG\.E\.128", 1), loads=r"^LDG\.E\.128")
        visit = LoopSpec("filter: gather pass", {r"^LDG\.E\.128": 1, r"^MUFU\.EX2": 8}, 8,
                         (r"^LDG\.E\.128", 1), loads=r"^LDG\.E\.128")
        passes = [term(binary, stats, visit, vocab)]
        if gather_loops(binary, stats, r"^LDG\.E\.128", 1) < 2:
            passes.insert(0, term(binary, stats, hist, vocab))
        serial_s = t_rows * sum(one_block_pass_s(t, VERIFY_THREADS) for t in passes)
        note = f"filters: {serial_s * 1e6:.0f} us of one-block row passes on the critical path"
    with_q = LoopSpec("race p-q (draft row)", {r"^LDG\.E\.128": 3, r"^MUFU\.EX2": 16,
                                               PHILOX: 2 * PHILOX_PER_BLOCK}, 8,
                      (r"^LDG\.E\.128", 3))
    no_q = LoopSpec("race p (bonus row)", {r"^LDG\.E\.128": 1, r"^MUFU\.EX2": 8,
                                           PHILOX: 2 * PHILOX_PER_BLOCK}, 8, (r"^LDG\.E\.128", 1))
    stats_terms = [term(binary, stats, stream, batch * vocab * t_rows)]
    emit_terms, emit_bytes, emit_round_trips = [], 0.0, 0
    if not greedy:
        p_draft = 1 - alpha ** block       # rejected at a drafted row: race over max(p - q, 0)
        # Since the race moved into the statistics kernel (its loops are in both kernels), the
        # blocks of a request that see its rejection race one chunk each of row j* as they stop,
        # re-reading it from L2: between a chunk's stream and its race the GPU reads about one row
        # step of the resident blocks (3 x 132 x 57 KB = 23 MB, under the 50 MB L2). A request
        # that accepts every draft leaves C - 1 of its C chunks to the emit kernel (its other
        # blocks finished before the bonus row was decided), which reads them from HBM.
        fused = _has_loop(binary, stats, with_q)
        chunks_in_stats = chunks if fused else 0
        rejected_in_emit = 1 - chunks_in_stats / chunks
        bonus_in_emit = 1 - min(chunks_in_stats, 1) / chunks
        if fused:
            stats_terms += [term(binary, stats, with_q, batch * vocab * p_draft),
                            term(binary, stats, no_q, batch * vocab * (1 - p_draft) / chunks)]
            # The deciding block races its own chunk after the decision, on the critical path.
            serial_s += one_block_pass_s(dataclasses.replace(
                stats_terms[1], elements=vocab / chunks), VERIFY_THREADS)
        emit_terms = [term(binary, emit, with_q, batch * vocab * p_draft * rejected_in_emit),
                      term(binary, emit, no_q, batch * vocab * (1 - p_draft) * bonus_in_emit)]
        emit_bytes = batch * vocab * (BF16 * (p_draft * rejected_in_emit
                                              + (1 - p_draft) * bonus_in_emit)
                                      + F32 * p_draft * rejected_in_emit)
        emit_round_trips = 1
    launches = [Launch(stats, "row statistics + decide" + (" + filters" if filtered else "")
                       + ("" if greedy else " + race"),
                       VERIFY_THREADS, blocks, filter_shared_bytes() if filtered else 0,
                       stats_terms, stats_bytes + batch * rows * 8 + batch * 16,
                       serial_round_trips=t_rows, serial_s=serial_s, note=note)]
    launches.append(Launch(emit, "emit (greedy: nothing left)" if greedy else
                           "emit (race on row j*: the chunks left)", VERIFY_THREADS, blocks, 0,
                           emit_terms, emit_bytes, serial_round_trips=emit_round_trips,
                           dependent=is_dependent_launch(binary, emit)))
    shape = f"B={batch} G={block} V={vocab}"
    label = ("greedy" if greedy else "sampled") + f" a={alpha:g}" + \
        (" (every row)" if alpha == 1 else "") + (" top-k 50 top-p 0.9" if filtered else "")
    bench = dict(op="verify", params=dict(B=batch, G=block, V=vocab),
                 variant=("greedy" if greedy else "sampled") + f" a~{alpha:g}"
                 + (" top-k" if filtered else ""))
    # No fill: common/stream_counters.h keeps the counters in a buffer per stream that the kernels
    # return to zero (filled once when made; per call only under CUDA-graph capture).
    return Op("verify", shape, label, floor, launches, match=None if alpha == 1 else bench)


# ------------------------------------------------------------------------------------------------
# markov_draft / rnn_draft (csrc/kernels/draft*.cuh, csrc/cuda/draft_cuda.cu)

DRAFT_THREADS, TILE_ROWS, MAX_GROUP, K_CHUNK = 256, 128, 64, 32
DRAFT_WARPS = DRAFT_THREADS // 32
FILTER_THREADS = 1024  # draft_filter.cuh kFilterThreads


def draft_shared(group: int, rank: int, passes: int) -> int:
    padded = (rank + K_CHUNK - 1) // K_CHUNK * K_CHUNK
    stride = (padded + 63) // 64 * 64 + 32   # 16-bit weights
    return passes * group * stride * BF16


# draft_slot.cuh draft_input_budget on the H200: half the SM's shared memory less kSlotSharedReserve.
DRAFT_INPUT_BUDGET = H200.smem_per_sm // 2 - 5 * 1024


def draft_group(batch: int, rank: int, passes: int) -> int:
    size = MAX_GROUP
    while size > 8 and draft_shared(size, rank, passes) > DRAFT_INPUT_BUDGET:
        size //= 2
    return min(size, max(8, (batch + 7) // 8 * 8))


# Slack of key_bound over -log(u) (draft_slot.cuh: within 0.06), as a factor on the chance to pass.
KEY_BOUND_SLACK = math.exp(0.06)


def vote_fraction(grid_tiles: int, tiles: int, slack: float) -> float:
    """ASSUMPTION: the expected fraction of the epilogue's warp calls (16 rows x 8 requests) in
    which some lane's token may still win, so the warp runs the vote-guarded block.

    A block's first tile knows no best key yet (it folds the grid's maxima in at the start of a
    tile, and every block starts together): all of its calls run the block. In the r-th later
    round of tiles about n = r * grid_tiles * 128 rows per request are known, and a row whose key
    is exchangeable with theirs beats their best key with probability about 1/n (times `slack`
    for the key bound's margin), so a call of 128 (row, request) pairs runs the block with
    probability 1 - (1 - slack / n)^128. Independent of the logits' scale for exchangeable rows;
    rows sorted by logit, or adversarial inputs, would run it more often.
    """
    done, calls, round_ = 0, 0.0, 0
    while done < tiles:
        n_tiles = min(grid_tiles, tiles - done)
        if round_ == 0:
            p = 1.0
        else:
            known = round_ * grid_tiles * TILE_ROWS
            p = 1.0 - (1.0 - min(1.0, slack / known)) ** (16 * 8)
        calls += n_tiles * p
        done += n_tiles
        round_ += 1
    return calls / tiles


def warp_tile_shares(vocab: int, grid_tiles: int) -> List[int]:
    """16-row tiles per block of draft_slot_kernel: warp w of block x takes tiles w * grid + x,
    then every DRAFT_WARPS * grid-th."""
    warp_tiles, stride = (vocab + 15) // 16, DRAFT_WARPS * grid_tiles
    return [sum(max(0, (warp_tiles - (w * grid_tiles + x) + stride - 1) // stride)
                for w in range(DRAFT_WARPS)) for x in range(grid_tiles)]


def warp_interleaved(binary: Binary, kernel: KernelInfo) -> bool:
    """Whether the slot kernel's tile loop (its largest outermost loop) steps by
    DRAFT_WARPS * gridDim.x, the warp-interleaved walk, rather than by gridDim.x: its latch scales
    the step by 8 (``IMAD.WIDE.U32 R10, R97, 0x8, R10``; earlier builds add gridDim.x itself)."""
    cfg = binary.cfg(kernel.name)
    outer = [loop for loop in cfg.loops if loop.parent is None]
    if not outer:
        return False
    tiles = max(outer, key=lambda loop: len(loop.blocks))
    return any(re.match(r"(IMAD|LEA|SHF\.L)\S* .*, 0x%x\b" % DRAFT_WARPS, i.body)
               for latch in tiles.latches for i in cfg.blocks[latch].instrs)


def draft_op(binary: Binary, batch: int, block: int, vocab: int, rank: int, rnn: bool,
             sampled: bool = True, hidden: int = 2560, filtered: bool = False) -> Op:
    passes = 2 if rnn else 1
    # Newest first: the base logits' dtype a template parameter (bf16 base, S2_), then the build
    # whose epilogue switched on it per element.
    version, slot = binary.find_first(r"draft_slot_kernelI13__nv_bfloat16S2_Lb%dE" % int(rnn),
                                      r"draft_slot_kernelI13__nv_bfloat16Lb%dE" % int(rnn))
    vote = version == 0
    group = draft_group(batch, rank, passes)
    groups = (batch + group - 1) // group
    dyn = draft_shared(group, rank, passes)
    bps = occ_of(slot, DRAFT_THREADS, dyn).blocks_per_sm
    tiles = (vocab + TILE_ROWS - 1) // TILE_ROWS
    grid_tiles = min(max(bps * H200.sms // groups, 1), tiles)
    if warp_interleaved(binary, slot):
        # The warps walk 16-row tiles interleaved over the grid: the busiest block's share.
        imbalance = max(warp_tile_shares(vocab, grid_tiles)) / ((vocab + 15) // 16 / grid_tiles)
    else:  # earlier builds: each block walks whole 128-row tiles
        imbalance = math.ceil(tiles / grid_tiles) / (tiles / grid_tiles)
    ct = (min(group, batch) + 7) // 8                    # MMA column tiles per block
    chunks = (rank + K_CHUNK - 1) // K_CHUNK
    mma = LoopSpec("W2 x inputs (mma.sync)",
                   {r"^HMMA": 2 * min(4, chunks) * ct * passes, r"^LDG\.E\.128": 2 * min(4, chunks)},
                   16 * K_CHUNK * min(4, chunks) / 32, (r"^LDG\.E\.128", 2 * min(4, chunks)),
                   loads=r"^LDG\.E\.128")
    # z is stored through a row pointer kept in shared memory since the Base template (a generic
    # ST.E), before it through a global STG.E.
    store = r"^ST\.E$" if vote else r"^STG\.E$"
    need = {store: 4 * ct}
    if sampled:
        need[PHILOX] = PHILOX_PER_BLOCK * ct  # one Philox block per lane and column tile
    epi = LoopSpec("epilogue: store z, key bounds" if vote else "epilogue: store z, Gumbel keys",
                   need, 16 * 8 * ct / 32, (store, 4 * ct), innermost=False)
    w2 = vocab * rank * BF16 * groups
    slot_bytes = w2 + batch * vocab * BF16 + batch * vocab * F32 + batch * rank * BF16
    terms = [term(binary, slot, mma, vocab * rank * groups),
             term(binary, slot, epi, vocab * batch)]
    note = ""
    if vote:
        # The epilogue's two warp votes: the logarithms (log1pf and logf: two exponent
        # extractions per element, 4 elements per lane) and the reductions + global atomicMax
        # (2 per call). Their fractions of warp calls are ASSUMPTIONS (vote_fraction); each
        # warp runs exactly one first tile, so the busiest SM's extra tiles (imbalance) are late
        # ones that rarely vote in: the vote blocks' elements are divided by the imbalance.
        # One column tile's share of the epilogue's anchors with its vote block, times ct: a
        # path search over all tiles' anchors at once grows too large with the bf16 store path.
        epi_tile = dataclasses.replace(epi, need={a: n // ct for a, n in epi.need.items()},
                                       unroll=(store, 4))
        f_red = vote_fraction(grid_tiles, tiles, 1.0)
        f_log = vote_fraction(grid_tiles, tiles, KEY_BOUND_SLACK) if sampled else 0.0
        if sampled:
            terms.append(extra_term(binary, slot, epi_tile,
                                    f"epilogue: logarithms ({100 * f_log:.1f}% "
                                    "of warp calls, assumed)", {r"^I2FP\.F32\.S32": 8},
                                    vocab * batch * f_log / imbalance, copies=ct))
        terms.append(extra_term(binary, slot, epi_tile, f"epilogue: reductions + atomicMax "
                                f"({100 * f_red:.1f}% of warp calls, assumed)",
                                {r"^ATOMG\.E\.MAX": 2}, vocab * batch * f_red / imbalance,
                                copies=ct))
        note = (f"vote blocks assumed in {100 * f_log:.1f}% (logarithms) / {100 * f_red:.1f}% "
                "(reductions) of warp calls: every call of a block's first tile, ~1/n later")
    launches = []
    if rnn:
        rows = 3 * rank
        width = 2 * rank + hidden
        # Newest first: the tensor-core head (a block per 16 rows x 8 requests, its eight warps
        # splitting the 16-column steps), then the CUDA-core head.
        version, head = binary.find_first(r"rnn_head_mma_kernelI13__nv_bfloat16E",
                                          r"rnn_head_kernelI13__nv_bfloat16E")
        if version == 0:
            head_threads = 256
            head_blocks = ((rows + 15) // 16) * ((batch + 7) // 8)
            # A warp's step: one m16n8k16 (16 rows x 8 requests x 16 columns: 64 multiply-adds a
            # lane) from four 32-bit J loads and two of the inputs; unrolled by 4. The modelled
            # loop is the bf16 hidden segment's (exact in bf16: one MMA a step), d of the 2r + d
            # columns; the float32 state's r columns take three MMAs a step.
            macs = LoopSpec("J x [s; W1[x]; h] (mma.sync, pair loads)",
                            {r"^HMMA": 4, r"^LDG\.E\.CONSTANT$": 24}, 64, (r"^HMMA", 1),
                            loads=r"^LDG\.E\.CONSTANT$")
        else:
            head_threads = DRAFT_THREADS
            head_blocks = ((rows + 31) // 32) * ((batch + 7) // 8)
            # A lane's step: a pair of columns for 4 rows x 8 requests (64 multiply-adds). The
            # modelled loop is the bf16 hidden segment's with pair loads (12 32-bit loads; the
            # high halves unpacked by LOP3), d of the 2r + d columns; before pair loads, the one
            # k loop.
            pairs = LoopSpec("J x [s; W1[x]; h] (FMA, pair loads)",
                             {r"^FFMA": 64, r"^LDG\.E\.CONSTANT$": 12, r"^LOP3": 12}, 64,
                             (r"^FFMA", 64))
            single = LoopSpec("J x [s; W1[x]; h] (FMA)", {r"^FFMA": 32}, 32, (r"^FFMA", 32))
            macs = [pairs, single][first_matching(binary, head, [pairs, single])]
        head_bytes = rows * width * BF16 + batch * hidden * BF16 + batch * rank * (BF16 + 2 * F32) \
            + batch * rows * F32
        launches.append(Launch(head, "rnn head [g;c;o]", head_threads, head_blocks, 0,
                               [term(binary, head, macs, rows * width * batch)], head_bytes,
                               count=block, note="J read once from HBM, L2 serves the batch blocks"))
    launches.append(Launch(slot, f"slot: W2 mma + sample ({groups} group(s) of {group})",
                           DRAFT_THREADS, grid_tiles * groups, dyn, terms, slot_bytes, count=block,
                           imbalance=imbalance, serial_round_trips=1,
                           load_bytes=w2 + batch * vocab * BF16, note=note))
    if filtered:
        # float32 rows: the float instantiation (before it the only, untemplated kernel).
        _, filt = binary.find_first(r"draft_filter_kernelIfE", r"draft_filter_kernelENS")
        # Since: 1024 threads a block, two 16-byte loads per 8 elements; before: 256 threads,
        # 8 scalar loads.
        scan_vec = LoopSpec("row max", {r"^LDG\.E\.128": 2}, 8, (r"^LDG\.E\.128", 2))
        scan = LoopSpec("row max", {r"^LDG\.E$": 8}, 8, (r"^LDG\.E$", 8))
        vector = first_matching(binary, filt, [scan_vec, scan]) == 0
        load = (r"^LDG\.E\.128", 2) if vector else (r"^LDG\.E$", 8)
        scan = scan_vec if vector else scan
        # By count (top-k): one shared increment per element (ATOMS.POPC.INC; the gather pass's
        # warp-aggregated ATOMS.ADD is a different loop).
        hist = LoopSpec("first-digit histogram", {load[0]: load[1], r"^ATOMS\.POPC\.INC": 8}, 8,
                        (r"^ATOMS\.POPC\.INC", 8))
        redraw = LoopSpec("drop + redraw", {load[0]: load[1], r"^STG\.E$": 8,
                                            PHILOX: 2 * PHILOX_PER_BLOCK}, 8, (r"^STG\.E$", 8))
        # The candidates' gather (a warp-aggregated ATOMS.ADD, costed as if every iteration
        # took it). Since top-k's gather starts from the floor the threads' maxima give (two
        # gather loops: the floor's and the fallback's), it replaces the first-digit pass.
        gather = LoopSpec("gather candidates", {load[0]: load[1], r"^ATOMS\.ADD$": 1}, 8,
                          (load[0], load[1]))
        gathers = gather_loops(binary, filt, load[0], load[1])
        n = batch * vocab
        threads = FILTER_THREADS if vector else DRAFT_THREADS
        if gathers >= 2:
            passes, reads = [scan, gather, redraw], 3
            note = ("the slot's rows (B*V*4, below the 50 MB L2) are read 3 times from L2 (max, "
                    "gather from the floor, redraw) and rewritten")
        else:
            passes, reads = [scan, hist, redraw], 4
            note = ("the slot's rows (B*V*4, below the 50 MB L2) are read 4 times from L2 and "
                    "rewritten; gather pass not costed")
        launches.append(Launch(filt, "top-k filter + redraw (block per request)", threads,
                               batch, filter_shared_bytes(),
                               [term(binary, filt, spec, n) for spec in passes],
                               batch * vocab * F32, count=block, latency_s=H200.l2_latency_s,
                               load_bytes=reads * batch * vocab * F32,
                               note=note))
    floor = block * vocab * rank * BF16 + batch * block * vocab * (BF16 + F32)
    op = "rnn_draft" if rnn else "markov_draft"
    shape = f"B={batch} G={block} V={vocab} r={rank}" + (f" d={hidden}" if rnn else "")
    variant = ("sampled" if sampled else "greedy") + (" top-k" if filtered else "")
    return Op(op, shape, variant, floor, launches,
              match=None if filtered else dict(op=op, params=dict(B=batch, G=block, V=vocab,
                                                                    r=rank),
                                               variant="sampled" if sampled else "greedy"))


CONFIDENCE_THREADS, CONFIDENCE_SEGMENT = 128, 2048  # draft_confidence.cuh kConfidenceThreads, kConfidenceSegment


def confidence_op(binary: Binary, batch: int, block: int, hidden: int, rank: int) -> Op:
    k = binary.find(r"draft_confidence_kernelI13__nv_bfloat16E")
    rows = batch * block
    nbytes = rows * hidden * BF16 + rows * rank * BF16 + (hidden + rank) * BF16 + rows * 12
    # Since: weights staged in shared memory CONFIDENCE_SEGMENT at a time, each lane's eight
    # 16-byte row loads issued before its multiply-adds, four rows per block. Before: one
    # element per lane and iteration, both operands from global memory, eight rows per block.
    staged = LoopSpec("row . weight (16-byte loads)", {r"^LDG\.E\.128": 8, r"^FFMA": 64}, 64,
                      (r"^LDG\.E\.128", 8))
    scalar = LoopSpec("hidden . weight", {r"^LDG\.E\.U16": 2, r"^FFMA": 1}, 1, (r"^FFMA", 1))
    if first_matching(binary, k, [staged, scalar]) == 0:
        segments = -(-hidden // CONFIDENCE_SEGMENT) + -(-rank // CONFIDENCE_SEGMENT)
        rows_per_block = CONFIDENCE_THREADS // 32
        launches = [Launch(k, "stage weights, dot + sigmoid (warp per row)", CONFIDENCE_THREADS,
                           -(-rows // rows_per_block), 0,
                           [term(binary, k, staged, rows * (hidden + rank))], nbytes,
                           serial_round_trips=segments, barrier_stages=2 * segments,
                           note=f"{segments} weight segments staged in turn")]
    else:
        launches = [Launch(k, "dot + sigmoid (warp per row)", DRAFT_THREADS, (rows + 7) // 8, 0,
                           [term(binary, k, scalar, rows * (hidden + rank))], nbytes)]
    return Op("draft_confidence", f"B={batch} G={block} d={hidden} r={rank}", "calibrated",
              nbytes, launches, launch_bound=True,
              match=dict(op="draft_confidence", params=dict(B=batch, G=block, d=hidden, r=rank),
                         variant=""))


# ------------------------------------------------------------------------------------------------
# block_draft_attention, append_context_kv (csrc/kernels/attention.cuh, cuda/attention_cuda.cu)

ATTN_THREADS, ATTN_ROWS, ATTN_KEYS = 128, 16, 64


def attention_op(binary: Binary, batch: int, block: int, heads: int, kv_heads: int, dim: int,
                 length: int) -> Op:
    split = binary.find(r"block_attention_split_kernelI13__nv_bfloat16Li%dE" % dim)
    merge = binary.find(r"block_attention_merge_kernelI13__nv_bfloat16Li%dE" % dim)
    smem = BF16 * (ATTN_ROWS + 2 * ATTN_KEYS) * (dim + 8)
    bps = occ_of(split, ATTN_THREADS, smem).blocks_per_sm
    rows = block * (heads // kv_heads)
    groups = (rows + ATTN_ROWS - 1) // ATTN_ROWS
    base = batch * kv_heads * groups
    kper = dim // 32                                    # merge: floats per lane and row
    # The merge kernel and the split plan changed together: one maximum over all splits (lanes
    # over splits, a scaling loop over them) with the waves / splits plan; before it, a serial
    # running rescale with the one-wave plan.
    merge_new = LoopSpec("splits: scale partial outputs", {r"^MUFU\.EX2": 1, r"^FFMA": kper,
                                                          r"^LDG": kper + 1}, kper,
                         (r"^MUFU\.EX2", 1))
    values = LoopSpec("block keys: fold v", {r"^SHFL\.IDX": 1, r"^MUFU\.EX2": 1, r"^LDG": kper},
                      kper, (r"^MUFU\.EX2", 1), pick="densest")
    merge_old = LoopSpec("block keys: q.k, fold v", {r"^SHFL\.BFLY": 5, r"^MUFU\.EX2": 2},
                         2 * dim / 32, (r"^SHFL\.BFLY", 5))
    # The block keys' values in their own loop (a score shuffled in from lane n) only since.
    new_merge = first_matching(binary, merge, [values, merge_old]) == 0
    wanted = bps * H200.sms
    if new_merge:
        # attention_cuda.cu: the fewest splits within 2% of the best waves(s) / s.
        max_splits = min(max(1, (length + 255) // 256), 2 * ((wanted + base - 1) // base))
        splits, best_cost = 1, float((base + wanted - 1) // wanted)
        for s in range(2, max_splits + 1):
            cost = ((base * s + wanted - 1) // wanted) / s
            if cost < 0.98 * best_cost:
                splits, best_cost = s, cost
    else:
        max_splits = max(1, (length + 255) // 256)
        splits = min(max((wanted + base - 1) // base, 1), max_splits)
    split_len = max(ATTN_KEYS, ((length + splits - 1) // splits + ATTN_KEYS - 1) // ATTN_KEYS
                    * ATTN_KEYS)
    splits = max(1, (length + split_len - 1) // split_len)
    kv = 2 * batch * length * kv_heads * dim * BF16
    partial = batch * kv_heads * rows * splits * (dim + 2) * F32
    q = batch * block * heads * dim * BF16
    # The K/V tiles by cp.async (LDGSTS, outstanding until the DEPBAR of their group); before,
    # 16-byte loads through registers. The scalar loads are the unaligned fallback.
    mmas = dim // 16 * 2 + dim // 8
    tile_specs = [LoopSpec("K/V tile: S=QK^T, softmax, O+=PV",
                           {r"^HMMA": mmas, r"^LDGSTS": dim // 8},
                           ATTN_KEYS * dim * 2 / ATTN_THREADS, (r"^HMMA", mmas), loads=r"^LDGSTS"),
                  LoopSpec("K/V tile: S=QK^T, softmax, O+=PV",
                           {r"^HMMA": mmas, r"^LDG\.E\.128": dim // 8},
                           ATTN_KEYS * dim * 2 / ATTN_THREADS, (r"^HMMA", mmas),
                           loads=r"^LDG\.E\.128")]
    tile = tile_specs[first_matching(binary, split, tile_specs)]
    split_elems = batch * kv_heads * groups * length * dim * 2
    launches = [Launch(split, f"split-KV ({splits} split(s), {groups} row group(s)/head)",
                       ATTN_THREADS, splits * kv_heads * groups * batch, smem,
                       [term(binary, split, tile, split_elems)], kv + partial + q,
                       load_bytes=kv + q,
                       note="row groups of one head share K/V through L2 (HBM once)")]
    out_rows = batch * block * heads
    merge_bytes = partial + out_rows * dim * BF16 + q + 2 * batch * block * kv_heads * dim * BF16
    if new_merge:
        # Block keys' scores and values in loops unrolled by 4 (G >= 4 at the modelled shapes:
        # the unrolled loop, not its remainder); the splits' scaling loop runs `splits` times
        # (its remainder loop when fewer than 4).
        scores = LoopSpec("block keys: q.k", {r"^SHFL\.BFLY": 5}, kper, (r"^SHFL\.BFLY", 5),
                          pick="densest")
        if splits >= 4:
            merge_new = dataclasses.replace(merge_new, pick="densest")
        merge_terms = [term(binary, merge, scores, out_rows * block * dim),
                       term(binary, merge, merge_new, out_rows * splits * dim),
                       term(binary, merge, values, out_rows * block * dim)]
        label = "merge splits + block keys (warp per row)"
    else:
        merge_terms = [term(binary, merge, merge_old, out_rows * block * 2 * dim)]
        label = "merge splits + block keys (warp per row)"
    launches.append(Launch(merge, label, ATTN_THREADS, (out_rows + 3) // 4, 0, merge_terms,
                           merge_bytes))
    return Op("block_draft_attention",
              f"B={batch} G={block} Hq={heads} Hkv={kv_heads} D={dim} ctx={length}", "bf16", kv,
              launches, match=dict(op="block_draft_attention",
                                   params=dict(B=batch, G=block, Hq=heads, Hkv=kv_heads, D=dim,
                                               ctx=length), variant="bf16"))


def append_op(binary: Binary, batch: int, rows: int, kv_heads: int, dim: int, context: int) -> Op:
    k = binary.find(r"append_context_kv_kernelItE")
    # Newest first: 256 threads, each with 4 K and 4 V 16-byte chunks in flight (aligned rows);
    # before it, 128 threads copying one K and one V element per iteration.
    chunks = LoopSpec("copy 4 K + 4 V 16-byte chunks", {r"^LDG\.E\.128": 8, r"^ST\.E\.128": 8},
                      2 * 4 * 8, (r"^ST\.E\.128", 8), loads=r"^LDG\.E\.128")
    element = LoopSpec("copy one K and one V element", {r"^LDG\.E\.U16": 2, r"^STG\.E\.U16": 2},
                       2, (r"^STG\.E\.U16", 2))
    new = first_matching(binary, k, [chunks, element]) == 0
    copy, threads = (chunks, 256) if new else (element, ATTN_THREADS)
    elems = 2 * batch * rows * kv_heads * dim
    nbytes = 2 * elems * BF16 + batch * 12
    launches = [Launch(k, "copy kept rows (block per request)", threads, batch, 0,
                       [term(binary, k, copy, elems)], nbytes, load_bytes=elems * BF16)]
    return Op("append_context_kv", f"B={batch} n<={rows} Hkv={kv_heads} D={dim} ctx={context}",
              "bf16", nbytes, launches, launch_bound=True,
              match=dict(op="append_context_kv", params=dict(B=batch, Hkv=kv_heads, D=dim,
                                                            ctx=context), variant="bf16"))


# ------------------------------------------------------------------------------------------------
# scheduling (csrc/kernels/schedule.cuh, csrc/cuda/schedule_cuda.cu)

SCHEDULE_THREADS, SHARED_KEYS = 1024, 16384
H200_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on an H200 (227 KB)


MERGE_ITEMS, MERGE_CHUNKS = 8, 4   # schedule.cuh: outputs per merge segment, segments per thread
SMEM_LATENCY_S = 33 / H200.clock_hz  # ASSUMPTION: one dependent shared-memory load, ~33 clocks


def merge_rounds(batch: int, block: int) -> List[int]:
    """Run widths of the merge rounds: G, 2G, ... while below the B * G keys."""
    widths, width = [], block
    while width < batch * block:
        widths.append(width)
        width *= 2
    return widths


def schedule_merge_op(binary: Binary, batch: int, block: int) -> Op:
    """The merge of per-request sorted runs (schedule.cuh): ceil(log2 B) rounds, a thread's 8
    outputs per segment after one merge-path binary search."""
    pairs = batch * block
    shared = pairs <= SCHEDULE_THREADS * MERGE_ITEMS * MERGE_CHUNKS and \
        pairs * 4 + 2048 <= H200_OPTIN
    k = binary.find(r"schedule_kernelILi0ELb%dE" % int(shared))
    segments = math.ceil(pairs / MERGE_ITEMS)
    per_thread = min(MERGE_CHUNKS, math.ceil(segments / SCHEDULE_THREADS))
    widths = merge_rounds(batch, block)
    load, store = (r"^LDS$", r"^STS\.128") if shared else (r"^LDG", r"^STG\.E\.128")
    rounds_need = {r"^BAR": 2 if shared else 1, store: 2 * per_thread, load: 8 * per_thread}
    # One source-level iteration = one segment; the unrolled chunks are the unrolling.
    round_spec = LoopSpec("merge round: 8 outputs per segment", rounds_need, MERGE_ITEMS,
                          (store, 2), innermost=not shared)
    search = LoopSpec("merge-path search step", {load: 2}, 1, (load, 2))
    steps = [max(1, math.ceil(math.log2(w + 1))) for w in widths]   # run A holds w keys
    # Critical path of a round: the dependent search steps, then the 8 dependent merge steps.
    chain = sum(s + MERGE_ITEMS for s in steps)
    latency = H200.l2_latency_s if not shared else SMEM_LATENCY_S
    nbytes = pairs * F32 + batch * 8
    launches = [Launch(k, "survival keys, merge of sorted runs, scan, lengths (one block)",
                       SCHEDULE_THREADS, 1, pairs * 4 if shared else 0,
                       [term(binary, k, round_spec, len(widths) * pairs),
                        term(binary, k, search, segments * sum(steps))],
                       0, latency_s=None, barrier_stages=0, serial_s=chain * latency,
                       note=f"{pairs} keys in {'shared memory' if shared else 'global (L2)'}, "
                            f"{len(widths)} merge rounds, {chain} dependent "
                            f"{'shared' if shared else 'L2'} loads on the critical path "
                            "(assumed latency each)")]
    return Op("schedule_verify", f"B={batch} G={block}", "one-stage", nbytes, launches,
              launch_bound=True,
              match=dict(op="schedule_verify", params=dict(B=batch, G=block), variant=""))


def schedule_op(binary: Binary, batch: int, block: int) -> Op:
    # Newest first: the merge of sorted runs (16-byte stores of merged segments), else the
    # bitonic sort of 64-bit rank keys.
    merged = LoopSpec("merge round", {r"^BAR": 2, r"^STS\.128": 2}, MERGE_ITEMS,
                      (r"^STS\.128", 2), innermost=False)
    bitonic = LoopSpec("bitonic compare-exchange", {r"^LDS\.64": 2}, 1, (r"^LDS\.64", 2))
    if first_matching(binary, binary.find(r"schedule_kernelILi0ELb1E"), [merged, bitonic]) == 0:
        return schedule_merge_op(binary, batch, block)
    pairs = batch * block
    size = 1
    while size < pairs:
        size <<= 1
    shared = size <= SHARED_KEYS and size * 8 + 2048 <= H200_OPTIN
    k = binary.find(r"schedule_kernelILi0ELb%dE" % int(shared))
    load = r"^LDS\.64" if shared else r"^LDG\.E\.64"
    cmp = LoopSpec("bitonic compare-exchange", {load: 2}, 1, (load, 2))
    stage = LoopSpec("bitonic stage (barrier)", {r"^BAR": 1}, 1, (r"^BAR", 1), innermost=False)
    log = size.bit_length() - 1
    stages = log * (log + 1) // 2
    per_thread = math.ceil(size // 2 / SCHEDULE_THREADS)
    nbytes = pairs * F32 + (pairs + 1) * F32 + batch * 8
    key_traffic = stages * size * 8 * 2          # every stage reads and writes every key
    launches = [Launch(k, "rank keys, bitonic sort, scan, lengths (one block)", SCHEDULE_THREADS,
                       1, size * 8 if shared else 0,
                       [term(binary, k, cmp, stages * per_thread * SCHEDULE_THREADS),
                        term(binary, k, stage, stages * SCHEDULE_THREADS)],
                       0 if shared else key_traffic / 2,
                       load_bytes=None if shared else key_traffic / 2,
                       latency_s=None if shared else H200.l2_latency_s,
                       barrier_stages=stages,
                       note=f"{size} keys in {'shared memory' if shared else 'global (L2)'}, "
                            f"{stages} stages")]
    if not shared:
        launches[0].note += "; key traffic L2-resident, its reads costed at L2 latency"
    return Op("schedule_verify", f"B={batch} G={block}", "one-stage", nbytes, launches,
              launch_bound=True,
              match=dict(op="schedule_verify", params=dict(B=batch, G=block), variant=""))


# ------------------------------------------------------------------------------------------------

# The ops of csrc/schemas.h that all_ops leaves out, and why (python_tests/test_layout.py: every
# other op is modelled above).
# ------------------------------------------------------------------------------------------------
# dspark_loss (csrc/kernels/loss.cuh, csrc/args/loss_args.cpp)

LOSS_THREADS = 256
LOSS_SCRATCH_BYTES = 256 << 20  # args/loss_args.h kLossScratchBytesCuda: z and t of a chunk


def loss_op(binary: Binary, rows: int, vocab: int, hidden: int, rank: int,
            softcap: bool = False) -> Op:
    """The vocabulary pass of dspark_loss (forward + gradients, LM head frozen, bf16): one launch
    per row chunk, a block per row, three loops over the row. The chunk's matrix products are
    cuBLAS calls the model does not read; their time is the op's floor row in docs/semantics.md
    §4 (9.2 TFLOP at this shape), so this row's floor is the pass's own bytes.

    ``softcap``: Gemma4's logit soft cap (the kernel's kCap instantiation): the Markov bias is a
    third row read by every loop beside z and t, each loop computes a tanh per z and t element
    (an exponential and a reciprocal in SASS), the gradient loop writes the bias row too, and the
    chunk holds three rows of scratch per row instead of two."""
    # Rows of 16-byte multiples (V = 151936 in bf16): 16-byte loads of 8 values per tensor and
    # iteration. The first two loops have the same anchors; the cheaper path is charged for both
    # (the logsumexp loop's is a few % longer).
    ldg, mufu, rcp, stg = r"^LDG\.E\.128", r"^MUFU\.EX2", r"^MUFU\.RCP", r"^STG\.E\.U16"
    if softcap:
        k = binary.find(r"dspark_loss_kernelI13__nv_bfloat16Lb1E")
        # z, bias, t per iteration; per element exp(z - lse), exp(t - lse) and two tanh.
        need = {ldg: 3, mufu: 32, rcp: 16}
        streams, writes = 3, 2
    else:
        _, k = binary.find_first(r"dspark_loss_kernelI13__nv_bfloat16Lb0E",
                                 r"dspark_loss_kernelI13__nv_bfloat16E")
        need = {ldg: 2, mufu: 16}
        streams, writes = 2, 1
    loads = streams
    lse = LoopSpec("online logsumexps of z and t", need, 8, (ldg, loads), loads=ldg)
    l1 = LoopSpec("p, q: |p - q|, <s,p>, <s,q>", need, 8, (ldg, loads), loads=ldg)
    grad = LoopSpec("write d loss / d z" + (" and d loss / d bias" if softcap else ""),
                    {**need, stg: 8 * writes}, 8, (ldg, loads), loads=ldg)
    chunk = max(1, min(rows, LOSS_SCRATCH_BYTES // (streams * vocab * BF16)))
    chunks = -(-rows // chunk)
    elements = chunk * vocab
    # Every stream read by each of the three loops; z (and the bias) written once.
    per_element = 3 * streams + writes
    nbytes = per_element * elements * BF16
    launches = [Launch(k, "vocabulary pass (block per row, one launch per chunk)", LOSS_THREADS,
                       chunk, 0, [term(binary, k, spec, elements) for spec in (lse, l1, grad)],
                       nbytes, count=chunks, barrier_stages=4,
                       note=f"{chunks} chunks of {chunk} rows; products by cuBLAS not modelled")]
    variant = "dspark cap30 bf16 fwd+bwd" if softcap else "dspark bf16 fwd+bwd"
    return Op("dspark_loss", f"N={rows} V={vocab} d={hidden} r={rank}",
              "bf16 vocabulary pass" + (", soft cap" if softcap else ""),
              per_element * rows * vocab * BF16, launches,
              match=dict(op="dspark_loss", params=dict(N=rows, V=vocab, d=hidden, r=rank),
                         variant=variant))


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


def all_ops(binary: Binary) -> List[Op]:
    """The benchmark/floor shapes of docs/semantics.md §4 (and the benchmarks' defaults)."""
    B, G, V, R = 64, 8, 151936, 256
    return [
        verify_op(binary, B, G, V, "greedy", alpha=1.0),
        verify_op(binary, B, G, V, "greedy", alpha=0.7),
        verify_op(binary, B, G, V, "sampled", alpha=0.7),
        verify_op(binary, B, G, V, "sampled", alpha=1.0),
        verify_op(binary, B, G, V, "sampled", alpha=0.7, filtered=True),
        draft_op(binary, B, G, V, R, rnn=False),
        draft_op(binary, B, 7, V, R, rnn=False),
        draft_op(binary, B, 7, V, R, rnn=False, sampled=False),
        draft_op(binary, B, 7, V, R, rnn=True),
        draft_op(binary, B, G, V, R, rnn=False, filtered=True),
        confidence_op(binary, B, 7, 2560, R),
        attention_op(binary, B, G, 32, 8, 128, 4096),
        attention_op(binary, B, G, 32, 8, 64, 4096),
        attention_op(binary, B, G, 32, 8, 256, 4096),
        append_op(binary, B, 9, 8, 128, 4096),
        schedule_op(binary, 256, 16),
        schedule_op(binary, 1024, 32),
        loss_op(binary, 512 * 7, V, 2560, R),
        loss_op(binary, 512 * 7, V, 2560, R, softcap=True),
    ]
