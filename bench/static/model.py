"""Hardware constants, occupancy and the time of one launch (a MODEL: an estimate, not a
measurement). Every number here is an assumption stated in docs/performance-model.md."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str = "H200 (sm_90)"
    sms: int = 132
    regs_per_sm: int = 65536
    regs_per_partition: int = 16384   # four partitions (schedulers) per SM
    partitions: int = 4
    reg_unit: int = 256               # registers are given to a warp in units of 256
    max_regs_per_thread: int = 255
    smem_per_sm: int = 233472         # 228 KB
    smem_unit: int = 128
    smem_reserved_per_block: int = 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    clock_hz: float = 1.98e9          # boost clock
    issue_per_sm_clock: int = 4       # one warp-instruction per scheduler per clock
    dram_bytes_per_s: float = 4.3e12  # measured device-to-device copy bandwidth
    dram_latency_s: float = 700e-9    # loaded HBM latency (600-800 ns): Little's law
    l2_latency_s: float = 150e-9      # L2 hit, about 300 clocks
    launch_s: float = 2.0e-6          # one kernel launch on the GPU, back to back
    # a programmatic dependent launch: its launch overlaps the kernel before, what remains is
    # the wait for that grid to complete and flush (griddepcontrol.wait)
    dependent_launch_s: float = 0.5e-6
    barrier_stage_s: float = 50e-9    # one barrier-separated dependent shared-memory stage
    # Calibration against the one H200 run (docs/performance-model.md, "Calibration": each
    # constant's source, and which were fitted to which rows).
    # A global load that its warp waits for with nothing else of its own in flight, on a critical
    # path (Chain), while the rest of the grid streams: the HBM latency above queued behind the
    # grid's traffic, with the issue and scoreboard turn-around around each wait (2-3x it).
    dram_dependent_s: float = 1.4e-6  # FITTED
    # The same for data that L2 holds (a row just streamed, a counter, a partial, an atomic).
    l2_dependent_s: float = 0.7e-6    # FITTED
    # __threadfence() (MEMBAR.SC.GPU in the SASS): a sequentially consistent fence drains the
    # thread's outstanding memory operations through the loaded memory system.
    fence_s: float = 3.5e-6           # FITTED
    # One instruction of a warp's serial chain (the drafting epilogue, a block's race): its
    # dependent latency and its share of a scheduler shared with three other warps, ~9 clocks.
    dependent_instr_s: float = 4.5e-9  # FITTED
    # The benchmark's eager, L2-flushed timing adds to an op's kernels the start event's wait,
    # the first launch's cold instruction and constant caches, and the end event: the committed
    # schedule rows give eager - graph replay = 3.1-3.5 us for single-kernel ops.
    op_entry_s: float = 3.3e-6
    # cuBLAS's bf16 products (the loss) run at this fraction of the bf16 GEMM rate above.
    gemm_bf16_flops: float = 790e12   # bf16 GEMM rate of docs/semantics.md §4
    gemm_fraction: float = 0.70       # FITTED


H200 = Hardware()


@dataclasses.dataclass
class Occupancy:
    blocks_per_sm: int
    limiter: str          # registers, shared memory, warps, blocks
    warps_per_sm: int
    by: Dict[str, int]

    @property
    def fraction(self) -> float:
        return self.warps_per_sm / H200.max_warps_per_sm


def occupancy(regs: int, threads: int, smem_block: int, hw: Hardware = H200) -> Occupancy:
    """Resident blocks per SM of a kernel using ``regs`` registers per thread, ``threads`` per
    block and ``smem_block`` bytes of shared memory per block (static + dynamic + the 1 KB the
    driver reserves per block), as the CUDA occupancy calculator computes it for sm_90."""
    warps = -(-threads // 32)
    regs = max(regs, 1)
    per_warp = -(-regs * 32 // hw.reg_unit) * hw.reg_unit
    warps_by_regs = (hw.regs_per_partition // per_warp) * hw.partitions
    by = {
        "registers": warps_by_regs // warps,
        "warps": hw.max_warps_per_sm // warps,
        "blocks": hw.max_blocks_per_sm,
        "shared memory": (hw.smem_per_sm // (-(-smem_block // hw.smem_unit) * hw.smem_unit)
                          if smem_block > 0 else hw.max_blocks_per_sm),
    }
    limiter = min(by, key=lambda k: (by[k], ["registers", "shared memory", "warps",
                                             "blocks"].index(k)))
    n = by[limiter]
    return Occupancy(n, limiter, n * warps, by)


@dataclasses.dataclass
class Term:
    """One costed loop of a launch."""
    name: str
    path_instrs: int          # SASS instructions per iteration (per thread = per warp)
    elems_per_iter: float     # elements one thread handles per iteration (unrolling included)
    elements: float           # elements of the whole launch through this loop
    in_flight: int            # global-load bytes one thread has outstanding at most
    loads_per_iter: int       # global-load bytes per thread per iteration
    candidates: int = 1       # loops of the kernel that matched the selector

    @property
    def instr_per_elem(self) -> float:
        return self.path_instrs / self.elems_per_iter

    @property
    def warp_instrs(self) -> float:
        return self.elements / 32.0 * self.instr_per_elem


@dataclasses.dataclass(frozen=True)
class Chain:
    """The critical path of a launch that no amount of parallelism hides: what one warp (or one
    block) does in series, counted from the code. Its time is the counts times the Hardware's
    latencies; `scaled` and `+` compose a launch's path from per-row or per-tile parts."""
    dram_waits: float = 0.0        # HBM loads waited for with nothing else in flight
    l2_waits: float = 0.0          # loads, atomics and polls served by L2, waited for
    fences: float = 0.0            # __threadfence (MEMBAR.SC.GPU) waited on
    dependent_instrs: float = 0.0  # instructions issued one after another by one warp
    barrier_stages: float = 0.0    # __syncthreads-separated stages

    def __add__(self, other: "Chain") -> "Chain":
        return Chain(*(a + b for a, b in zip(dataclasses.astuple(self),
                                              dataclasses.astuple(other))))

    def scaled(self, factor: float) -> "Chain":
        return Chain(*(factor * a for a in dataclasses.astuple(self)))

    def time_s(self, hw: "Hardware" = H200) -> float:
        return (self.dram_waits * hw.dram_dependent_s + self.l2_waits * hw.l2_dependent_s
                + self.fences * hw.fence_s + self.dependent_instrs * hw.dependent_instr_s
                + self.barrier_stages * hw.barrier_stage_s)


@dataclasses.dataclass
class LaunchResult:
    kernel: str
    label: str
    count: int                # identical launches (e.g. one per draft slot)
    regs: int
    local_bytes: int
    static_smem: int
    dynamic_smem: int
    threads: int
    blocks: int
    occ: Occupancy
    terms: List[Term]
    dram_bytes: float         # per launch
    memory_s: float
    issue_s: float
    latency_s: float
    overhead_s: float
    bound: str
    in_flight_per_sm: float
    note: str = ""
    chain: Chain = Chain()
    chain_s: float = 0.0
    serial_chain: Chain = Chain()  # the part of overhead_s counted as a Chain

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.issue_s, self.latency_s, self.chain_s) + self.overhead_s

    @property
    def total_s(self) -> float:
        return self.count * self.time_s


def launch_time(*, blocks: int, threads: int, occ: Occupancy, terms: List[Term],
                dram_bytes: float, latency_s: Optional[float], imbalance: float = 1.0,
                barrier_stages: float = 0, load_bytes: Optional[float] = None,
                serial_s: float = 0.0, dependent: bool = False, hw: Hardware = H200):
    """(memory, issue, latency, overhead) seconds of one launch.

    memory: dram_bytes / bandwidth. issue: the busiest SM's warp-instructions of the costed
    loops at 4 per clock. latency: Little's law, the busiest SM's share of the loaded bytes
    (load_bytes, default dram_bytes) over the bytes its resident threads keep in flight, times
    the latency of where the data lives.
    overhead: the launch (a dependent launch's wait when `dependent`), plus barrier stages and
    one-block work (serial_s) a block does in series after the parallel part. A launch's
    critical path (Chain) is a fourth bound beside memory, issue and latency, not an overhead.
    """
    per_sm_blocks = math.ceil(blocks / hw.sms) if blocks else 0
    share = (per_sm_blocks / blocks if blocks else 0.0) * imbalance  # busiest SM's fraction
    memory = dram_bytes / hw.dram_bytes_per_s
    warp_instrs = sum(t.warp_instrs for t in terms)
    issue = warp_instrs * share / (hw.issue_per_sm_clock * hw.clock_hz)
    resident = min(occ.blocks_per_sm, per_sm_blocks)
    flight = max((t.in_flight for t in terms), default=0)
    in_flight_sm = resident * threads * flight
    latency = 0.0
    if latency_s and in_flight_sm > 0:
        waited = dram_bytes if load_bytes is None else load_bytes
        latency = waited * share * latency_s / in_flight_sm
    overhead = (hw.dependent_launch_s if dependent else hw.launch_s) \
        + barrier_stages * hw.barrier_stage_s + serial_s
    return memory, issue, latency, overhead, in_flight_sm


def bound_of(memory: float, issue: float, latency: float, overhead: float,
             chain: float = 0.0) -> str:
    worst = max(memory, issue, latency, chain)
    if overhead >= worst:
        return "overhead"  # the launch and the work a block does in series
    if worst == memory:
        return "memory"
    if worst == issue:
        return "issue"
    return "latency" if worst == latency else "chain"


@dataclasses.dataclass
class LibraryCall:
    """Work an op hands to a library (cuBLAS's products, ATen's element-wise kernels): the model
    does not read its code, only its floating-point operations and bytes, at the stated fraction
    of the bf16 GEMM rate (Hardware.gemm_fraction) or at the copy bandwidth."""
    name: str
    flops: float              # per call
    dram_bytes: float         # per call: every operand read once, the result written once
    count: int = 1

    def time_s(self, hw: Hardware = H200) -> float:
        compute = self.flops / (hw.gemm_fraction * hw.gemm_bf16_flops)
        return max(compute, self.dram_bytes / hw.dram_bytes_per_s) + hw.launch_s

    def total_s(self, hw: Hardware = H200) -> float:
        return self.count * self.time_s(hw)
