"""SASS text -> functions, control-flow graph, natural loops and per-iteration paths.

Input is the text of ``cuobjdump -sass`` (branch targets as addresses, ``BRA 0x5a0``) or of
``nvdisasm`` (labels, ``.L_x_3:`` and ``BRA `(.L_x_3)``). A loop is a natural loop of the
control-flow graph (a back edge n -> h where h dominates n), so an out-of-line block that jumps
back into the main body (the compiler's fallback paths for shuffles, say) is not a loop even
though its branch goes backwards.

The instructions of one iteration are counted along one path through the loop body, from the
header to a back edge: the shortest path that still contains the work the configuration needs
(minimum counts of "anchor" opcodes, e.g. six 16-byte global loads). Rarely taken paths inside
the body (a running maximum that grew, an unaligned fallback) are thereby left out, and every
instruction on the chosen path is counted once. Inner loops are collapsed into one node of zero
cost: each loop is costed on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


class StructureError(RuntimeError):
    """The compiled code does not have the loop structure the model expects."""


@dataclasses.dataclass
class Instr:
    addr: int
    text: str  # without the trailing ';', predicate included

    @functools.cached_property
    def pred(self) -> Optional[str]:
        m = re.match(r"@(!?U?P\w+)\s", self.text)
        return m.group(1) if m else None

    @functools.cached_property
    def body(self) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", self.text)

    @functools.cached_property
    def opcode(self) -> str:
        """Full opcode with modifiers, e.g. ``LDG.E.128.CONSTANT``."""
        return self.body.split()[0] if self.body.split() else ""

    @functools.cached_property
    def base_op(self) -> str:
        return self.opcode.split(".")[0]


_CUOBJ_FUNC = re.compile(r"^\s*Function : (\S+)")
_CUOBJ_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")
_NVDIS_FUNC = re.compile(r"^\s*\.text\.(\S+?):?\s*$")
_LABEL = re.compile(r"^\s*(\.L\w+):\s*$")


def parse_functions(text: str) -> Dict[str, List[Instr]]:
    """Function name -> instructions, from cuobjdump or nvdisasm SASS text.

    nvdisasm's labels are resolved to addresses, so branch targets always read ``0x...``.
    """
    funcs: Dict[str, List[Instr]] = {}
    labels: Dict[str, Dict[str, int]] = {}
    pending: List[str] = []
    current: Optional[str] = None
    for line in text.splitlines():
        m = _CUOBJ_FUNC.match(line) or _NVDIS_FUNC.match(line)
        if m:
            current = m.group(1)
            funcs[current] = []
            labels[current] = {}
            pending = []
            continue
        if current is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _CUOBJ_INSTR.match(line)
        if not m:
            continue
        body = m.group(2).strip().rstrip(";").strip()
        if not body or body.startswith("0x"):
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[current][name] = addr
        pending = []
        funcs[current].append(Instr(addr, body))
    for name, instrs in funcs.items():
        table = labels[name]
        if table:
            for ins in instrs:
                ins.text = re.sub(r"`\((\.L\w+)\)",
                                  lambda mm: hex(table[mm.group(1)]) if mm.group(1) in table
                                  else mm.group(0), ins.text)
    return funcs


_BRANCH_TARGET = re.compile(r"\b(?:BRA|BRX|JMP|CALL|BSSY|BREAK|SSY|PBK|CAL)\S*\s+(?:\S+,\s*)?(0x[0-9a-fA-F]+)")


def branch_target(ins: Instr) -> Optional[int]:
    if ins.base_op not in ("BRA", "JMP"):
        return None
    m = re.search(r"(0x[0-9a-fA-F]+)", ins.body)
    return int(m.group(1), 16) if m else None


@dataclasses.dataclass
class Block:
    index: int
    instrs: List[Instr]
    succs: List[int] = dataclasses.field(default_factory=list)
    preds: List[int] = dataclasses.field(default_factory=list)

    @property
    def start(self) -> int:
        return self.instrs[0].addr


@dataclasses.dataclass
class Loop:
    header: int                 # block index
    blocks: frozenset           # block indices, header included
    latches: Tuple[int, ...]    # blocks with a back edge to the header
    parent: Optional["Loop"] = None
    children: List["Loop"] = dataclasses.field(default_factory=list)

    def instrs(self, cfg: "CFG") -> List[Instr]:
        return [i for b in sorted(self.blocks) for i in cfg.blocks[b].instrs]

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1


def _ends_flow(ins: Instr) -> bool:
    """No fall-through after an unpredicated branch, exit, return or trap."""
    if ins.pred is not None and ins.pred not in ("PT",):
        return False
    return ins.base_op in ("BRA", "EXIT", "RET", "BPT", "JMP", "BRX", "JMX", "KILL")


class CFG:
    """Basic blocks of one function, reachable from its entry (subroutines after the body,
    reached only by CALL, are left out)."""

    def __init__(self, instrs: Sequence[Instr]):
        if not instrs:
            raise StructureError("empty function")
        addrs = {i.addr for i in instrs}
        leaders = {instrs[0].addr}
        for k, ins in enumerate(instrs):
            t = branch_target(ins)
            if t is not None and t in addrs:
                leaders.add(t)
            if (t is not None or _ends_flow(ins)) and k + 1 < len(instrs):
                leaders.add(instrs[k + 1].addr)
        self.blocks: List[Block] = []
        at: Dict[int, int] = {}
        for ins in instrs:
            if ins.addr in leaders or not self.blocks:
                at[ins.addr] = len(self.blocks)
                self.blocks.append(Block(len(self.blocks), []))
            self.blocks[-1].instrs.append(ins)
        for blk in self.blocks:
            last = blk.instrs[-1]
            t = branch_target(last)
            if t is not None and t in at and t != last.addr:
                blk.succs.append(at[t])
            if not _ends_flow(last) and blk.index + 1 < len(self.blocks):
                if blk.index + 1 not in blk.succs:
                    blk.succs.append(blk.index + 1)
        for blk in self.blocks:
            for s in blk.succs:
                self.blocks[s].preds.append(blk.index)
        self._dominators()
        self.loops = self._loops()

    def _dominators(self) -> None:
        # Reverse post-order from the entry, then Cooper-Harvey-Kennedy.
        order, seen = [], set()
        stack = [(0, iter(self.blocks[0].succs))]
        seen.add(0)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, iter(self.blocks[nxt].succs)))
        rpo = order[::-1]
        self.reachable = set(rpo)
        pos = {b: k for k, b in enumerate(rpo)}
        idom = {0: 0}
        changed = True
        while changed:
            changed = False
            for b in rpo[1:]:
                preds = [p for p in self.blocks[b].preds if p in idom]
                if not preds:
                    continue
                new = preds[0]
                for p in preds[1:]:
                    a, c = p, new
                    while a != c:
                        while pos[a] > pos[c]:
                            a = idom[a]
                        while pos[c] > pos[a]:
                            c = idom[c]
                    new = a
                if idom.get(b) != new:
                    idom[b] = new
                    changed = True
        self.idom = idom

    def dominates(self, a: int, b: int) -> bool:
        while True:
            if a == b:
                return True
            if b == 0:
                return False
            b = self.idom[b]

    def _loops(self) -> List[Loop]:
        by_header: Dict[int, List[int]] = {}
        for blk in self.blocks:
            if blk.index not in self.reachable:
                continue
            for s in blk.succs:
                if self.dominates(s, blk.index):
                    by_header.setdefault(s, []).append(blk.index)
        loops = []
        for h, latches in by_header.items():
            body, work = {h}, [n for n in latches if n != h]
            body.update(work)
            while work:
                n = work.pop()
                for p in self.blocks[n].preds:
                    if p not in body and p in self.reachable:
                        body.add(p)
                        work.append(p)
            loops.append(Loop(h, frozenset(body), tuple(sorted(latches))))
        loops.sort(key=lambda l: len(l.blocks))
        for k, inner in enumerate(loops):
            for outer in loops[k + 1:]:
                if inner.blocks < outer.blocks:
                    inner.parent = outer
                    outer.children.append(inner)
                    break
        return loops


# ------------------------------------------------------------------------------------------------
# Anchors and paths.

def matches(ins: Instr, pattern: str) -> bool:
    """Whether ``ins`` matches an anchor: a regex over the opcode with modifiers
    (``^LDG\\.E\\.128``), or ``re:`` + a regex over the whole instruction text."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], ins.text) is not None
    return re.search(pattern, ins.opcode) is not None


def count(instrs: Iterable[Instr], pattern: str) -> int:
    return sum(1 for i in instrs if matches(i, pattern))


@dataclasses.dataclass
class Path:
    instrs: List[Instr]
    blocks: List[int]

    def __len__(self) -> int:
        return len(self.instrs)


def iteration_path(cfg: CFG, loop: Loop, need: Dict[str, int]) -> Path:
    """The fewest instructions on a header -> back-edge path through ``loop`` (inner loops
    collapsed at zero cost) that contains at least need[pattern] matching instructions each.

    Raises StructureError when no path has that work.
    """
    # Nodes: blocks of the loop outside its child loops, and one node per child loop.
    owner: Dict[int, object] = {}
    for child in loop.children:
        for b in child.blocks:
            owner[b] = ("loop", child.header)
    def node(b):
        return owner.get(b, b)
    nodes = {node(b) for b in loop.blocks}
    header = node(loop.header)
    edges: Dict[object, set] = {n: set() for n in nodes}
    latch_nodes = set()
    for b in loop.blocks:
        for s in cfg.blocks[b].succs:
            if s not in loop.blocks:
                continue
            if s == loop.header:
                latch_nodes.add(node(b))
                continue
            a, c = node(b), node(s)
            if a != c:
                edges[a].add(c)
    patterns = list(need)
    caps = [need[p] for p in patterns]
    own = [i for n in nodes if not isinstance(n, tuple) for i in cfg.blocks[n].instrs]
    for p, cap in zip(patterns, caps):
        if count(own, p) < cap:  # not even the whole body has that work
            raise StructureError(f"the loop body has fewer than {cap} x {p}")

    weights: Dict[object, Tuple[int, tuple]] = {}

    def weight(n):
        if n not in weights:
            if isinstance(n, tuple):
                weights[n] = 0, (0,) * len(patterns)
            else:
                ins = cfg.blocks[n].instrs
                weights[n] = len(ins), tuple(count(ins, p) for p in patterns)
        return weights[n]

    # Topological order of the acyclic body (back edges to the header were dropped).
    indeg = {n: 0 for n in nodes}
    for a in nodes:
        for c in edges[a]:
            indeg[c] += 1
    order, ready = [], [n for n in nodes if indeg[n] == 0]
    while ready:
        n = ready.pop()
        order.append(n)
        for c in edges[n]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if len(order) != len(nodes):
        raise StructureError("irreducible loop body")
    # Per node, the Pareto set of (anchor counts capped at need, cost): a state is kept unless
    # another reaches the node with at least its counts for no more instructions.
    best: Dict[object, Dict[tuple, Tuple[int, Optional[tuple]]]] = {n: {} for n in nodes}
    backs: Dict[tuple, Optional[tuple]] = {}  # (node, state) -> predecessor, never pruned

    def insert(n, state, cost, back) -> None:
        table = best[n]
        old = table.get(state)
        if old is not None and old[0] <= cost:
            return
        for other, (c, _) in table.items():
            if c <= cost and other != state and all(o >= s for o, s in zip(other, state)):
                return
        for other in [o for o, (c, _) in table.items()
                      if c >= cost and all(s >= o2 for s, o2 in zip(state, o))]:
            del table[other]
        table[state] = (cost, back)
        backs[(n, state)] = back

    w0, c0 = weight(header)
    insert(header, tuple(min(c, cap) for c, cap in zip(c0, caps)), w0, back=None)
    for n in order:
        for state, (cost, _) in list(best[n].items()):
            for c in edges[n]:
                wc, cc = weight(c)
                insert(c, tuple(min(s + x, cap) for s, x, cap in zip(state, cc, caps)),
                       cost + wc, (n, state))
    goal = tuple(caps)
    ends = [(best[n][goal][0], n) for n in latch_nodes if goal in best[n]]
    if not ends:
        raise StructureError(f"no path through the loop has the expected work {need}")
    cost, n = min(ends, key=lambda e: (e[0], str(e[1])))
    seq, state = [], goal
    while n is not None:
        seq.append(n)
        back = backs[(n, state)]
        n, state = back if back is not None else (None, None)
    seq.reverse()
    blocks = [b for b in seq if not isinstance(b, tuple)]
    return Path([i for b in blocks for i in cfg.blocks[b].instrs], blocks)


# ------------------------------------------------------------------------------------------------
# Loads in flight.

_LOAD_BYTES = {"": 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "8": 1, "16": 2, "32": 4, "64": 8,
               "128": 16}


def global_load_bytes(ins: Instr) -> int:
    """Bytes a global load instruction reads per thread (0 for anything else): LDG/LD into
    registers, or LDGSTS (cp.async) straight into shared memory."""
    if ins.base_op not in ("LDG", "LD", "LDGSTS"):
        return 0
    width = 4
    for mod in ins.opcode.split(".")[1:]:
        if mod in ("64", "128", "U8", "S8", "U16", "S16"):
            width = _LOAD_BYTES[mod]
    return width


def _regs(token: str) -> List[int]:
    m = re.match(r"-?\|?R(\d+)(?:\.64)?", token)
    if not m:
        return []
    r = int(m.group(1))
    return [r, r + 1] if ".64" in token else [r]


def _operands(ins: Instr) -> List[str]:
    rest = ins.body[len(ins.opcode):]
    return [t.strip() for t in re.split(r",(?![^\[]*\])", rest) if t.strip()]


def _mma_operand_widths(ins: Instr) -> Optional[List[int]]:
    """Registers each source operand of an HMMA names from its first (A, B, C), by shape:
    m16n8k16 reads 4 + 2, m16n8k8 2 + 1; C is 4 registers for float32 accumulators, else 2."""
    m = re.match(r"HMMA\.(16816|1688)", ins.opcode)
    if not m:
        return None
    a, b = (4, 2) if m.group(1) == "16816" else (2, 1)
    return [a, b, 4 if ".F32" in ins.opcode else 2]


def _reads(ins: Instr) -> set:
    ops = _operands(ins)
    is_store = ins.base_op in ("ST", "STG", "STS", "STL", "RED", "REDUX", "BRA", "EXIT", "BAR")
    src = ops if is_store else ops[1:]
    widths = _mma_operand_widths(ins) or [1] * len(src)
    out = set()
    for tok, width in zip(src, widths + [1] * len(src)):
        for r in re.findall(r"(?<![A-Za-z0-9_])R\d+(?:\.64)?", tok):
            regs = _regs(r)
            out.update(range(regs[0], regs[0] + width) if regs and width > 1 else regs)
    return out


def _writes(ins: Instr) -> set:
    """Registers an instruction overwrites (its first operand, one register; two for 64-bit
    results): enough to tell a load whose register is reused before any read."""
    if ins.base_op in ("ST", "STG", "STS", "STL", "RED", "BRA", "EXIT", "BAR", "BSSY", "BSYNC"):
        return set()
    r = _first_register(ins)
    if r is None:
        return set()
    wide = ".WIDE" in ins.opcode or ins.base_op in ("DADD", "DMUL", "DFMA") or ".F64" in ins.opcode
    return {r, r + 1} if wide else {r}


def _first_register(ins: Instr) -> Optional[int]:
    """The number of the general register an instruction's first operand names, if any."""
    ops = _operands(ins)
    m = re.match(r"R(\d+)", ops[0]) if ops else None
    return int(m.group(1)) if m else None


def _async(ins: Instr) -> bool:
    """A cp.async copy (LDGSTS): no destination register; outstanding until a DEPBAR waits for
    its group (LDGDEPBAR commits the copies issued since the last one)."""
    return ins.base_op == "LDGSTS"


def _depbar_pending(ins: Instr) -> Optional[int]:
    """For ``DEPBAR.LE SB0, N`` (cp.async.wait_group N): the groups that may stay pending."""
    m = re.match(r"DEPBAR\.LE\s+SB0\s*,\s*(0x[0-9a-fA-F]+|\d+)", ins.body)
    return int(m.group(1), 0) if m else None


def _load_dest(ins: Instr) -> set:
    r = _first_register(ins)
    if r is None:
        return set()
    return set(range(r, r + max(1, global_load_bytes(ins) // 4)))


def _complement(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and (a == "!" + b or b == "!" + a)


def _consumed_loads(path: Path, loads: Optional[str] = None) -> set:
    """Positions (in path.instrs) of the global loads whose result some instruction of the path
    reads (wrapping around once): a load whose result nothing reads is predicated off in this
    configuration and moves no data."""
    seq = path.instrs + path.instrs
    n = len(path.instrs)
    used = set()
    for k in range(n):
        if not global_load_bytes(seq[k]) or (loads and not matches(seq[k], loads)):
            continue
        if _async(seq[k]):
            used.add(k)  # its data goes to shared memory whether or not the path reads it
            continue
        dest = _load_dest(seq[k])
        for later in seq[k + 1:k + n]:
            if _complement(later.pred, seq[k].pred):
                continue  # runs only when this load does not
            if dest & _reads(later):
                used.add(k)
                break
            dest -= _writes(later)
            if not dest:
                break
    return used


def bytes_in_flight(path: Path, loads: Optional[str] = None) -> int:
    """Most global-load bytes one thread has issued and not yet used along the path (run twice
    in a row, so loads issued for the next iteration count): a load is outstanding from its issue
    until the first instruction that reads one of its destination registers, a cp.async copy
    until the DEPBAR that waits for its group. Loads whose result the path never reads are left
    out (predicated off)."""
    live = _consumed_loads(path, loads)
    n = len(path.instrs)
    outstanding: List[Tuple[set, int, Optional[str]]] = []
    open_group, groups = 0, []  # cp.async: bytes of the open group, then of each committed one
    most = 0
    for k, ins in enumerate(path.instrs + path.instrs):
        used = _reads(ins)
        outstanding = [(regs, b, p) for regs, b, p in outstanding
                       if not (regs & used) or _complement(ins.pred, p)]
        if ins.base_op == "LDGDEPBAR":
            groups.append(open_group)
            open_group = 0
        pending = _depbar_pending(ins)
        if pending is not None:
            groups = groups[-pending:] if pending else []
        if k % n in live:
            if _async(ins):
                open_group += global_load_bytes(ins)
            else:
                outstanding.append((_load_dest(ins), global_load_bytes(ins), ins.pred))
        most = max(most, sum(b for _, b, _ in outstanding) + open_group + sum(groups))
    return most


def loaded_bytes(path: Path, loads: Optional[str] = None) -> int:
    """Global-load bytes per thread and iteration whose result the path reads."""
    return sum(global_load_bytes(path.instrs[k]) for k in _consumed_loads(path, loads))


