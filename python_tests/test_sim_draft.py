"""The drafting family's CUDA entry points, launchers and kernels (csrc/cuda/draft_cuda.cpp,
draft_launch.cu, csrc/kernels/draft*.cuh) run in the SIMT emulator: markov_draft, rnn_draft and
draft_confidence against the CPU kernel and dspark_ops.reference.

The rule is the one test_draft.py applies to CUDA (float32 accumulation in another order than the
CPU kernel's float64): draft_logits within ``cuda_tolerance`` of the z the reference computes for
the emulated op's own drafts, every draft the Gumbel-max winner of its own stored row, and the
drafts equal to the CPU kernel's and the reference's; a row may part from them only at a slot where
the two candidates' keys are a float near-tie (then the later slots have other inputs), and up to
that slot its draft_logits agree within the same tolerance.

Covered: vocabulary tails (V = 1, 2, 17, 100, 8193: partial 128-row tiles and 16-row warp slices),
ranks 1, 20, 40, 44 (not multiples of 16/32) and 64, G = 1, 2, 7 (32 for small V), B = 1, odd,
several request groups (B = 65, 130; large ranks that halve the group), float32 weights (CUDA-core
path) and bfloat16/float16 weights (mma.sync; the RNN head's two-pass split activation), every
base/hidden dtype, aligned and unaligned W1/W2 rows, mixed greedy/sampled requests, NaN/+-inf base
logits, int32 anchors and ids, out-of-range ids (zero rows), several tiles per block (V = 151936),
the emulated A100 and L4, draft_confidence with and without bias and calibration, the sampling
filters (draft_filter_kernel after every slot: top-k / top-p / min-p per request, some off, the
filtered rows and redrawn tokens against the CPU kernel exactly, unchecked garbage values, and the
launch count), the W2 ring (its 2, 4 and 8 stages, chunks streamed across a warp's tiles) and
the programmatic dependent launches of a block walk. Planted faults
(mma_swap_a12, a dropped barrier in draft_slot_kernel, shuffle_off_by_one) are shown to be caught.
The key-bound skip of the logarithms: the bound checked against the float32 key over every exponent
of u, and drafts over many blocks (the later ones skipping most logarithms) on flat, peaky and wide
rows at temperatures 0.05 to 20.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import dspark_ops
import emulator
from bench.static.plans import parse_records
from conftest import full_tests
from dspark_ops import reference
from cases.common import DEBUG, DTYPE_IDS, INF, NAN, generator, is_greedy, stable_seed
from cases.draft import (
    assert_sampled_from_stored_logits,
    bf16_representable,
    check_output_contract,
    confidence_logits,
    cuda_tolerance,
    draft_keys,
    DraftCase,
    make_case,
    make_confidence_case,
    rnn_state_case,
    teacher_forced_logits,
)
from cases.tails import (
    CONFIDENCE_SEGMENT,
    DRAFT_KINDS,
    DRAFT_VOCABS,
    check_draft_tail,
    confidence_tail_cases,
    draft_tail_case,
)
from cases.verify import make_case as verify_case

pytestmark = pytest.mark.sim

TILE_ROWS = 128  # kTileRows: the rows a block's 8 warps take per round of their walk (16 each)
MAX_RESIDENT = 8 * 132  # the most draft_slot_kernel blocks any emulated device holds at once


# --------------------------------------------------------------------------------------------
# Running and checking
# --------------------------------------------------------------------------------------------


def run_sim(sim, case: DraftCase) -> dspark_ops.DraftOutput:
    tokens, logits = case.call(sim)
    return dspark_ops.DraftOutput(tokens, logits)


def sim_tolerance(case: DraftCase, z: torch.Tensor) -> dict:
    """The CUDA tolerance of test_draft.py's check_against_reference (cases/draft.py)."""
    full_f32 = case.w1.dtype == torch.float32 and not bf16_representable(case.w1, case.w2)
    return cuda_tolerance(case, z, 4.0 if full_f32 else 1.0)


def near_tie(key_best: float, key_got: float) -> bool:
    """test_draft's near-tie rule: the two keys within float rounding of each other."""
    return key_best - key_got <= 1e-4 * (1 + abs(key_best))


def assert_same_drafts(case: DraftCase, got, expected, tol: dict, against: str) -> None:
    """``got`` drafts what ``expected`` does, except that a row may part at a near-tie of
    ``expected``'s keys; draft_logits agree up to and including that slot."""
    tokens, want = got.tokens, expected.tokens
    batch, block = tokens.shape
    differ = tokens != want
    diverged = differ.any(1)
    first = torch.where(diverged, differ.int().argmax(1), block)
    same_inputs = torch.arange(block)[None, :] <= first[:, None]
    torch.testing.assert_close(got.draft_logits[same_inputs], expected.draft_logits[same_inputs],
                               equal_nan=True, **tol,
                               msg=lambda m: f"draft_logits against {against}: {m}")
    for b in diverged.nonzero()[:, 0].tolist():
        j = int(first[b])
        keys = draft_keys(expected.draft_logits[b:b + 1, j], case.temperature[b:b + 1],
                          case.seed[b:b + 1], case.position[b:b + 1] + 1 + j)[0]
        best, theirs = float(keys[want[b, j]]), float(keys[tokens[b, j]])
        assert near_tie(best, theirs), (
            f"request {b} slot {j}: emulated CUDA drafted {int(tokens[b, j])} (key {theirs}), "
            f"{against} {int(want[b, j])} (key {best}); T={float(case.temperature[b])}; "
            f"tokens {tokens[b].tolist()} vs {want[b].tolist()}")
    assert int(diverged.sum()) <= max(1, batch // 20), (
        f"{int(diverged.sum())} of {batch} requests part from {against} at near-ties")


def check_draft(sim, case: DraftCase, *, cpu: bool = True):
    """Runs the emulated CUDA op and checks it against its own teacher-forced logits, its own
    stored rows, the CPU kernel (unless ``cpu`` is False) and the reference."""
    got = run_sim(sim, case)
    check_output_contract(case, got)
    forced = teacher_forced_logits(case, got.tokens)
    tol = sim_tolerance(case, forced)
    torch.testing.assert_close(got.draft_logits, forced, equal_nan=True, **tol)
    assert_sampled_from_stored_logits(case, got)
    if cpu:
        assert_same_drafts(case, got, case.call(), tol, "the CPU kernel")
    assert_same_drafts(case, got, case.call(reference), tol, "the reference")
    return got


# --------------------------------------------------------------------------------------------
# Layouts of W1 / W2 rows (draft_cuda.cpp rows_aligned: 16-byte aligned start and row stride)
# --------------------------------------------------------------------------------------------


def per16(w: torch.Tensor) -> int:
    return 16 // w.element_size()


def w2_aligned(w: torch.Tensor) -> bool:
    return w.data_ptr() % 16 == 0 and w.stride(0) % per16(w) == 0


def row_layout(w: torch.Tensor, kind: str) -> torch.Tensor:
    """``w`` [V, r] with unit stride along r, in a chosen row layout; gaps hold NaN:
    ``contiguous``; ``aligned`` (stride r rounded up to 16 bytes: vector loads even when r is not
    a multiple of 8 or 4); ``offset`` (the rows start one element past a 16-byte boundary);
    ``padded`` (a row stride that is not a multiple of 16 bytes)."""
    vocab, rank = w.shape
    if kind == "contiguous":
        return w
    if kind == "offset":
        storage = torch.full((vocab * rank + 1,), NAN, dtype=w.dtype)
        out = storage[1:].view(vocab, rank)
    else:
        if kind == "aligned":
            stride = -(-rank // per16(w)) * per16(w)
        elif kind == "padded":
            stride = rank + 1 if (rank + 1) % per16(w) else rank + 2
        else:
            raise ValueError(kind)
        out = torch.full((vocab, stride), NAN, dtype=w.dtype)[:, :rank]
    out.copy_(w)
    assert w2_aligned(out) == (kind == "aligned" or (kind == "contiguous" and w2_aligned(w)))
    return out


def transposed(t: torch.Tensor) -> torch.Tensor:
    """[B, G, ...] stored as [G, B, ...] (batch stride below the slot stride)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


# --------------------------------------------------------------------------------------------
# The sweeps of markov_draft and rnn_draft: one case builder for both heads
# --------------------------------------------------------------------------------------------

F32, BF16, F16, I32, I64 = torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64
LAYOUTS = ("contiguous", "aligned", "offset", "padded")


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """One emulated drafting case: the shape, the head (the RNN head with its hidden width and
    dtype), the weight kind (cases/draft.py WEIGHTS), the base and anchor dtypes, the
    temperature kind and the W1/W2 row layout (row_layout)."""

    head: str
    batch: int
    block: int
    vocab: int
    rank: int
    weights: str
    base: torch.dtype
    ids: torch.dtype
    layout: str
    temperature: str = "mixed"
    hidden_size: int = 16
    hidden: torch.dtype = F32

    def key(self) -> tuple:
        # The seed and the test id name the same choices, in the same order, for each head.
        if self.head == "markov":
            return ("sim", (self.batch, self.block, self.vocab, self.rank, self.weights,
                            self.base, self.ids, self.temperature, self.layout))
        return ("sim-rnn", (self.batch, self.block, self.vocab, self.rank, self.hidden_size,
                            self.weights, self.base, self.hidden, self.ids, self.layout))

    @property
    def id(self) -> str:
        shape = f"B{self.batch}-G{self.block}-V{self.vocab}-r{self.rank}"
        if self.head == "markov":
            return (f"{shape}-w{self.weights}-{DTYPE_IDS[self.base]}-{DTYPE_IDS[self.ids]}"
                    f"-{self.temperature}-{self.layout}")
        return (f"{shape}-d{self.hidden_size}-w{self.weights}-{DTYPE_IDS[self.base]}"
                f"-h{DTYPE_IDS[self.hidden]}-{DTYPE_IDS[self.ids]}-{self.layout}")

    def build(self) -> DraftCase:
        case = make_case(self.batch, self.block, self.vocab, self.rank,
                         seed=stable_seed(*self.key()), weights=self.weights,
                         base_dtype=self.base, anchor_dtype=self.ids,
                         temperature=self.temperature, head=self.head,
                         hidden_size=self.hidden_size)
        if case.hidden is not None:
            case = case.replace(hidden=case.hidden.to(self.hidden))
        return case.replace(w1=row_layout(case.w1, self.layout),
                            w2=row_layout(case.w2, self.layout))


def markov(batch, block, vocab, rank, weights, base, ids, temperature, layout) -> SweepCase:
    return SweepCase("markov", batch, block, vocab, rank, weights, base, ids, layout, temperature)


def rnn(batch, block, vocab, rank, d, weights, base, hidden, ids, layout) -> SweepCase:
    return SweepCase("rnn", batch, block, vocab, rank, weights, base, ids, layout,
                     hidden_size=d, hidden=hidden)


def sweep_params(cases) -> list:
    return [pytest.param(c, id=c.id) for c in cases]


def full_sweep(head: str) -> list:
    """The long sweep of one head (DSPARK_OPS_TEST_FULL=1): every V x G x r x weight kind, the
    base, hidden and anchor dtypes and the row layouts cycling along."""
    if not full_tests():
        return [pytest.param(None, marks=pytest.mark.skip(reason="set DSPARK_OPS_TEST_FULL=1"))]
    vocabs, ranks, batch, long_batch = {
        "markov": ((1, 2, 17, 100, 8193), (1, 20, 40, 64), 65, 3),
        "rnn": ((2, 17, 100, 8193), (1, 20, 64), 9, 2),
    }[head]
    floats = (F32, BF16, F16)
    cases = [SweepCase(head, long_batch if vocab == 8193 else batch, block, vocab, rank, weights,
                       base=floats[i % 3], ids=(I64, I32)[i % 2], layout=LAYOUTS[i % 4],
                       hidden=floats[i // 3 % 3])
             for i, (vocab, block, rank, weights) in enumerate(itertools.product(
                 vocabs, (1, 7, 32), ranks, ("f32", "bf16", "f16")))]
    return sweep_params(cases)


# --------------------------------------------------------------------------------------------
# markov_draft
# --------------------------------------------------------------------------------------------

# markov(B, G, V, r, weights, base dtype, anchor dtype, temperature, W1/W2 layout)
MARKOV_CASES = sweep_params([
    # V = 1 and 2: one partial warp slice; r = 1.
    markov(1, 7, 1, 20, "bf16", F32, I64, "sampled", "contiguous"),
    markov(3, 7, 2, 1, "f32", BF16, I32, "mixed", "contiguous"),
    markov(2, 2, 2, 1, "f16", F16, I64, "mixed", "padded"),
    # V = 17: warp 0 full, warp 1 one row; odd B.
    markov(5, 7, 17, 40, "f16", F16, I64, "mixed", "aligned"),
    markov(7, 7, 17, 20, "f32", F32, I32, "greedy", "offset"),
    # G = 32 with one full group of 64 requests.
    markov(64, 32, 17, 64, "bf16", F32, I32, "mixed", "contiguous"),
    # B = 65 / 130: two and three request groups of 64.
    markov(65, 2, 100, 20, "f32", BF16, I64, "mixed", "aligned"),
    markov(130, 1, 100, 40, "bf16", F16, I32, "sampled", "offset"),
    markov(65, 2, 100, 44, "f16", F32, I64, "mixed", "aligned"),  # aligned rows, a scalar k tail
    # V = 8193: 65 tiles (the last one row) over 65 blocks per group.
    markov(7, 2, 8193, 20, "bf16", F32, I64, "mixed", "padded"),
    markov(4, 2, 8193, 64, "f32", BF16, I32, "mixed", "contiguous"),
    markov(3, 1, 8193, 40, "f16", F16, I64, "sampled", "contiguous"),
    markov(1, 2, 8193, 1, "f32", F16, I32, "greedy", "offset"),
    # Large ranks: inputs past 48 KB need the shared-memory opt-in (f32 r = 200: 58 KB at 64
    # requests); past the emulated H200's budgets (71 KB for 16-bit weights with their ring,
    # 109 KB for float32: bf16 r = 864, f32 r = 448) the group halves to 32.
    markov(40, 2, 100, 200, "f32", F32, I64, "mixed", "contiguous"),
    markov(33, 1, 300, 400, "bf16", BF16, I32, "mixed", "padded"),
    markov(34, 1, 200, 352, "f16", F32, I64, "greedy", "aligned"),
    markov(40, 2, 100, 448, "f32", F32, I64, "mixed", "contiguous"),
    markov(33, 1, 300, 864, "bf16", BF16, I32, "mixed", "padded"),
    # Full-mantissa float32 weights.
    markov(9, 3, 500, 20, "f32full", F32, I64, "mixed", "padded"),
])


@pytest.mark.parametrize("params", MARKOV_CASES)
def test_markov_draft_matches_cpu_and_reference(sim, params):
    """markov_draft on the emulated H200: the drafts of the CPU kernel and the reference (up to
    float near-ties), draft_logits within the CUDA tolerance, over vocabulary tails, ranks, group
    counts, every weight/base/id dtype and aligned and unaligned W2 rows."""
    case = params.build()
    out = check_draft(sim, case)
    batch, block, vocab = case.base_logits.shape
    if batch * block >= 60 and vocab > 2 and not is_greedy(case.temperature).all():
        assert (out.tokens != out.draft_logits.argmax(-1)).any()  # really sampled


@pytest.mark.parametrize("params", full_sweep("markov"))
def test_markov_draft_full_sweep(sim, params):
    """The long sweep (DSPARK_OPS_TEST_FULL=1): every V x G x r x weight dtype."""
    check_draft(sim, params.build())


def test_unaligned_rows_give_the_same_results(sim):
    """W2 rows read with 16-byte vector loads (aligned) and element by element (odd offset,
    padded stride), and a transposed base: the emulated op's outputs are bit-identical, for
    the CUDA-core and the tensor-core path."""
    for weights, rank in (("f32", 20), ("bf16", 40), ("f16", 44)):
        case = make_case(9, 3, 300, rank, seed=stable_seed("layouts", weights), weights=weights,
                         base_dtype=BF16)
        aligned = case.replace(w1=row_layout(case.w1, "aligned"),
                               w2=row_layout(case.w2, "aligned"))
        out = check_draft(sim, aligned)
        for kind in ("offset", "padded"):
            other = case.replace(w1=row_layout(case.w1, kind), w2=row_layout(case.w2, kind),
                                 base_logits=transposed(case.base_logits))
            assert not w2_aligned(other.w2)
            got = run_sim(sim, other)
            assert torch.equal(got.tokens, out.tokens), (weights, kind)
            assert torch.equal(got.draft_logits, out.draft_logits), (weights, kind)


def test_several_tiles_per_block(sim):
    """V = 151936: 1187 rounds of 128 rows (9496 warp tiles of 16), more than the blocks the
    occupancy plan launches per group on any emulated device (at most 8 x 132), so warps walk two
    tiles and carry their block's best keys (and the key-bound skip) from one tile to the next;
    greedy and sampled requests."""
    vocab = 151936
    assert -(-vocab // TILE_ROWS) > MAX_RESIDENT
    gen = generator(201)
    case = make_case(2, 1, vocab, 20, seed=202, weights="bf16",
                     temperature=torch.tensor([0.0, 0.9]))
    # Each request's winner in a tile that some warp takes second (past row MAX_RESIDENT x 128).
    winners = MAX_RESIDENT * TILE_ROWS + torch.randint(0, vocab - MAX_RESIDENT * TILE_ROWS, (2,),
                                                       generator=gen)
    case.base_logits[torch.arange(2), 0, winners] += 30.0
    out = check_draft(sim, case)
    assert torch.equal(out.tokens[:, 0], winners)
    if full_tests():
        check_draft(sim, make_case(3, 2, vocab, 64, seed=203, weights="f32", base_dtype=F16))


def planned_records(sim, head: str, args: tuple) -> list:
    """The launch records of one drafting call (``head``: markov or rnn), planned only."""
    sim.clear_launch_log()
    sim.set_plan_only(True)
    try:
        getattr(sim, f"{head}_draft")(*args)
    finally:
        sim.set_plan_only(False)
    return parse_records(sim.launch_records())


def slot_plans(sim, case_args: list) -> list:
    """The launch records of each (head, call arguments) in ``case_args``, planned only: kernel,
    whether dependent, the W2 ring's stages."""
    return [[(r["kernel"].replace("dspark_ops::kernels::", ""), r["dependent"],
              r["fields"].get("stages")) for r in planned_records(sim, head, args)]
            for head, args in case_args]


def plan_args(head: str, batch: int, block: int, vocab: int, rank: int, weights) -> tuple:
    i64 = dict(dtype=torch.int64)
    base = torch.empty(batch, block, vocab)
    common = (torch.ones(batch), torch.zeros(batch, **i64), torch.zeros(batch, **i64))
    w = (torch.empty(vocab, rank, dtype=weights), torch.empty(vocab, rank, dtype=weights))
    if head == "markov":
        return (base, torch.zeros(batch, **i64)) + w + common
    return (base, torch.zeros(batch, **i64), torch.empty(batch, block, 16)) + w + (
        torch.empty(3 * rank, 2 * rank + 16, dtype=weights),
        torch.empty(3 * rank, dtype=weights)) + common


@pytest.mark.skipif(DEBUG, reason="DSPARK_OPS_DEBUG=1 turns the value checks on")
def test_w2_ring_stages_and_dependent_launches(sim):
    """The slot kernel's W2 ring takes the most stages (8, 4 or 2) the shared-memory budget leaves
    beside the group's inputs (none for float32 weights), and every launch of a block walk after
    its first is a programmatic dependent launch (the first waits for the stream: what ran before
    may have written the weights). The budget is a third of the SM's shared memory for 16-bit
    weights (three blocks per SM), a half for float32 weights. The stages the emulated tests cover:
    8 at small ranks, 4 for Markov at r 256 and for the RNN's two input planes at r 256, 2 for
    bf16 r 864 (groups of 32) and on the L4 at r 352."""
    slot = "draft_slot_kernel<__nv_bfloat16, float, {}>"
    markov, rnn = slot.format("false"), slot.format("true")
    head = "rnn_head_mma_kernel<__nv_bfloat16>"
    got = slot_plans(sim, [("markov", plan_args("markov", 64, 3, 1000, 256, BF16)),
                           ("rnn", plan_args("rnn", 64, 2, 1000, 256, BF16)),
                           ("markov", plan_args("markov", 33, 1, 300, 864, BF16)),
                           ("markov", plan_args("markov", 9, 2, 300, 20, F32))])
    assert got[0] == [(markov, False, 4), (markov, True, 4), (markov, True, 4)]
    assert got[1] == [(head, False, 4), (rnn, True, 4), (head, True, 4), (rnn, True, 4)]
    assert got[2] == [(markov, False, 2)]
    f32 = "draft_slot_kernel<float, float, false>"
    assert got[3] == [(f32, False, 0), (f32, True, 0)]
    with emulator.emulated_device("l4"):
        (l4,) = slot_plans(sim, [("markov", plan_args("markov", 33, 1, 300, 352, BF16))])
    assert l4 == [(markov, False, 2)]


@pytest.mark.skipif(DEBUG, reason="DSPARK_OPS_DEBUG=1 turns the value checks on")
def test_groups_sized_for_three_blocks_per_sm(sim):
    """16-bit weights plan for three slot blocks per SM: a group's inputs and W2 ring fit a third
    of the SM's shared memory less 5 KB (72,704 bytes on the emulated H200), float32 weights a
    half. r 256: 64 requests (32 KB of inputs), a ring of 4 stages; r 512: groups of 32, 4
    stages; r 864: groups of 32, 2 stages; the RNN's two input planes at r 256: groups of 32, 4
    stages; float32 r 200: 64 requests in a half (57 KB of inputs)."""
    def plan(head, batch, rank, weights):
        (record,) = [r for r in planned_records(sim, head, plan_args(head, batch, 1, 300, rank,
                                                                      weights))
                     if r["kernel"].startswith("draft_slot_kernel")]
        return record["fields"]["group_size"], record["fields"]["stages"], record["shared"]

    third, half = 228 * 1024 // 3 - 5 * 1024, 228 * 1024 // 2 - 5 * 1024
    for head, rank, weights, group, stages, budget in (
            ("markov", 256, BF16, 64, 4, third), ("markov", 512, BF16, 32, 4, third),
            ("markov", 864, BF16, 32, 2, third), ("rnn", 256, BF16, 32, 4, third),
            ("markov", 200, F32, 64, 0, half)):
        got = plan(head, 64, rank, weights)
        assert got[:2] == (group, stages), (head, rank, got)
        assert got[2] <= budget


@pytest.mark.parametrize("batch, stages", [(9, 4), (56, 2)])
def test_w2_ring_over_several_tiles_per_warp(sim, batch, stages):
    """The W2 ring streams a warp's chunks across its tiles: on the emulated L4 (a smaller grid,
    four or two stages beside r = 136's inputs) warps walk two 16-row tiles of five k chunks
    each, so chunks of the next tile are in flight during a tile's epilogue and the ring wraps
    inside a tile. B = 9: one request in the second column tile, one sweep; B = 56: seven column
    tiles in two sweeps (4 + 3), so the stream runs through each tile's chunks twice before the
    next tile. Greedy and sampled requests, bf16 base logits, a winner placed in a warp's second
    tile."""
    vocab, rank = 20000, 136
    case = make_case(batch, 2, vocab, rank, seed=stable_seed("ring-tiles", batch),
                     weights="bf16", base_dtype=BF16)
    with emulator.emulated_device("l4"):
        (records,) = slot_plans(sim, [("markov", (case.base_logits, case.anchor, case.w1, case.w2,
                                                  case.temperature, case.seed, case.position))])
        assert {got for _, _, got in records} == {stages}
        case.base_logits[0, 0, vocab - 5] += 40.0  # row 19995: tile 1249, a second tile
        case.base_logits[batch - 1, 0, vocab - 7] += 40.0  # the last column tile's request
        out = check_draft(sim, case)
    assert int(out.tokens[0, 0]) == vocab - 5
    assert int(out.tokens[batch - 1, 0]) == vocab - 7


def key_bound(zt: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """draft_slot.cuh key_bound in float32: fmaf(float(bits(u)), -(ln 2) 2^-23, zt + 127 ln 2) (the
    product is exact in float64, so one rounding to float32 is the fma's)."""
    ln2_ulp = float.fromhex("0x1.62e42ep-24")
    c127 = torch.tensor(float.fromhex("0x1.601e68p+6"), dtype=torch.float32)
    bits = u.view(torch.int32).to(torch.float32).double()
    return (bits * -ln2_ulp + (zt + c127).double()).float()


def test_key_bound_is_above_the_float32_key():
    """The bound that lets draft_slot_kernel skip a token's logarithms, against the float32 key
    zt - log(-log1p(-u)), for uniforms of words over every exponent (and both ends) and zt from
    -1e6 to 1e6: never below the key by more than 5e-5 + 5e-7 |zt| (the skip's threshold margin,
    1e-4 (1 + |best key|), covers that with room for the logarithms' own rounding), and within
    0.07 above it for u <= 1/64, the tokens that can win (so it rules out nearly every token once
    the best key is known)."""
    gen = generator(stable_seed("key-bound"))
    words = torch.randint(0, 2**32, (1 << 18,), generator=gen, dtype=torch.int64)
    shifts = torch.randint(0, 32, words.shape, generator=gen)
    edges = torch.tensor([0, 1, 2, 3, 2**31 - 1, 2**31, 2**32 - 257, 2**32 - 256, 2**32 - 1])
    words = torch.cat([words >> shifts, edges])  # small words: u down to 2^-33
    u = reference.uniform_from_bits(words)
    for zt in (-1e6, -300.0, -20.0, -1.0, 0.0, 0.5, 7.0, 20.0, 300.0, 1e6):
        z = torch.full_like(u, zt)
        key = z - torch.log(-torch.log1p(-u))
        bound = key_bound(z, u)
        assert (key.double() - bound.double() <= 5e-5 + 5e-7 * abs(zt)).all(), zt
        small = u <= 1 / 64
        gap = bound.double() - key.double()
        assert (gap[small] <= 0.07 + 1e-6 * abs(zt)).all(), (zt, float(gap[small].max()))


@pytest.mark.parametrize("weights", ["bf16", "f32"])
def test_key_bound_skip_keeps_the_drafts(sim, weights):
    """V = 20000 (157 tiles, one per block: the emulator runs the blocks one after another, so a
    block's first tile sees the best keys of the blocks before it and skips most tokens'
    logarithms, while the very first block computes them all): peaky and flat rows (on a flat
    row every token's key bound is near the best, so many are computed), temperatures 0.05 to
    20 and greedy; the drafts equal the CPU kernel's and the reference's."""
    batch, block, vocab = 7, 2, 20000
    case = make_case(batch, block, vocab, 16, seed=stable_seed("skip", weights), weights=weights,
                     temperature=torch.tensor([0.05, 1.0, 20.0, 1.0, 0.3, 0.0, 1.0]))
    case.base_logits[3] = 0.0  # flat: only the bias and the Gumbel noise decide
    case.base_logits[6] *= 8.0  # wide: z ~ N(0, 8), the best key far above the typical token
    out = check_draft(sim, case)
    assert (out.tokens[:5] != out.draft_logits[:5].argmax(-1)).any()  # really sampled


def test_greedy_ties_across_warps_and_blocks(sim):
    """Integer logits and zero W1: z = base exactly and ties everywhere; greedy requests take the
    lowest tied id although tied candidates come from different warps and blocks."""
    batch, block, vocab = 6, 2, 2000
    gen = generator(204)
    base = torch.randint(0, 3, (batch, block, vocab), generator=gen).float()
    for weights in (F32, BF16):
        case = DraftCase(base, torch.randint(0, vocab, (batch,), generator=gen),
                         torch.zeros(vocab, 8, dtype=weights),
                         torch.randn(vocab, 8, generator=gen).to(weights), torch.zeros(batch),
                         torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                         torch.randint(0, 2**40, (batch,), generator=gen))
        out = check_draft(sim, case)
        assert torch.equal(out.draft_logits, base)
        assert torch.equal(out.tokens, (base == base.amax(-1, keepdim=True)).int().argmax(-1))


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_non_finite_base_logits(sim, head):
    """NaN and +-inf base logits (also at each row's would-be winners, and whole slots without a
    finite logit): never drafted, a dead slot drafts 0, draft_logits carry them through."""
    batch, block, vocab = 12, 4, 300
    case = make_case(batch, block, vocab, 20, seed=stable_seed("sim-nonfinite", head), head=head,
                     weights="bf16" if head == "markov" else "f32", temperature="mixed")
    gen = generator(205)
    base = case.base_logits.clone()
    poison = torch.rand(base.shape, generator=gen)
    base[poison < 0.3] = NAN
    base[(poison >= 0.3) & (poison < 0.33)] = INF
    base[(poison >= 0.33) & (poison < 0.36)] = -INF
    top = case.base_logits.topk(2, dim=-1).indices
    base[torch.arange(batch)[:, None, None], torch.arange(block)[None, :, None], top] = \
        torch.tensor([NAN, INF])
    dead = torch.zeros(batch, block, dtype=torch.bool)
    dead[[1, 4, 7], [0, 2, 3]] = True
    kinds = torch.tensor([NAN, -INF, INF])[torch.arange(vocab) % 3]
    for n, (b, j) in enumerate(dead.nonzero().tolist()):
        base[b, j] = [torch.full((vocab,), NAN), torch.full((vocab,), -INF), kinds][n]
    case = case.replace(base_logits=base)
    out = check_draft(sim, case)
    z = out.draft_logits
    assert torch.equal(torch.isnan(z), torch.isnan(base))
    assert torch.equal(z == INF, base == INF) and torch.equal(z == -INF, base == -INF)
    assert torch.isfinite(z).gather(-1, out.tokens[..., None])[..., 0][~dead].all()
    assert (out.tokens[dead] == 0).all()


def test_keys_overflowing_float32(sim):
    """Finite z whose key z / T overflows: -inf keys never win, +inf keys beat everything (ties
    to the lowest id), a row of -inf keys drafts 0 (test_draft's literal case)."""
    vocab = 40
    base = torch.full((6, 1, vocab), -3e38)
    base[0, 0, 0] = NAN
    base[2, 0, 7] = -1e38
    base[3, 0, [5, 9]] = 3e38
    base[3, 0, 6] = 3.2e38
    base[4, 0, :5] = NAN
    base[5, 0, 0] = NAN
    case = DraftCase(base, torch.zeros(6, dtype=I64), torch.zeros(vocab, 4), torch.zeros(vocab, 4),
                     torch.tensor([0.5, 0.5, 0.5, 0.5, 0.25, 0.0]), torch.arange(6) * 7919,
                     torch.arange(6) * 1000)
    out = check_draft(sim, case)
    assert out.tokens[:, 0].tolist() == [0, 0, 7, 5, 0, 1]


def test_overflowing_keys_across_blocks(sim):
    """+inf keys (z / T overflowing) in row 5 of every 128 rows from row 256 on, over V = 151936
    where warps walk two tiles: warps whose second tile holds one already know a +inf key as the
    best when lower ids' +inf keys come, which must still be computed and win by their id; and a
    +inf key in the first tile against one in the last."""
    vocab = 151936
    gen = generator(stable_seed("overflow-blocks"))
    base = torch.randn(2, 1, vocab, generator=gen)
    tiles = -(-vocab // TILE_ROWS)
    base[0, 0, torch.arange(2, tiles - 1) * TILE_ROWS + 5] = 3e38
    base[1, 0, [7, vocab - 1]] = 3e38
    case = DraftCase(base, torch.zeros(2, dtype=I64), torch.zeros(vocab, 4), torch.zeros(vocab, 4),
                     torch.tensor([0.5, 0.25]), torch.tensor([11, 12]), torch.tensor([5, 6]))
    out = check_draft(sim, case)
    assert out.tokens[:, 0].tolist() == [2 * TILE_ROWS + 5, 7]


@pytest.mark.parametrize("device", ["a100", "l4"])
def test_other_emulated_devices(sim, device):
    """The same checks on the emulated A100 and L4 (compute capability 8.x, so the 16-bit
    tensor-core path is allowed; their launch limits), with halved groups of the largest
    per-block inputs (above each device's budget: its SM's shared memory less 5 KB a block, split
    three ways for 16-bit weights, two for float32, and never below 44 KB: 77 KB on the A100 and
    45 KB on the L4 for float32 weights) and the RNN head's two input planes, under each device's
    own grid plan."""
    cases = [
        # f32 r = 316: 64 x 324 x 4 bytes > 77 KB, so groups of 32 (two here) on both.
        make_case(33, 2, 300, 316, seed=stable_seed("dev", device, 0), weights="f32",
                  base_dtype=F16),
        # bf16 r = 352: 64 x 352 x 2 bytes (44 KB) and a ring of at least 16 KB: groups of 32 on
        # both (16-bit weights: a third of the A100's SM, 49.7 KB; the L4's 44 KB floor).
        make_case(33, 2, 300, 352, seed=stable_seed("dev", device, 1), weights="bf16",
                  base_dtype=BF16, anchor_dtype=I32),
        make_case(65, 2, 100, 40, seed=stable_seed("dev", device, 2), weights="f16",
                  head="rnn"),
        make_case(9, 3, 200, 20, seed=stable_seed("dev", device, 3), weights="f32",
                  head="rnn", base_dtype=BF16),
    ]
    conf = make_confidence_case(9, 3, 200, 40, 40, seed=stable_seed("dev-conf", device),
                                w1_dtype=BF16)
    with emulator.emulated_device(device):
        assert sim.device_name() == device
        for case in cases:
            check_draft(sim, case)
        torch.testing.assert_close(conf.call(sim), conf.call(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(DEBUG, reason="DSPARK_OPS_DEBUG=1 turns the value checks on")
@pytest.mark.parametrize("op", ["markov", "rnn", "confidence"])
def test_out_of_range_ids_embed_as_zero_rows(sim, op):
    """Without DSPARK_OPS_DEBUG the CUDA glue does not check id values (nor does the emulator's):
    an anchor (or a prev_token) outside [0, V), also as int32, embeds as a zero row and is never
    an address; the drafts stay inside [0, V)."""
    if op == "confidence":
        for ids, junk in ((I32, [-1, 300, 2**31 - 1, -(2**31)]), (I64, [-1, 300, 2**40, -(2**40)])):
            case = make_confidence_case(8, 4, 300, 40, 8, seed=206, ids_dtype=ids)
            case.prev_tokens[:, 1] = torch.tensor(junk, dtype=ids).repeat(2)
            got = case.call(sim)
            torch.testing.assert_close(got, case.call(reference), rtol=1e-5, atol=1e-6)
        return
    case = make_case(8, 3, 500, 20, seed=stable_seed("oor", op), head=op, weights="bf16")
    case.anchor = torch.tensor([-1, 500, 2**40, -(2**40), 3, 7, 2**33, 499])
    check_draft(sim, case, cpu=False)
    narrow = case.replace(anchor=torch.tensor([-1, 500, 2**31 - 1, -(2**31)] * 2, dtype=I32))
    out = check_draft(sim, narrow, cpu=False)
    if op == "markov":  # slot 0 unbiased
        torch.testing.assert_close(out.draft_logits[:4, 0], case.base_logits[:4, 0], rtol=0,
                                   atol=0)


# --------------------------------------------------------------------------------------------
# rnn_draft
# --------------------------------------------------------------------------------------------

# rnn(B, G, V, r, d, weights, base dtype, hidden dtype, anchor dtype, layout)
RNN_CASES = sweep_params([
    rnn(1, 2, 2, 1, 7, "f32", F32, F32, I64, "contiguous"),
    rnn(8, 7, 100, 20, 16, "f32", F32, BF16, I64, "aligned"),
    rnn(5, 4, 1000, 40, 24, "bf16", BF16, F16, I32, "offset"),
    rnn(3, 3, 17, 64, 33, "f16", F16, F32, I64, "padded"),
    rnn(65, 2, 17, 8, 16, "bf16", F32, F32, I32, "contiguous"),
    rnn(2, 2, 8193, 20, 16, "f16", BF16, BF16, I64, "contiguous"),
    # r = 130, 16-bit: two input planes of 64 x 160 x 2 bytes (40 KB; 56 KB with the ring, past
    # 48 KB: the opt-in).
    rnn(33, 2, 100, 130, 16, "bf16", F16, BF16, I64, "aligned"),
    rnn(33, 1, 50, 130, 8, "f16", BF16, F32, I32, "offset"),
    # Past the emulated H200's budgets (71 KB for 16-bit weights, 109 KB for float32), so groups
    # of 32: r = 416, 16-bit (two planes of 64 x 416 x 2 bytes); f32 r = 448 (one plane of
    # 64 x 452 x 4 bytes).
    rnn(33, 1, 50, 416, 8, "bf16", BF16, BF16, I64, "aligned"),
    rnn(34, 1, 50, 448, 8, "f32", F32, F16, I64, "padded"),
    rnn(9, 3, 300, 20, 16, "f32full", F32, F32, I32, "padded"),
    # A wide hidden input (d = 2560 as in the released checkpoints): rnn_head_mma_kernel's warps
    # take 20 of its 160 16-column steps each, in rounds of 7, 7, 4 and 2 (head_mma_segment).
    rnn(4, 2, 100, 40, 2560, "bf16", BF16, BF16, I64, "aligned"),
    # d = 1688: 105 whole steps and a partial one. Warp 0 takes 14 steps, the others 13, warp 1
    # the partial step: bf16 (pair loads) in rounds of 7 + 7 and 7 + 4 + 2, float32 (three parts
    # a step) in rounds of 4 + 4 + 4 + 2 and 4 + 4 + 4 + 1. d = 1687 makes J's rows odd-length:
    # element loads, rounds of 2 and a single step.
    rnn(3, 2, 100, 20, 1688, "bf16", BF16, BF16, I64, "aligned"),
    rnn(3, 2, 100, 20, 1688, "f16", F32, F32, I32, "contiguous"),
    rnn(2, 2, 100, 24, 1687, "bf16", F16, BF16, I64, "contiguous"),
])


@pytest.mark.parametrize("params", RNN_CASES)
def test_rnn_draft_matches_cpu_and_reference(sim, params):
    """rnn_draft (rnn_head_kernel + draft_slot_kernel per slot, the state advanced by the slot
    kernel): the CPU kernel's and the reference's drafts, z within the CUDA tolerance, for float32
    weights and the 16-bit two-pass split activation, across slots, groups and layouts."""
    check_draft(sim, params.build())


@pytest.mark.parametrize("params", full_sweep("rnn"))
def test_rnn_draft_full_sweep(sim, params):
    """The long sweep (DSPARK_OPS_TEST_FULL=1): every V x G x r x weight dtype of the RNN head."""
    check_draft(sim, params.build())


def test_rnn_state_update_is_after_the_bias(sim):
    """o = s_j and constant gate/candidate (cases/draft.py rnn_state_case): slot j's bias is
    W2 . tanh(s_j) from the state before its update (slot 0 unbiased), on the CUDA-core and the
    tensor-core path."""
    gen = generator(208)
    w2 = torch.randn(200, 8, generator=gen)
    for weights in (F32, BF16):
        case, expected = rnn_state_case(gen, w2, weights)
        out = check_draft(sim, case)
        torch.testing.assert_close(out.draft_logits, expected, **cuda_tolerance(case, expected))
        torch.testing.assert_close(out.draft_logits[:, 0], case.base_logits[:, 0], rtol=0,
                                   atol=0)


# --------------------------------------------------------------------------------------------
# draft_confidence
# --------------------------------------------------------------------------------------------

# (B, G, V, r, d, hidden dtype, w1 dtype, weight dtype, bias, calib, ids dtype)
CONFIDENCE_CASES = [
    (1, 1, 1, 1, 1, F32, F32, F32, False, False, I64),
    (3, 16, 2, 8, 7, BF16, F16, F32, True, False, I32),
    (16, 7, 1000, 40, 64, F16, BF16, BF16, True, True, I64),
    (5, 3, 50, 100, 33, F32, F32, F16, False, True, I32),
    (9, 2, 300, 20, 130, BF16, F32, F32, True, True, I32),
    # Rows longer than a staged weight segment (2048), 16-byte vectors plus a tail.
    (2, 3, 40, 264, 4100, BF16, BF16, BF16, True, False, I64),
    (3, 2, 30, 16, 2053, F32, F16, F32, False, True, I32),
]


@pytest.mark.parametrize("params", CONFIDENCE_CASES,
                         ids=lambda c: "B{}-G{}-V{}-r{}-d{}".format(*c[:5]) + (
                             f"-h{DTYPE_IDS[c[5]]}-w1{DTYPE_IDS[c[6]]}-w{DTYPE_IDS[c[7]]}"
                             f"{'-bias' if c[8] else ''}{'-calib' if c[9] else ''}"
                             f"-{DTYPE_IDS[c[10]]}"))
@pytest.mark.parametrize("layout", ["contiguous", "offset"])
def test_draft_confidence_matches_cpu_and_reference(sim, params, layout):
    """draft_confidence (one warp per row, the weight vector staged whole in shared memory by
    asynchronous copies, 16-byte row loads two rounds ahead or element by element, a shuffle
    reduction) within test_draft's tolerances of the reference, the float64 logit and the CPU
    kernel, with and without bias and calibration, hidden/rank below and above 32 lanes and one
    segment, int32/int64 ids; ``offset``: hidden and W1 rows that start one element past a
    16-byte boundary."""
    batch, block, vocab, rank, d, hidden, w1, weight, bias, calib, ids = params
    case = make_confidence_case(batch, block, vocab, rank, d, seed=stable_seed("sim-conf", params),
                                hidden_dtype=hidden, w1_dtype=w1, weight_dtype=weight, bias=bias,
                                calib=calib, ids_dtype=ids)
    if layout == "offset":
        case.w1 = row_layout(case.w1, "offset")
        storage = torch.full((batch * block * d + 1,), NAN, dtype=case.hidden.dtype)
        case.hidden = storage[1:].view(batch, block, d).copy_(case.hidden)
    elif rank > 8:
        case.w1 = row_layout(case.w1, "padded")
    got = case.call(sim)
    assert got.dtype == torch.float32 and got.shape == (batch, block)
    assert ((got >= 0) & (got <= 1)).all()
    torch.testing.assert_close(got, case.call(reference), rtol=1e-5, atol=1e-6)
    tau = 1.0 if case.calib_temperature is None else case.calib_temperature
    torch.testing.assert_close(got, torch.sigmoid(confidence_logits(case) / tau), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(got, case.call(), rtol=1e-4, atol=1e-5)


# (B, G, r, d, hidden dtype, w1 dtype, weight dtype): B * G not a multiple of the block's four
# rows; hidden rows of more than two rounds of 16-byte loads a lane (float32 d 6144: 48 vectors a
# lane, segment sums across rounds), W1 rows past the first round (float32 r 1024: 8 vectors a
# lane), a weight vector that is no whole number of 16-byte copies.
CONFIDENCE_ROUND_CASES = [
    (3, 3, 8, 6144, F32, F32, F32),
    (2, 5, 1024, 2051, BF16, F32, BF16),
    (5, 1, 1000, 3000, F16, F16, F16),
    (1, 7, 9, 4097, BF16, BF16, F32),
]


@pytest.mark.parametrize("params", CONFIDENCE_ROUND_CASES,
                         ids=lambda c: "B{}-G{}-r{}-d{}".format(*c[:4]))
@pytest.mark.parametrize("weight_layout", ["aligned", "offset"])
def test_draft_confidence_rounds_and_staged_weights(sim, params, weight_layout):
    """Rows streamed in more rounds than are issued ahead, W1 rows past their first round, and
    the weight vector staged by 16-byte copies with an element-by-element remainder, or wholly
    element by element when the tensor starts one element past a 16-byte boundary: the same
    confidences as the reference and the float64 logit."""
    batch, block, rank, d, hidden, w1, weight = params
    case = make_confidence_case(batch, block, 60, rank, d, seed=stable_seed("sim-conf-rounds",
                                                                            params),
                                hidden_dtype=hidden, w1_dtype=w1, weight_dtype=weight)
    if weight_layout == "offset":
        storage = torch.full((d + rank + 1,), NAN, dtype=weight)
        case.weight = storage[1:].copy_(case.weight)
    got = case.call(sim)
    torch.testing.assert_close(got, case.call(reference), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, torch.sigmoid(confidence_logits(case) /
                                                  case.calib_temperature), rtol=1e-5, atol=1e-6)


def test_draft_confidence_refuses_a_weight_vector_beyond_shared_memory(sim):
    """The CUDA kernel stages [d + r] whole in shared memory: a larger weight vector is refused
    with the limit, before any launch; the CPU kernel takes it."""
    case = make_confidence_case(1, 1, 4, 8, 96 * 1024 // 4, seed=5)
    with pytest.raises(ValueError, match="at most 98304 bytes"):
        case.call(sim)
    assert case.call().shape == (1, 1)


# --------------------------------------------------------------------------------------------
# Launches and planted faults
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_batch_invariance(sim, head):
    """A request's drafts and draft_logits are bitwise the same alone, in a reordered batch and
    among other requests (16-bit weights: the tensor-core slot kernel and RNN head, whose sums
    run in an order that does not depend on the batch). 70 requests: two groups of the slot
    kernel and nine of the head."""
    case = make_case(30, 3, 700, 40, seed=stable_seed("sim-invariance", head), weights="bf16",
                     head=head, hidden_size=40)
    out = run_sim(sim, case)
    others = make_case(40, 3, 700, 40, seed=stable_seed("sim-invariance-others", head),
                       weights="bf16", head=head, hidden_size=40)
    joined = case.replace(**{k: torch.cat([getattr(case, k), getattr(others, k)])
                             for k in DraftCase.PER_REQUEST if getattr(case, k) is not None})
    gen = generator(220)
    arrangements = {"alone": torch.tensor([7]), "reordered": torch.randperm(30, generator=gen),
                    "joined": torch.randperm(70, generator=gen)}
    for name, index in arrangements.items():
        got = run_sim(sim, (joined if name == "joined" else case).select(index))
        for i, b in enumerate(index.tolist()):
            if b < 30:
                assert torch.equal(got.tokens[i], out.tokens[b]), (name, b)
                assert torch.equal(got.draft_logits[i], out.draft_logits[b]), (name, b)


def test_launches(sim):
    """G launches of draft_slot_kernel per markov_draft call, G RNN head launches (tensor cores,
    rnn_head_mma_kernel, for 16-bit weights; rnn_head_kernel for float32) + G draft_slot_kernel
    per rnn_draft call, one draft_confidence_kernel; one instantiation per weight dtype, base
    logits dtype (a template parameter: no type switch per element) and head; the confidence
    kernel's per W1 dtype and weight-vector dtype."""
    sim.clear_launch_log()
    bases = {"f32": (F32, "float"), "bf16": (BF16, "__nv_bfloat16"), "f16": (F16, "__half")}
    for weights, base in zip(("f32", "bf16", "f16"), ("bf16", "f16", "f32")):
        run_sim(sim, make_case(3, 3, 50, 8, seed=209, weights=weights))
        run_sim(sim, make_case(3, 2, 50, 8, seed=210, weights=weights, head="rnn",
                               base_dtype=bases[base][0]))
        dtype = bases[weights][0]
        make_confidence_case(3, 2, 50, 8, 8, seed=211, w1_dtype=dtype).call(sim)
    expected = {}
    for weights, base in zip(("f32", "bf16", "f16"), ("bf16", "f16", "f32")):
        w, b = bases[weights][1], bases[base][1]
        expected[f"draft_slot_kernel<{w}, float, false>"] = 3
        expected[f"draft_slot_kernel<{w}, {b}, true>"] = 2
        expected[f"rnn_head_{'' if weights == 'f32' else 'mma_'}kernel<{w}>"] = 2
        expected[f"draft_confidence_kernel<{w}, float>"] = 1
    got = {name.replace("dspark_ops::kernels::", ""): n for name, n in emulator.launches().items()}
    assert got == expected


def test_counters_are_back_to_zero_after_every_call(sim):
    """The slots' best keys and arrival counters live in a buffer per stream, shared with verify,
    that is not filled between calls: the last block of each request group returns its keys and
    counter to zero. Drafting calls of several shapes (one and two request groups, both heads,
    16-bit and float32 weights, greedy and sampled) run once against the CPU kernel and the
    reference, then again with a verify call among them in three shuffled orders, and give
    bitwise the same outputs every time: a key left set would win a later call's slot, an
    arrival count left set would make a block write its group's tokens before the others have
    published their keys, or no block write them."""
    cases = [
        make_case(3, 7, 8193, 8, seed=stable_seed("sim-counters", 0), temperature="mixed"),
        make_case(70, 3, 700, 40, seed=stable_seed("sim-counters", 1), head="rnn",
                  hidden_size=40),
        make_case(5, 2, 100, 20, seed=stable_seed("sim-counters", 2), weights="f32",
                  temperature="greedy"),
        make_case(4, 3, 300, 8, seed=stable_seed("sim-counters", 3), head="rnn", weights="f32"),
        make_case(66, 2, 1000, 8, seed=stable_seed("sim-counters", 4), temperature="sampled"),
    ]
    first = [check_draft(sim, case) for case in cases]
    v = verify_case(3, 4, 8193, seed=stable_seed("sim-counters", "verify"), temperature="mixed")
    run_verify = lambda: sim.verify(v.target_logits, v.draft_tokens, v.num_draft,  # noqa: E731
                                    v.temperature, v.seed, v.position, v.draft_logits,
                                    v.target_start, v.draft_temperature)
    verified = run_verify()
    assert torch.equal(verified[0], v.call(reference.verify).tokens)
    for round_ in range(3):
        order = torch.randperm(len(cases) + 1, generator=generator(413 + round_)).tolist()
        for i in order:
            if i == len(cases):
                again = run_verify()
                assert all(torch.equal(a, b) for a, b in zip(again, verified)), round_
                continue
            again = run_sim(sim, cases[i])
            assert torch.equal(again.tokens, first[i].tokens), (round_, i)
            assert torch.equal(again.draft_logits, first[i].draft_logits), (round_, i)


# --------------------------------------------------------------------------------------------
# Sampling filters (draft_filter_kernel)
# --------------------------------------------------------------------------------------------


def filter_case(batch: int, vocab: int, filters: dict, seed: int) -> dict:
    out = {}
    for key, values in filters.items():
        dtype = torch.int32 if key == "top_k" else torch.float32
        out[key] = torch.tensor([values[b % len(values)] for b in range(batch)], dtype=dtype)
    return out


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("vocab", [17, 300, 8193])
def test_filtered_drafts_match_cpu(sim, head, vocab):
    # The emulated kernels against the CPU kernel exactly: the filter passes over the stored row
    # (float32 z within rounding of the CPU's float64 head, so the inputs are made exact: bf16
    # weights, and rows compared only while the drafts agree).
    batch, block = 5, 3
    case = make_case(batch, block, vocab, 20, seed=stable_seed("sim-filters", head, vocab),
                     head=head, weights="bf16", temperature="mixed")
    filters = filter_case(batch, vocab, dict(top_k=[2, 0, 9, 40], top_p=[0.9, 0.6, 1.0, 0.95],
                                             min_p=[0.0, 0.05, 0.3, 0.01]), 0)
    got = dspark_ops.DraftOutput(*case.call(sim, **filters))
    check_output_contract(case, got)
    want = case.call(**filters)
    finite = torch.isfinite(got.draft_logits)
    chosen = finite.gather(-1, got.tokens[..., None])[..., 0]
    assert chosen.all(), "a draft outside the kept set"
    same = (got.tokens == want.tokens).all(1)
    assert int((~same).sum()) <= 1, (got.tokens, want.tokens)
    assert torch.equal(finite[same], torch.isfinite(want.draft_logits)[same])
    torch.testing.assert_close(got.draft_logits[same][finite[same]],
                               want.draft_logits[same][finite[same]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("filters", [dict(top_p=[0.5, 0.97]), dict(top_k=[3000, 8000]),
                                     dict(top_k=[2600, 40], top_p=[0.9, 0.9])],
                         ids=["top-p", "top-k", "both"])
def test_filters_beyond_the_on_chip_candidates(sim, filters):
    # Near-flat logits: more tokens qualify after the first digit than the block keeps on chip
    # (kFilterCandidates), so the descent goes on over the row; results as on the CPU.
    batch, vocab = 2, 8193
    gen = generator(219)
    case = make_case(batch, 2, vocab, 8, seed=219, weights="bf16", temperature="sampled")
    case = case.replace(base_logits=torch.randn(batch, 2, vocab, generator=gen) * 0.05,
                        w2=torch.zeros_like(case.w2))
    kwargs = filter_case(batch, vocab, filters, 0)
    got = dspark_ops.DraftOutput(*case.call(sim, **kwargs))
    want = case.call(**kwargs)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(torch.isfinite(got.draft_logits), torch.isfinite(want.draft_logits))
    # A request gathered more candidates than fit: at least top_k, or every token it keeps.
    kept = torch.isfinite(got.draft_logits).sum(-1).amax(-1)
    top_k = kwargs.get("top_k", torch.zeros(batch, dtype=torch.int32))
    assert (torch.maximum(kept, top_k) > 2560).any()


def test_top_k_floor_with_too_many_ties(sim):
    # top-k = 5 over rows whose 3000 largest logits tie: the k-th largest of the threads' maxima
    # (the floor the gather starts from) has more tokens at or above it than fit on chip, so the
    # kernel falls back to the first digit over the row; all 3000 are kept, as on the CPU.
    batch, vocab = 2, 8193
    gen = generator(221)
    case = make_case(batch, 2, vocab, 8, seed=221, weights="bf16", temperature="sampled")
    base = torch.randn(batch, 2, vocab, generator=gen)
    base[..., torch.randperm(vocab, generator=gen)[:3000]] = 10.0
    case = case.replace(base_logits=base, w2=torch.zeros_like(case.w2))
    kwargs = filter_case(batch, vocab, dict(top_k=[5, 5]), 0)
    got = dspark_ops.DraftOutput(*case.call(sim, **kwargs))
    want = case.call(**kwargs)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(torch.isfinite(got.draft_logits), torch.isfinite(want.draft_logits))
    assert (torch.isfinite(got.draft_logits).sum(-1) == 3000).all()


def test_unchecked_filter_values_stay_in_bounds(sim):
    # What the CUDA entry point does not check (value checks need DSPARK_OPS_DEBUG=1): negative
    # or huge top_k, top_p outside (0, 1] or NaN, min_p outside [0, 1] or NaN. The kernel treats
    # them as documented (off, or clamped) and never leaves the row.
    batch, vocab = 6, 100
    case = make_case(batch, 2, vocab, 8, seed=217, temperature="sampled")
    filters = dict(top_k=torch.tensor([-5, 2**31 - 1, 0, 1, vocab, -1], dtype=torch.int32),
                   top_p=torch.tensor([NAN, -1.0, 0.0, 2.0, 1e-30, INF]),
                   min_p=torch.tensor([NAN, -1.0, 5.0, 0.5, INF, 0.0]))
    got = dspark_ops.DraftOutput(*case.call(sim, **filters))
    check_output_contract(case, got)
    finite = torch.isfinite(got.draft_logits)
    assert finite.gather(-1, got.tokens[..., None]).all()
    assert (finite.sum(-1) >= 1).all()  # the most probable token always stays


def test_filter_launches(sim):
    """One draft_filter_kernel launch per slot when filters are given, none otherwise."""
    sim.clear_launch_log()
    case = make_case(3, 4, 50, 8, seed=218, weights="f32")
    case.call(sim)
    case.call(sim, top_p=torch.full((3,), 0.5))
    got = {name.replace("dspark_ops::kernels::", ""): n for name, n in emulator.launches().items()}
    assert got == {"draft_slot_kernel<float, float, false>": 8, "draft_filter_kernel<float>": 4}


def _fault_cases():
    return {
        "markov-bf16": make_case(16, 3, 600, 40, seed=212, weights="bf16"),
        "markov-f16": make_case(16, 3, 600, 40, seed=213, weights="f16"),
        "markov-f32": make_case(16, 3, 600, 40, seed=214, weights="f32"),
        "rnn-bf16": make_case(8, 2, 300, 40, seed=215, weights="bf16", head="rnn"),
    }


def test_mma_swap_a12_breaks_the_tensor_core_path(sim):
    """mma.sync taking A registers 1 and 2 swapped (rows g+8 and columns 8.. exchanged) breaks
    the bf16/fp16 paths (the Markov head, the RNN head's product and its split activation), and
    only them: the float32 CUDA-core path never issues mma.sync and still passes."""
    cases = _fault_cases()
    for name, case in cases.items():
        check_draft(sim, case)  # the unbroken kernel passes
    with emulator.planted("mma_swap_a12"):
        for name in ("markov-bf16", "markov-f16", "rnn-bf16"):
            assert emulator.caught(lambda: check_draft(sim, cases[name])), name
        check_draft(sim, cases["markov-f32"])


def test_dropped_head_barrier_is_caught(sim):
    """Without the __syncthreads before rnn_head_mma_kernel's warp 0 sums the eight warps'
    partial tiles, it reads tiles other warps have not written yet (the previous block's, or
    never written): wrong preactivations (and, in the race flavour, a reported race or
    uninitialised read). r = 128 and d = 128: every warp has the same 16-column steps, so which
    warp finishes first is the emulator's seeded interleaving."""
    site = emulator.barrier_site("draft_rnn_head.cuh", "partial[warp][lane][e] = acc[e]")
    case = make_case(16, 2, 300, 128, seed=219, weights="bf16", head="rnn", hidden_size=128)
    check_draft(sim, case)
    with emulator.planted(f"drop_barrier:{site}"):
        assert emulator.caught(lambda: check_draft(sim, case))


@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_dropped_barrier_is_caught(sim, weights):
    """Without the __syncthreads after draft_slot_kernel's arrival count, threads read the
    block's `last` flag before thread 0 has set it (a stale flag from the block before): missing
    or wrong drafts (and, in the race flavour, a reported race)."""
    site = emulator.barrier_site("draft_slot.cuh", "last = atomicAdd(arrivals")
    case = make_case(64, 3, 1024, 20, seed=stable_seed("barrier", weights), weights=weights,
                     temperature="mixed")
    check_draft(sim, case)
    with emulator.planted(f"drop_barrier:{site}"):
        assert emulator.caught(lambda: check_draft(sim, case))


def test_shuffle_off_by_one_is_caught(sim):
    """Shuffles reading the next lane break the Philox word trade and the key reductions of
    draft_slot_kernel and draft_confidence's warp sum."""
    cases = _fault_cases()
    conf = make_confidence_case(8, 3, 200, 40, 64, seed=216)
    with emulator.planted("shuffle_off_by_one"):
        for name in ("markov-f32", "markov-bf16", "rnn-bf16"):
            assert emulator.caught(lambda: check_draft(sim, cases[name])), name
        expected = conf.call(reference)
        assert emulator.caught(lambda: torch.testing.assert_close(conf.call(sim), expected, rtol=1e-5,
                                                         atol=1e-6))


# --------------------------------------------------------------------------------------------
# bfloat16 draft_logits (draft_logits_dtype=torch.bfloat16: the epilogue rounds z, stores
# bfloat16 and takes the keys of the rounded value; the filter kernel reads and writes bfloat16)
# --------------------------------------------------------------------------------------------

BF16_LOGITS = dict(draft_logits_dtype=BF16)


def as_float(out) -> dspark_ops.DraftOutput:
    return dspark_ops.DraftOutput(out.tokens, out.draft_logits.float())


def check_bf16_draft(sim, case: DraftCase, **filters):
    """The emulated op with bfloat16 logits: float32 z within the CUDA tolerance of the drafts'
    own teacher-forced z, rounded (so up to half a bfloat16 ulp more), every draft the Gumbel-max
    winner of its own stored rounded row (greedy: exactly, ties to the lowest id), and the drafts
    and values of the CPU kernel and the reference (which round the float64 z; up to near-ties)."""
    got = dspark_ops.DraftOutput(*case.call(sim, **BF16_LOGITS, **filters))
    assert got.draft_logits.dtype == BF16 and got.draft_logits.shape == case.base_logits.shape
    assert got.tokens.dtype == torch.int64
    assert ((got.tokens >= 0) & (got.tokens < case.vocab)).all()
    forced = teacher_forced_logits(case, got.tokens)
    tol = sim_tolerance(case, forced)
    tol = dict(rtol=tol["rtol"] + 2.0**-8, atol=tol["atol"])
    finite = torch.isfinite(got.draft_logits)
    if not filters:
        torch.testing.assert_close(got.draft_logits.float(), forced, equal_nan=True, **tol)
        assert_sampled_from_stored_logits(case, as_float(got))
    else:
        torch.testing.assert_close(got.draft_logits.float()[finite], forced[finite], **tol)
        assert finite.gather(-1, got.tokens[..., None]).all(), "a draft outside the kept set"
    for ops, name in ((dspark_ops, "the CPU kernel"), (reference, "the reference")):
        want = case.call(ops, **BF16_LOGITS, **filters)
        assert want.draft_logits.dtype == BF16
        if filters:
            same = (got.tokens == want.tokens).all(1)
            assert int((~same).sum()) <= 1, (got.tokens, want.tokens)
            assert torch.equal(finite[same], torch.isfinite(want.draft_logits)[same])
        else:
            assert_same_drafts(case, as_float(got), as_float(want), tol, name)
    return got


@pytest.mark.parametrize("params", sweep_params([
    markov(5, 3, 300, 40, "bf16", BF16, I64, "mixed", "aligned"),
    markov(9, 2, 8193, 20, "f32", F32, I32, "sampled", "padded"),
    markov(65, 2, 100, 64, "f16", F16, I64, "greedy", "aligned"),
    markov(3, 7, 17, 1, "bf16", F32, I64, "mixed", "offset"),
]))
def test_bf16_logits_markov(sim, params):
    case = params.build()
    got = check_bf16_draft(sim, case)
    # The float32 op draws from the unrounded z: its stored rows round to these (same drafts).
    f32 = run_sim(sim, case)
    same = (f32.tokens == got.tokens).all(1)
    assert torch.equal(f32.draft_logits[same].to(BF16), got.draft_logits[same])


@pytest.mark.parametrize("weights", ["bf16", "f32"])
def test_bf16_logits_rnn(sim, weights):
    case = make_case(6, 3, 500, 20, seed=stable_seed("sim-bf16-rnn", weights), head="rnn",
                     weights=weights, temperature="mixed")
    check_bf16_draft(sim, case)


def test_bf16_logits_greedy_ties_of_rounded_values(sim):
    # Distinct float32 logits that round to one bfloat16 value, spread over warps and blocks:
    # the lowest id among them wins (float32 logits: the largest).
    batch, vocab = 3, 8193
    case = make_case(batch, 1, vocab, 8, seed=231, weights="bf16", temperature="greedy")
    base = torch.zeros(batch, 1, vocab)
    ids = torch.tensor([7000, 4100, 300, 5000])
    base[:, 0, ids] = 3.0 + torch.arange(4, dtype=torch.float32) * 2.0**-12
    case = case.replace(base_logits=base, w2=torch.zeros_like(case.w2))
    got = check_bf16_draft(sim, case)
    assert (got.tokens == 300).all()
    assert (run_sim(sim, case).tokens == 5000).all()


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_bf16_logits_filtered(sim, head):
    batch, block, vocab = 5, 3, 300
    case = make_case(batch, block, vocab, 20, seed=stable_seed("sim-bf16-filters", head),
                     head=head, weights="bf16", temperature="mixed")
    filters = filter_case(batch, vocab, dict(top_k=[2, 0, 9, 40], top_p=[0.9, 0.6, 1.0, 0.95],
                                             min_p=[0.0, 0.05, 0.3, 0.01]), 0)
    check_bf16_draft(sim, case, **filters)


def test_bf16_logits_verify_accepts_every_draft(sim):
    # p = q: the target rows are the stored bfloat16 rows; the emulated verify accepts them all.
    batch, block, vocab = 16, 4, 700
    case = make_case(batch, block, vocab, 16, seed=232, weights="bf16", temperature="sampled")
    draft = dspark_ops.DraftOutput(*case.call(sim, **BF16_LOGITS))
    target = torch.cat([draft.draft_logits.float(), torch.randn(batch, 1, vocab)], 1)
    n = torch.full((batch,), block, dtype=torch.int32)
    expected = reference.verify(target, draft.tokens, n, case.temperature, case.seed,
                                case.position, draft_logits=draft.draft_logits,
                                draft_temperature=case.temperature)
    assert (expected.num_accepted == block).all(), expected.num_accepted
    out = sim.verify(target, draft.tokens, n, case.temperature, case.seed, case.position,
                     draft_logits=draft.draft_logits, draft_temperature=case.temperature)
    assert torch.equal(out[0], expected.tokens) and torch.equal(out[1], expected.num_accepted)


@pytest.mark.parametrize("head", ["markov_draft", "rnn_draft"])
def test_extreme_position_without_value_checks(sim, head):
    """position = 2^63 - 1 is refused on CPU; on CUDA without DSPARK_OPS_DEBUG=1 slot j draws
    from p0 + 1 + j modulo 2^64 (no signed overflow: the asan flavour's UBSan checks it), as the
    reference does."""
    from fuzz.ops import BY_NAME

    spec = BY_NAME[head]
    for seed in (0, 1):  # plain, and sampling filters
        args = spec.build(seed)
        args["position"][1] = 2**63 - 1
        args["position"][2] = 2**63 - 2
        got = getattr(sim, head)(*args.values())
        assert torch.equal(got[0], spec.reference(args)[0])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_confidence_with_huge_finite_weights(sim, weight_dtype):
    """Finite weights near float32's maximum overflow a float32 dot product (inf, or inf - inf =
    NaN); the CPU kernel and the reference sum in float64. The emulated CUDA kernel redoes such
    rows in float64: confidences in [0, 1], equal to the CPU's, also where the logit itself
    rounds to +-inf."""
    gen = torch.Generator().manual_seed(71)
    batch, block, vocab, rank, hidden_size = 3, 4, 37, 8, 40
    hidden = torch.randn(batch, block, hidden_size, generator=gen)
    # Logits of about -+3e37 (confidence 0 or 1) and beyond float32's range (-+inf), whatever
    # the order of the float64 sums.
    rows = torch.tensor([[1.0, 1.0, 1.0, 1.1], [1.0, 1.1, 1.0, 1.0], [1.0, 1.0, -1.0, -1.0],
                         [-1.0, -1.0, 1.0, 1.0]])
    hidden[..., :4] = rows[torch.arange(batch * block) % 4].reshape(batch, block, 4)
    prev = torch.randint(0, vocab, (batch, block), generator=gen)
    w1 = torch.randn(vocab, rank, generator=gen)
    weight = torch.randn(hidden_size + rank, generator=gen)
    weight[:4] = torch.tensor([3e38, 3e38, -3e38, -3e38])  # float32 partial sums overflow
    weight = weight.to(weight_dtype)
    w1 = w1.to(weight_dtype)
    got = sim.draft_confidence(hidden, prev, w1, weight)
    cpu = dspark_ops.draft_confidence(hidden, prev, w1, weight)
    want = reference.draft_confidence(hidden, prev, w1, weight)
    assert not got.isnan().any() and bool(((got >= 0) & (got <= 1)).all())
    assert torch.equal(got, cpu) and torch.equal(got, want)
    assert set(got.flatten().tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("logits_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_filtered_row_without_finite_logit_is_stored_as_minus_inf(sim, logits_dtype, which):
    """All-NaN base logits: with a sampling filter on, the row is stored as every filtered row
    is, non-finite values as -inf (the CPU kernel and the reference), token 0."""
    gen = torch.Generator().manual_seed(72)
    batch, block, vocab, rank = 2, 2, 40, 8
    base = torch.randn(batch, block, vocab, generator=gen)
    base[0, 1] = float("nan")
    base[1, 0] = float("nan")
    anchor = torch.randint(0, vocab, (batch,), generator=gen)
    w1, w2 = torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen)
    temperature, seed = torch.tensor([1.0, 0.0]), torch.tensor([5, 6])
    position = torch.tensor([10, 20])
    filters = {"top_k": torch.tensor([3, 3], dtype=torch.int32),
               "top_p": torch.tensor([0.5, 0.5]), "min_p": torch.tensor([0.1, 0.1])}
    kw = {which: filters[which]}
    args = (base, anchor, w1, w2, temperature, seed, position, kw.get("top_k"), kw.get("top_p"),
            kw.get("min_p"), logits_dtype)
    got = sim.markov_draft(*args)
    cpu = torch.ops.dspark_ops.markov_draft(*args)
    want = reference.markov_draft(*args[:7], draft_logits_dtype=logits_dtype, **kw)
    assert got[1][0, 1].float().isneginf().all() and got[1][1, 0].float().isneginf().all()
    assert torch.equal(got[0], cpu[0]) and torch.equal(got[0], want.tokens)
    assert torch.equal(got[1].float().isneginf(), want.draft_logits.float().isneginf())


# --------------------------------------------------------------------------------------------
# Vocabulary tails (cases/tails.py): the winner at V - 1 and at every tile boundary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("vocab", DRAFT_VOCABS)
def test_boundary_ids_are_drafted(sim, vocab, head, kind):
    """V one past a warp tile, a block tile, a CPU chunk: every slot drafts its request's
    boundary id (the first and last of every block tile and of some warp tiles, and V - 1):
    the sampled and greedy winner, or the only token the filter kernel keeps; the stored logits
    are the reference's."""
    case, filters, where = draft_tail_case(vocab, head, kind, seed=vocab)
    tokens, logits = case.call(sim, **filters)
    check_draft_tail(tokens, logits, case, filters, where)


@pytest.mark.parametrize("hidden_size", [CONFIDENCE_SEGMENT - 7, 5])
def test_confidence_reads_every_weight_segment_edge(sim, hidden_size):
    """The only nonzero confidence weight at each edge of the staged weight segments ([h; W1[x]]
    one id past a segment, the W1 part from W1's last row), or inside a short vector."""
    for hidden, prev, w1, weight in confidence_tail_cases(hidden_size, 8, 37):
        got = sim.draft_confidence(hidden, prev, w1, weight)
        want = reference.draft_confidence(hidden, prev, w1, weight)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert (got != 0.5).all()


# --------------------------------------------------------------------------------------------
# Head sums that overflow float32 (huge finite weights): summed again in float64
# --------------------------------------------------------------------------------------------


def huge_head_case(head: str, weights: str, seed: int) -> DraftCase:
    """Two thirds of W2's rows start with two weights of -3e38 against bias inputs of 1 there
    (W1's rows, or tanh(20) = 1 from the RNN head's bias), and their base logits are 3.4e38: the
    float64 bias (about -6e38) plus the base is a finite z near -2.6e38, while the float32 sum
    overflows to -inf in any order (the bias itself is beyond float32's range). Every slot's bias
    input has that prefix, whichever token was drafted; the other rows are ordinary and win."""
    batch, block, vocab, rank = 5, 3, 100, 8
    case = make_case(batch, block, vocab, rank, seed=seed, head=head, weights=weights,
                     temperature="mixed")
    dtype = case.w2.dtype
    huge = torch.arange(vocab) % 3 != 0
    w2 = case.w2.float().clone()
    w2[huge, :2] = -3e38
    base = case.base_logits.clone()
    base[..., huge] = 3.4e38
    changes = dict(w2=w2.to(dtype), base_logits=base)
    if head == "markov":
        w1 = case.w1.float().clone()
        w1[:, :2] = 1.0
        changes["w1"] = w1.to(dtype)
    else:
        joint_weight, joint_bias = case.joint_weight.clone(), case.joint_bias.clone()
        joint_weight[2 * rank:2 * rank + 2] = 0  # o_k = 20 exactly: tanh(o_k) = 1
        joint_bias[2 * rank:2 * rank + 2] = 20.0
        changes.update(joint_weight=joint_weight, joint_bias=joint_bias)
    return case.replace(**changes)


@pytest.mark.parametrize("weights", ["f32", "bf16"])
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_overflowing_head_sums_are_summed_again_in_float64(sim, head, weights):
    """Finite weights whose float32 head sums overflow: the emulated kernel stores the float64
    head's finite z (within float32 rounding of the reference, and the CPU kernel's, which falls
    back to float64 there too) and drafts the reference's tokens, where a float32-only head
    stores +-inf or NaN."""
    case = huge_head_case(head, weights, stable_seed("huge-head", head, weights))
    want = case.call(reference)
    assert torch.isfinite(want.draft_logits).all()
    got = run_sim(sim, case)
    check_output_contract(case, got)
    assert torch.isfinite(got.draft_logits).all(), "a float32 sum that overflowed was stored"
    # Relative to the huge values, and the ordinary rows' float32 rounding.
    tol = dict(rtol=1e-5, atol=1e-3)
    assert_same_drafts(case, got, want, tol, "the reference")
    assert_same_drafts(case, got, case.call(), tol, "the CPU kernel")


@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_overflowing_rnn_joint_sums_are_summed_again_in_float64(sim, weights):
    """Every other row of J (gates, candidates, outputs) reads only W1[x]'s first four columns,
    with weights +3e38, +3e38, -3e38, -3e38 against 1s: exactly 0 in float64 whatever the order
    (so the row is its bias; a term of ordinary size beside them would be lost to the float64
    rounding of 3e38, differently in every order), while float32 partial sums reach +inf and
    -inf (their sum NaN) or one of them, which would make the gates, the state and tanh(o) NaN
    or saturated. The emulated head kernels redo such rows in float64: the drafts and logits
    are the reference's and the CPU kernel's."""
    rank = 8
    case = make_case(5, 3, 100, rank, seed=stable_seed("huge-joint", weights), head="rnn",
                     weights=weights, temperature="mixed")
    dtype = case.w1.dtype
    joint_weight, w1 = case.joint_weight.float().clone(), case.w1.float().clone()
    joint_weight[::2] = 0
    joint_weight[::2, rank:rank + 4] = torch.tensor([3e38, 3e38, -3e38, -3e38])
    w1[:, :4] = 1.0
    case = case.replace(joint_weight=joint_weight.to(dtype), w1=w1.to(dtype))
    want = case.call(reference)
    assert torch.isfinite(want.draft_logits).all()
    got = run_sim(sim, case)
    check_output_contract(case, got)
    assert torch.isfinite(got.draft_logits).all()
    tol = sim_tolerance(case, want.draft_logits)
    assert_same_drafts(case, got, want, tol, "the reference")
    assert_same_drafts(case, got, case.call(), tol, "the CPU kernel")
