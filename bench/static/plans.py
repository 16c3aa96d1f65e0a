"""Launch plans of the real code: each op's CUDA entry point (its glue and launchers, compiled by
g++ into the SIMT emulator, csrc/sim/) called at a modelled shape in the emulator's plan-only
mode, which records every launch (kernel, grid, block, dynamic shared memory, the parameter
struct's plan fields) and runs no block. The emulated device is the H200, and its occupancy
queries answer with the registers and static shared memory of the binary being modelled, so a
launcher that sizes its grid by occupancy plans as it does on the GPU.

Tensors are made with torch.empty: a plan depends on shapes and dtypes, never on values (the glue
reads nothing back from the device), and untouched pages cost no memory. The loss's products run
for real (ATen on the CPU), so its plan is taken at a hidden size and rank of 0 (empty products):
its row chunks depend on the rows, the vocabulary and the scratch rows per row only."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

from bench.static.binary import Binary, KernelInfo, demangled_names
from bench.static.sass import StructureError

ROOT = Path(__file__).resolve().parents[2]
# The flavour the tests load (DSPARK_OPS_SIM_FLAVOUR, plain by default): plan-only launches run no
# kernel code, so any flavour plans alike, and the one a test run already built is reused. The
# asan flavour needs the sanitizer runtimes preloaded, so it is never used here.
FLAVOUR = os.environ.get("DSPARK_OPS_SIM_FLAVOUR", "plain")
if FLAVOUR not in ("plain", "race"):
    FLAVOUR = "plain"
LIBRARY = ROOT / "build" / "sim" / FLAVOUR / "dspark_ops_sim.so"
BUILD = [sys.executable, str(ROOT / "csrc" / "sim" / "build.py"), FLAVOUR]


class EmulatorUnavailable(RuntimeError):
    """The SIMT emulator library could not be built or loaded."""


def emulator(build: bool = True):
    """torch.ops.dspark_ops_sim, loading build/sim/<FLAVOUR>/dspark_ops_sim.so once. With ``build``,
    the library is brought up to date first (csrc/sim/build.py is incremental: a no-op when
    nothing changed; the first build compiles every kernel and takes minutes)."""
    if hasattr(torch.ops.dspark_ops_sim, "set_plan_only"):
        return torch.ops.dspark_ops_sim
    if build:
        done = subprocess.run(BUILD, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise EmulatorUnavailable(
                f"building the SIMT emulator failed (`{' '.join(BUILD[1:])}`, needs g++, ninja "
                f"and the CUDA headers):\n{(done.stdout + done.stderr)[-2000:]}")
    if not LIBRARY.exists():
        raise EmulatorUnavailable(f"{LIBRARY} is missing: build it with "
                                  f"`python csrc/sim/build.py {FLAVOUR}`")
    if hasattr(torch.ops.dspark_ops_sim, "set_device"):
        raise EmulatorUnavailable("an emulator library without plan-only mode is loaded: "
                                  f"rebuild it with `python csrc/sim/build.py {FLAVOUR}`")
    torch.ops.load_library(str(LIBRARY))
    return torch.ops.dspark_ops_sim


def emulator_name(demangled: str) -> str:
    """A kernel's name as the emulator spells its instantiation (g++'s __PRETTY_FUNCTION__, the
    kernels:: namespace dropped) from its demangled name in the binary (c++filt's spelling)."""
    s = re.sub(r"^void\s+", "", demangled)
    s = re.sub(r"\(.*\)$", "", s)          # the parameter list
    s = s.replace("dspark_ops::kernels::", "")
    # c++filt and g++ spell the built-in integer types differently (one left-to-right pass: the
    # longest spelling at each place).
    spelled = {"unsigned long long": "long long unsigned int", "unsigned long": "long unsigned int",
               "unsigned short": "short unsigned int", "long long": "long long int",
               "long": "long int", "short": "short int"}
    pattern = r"\b(%s)\b" % "|".join(sorted(spelled, key=len, reverse=True))
    return re.sub(pattern, lambda m: spelled[m.group(1)], s)


@dataclasses.dataclass
class Launch:
    """One recorded launch, its kernel resolved to the binary's."""
    kernel: KernelInfo
    name: str                 # the emulator's instantiation name
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    shared: int               # dynamic shared memory, bytes
    dependent: bool
    fields: Dict[str, int]    # the parameter struct's plan fields (prelude.h plan_fields)

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def config(self):
        return (self.name, self.grid, self.block, self.shared, self.dependent)


@dataclasses.dataclass
class Plan:
    """The launches of one call, in order."""
    launches: List[Launch]

    def of(self, kernel: str) -> List[Launch]:
        """The launches of the kernel whose instantiation is ``kernel`` (the emulator's
        spelling, e.g. ``draft_slot_kernel<__nv_bfloat16, __nv_bfloat16, false>``)."""
        return [l for l in self.launches if l.name == kernel]

    def groups(self, kernel: str) -> List[Tuple[Launch, int]]:
        """The launches of ``kernel`` grouped by configuration (grid, block, shared memory, plan
        fields), in the order of each configuration's first launch: (a launch, how many)."""
        out: Dict[tuple, List] = {}
        for l in self.of(kernel):
            key = (l.config(), tuple(sorted(l.fields.items())))
            out.setdefault(key, [l, 0])[1] += 1
        return [(l, n) for l, n in out.values()]

    def one(self, kernel: str) -> Tuple[Launch, int]:
        """(the launch, how many times it was made) of a kernel launched with one configuration
        (e.g. once per draft slot); ValueError when it is not launched, or launched with more
        than one configuration."""
        found = self.of(kernel)
        if not found:
            raise ValueError(f"the plan launches no {kernel}; it launches "
                             f"{sorted({l.name for l in self.launches})}")
        if len({l.config() for l in found}) != 1 or len({tuple(sorted(l.fields.items()))
                                                        for l in found}) != 1:
            raise ValueError(f"{kernel} is launched with {len({l.config() for l in found})} "
                             "configurations; the model expects one")
        return found[0], len(found)


def parse_records(text: str) -> List[dict]:
    out = []
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            record["fields"] = {k: int(v) for k, v in
                                (f.split("=") for f in record["fields"].split())}
            out.append(record)
    return out


class Planner:
    """Plans of the ops at given shapes on the emulated H200, with the occupancy of ``binary``'s
    kernels."""

    def __init__(self, binary: Binary, build: bool = True):
        self.binary = binary
        self.sim = emulator(build)
        registered = set(self.sim.kernel_names().splitlines())
        demangled = demangled_names(list(binary.resources))
        self.kernels: Dict[str, KernelInfo] = {}
        for mangled, full in demangled.items():
            name = emulator_name(full)
            if name in registered:
                self.kernels[name] = binary.resources[mangled]
        self.resource_table = "".join(f"{name}\t{k.regs}\t{k.shared}\n"
                                      for name, k in sorted(self.kernels.items()))

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """Plan-only mode on the H200 with this binary's resources, restored after."""
        sim = self.sim
        previous = sim.device_name()
        sim.set_device("h200")
        sim.set_kernel_resources(self.resource_table)
        sim.clear_launch_log()
        sim.set_plan_only(True)
        try:
            yield
        finally:
            sim.set_plan_only(False)
            sim.set_kernel_resources("")
            sim.set_device(previous)

    def plan(self, op: str, *args, **kwargs) -> Plan:
        """The launches of one call of the emulated ``op`` with these arguments."""
        with self.planning():
            getattr(self.sim, op)(*args, **kwargs)
            records = parse_records(self.sim.launch_records())
            self.sim.clear_launch_log()
        launches = []
        for r in records:
            if r["kernel"] not in self.kernels:
                raise StructureError(f"{op} launched {r['kernel']}, which {self.binary.path.name} "
                                 "does not contain (is the binary built from this source?)")
            launches.append(Launch(self.kernels[r["kernel"]], r["kernel"], tuple(r["grid"]),
                                   tuple(r["block"]), r["shared"], r["dependent"], r["fields"]))
        return Plan(launches)

    # The modelled ops' calls. The rows of a request's logits are as the benchmarks make them.

    def verify(self, batch: int, block: int, vocab: int, sampled: bool,
               filtered: bool = False) -> Plan:
        i64 = dict(dtype=torch.int64)
        args = dict(
            target_logits=torch.empty(batch, block + 1, vocab, dtype=torch.bfloat16),
            draft_tokens=torch.zeros(batch, block, **i64),
            num_draft=torch.full((batch,), block, dtype=torch.int32),
            temperature=torch.full((batch,), 1.0 if sampled else 0.0),
            seed=torch.zeros(batch, **i64), position=torch.zeros(batch, **i64),
            draft_logits=torch.empty(batch, block, vocab) if sampled else None)
        if filtered:
            args.update(top_k=torch.full((batch,), 50, dtype=torch.int32),
                        top_p=torch.full((batch,), 0.9))
        return self.plan("verify", **args)

    def draft(self, batch: int, block: int, vocab: int, rank: int, rnn: bool, sampled: bool,
              hidden: int, filtered: bool) -> Plan:
        bf16, i64 = dict(dtype=torch.bfloat16), dict(dtype=torch.int64)
        args = dict(base_logits=torch.empty(batch, block, vocab, **bf16),
                    anchor=torch.zeros(batch, **i64))
        if rnn:
            args["hidden"] = torch.empty(batch, block, hidden, **bf16)
        args.update(w1=torch.empty(vocab, rank, **bf16), w2=torch.empty(vocab, rank, **bf16))
        if rnn:
            args.update(joint_weight=torch.empty(3 * rank, 2 * rank + hidden, **bf16),
                        joint_bias=torch.empty(3 * rank, **bf16))
        args.update(temperature=torch.full((batch,), 1.0 if sampled else 0.0),
                    seed=torch.zeros(batch, **i64), position=torch.zeros(batch, **i64))
        if filtered:
            args.update(top_k=torch.full((batch,), 50, dtype=torch.int32),
                        top_p=torch.full((batch,), 0.9))
        return self.plan("rnn_draft" if rnn else "markov_draft", **args)

    def confidence(self, batch: int, block: int, hidden: int, vocab: int, rank: int) -> Plan:
        bf16 = dict(dtype=torch.bfloat16)
        return self.plan("draft_confidence", torch.empty(batch, block, hidden, **bf16),
                         torch.zeros(batch, block, dtype=torch.int64),
                         torch.empty(vocab, rank, **bf16), torch.empty(hidden + rank, **bf16),
                         torch.empty(1, **bf16), torch.ones(block))

    def attention(self, batch: int, block: int, heads: int, kv_heads: int, dim: int,
                  length: int) -> Plan:
        """The cache holds ``length`` rows (the split plan divides the cache's length)."""
        bf16 = dict(dtype=torch.bfloat16)
        return self.plan("block_draft_attention",
                         torch.empty(batch, block, heads, dim, **bf16),
                         torch.empty(batch, block, kv_heads, dim, **bf16),
                         torch.empty(batch, block, kv_heads, dim, **bf16),
                         torch.empty(batch, length, kv_heads, dim, **bf16),
                         torch.empty(batch, length, kv_heads, dim, **bf16),
                         torch.full((batch,), length - block, dtype=torch.int32))

    def append(self, batch: int, rows: int, kv_heads: int, dim: int, length: int) -> Plan:
        bf16 = dict(dtype=torch.bfloat16)
        return self.plan("append_context_kv",
                         torch.empty(batch, length, kv_heads, dim, **bf16),
                         torch.empty(batch, length, kv_heads, dim, **bf16),
                         torch.empty(batch, rows, kv_heads, dim, **bf16),
                         torch.empty(batch, rows, kv_heads, dim, **bf16),
                         torch.full((batch,), rows, dtype=torch.int32),
                         torch.full((batch,), length - rows, dtype=torch.int32))

    def schedule(self, batch: int, block: int) -> Plan:
        # step_rate[n]: the rate of an n-token verify batch, n = 0 .. B.
        return self.plan("schedule_verify", torch.empty(batch, block), torch.ones(batch + 1))

    def loss(self, rows: int, vocab: int, softcap: bool, width: int = 0) -> Plan:
        """compute_grad, with a target and a Markov bias, bf16; hidden size and rank ``width``
        (0 by default: see the module)."""
        bf16 = dict(dtype=torch.bfloat16)
        return self.plan("dspark_loss", torch.zeros(rows, width, **bf16),
                         torch.zeros(vocab, width, **bf16), torch.zeros(rows, dtype=torch.int64),
                         torch.ones(rows), torch.ones(2), torch.zeros(rows, width, **bf16),
                         torch.zeros(rows, width, **bf16), torch.zeros(vocab, width, **bf16),
                         compute_grad=True, logit_softcap=30.0 if softcap else None)
