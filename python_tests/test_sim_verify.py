"""The verify family's CUDA entry point, launchers and kernels (csrc/cuda/verify_cuda.cpp,
verify_launch.cu, csrc/kernels/verify.cuh, reduce.cuh) run in the SIMT emulator, against the CPU
kernel and dspark_ops.reference.

The rule is the one test_verify.py applies to CUDA: tokens, num_accepted and valid equal the CPU
kernel's and the reference's exactly (the sums are merged in another order, but every case here is
away from float near-ties, as the CUDA tests' are).

Covered: vocabulary tails (V = 1, 2, 17, 100, 8193; 40000, whose chunks are long enough for the
statistics loop's two-group vector path), G = 1, 7, 32, B = 1 and odd, several
vocabulary chunks per request (V = 8193 at small B: 9 chunks, so the last-block merges of the row
statistics and of the race and the arrival counters run), padded [B, G+1, V] and ragged
``target_start`` layouts (shuffled, junk rows, shared rows, stride-0 draft broadcast), rows whose
start is not 16-byte aligned (odd V in 16-bit types, f32 V = 17 / 8193, rows offset by one
element, padded slices: the scalar loads) against aligned rows (the 16-byte vector loads), every
(target, draft) dtype pair (all 18 kernel instantiations), int32 and int64 draft ids, one-hot
drafts and draft logits, draft temperatures other than T and greedy ones, early rejection, full
acceptance with the bonus row, greedy and sampled requests in one call, NaN and +-inf logits, rows
without a finite logit (target and draft) or with one in a single chunk, num_draft = 0, the
residual-mass fallback (race over p), the grid plan depending on V only (the same chunks on the
emulated H200, A100 and L4 and at every B, checked through the workspace size the glue
allocates) and a request's outputs, logprobs included, bitwise the same alone and inside a batch
of 200. Planted faults (a dropped
barrier in block_reduce, shuffle_off_by_one) are shown to be caught.

Sampling filters and logprobs (kernels/filter.cuh): top_k, top_p, min_p per request (some off)
and allowed-token masks, alone and together, at V = 17, 100, 300, 8193 (masks ending inside a
32-bit word; 9 chunks per request at B <= 3, so the decider block's radix descent runs over the
whole row), B = 1 and odd, G = 1 and 7, every logit dtype, int32 and int64 draft ids, one-hot
drafts and draft logits, padded and ragged layouts with the mask rows following the target rows,
rows one element past a 16-byte boundary, logprobs (within 1e-5 of the CPU kernel and the
reference) including greedy requests (T = 1), literal outcomes (a draft the mask excludes,
a row that allows nothing, one-token rows, top_k = 1, unneeded NaN rows and zero mask rows
after a rejection), the unchecked garbage filter values (negative or huge top_k, NaN / +-inf /
out-of-range top_p and min_p) and a dropped barrier in the descent shown to be caught.

Values the CUDA glue does not check (out-of-range draft ids, num_draft outside [0, G],
target_start outside the rows) reach the kernels as on CUDA without DSPARK_OPS_DEBUG.

Not reachable here: the emulator runs blocks one at a time, so a block never streams a row while
another decides an earlier one of its request: the polling of the published rejection (abandoning
a row part-way) never fires. The emulator runs the grid's blocks in a seeded random order, so rows past a
rejection are sometimes decided in full (and ignored) and sometimes skipped by some of their
blocks, which leaves their arrival counters part-way for the emit kernel to return to zero
(test_counters_are_back_to_zero_after_every_call).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

import emulator
from bench.static.plans import parse_records
from conftest import non_contiguous
from dspark_ops import reference
from cases.common import INF, NAN, generator, is_greedy, stable_seed
from cases.tails import VERIFY_KINDS, VERIFY_VOCABS, check_verify_tail, verify_tail_case
from cases.verify import (
    BAD_ROWS,
    assert_same_outputs,
    Case,
    certain_accepts,
    check_output_contract,
    distinct_tokens,
    finite_or_neg_inf,
    first_rows,
    greedy_expectation,
    make_case,
    num_draft_zero_case,
    one_hot_logits,
    padded_rows,
    peaky_logits,
    sample_drafts,
    to_ragged,
    with_non_finite_logits,
)
from cases.verify_filters import (
    check_logprob_contract,
    Filters,
    KINDS,
    LOGPROB_TOLERANCE,
    NO_FILTERS,
    pack_mask,
    random_filters,
    to_ragged_with_mask,
)

pytestmark = pytest.mark.sim

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
I32, I64 = torch.int32, torch.int64
CUDA_TYPE = {F32: "float", BF16: "__nv_bfloat16", F16: "__half"}


# --------------------------------------------------------------------------------------------
# Running and comparing
# --------------------------------------------------------------------------------------------


def _positional(op):
    def call(target, drafts, n, temperature, seed, position, *, draft_logits=None,
             target_start=None, draft_temperature=None):
        return reference.VerifyOutput(*op(target, drafts, n, temperature, seed, position,
                                          draft_logits, target_start, draft_temperature))
    return call


def check(sim, case: Case, *, cpu: bool = True) -> reference.VerifyOutput:
    """Runs the emulated CUDA op; checks the output contract and exact equality with the
    reference and (unless ``cpu`` is False) the CPU kernel. Returns the emulated outputs."""
    got = case.call(_positional(sim.verify))
    check_output_contract(case, got)
    assert_same_outputs(got, case.call(reference.verify), case)
    if cpu:
        assert_same_outputs(got, case.call(_positional(torch.ops.dspark_ops.verify)), case)
    return got


def randoms(batch: int, gen: torch.Generator):
    """Seeds and positions (the latter across the 2^32 boundary of the counter words)."""
    return (torch.randint(-(2**62), 2**62, (batch,), generator=gen),
            torch.randint(0, 2**33, (batch,), generator=gen))


# --------------------------------------------------------------------------------------------
# The grid plan (kernels/verify.cuh verify_num_chunks): C = min(16, ceil(V / 1024)) chunks of a
# multiple of 16 elements, whatever B and the GPU
# --------------------------------------------------------------------------------------------


def expected_chunks(vocab: int) -> int:
    wanted = min(16, -(-vocab // 1024))
    chunk = -(-(-(-vocab // wanted)) // 16) * 16
    return -(-vocab // chunk)


def workspace_bytes(batch: int, block: int, chunks: int) -> int:
    """RowPartial (24 bytes) [B, G+1, C], RowResult (40: two SoftmaxStats, the decision and the
    FilterResult) [B, G+1], RacePartial (12) [B, C]."""
    r16 = lambda n: (n + 15) // 16 * 16  # noqa: E731
    rows = batch * (block + 1)
    return r16(24 * rows * chunks) + r16(40 * rows) + r16(12 * batch * chunks)


def observed_workspace(run) -> int:
    """Bytes of the uint8 workspace the op allocates while ``run`` runs (the grid plan's C)."""
    import torch.autograd.profiler as profiler

    with profiler.profile(use_kineto=False, record_shapes=True) as prof:
        run()
    sizes = [e.concrete_inputs[0] for e in prof.function_events
             if e.name == "aten::empty" and len(e.concrete_inputs) > 1
             and e.concrete_inputs[1] == 0]  # dtype code 0: torch.uint8
    assert sizes, "no workspace allocation seen"
    return int(sizes[-1][0])


# --------------------------------------------------------------------------------------------
# Shapes, modes and draft kinds
# --------------------------------------------------------------------------------------------

# (id, B, G, V, temperature, draft, target dtype, draft dtype, draft temperature, ids dtype)
SHAPES = [
    ("B1-G1-V1", 1, 1, 1, "sampled", "onehot", F32, None, None, I64),
    ("B3-G7-V2", 3, 7, 2, "mixed", "logits", F32, None, None, I64),
    ("B5-G32-V17-i32", 5, 32, 17, "mixed", "logits", F32, None, None, I32),
    ("B3-G7-V100-bf16", 3, 7, 100, "sampled", "onehot", BF16, None, None, I64),
    ("B9-G7-V100-f16", 9, 7, 100, "mixed", "logits", F16, None, "sampled", I32),
    ("B1-G7-V8193", 1, 7, 8193, "sampled", "logits", F32, None, None, I64),
    ("B1-G32-V8193-greedy", 1, 32, 8193, "greedy", "onehot", BF16, None, None, I64),
    ("B3-G7-V8193-f16-bf16", 3, 7, 8193, "mixed", "logits", F16, BF16, "sampled", I64),
    ("B7-G1-V8193-bf16-f32", 7, 1, 8193, "mixed", "logits", BF16, F32, None, I32),
    # Chunks of 2512 elements: the statistics loop's two-group vector path (a chunk longer than
    # 2 x 256 threads x 8 elements) runs, for a 16-bit target and a float32 draft row.
    ("B2-G2-V40000-bf16-f32", 2, 2, 40000, "mixed", "logits", BF16, F32, None, I64),
]


@pytest.mark.parametrize("params", SHAPES, ids=[s[0] for s in SHAPES])
def test_matches_cpu_and_reference(sim, params):
    """Realistic cases (drafts sampled from noisy copies of the target): emulated CUDA equals the
    CPU kernel and the reference over the vocabulary tails, G, B, dtypes and draft kinds."""
    name, batch, block, vocab, temperature, draft, dtype, draft_dtype, td, ids = params
    case = make_case(batch, block, vocab, seed=stable_seed("sim", name), temperature=temperature,
                     draft=draft, dtype=dtype, draft_dtype=draft_dtype, draft_temperature=td,
                     token_dtype=ids)
    check(sim, case)


def test_outcomes_cover_rejection_and_bonus(sim):
    """Over one multi-chunk batch (9 chunks): an early rejection (row 0), a later one, full
    accepts (a bonus token), and greedy requests that follow the argmax rule literally."""
    batch, block, vocab = 7, 5, 8193
    case = make_case(batch, block, vocab, seed=301, temperature="mixed", noise=0.05,
                     num_draft=torch.tensor([5, 5, 3, 5, 4, 5, 2]))
    # Forced rejections: request 0 at row 0, request 1 at row 2 (p(draft) = 0 there).
    target = case.target_logits.clone()
    for b, j in ((0, 0), (1, 2)):
        target[b, j, case.draft_tokens[b, j]] = -INF
    case.target_logits = target
    out = check(sim, case)
    accepted, n = out.num_accepted.long(), case.num_draft.long()
    assert (accepted == 0).any() and ((accepted > 0) & (accepted < n)).any()
    assert (accepted == n).any()
    greedy = is_greedy(case.temperature)
    assert greedy.any() and (~greedy).any()
    want_accepted, want_token = greedy_expectation(padded_rows(case), case.draft_tokens, n)
    emitted = out.tokens.gather(1, accepted[:, None])[:, 0]
    assert torch.equal(accepted[greedy], want_accepted[greedy])
    assert torch.equal(emitted[greedy], want_token[greedy])


def test_logit_dtype_pairs(sim):
    """Every (target, draft) dtype pair, with draft logits and one-hot drafts, at V = 3001
    (3 chunks; odd V leaves most 16-bit rows and 3 of 4 float32 rows unaligned): each of the 9
    instantiations of both kernels runs and agrees."""
    sim.clear_launch_log()
    for i, target_dtype in enumerate((F32, BF16, F16)):
        for k, draft_dtype in enumerate((F32, BF16, F16)):
            case = make_case(3, 2, 3001, seed=stable_seed("pairs", i, k), temperature="mixed",
                             dtype=target_dtype, draft_dtype=draft_dtype,
                             draft_temperature="sampled" if k == 1 else None)
            check(sim, case)
        check(sim, make_case(3, 2, 3001, seed=stable_seed("pairs", i), temperature="sampled",
                             dtype=target_dtype, draft="onehot"))
    launched = emulator.launches()
    for target_dtype in (F32, BF16, F16):
        for draft_dtype in (F32, BF16, F16):
            pair = f"<{CUDA_TYPE[target_dtype]}, {CUDA_TYPE[draft_dtype]}>"
            assert launched.get("verify_row_stats_kernel" + pair, 0) >= 1, (pair, launched)
            assert launched.get("verify_emit_kernel" + pair, 0) >= 1, (pair, launched)


@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_int32_and_int64_draft_ids(sim, draft):
    """int32 draft ids give exactly the int64 results (both agree with the references)."""
    case = make_case(5, 7, 1000, seed=stable_seed("ids", draft), temperature="mixed", draft=draft)
    wide = check(sim, case)
    narrow = check(sim, case.replace(draft_tokens=case.draft_tokens.int()))
    assert_same_outputs(narrow, wide, case)


# --------------------------------------------------------------------------------------------
# Layouts and alignment
# --------------------------------------------------------------------------------------------


def test_layouts(sim):
    """Padded [B, G+1, V] and ragged target_start (shuffled requests, junk and NaN rows between
    them) give the same results; shared rows (all requests at target_start 0) with a stride-0
    broadcast of the draft logits follow the references."""
    batch, block, vocab = 5, 5, 3000  # 3 chunks
    case = make_case(batch, block, vocab, seed=311, temperature="mixed")
    out = check(sim, case)
    ragged = to_ragged(case, generator(312))
    assert ragged.target_logits.shape[0] != batch * (block + 1)
    assert_same_outputs(check(sim, ragged), out, ragged)

    gen = generator(313)
    target = peaky_logits((block + 1,), vocab, gen)
    draft_row = target[:block] + 0.5 * torch.randn(block, vocab, generator=gen)
    temperature = torch.tensor([0.9, 0.0, 1.3, 0.7, 0.9])
    drafts = sample_drafts(draft_row.expand(batch, block, vocab), temperature, gen)
    shared = Case(target, drafts, torch.tensor([5, 3, 5, 0, 4], dtype=I32), temperature,
                  *randoms(batch, gen), draft_logits=draft_row.expand(batch, block, vocab),
                  target_start=torch.zeros(batch, dtype=I32))
    assert shared.draft_logits.stride(0) == 0
    got = check(sim, shared)
    assert (got.num_accepted > 0).any()


def offset_rows(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """The same values with every row starting ``elements`` elements past a 16-byte boundary
    (rows of V + 16 bytes' worth of elements, sliced from that element; the gaps hold NaN)."""
    per16 = 16 // t.element_size()
    storage = torch.full((*t.shape[:-1], t.shape[-1] + per16), NAN, dtype=t.dtype)
    out = storage[..., elements : t.shape[-1] + elements]
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_unaligned_rows_give_the_same_results(sim, dtype):
    """V = 1000: every contiguous row starts 16-byte aligned (the 16-byte vector loads of the
    statistics pass and of the race). Rows offset by one element (scalar loads) in the target,
    or the draft, and row-padded slices of both (conftest's layout: some rows aligned, most not)
    give the same results."""
    batch, block, vocab = 5, 4, 1000
    case = make_case(batch, block, vocab, seed=stable_seed("align", dtype), temperature="mixed",
                     dtype=dtype, draft_temperature="sampled")
    size = case.target_logits.element_size()
    assert (vocab * size) % 16 == 0 and case.target_logits.data_ptr() % 16 == 0
    out = check(sim, case)
    target, draft = offset_rows(case.target_logits), offset_rows(case.draft_logits)
    starts = lambda t: torch.tensor([t[b, j].data_ptr() % 16 for b in range(batch)  # noqa: E731
                                     for j in range(t.shape[1])])
    assert (starts(target) == size).all() and (starts(draft) == size).all()
    others = [case.replace(target_logits=target), case.replace(draft_logits=draft),
              case.replace(target_logits=non_contiguous(case.target_logits, "padded"),
                           draft_logits=non_contiguous(case.draft_logits, "padded"))]
    for other in others:
        assert_same_outputs(check(sim, other), out, other)
    onehot = case.replace(draft_logits=None)
    assert_same_outputs(check(sim, onehot.replace(target_logits=target)), check(sim, onehot),
                        onehot)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_rows_past_a_boundary_sum_bitwise_alike(sim, dtype):
    """Rows starting 1, 2, 5, 7 elements past a 16-byte boundary in 16-bit types (2, 4, 10, 14
    bytes), 1 .. 3 in float32: every word offset and both shifts of the race's re-cut 16-byte
    loads (the statistics pass loads such rows one element at a time), in the target, the draft
    or both, give bitwise the same tokens and logprobs as aligned rows (each
    thread sums the same elements in the same order), with a mask and filters too; V = 1000 and
    V = 3000 (3 chunks: chunk ends inside the row fall back to single loads)."""
    call = lambda c, **kw: c.call(_filtered(sim.verify), return_logprobs=True, **kw)  # noqa: E731
    for vocab in (1000, 3000):
        case = make_case(5, 3, vocab, seed=stable_seed("recut", dtype, vocab),
                         temperature="mixed", dtype=dtype)
        out = check(sim, case)
        base = call(case)
        per16 = 16 // case.target_logits.element_size()
        offsets = [1, 2, 3] if per16 == 4 else [1, 2, 5, 7]  # (word, half-word) offsets
        for elements in offsets:
            for which in ("target", "draft", "both") if elements == 1 else ("both",):
                changes = {}
                if which != "draft":
                    changes["target_logits"] = offset_rows(case.target_logits, elements)
                if which != "target":
                    changes["draft_logits"] = offset_rows(case.draft_logits, elements)
                other = case.replace(**changes)
                got = call(other)
                assert_same_outputs(got, base, other)
                assert torch.equal(got.logprobs, base.logprobs), (elements, which)
        assert_same_outputs(base, out, case)
        filters = dict(top_k=torch.tensor([0, 5, 40, 0, 3], dtype=I32),
                       top_p=torch.tensor([0.9, 1.0, 0.5, 0.8, 1.0]))
        shifted = case.replace(target_logits=offset_rows(case.target_logits, per16 - 1))
        a, b = call(shifted, **filters), call(case, **filters)
        assert_same_outputs(a, b, shifted)
        assert torch.equal(a.logprobs, b.logprobs)


def copies_made(run) -> int:
    """How many aten::copy_ calls ``run`` makes (a padded target reshaped by a copy shows here)."""
    import torch.autograd.profiler as profiler

    with profiler.profile(use_kineto=False) as prof:
        run()
    return sum(e.name == "aten::copy_" for e in prof.function_events)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_padded_slice_target_is_read_in_place(sim, dtype):
    """A padded target [B, G+1, V] sliced out of a wider [B, G+4, V + pad] buffer (requests
    unevenly spaced: no [R, V] view) is read through both strides without a copy, aligned and
    one element past a 16-byte boundary, with and without logprobs and a mask, and gives the
    contiguous target's results; on CPU the same input gives the same results."""
    batch, block, vocab = 5, 4, 3000
    case = make_case(batch, block, vocab, seed=stable_seed("slice", dtype), temperature="mixed",
                     dtype=dtype)
    out = check(sim, case)
    per16 = 16 // case.target_logits.element_size()
    for offset in (0, 1):
        wide = torch.full((batch, block + 4, vocab + 2 * per16), NAN, dtype=dtype)
        target = wide[:, 2 : block + 3, offset : offset + vocab]
        target.copy_(case.target_logits)
        assert target.stride(0) != (block + 1) * target.stride(1)
        sliced = case.replace(target_logits=target)
        got = {}
        assert copies_made(lambda: got.update(o=sliced.call(_positional(sim.verify)))) == 0
        assert_same_outputs(got["o"], out, sliced)
        assert_same_outputs(check(sim, sliced), out, sliced)
        full = lambda c, fn: c.call(_filtered(fn), return_logprobs=True)  # noqa: E731
        a, b = full(sliced, sim.verify), full(case, sim.verify)
        assert_same_outputs(a, b, sliced)
        assert torch.equal(a.logprobs, b.logprobs)


# --------------------------------------------------------------------------------------------
# Draft temperature, literal outcomes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_temperature", ["sampled", 0.0], ids=["random", "greedy"])
def test_draft_temperature(sim, draft_temperature):
    """A draft temperature other than T (random, or greedy: q one-hot on the draft argmax)
    changes the results, and the emulated op follows the references."""
    case = make_case(7, 5, 3000, seed=stable_seed("td", draft_temperature), temperature="sampled",
                     draft_temperature=draft_temperature, noise=0.7)
    out = check(sim, case)
    assert (out.num_accepted > 0).any()
    as_if_t = check(sim, case.replace(draft_temperature=None))
    differs = (as_if_t.tokens != out.tokens).any(1) | (as_if_t.num_accepted != out.num_accepted)
    assert differs.any()


def test_greedy_draft_rejects_non_argmax_drafts(sim):
    """T_d = 0: a draft that is not the draft argmax has q(x) = 0 and is rejected at once even
    where p(x) ~ 1."""
    batch, block, vocab = 5, 3, 3000
    case = make_case(batch, block, vocab, seed=321, temperature=1.0, draft_temperature=0.0,
                     num_draft=block)
    case.draft_tokens = (finite_or_neg_inf(case.draft_logits).argmax(-1) + 1) % vocab
    case.target_logits = case.target_logits.clone()
    rows, j = torch.arange(batch)[:, None], torch.arange(block)[None]
    case.target_logits[rows, j, case.draft_tokens] = 30.0
    out = check(sim, case)
    assert (out.num_accepted == 0).all() and out.valid.all()


@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_full_accept_and_forced_rejection(sim, draft):
    """p = q one-hot on the draft at every row: every draft is accepted and the bonus row's token
    is emitted. Requests with k >= 0 instead get a random row k where p(draft) = 0: rejected
    there (k = 0: the first row), with the correction from that row. Greedy and sampled
    requests share the call; V = 8193 spreads each row over 9 chunks."""
    batch, block, vocab = 5, 7, 8193
    gen = generator(stable_seed("accept", draft))
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    k = torch.tensor([-1, 0, 3, -1, 6])
    rows = torch.arange(batch)
    for b in (k >= 0).nonzero()[:, 0].tolist():
        target[b, k[b]] = peaky_logits((), vocab, gen)
        target[b, k[b], drafts[b, k[b]]] = -INF
    temperature = torch.tensor([0.8, 0.0, 1.1, 0.0, 0.6])
    case = Case(target, drafts, torch.full((batch,), block, dtype=I32), temperature,
                *randoms(batch, gen), draft_logits=draft_logits if draft == "logits" else None)
    out = check(sim, case)
    assert torch.equal(out.num_accepted.long(), torch.where(k >= 0, k, block))
    assert out.valid.all()
    full = k < 0
    assert torch.equal(out.tokens[full, :block], drafts[full])
    assert torch.equal(out.tokens[full, block], drafts[full, 0])  # the bonus row's only token
    rejected = ~full
    emitted = out.tokens[rows, k.clamp_min(0)][rejected]
    assert (emitted != drafts[rows, k.clamp_min(0)][rejected]).all()
    argmax = finite_or_neg_inf(target[rows, k.clamp_min(0)]).argmax(-1)
    greedy = is_greedy(temperature)
    assert torch.equal(out.tokens[rows, k.clamp_min(0)][rejected & greedy],
                       argmax[rejected & greedy])


def test_residual_without_mass_races_over_target(sim):
    """A rejected draft whose residual max(p - q, 0) has no mass: the token is drawn from p
    (the last block races over the whole row). (1) p == q (identical logits, 9 chunks) with a
    draft outside their support; (2) a greedy draft (T_d = 0) with argmax d, p one-hot on d and a
    draft x != d: the token is d."""
    batch, vocab = 3, 8193
    gen = generator(331)
    support = torch.rand(batch, vocab, generator=gen) < 0.1
    support[:, 0] = False
    logits = torch.where(support, torch.randn(batch, vocab, generator=gen), -INF)
    outside = (~support).float().multinomial(1, generator=gen)
    target = torch.stack([logits, torch.randn(batch, vocab, generator=gen)], 1)
    case = Case(target, outside, torch.ones(batch, dtype=I32), torch.tensor([1.0, 0.6, 1.7]),
                *randoms(batch, gen), draft_logits=logits[:, None].clone())
    out = check(sim, case)
    assert (out.num_accepted == 0).all() and out.valid.all()
    assert support.gather(1, out.tokens[:, :1]).all()
    # Not always the argmax: a draw from p, not the greedy token.
    more = case.replace(seed=case.seed + 1)
    tokens = torch.stack([out.tokens[:, 0], check(sim, more).tokens[:, 0]])
    assert (tokens != logits.argmax(-1)).any()

    d, x = distinct_tokens(2, vocab, gen, batch).unbind(1)
    target = one_hot_logits(d[:, None].expand(batch, 2), vocab, gen=gen)
    draft_logits = 3 * torch.randn(batch, 1, vocab, generator=gen)
    draft_logits[torch.arange(batch), 0, d] = 50.0
    case = Case(target, x[:, None], torch.ones(batch, dtype=I32), torch.ones(batch),
                *randoms(batch, gen), draft_logits=draft_logits,
                draft_temperature=torch.zeros(batch))
    out = check(sim, case)
    assert (out.num_accepted == 0).all() and out.valid.all()
    assert torch.equal(out.tokens[:, 0], d)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_num_draft_zero(sim, layout):
    """num_draft = 0: only row 0 is read (the others are NaN), the draft ids (garbage, out of
    range) are ignored."""
    batch, block, vocab = 5, 4, 8193
    case = num_draft_zero_case(batch, block, vocab, 341, layout)
    out = check(sim, case)
    assert (out.num_accepted == 0).all() and out.valid.all()
    greedy = is_greedy(case.temperature)
    argmax = finite_or_neg_inf(first_rows(case)).argmax(-1)
    assert torch.equal(out.tokens[:, 0][greedy], argmax[greedy])


# --------------------------------------------------------------------------------------------
# Non-finite logits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_non_finite_logits_are_never_emitted(sim, draft):
    """NaN and +-inf logits count as -inf (also at the drafts' own entries): never accepted,
    sampled or chosen as argmax; the vector and scalar loads both map them."""
    batch, block, vocab = 5, 7, 3000
    case = make_case(batch, block, vocab, seed=stable_seed("nonfinite", draft),
                     temperature="mixed", noise=0.3, dtype=BF16, draft_dtype=F32)
    case = with_non_finite_logits(case, generator(351), draft)
    out = check(sim, case)
    n = out.num_accepted.long()
    emitted = out.tokens.clamp_min(0)[..., None]
    finite = torch.isfinite(case.target_logits).gather(-1, emitted)[..., 0]
    assert finite[torch.arange(block + 1)[None] <= n[:, None]].all()
    assert out.valid.all()


@pytest.mark.parametrize("bad", list(BAD_ROWS))
def test_target_row_without_finite_logit(sim, bad):
    """Rows before k are certain accepts; row k (a draft row or the bonus row) has no finite
    logit in any of its 5 chunks: the op emits 0 there with valid = False."""
    batch, block, vocab = 5, 6, 4097
    gen = generator(stable_seed("badtarget", bad))
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    k = torch.tensor([0, 6, 3, 2, 5])
    n = torch.tensor([4, 6, 3, 6, 5], dtype=I32)
    target[torch.arange(batch), k] = BAD_ROWS[bad]((batch, vocab))
    temperature = torch.tensor([0.0, 0.9, 1.0, 0.0, 1.4])
    case = Case(target, drafts, n, temperature, *randoms(batch, gen),
                draft_logits=draft_logits if bad != "mixed" else None)
    out = check(sim, case)
    assert torch.equal(out.num_accepted.long(), k)
    assert (out.tokens[torch.arange(batch), k] == 0).all() and not out.valid.any()


def test_draft_row_without_finite_logit(sim):
    """A sampled request whose draft row k has no finite logit rejects there with valid = False
    and still emits an id in [0, V); greedy requests do not read the draft logits (5 chunks)."""
    batch, block, vocab = 5, 6, 4097
    gen = generator(361)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    k = torch.tensor([1, 0, 5, 2, 3])
    rows = torch.arange(batch)
    target[rows, k] = torch.randn(batch, vocab, generator=gen)
    draft_logits[rows, k] = torch.tensor([NAN, -INF, INF])[torch.arange(vocab) % 3]
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.2])
    case = Case(target, drafts, torch.full((batch,), block, dtype=I32), temperature,
                *randoms(batch, gen), draft_logits=draft_logits)
    out = check(sim, case)
    sampled = ~is_greedy(temperature)
    assert torch.equal(out.num_accepted[sampled].long(), k[sampled])
    assert not out.valid[sampled].any() and out.valid[~sampled].all()


def test_single_finite_logit_in_one_chunk(sim):
    """Rows whose only finite logit is at 0, in the middle, or at V - 1 (the last chunk's scalar
    tail): every other chunk's partial is empty (argmax -1) and the merge still finds it; greedy
    and sampled requests emit it."""
    batch, vocab = 6, 8193
    where = torch.tensor([0, vocab - 1, 4100, vocab - 1, 0, 913])
    target = one_hot_logits(where[:, None], vocab, value=-3.0)
    gen = generator(371)
    drafts = torch.where(torch.arange(batch) % 2 == 0, where, (where + 7) % vocab)[:, None]
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    case = Case(target.reshape(batch * 1, 1, vocab).expand(batch, 2, vocab).contiguous(), drafts,
                torch.ones(batch, dtype=I32), temperature, *randoms(batch, gen))
    out = check(sim, case)
    accepted = out.num_accepted.long()
    assert torch.equal(accepted, (torch.arange(batch) % 2 == 0).long())
    assert torch.equal(out.tokens[torch.arange(batch), accepted], where)


# --------------------------------------------------------------------------------------------
# Batch invariance: the grid plan depends on V alone
# --------------------------------------------------------------------------------------------


def test_grid_plan_depends_on_vocab_only(sim):
    """The same V gets the same chunks on every emulated device and at every B (seen in the
    workspace the glue sizes): B = 1 and B = 175 at V = 1025 (2 chunks) and V = 8193 (9) on the
    H200, the A100 and the L4, where a plan sized to one resident wave would vary with both.
    The emulator plans the launches without running them: the plan is all this looks at (the
    outputs' batch invariance: test_request_outputs_are_bitwise_batch_invariant)."""
    assert [expected_chunks(v) for v in (1, 1024, 1025, 8193, 16384, 50257, 151936)] == \
        [1, 1, 2, 9, 16, 16, 16]
    gen = generator(381)
    sim.set_plan_only(True)
    try:
        for vocab in (1025, 8193):
            for batch in (1, 175):
                case = Case(torch.randn(batch, vocab, generator=gen),
                            torch.zeros(batch, 0, dtype=I64), torch.zeros(batch, dtype=I32),
                            torch.zeros(batch), *randoms(batch, gen))
                for device in ("h200", "a100", "l4"):
                    with emulator.emulated_device(device):
                        seen = observed_workspace(lambda: case.call(_positional(sim.verify)))
                    assert seen == workspace_bytes(batch, 0, expected_chunks(vocab)), \
                        (vocab, batch, device)
    finally:
        sim.set_plan_only(False)


def ring_stages(sim, case: Case, **kwargs) -> list:
    """(the statistics kernel's ring stages, the emit kernel's shared memory: its race's ring)
    for ``case`` (planned only)."""
    sim.clear_launch_log()
    sim.set_plan_only(True)
    try:
        case.call(_filtered(sim.verify), **kwargs)
    finally:
        sim.set_plan_only(False)
    records = parse_records(sim.launch_records())
    (stats,) = [r for r in records if r["kernel"].startswith("verify_row_stats_kernel")]
    (emit,) = [r for r in records if r["kernel"].startswith("verify_emit_kernel")]
    return stats["fields"]["stages"], emit["shared"]


def test_ring_stages_follow_the_device(sim):
    """Both kernels stream their rows through per-thread rings of cp.async copies, as deep as a
    chunk needs while the kernel keeps the blocks per SM it is built for. At V = 151,936
    (9,504-element chunks) with a bf16 target and a float32 draft row: the statistics pass's three
    iterations take three stages on the emulated H200 (three blocks per SM) and A100 (two), the
    whole chunk in flight at once, and two on the L4 (the ring wraps), with filters too (their
    shared memory is the ring's, reused by the deciding block); the race's five iterations
    (12 KB a stage) take five stages on the H200, four on the A100 and two on the L4 (three blocks
    per SM). A float32 pair's chunk is two statistics iterations (two stages on the H200) and
    five race iterations (four stages of 16 KB). Chunks of one iteration (most other tests) take
    one stage. Sampled with top-k and top-p and logprobs: the same outputs on the three devices,
    bit for bit, and the CPU kernel's and the reference's."""
    vocab = 151936
    case = make_case(1, 2, vocab, seed=stable_seed("ring"), temperature="sampled",
                     dtype=BF16, draft_dtype=F32, noise=0.05)
    filters = Filters(top_k=torch.tensor([50], dtype=I32), top_p=torch.tensor([0.9]))
    race_stage = 256 * 8 * (2 + 4)
    outputs = {}
    for device, stages, race in (("h200", 3, 5), ("a100", 3, 4), ("l4", 2, 2)):
        with emulator.emulated_device(device):
            assert ring_stages(sim, case) == (stages, race * race_stage), device
            assert ring_stages(sim, case, **filters.kwargs()) == (stages, race * race_stage), \
                device
            outputs[device] = check_filtered(sim, case, filters)
    for device in ("a100", "l4"):
        for name in ("tokens", "num_accepted", "valid", "logprobs"):
            assert torch.equal(getattr(outputs[device], name), getattr(outputs["h200"], name)), \
                (device, name)
    f32 = make_case(1, 1, vocab, seed=stable_seed("ring-f32"), temperature="sampled",
                    dtype=F32, draft_dtype=F32)
    assert ring_stages(sim, f32) == (2, 4 * 256 * 8 * 8)
    check(sim, f32)


def _joined(case: Case, others: Case, order: torch.Tensor) -> Case:
    """``case``'s requests among ``others``', in ``order`` (padded layouts)."""
    both = Case(**{
        f.name: None if getattr(case, f.name) is None
        else torch.cat([getattr(case, f.name), getattr(others, f.name)])
        for f in dataclasses.fields(case)
    })
    return both.select(order)


@pytest.mark.parametrize("dtype, draft", [(F32, "logits"), (BF16, "onehot")])
def test_request_outputs_are_bitwise_batch_invariant(sim, dtype, draft):
    """A request verified alone and inside a batch of 200 (at V = 8193: 9 chunks either way; a
    plan sized to the batch would split its rows into 9 chunks alone and 5 in the batch) gets
    bitwise the same tokens, num_accepted, valid and logprobs (float sums merged in the same
    order), sampled and greedy: float32 targets with draft logits, bfloat16 with one-hot drafts
    (each 200-request batch is a long emulation; the plan is shared by both dtypes and kinds)."""
    block, vocab = 2, 8193
    call = lambda c, fn: c.call(_filtered(fn), return_logprobs=True)  # noqa: E731
    case = make_case(4, block, vocab, seed=stable_seed("invariant", draft, dtype),
                     temperature="mixed", draft=draft, dtype=dtype)
    others = make_case(196, block, vocab, seed=stable_seed("others", draft, dtype),
                       temperature="mixed", draft=draft, dtype=dtype)
    order = torch.randperm(200, generator=generator(383))
    big = call(_joined(case, others, order), sim.verify)
    where = {int(b): i for i, b in enumerate(order.tolist()) if b < 4}
    for b in range(4):
        alone = call(case.select(torch.tensor([b])), sim.verify)
        i = where[b]
        assert torch.equal(alone.tokens[0], big.tokens[i]), (draft, b)
        assert int(alone.num_accepted[0]) == int(big.num_accepted[i]), (draft, b)
        assert bool(alone.valid[0]) == bool(big.valid[i]), (draft, b)
        assert torch.equal(alone.logprobs[0], big.logprobs[i]), (draft, b, alone.logprobs,
                                                                 big.logprobs[i])
    check(sim, case)


def _all_accepted(batch: int, block: int, vocab: int, gen: torch.Generator) -> Case:
    """Every draft accepted (one-hot p = q), then a bonus row drawn from a peaked distribution."""
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    target[:, block] = peaky_logits((batch,), vocab, gen)
    return Case(target, drafts, torch.full((batch,), block, dtype=I32), torch.ones(batch),
                *randoms(batch, gen), draft_logits=draft_logits)


def test_counters_are_back_to_zero_after_every_call(sim):
    """The kernels' counters (row arrivals, rejection marks, race claims and arrivals) live in one
    buffer per stream that is not filled between calls: every call returns each counter it
    touches to zero. Calls of several shapes (9 chunks and 1; rejections at various rows, every
    draft accepted, greedy and sampled, a target row without a finite logit) run once against
    the CPU kernel, then again in three shuffled orders, and give bitwise the same outputs every
    time: a counter left set would make a later call decide a row early or never, or race a
    chunk twice."""
    cases = [
        make_case(3, 7, 8193, seed=stable_seed("counters", 0), temperature="mixed"),
        make_case(5, 2, 100, seed=stable_seed("counters", 1), draft="onehot"),
        _all_accepted(4, 3, 8193, generator(stable_seed("counters", 2))),
        make_case(6, 1, 8193, seed=stable_seed("counters", 3), temperature="greedy"),
        make_case(2, 5, 3000, seed=stable_seed("counters", 4), dtype=BF16),
    ]
    cases[4].target_logits[1, 0] = NAN  # request 1: its first row has no finite logit
    first = [check(sim, case) for case in cases]
    assert int(first[2].num_accepted.min()) == 3  # the bonus rows were raced
    assert not bool(first[4].valid[1])
    for round_ in range(3):
        for i in torch.randperm(len(cases), generator=generator(397 + round_)).tolist():
            again = cases[i].call(_positional(sim.verify))
            assert torch.equal(again.tokens, first[i].tokens), (round_, i)
            assert torch.equal(again.num_accepted, first[i].num_accepted), (round_, i)
            assert torch.equal(again.valid, first[i].valid), (round_, i)


# --------------------------------------------------------------------------------------------
# Values the CUDA glue does not check (without DSPARK_OPS_DEBUG)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["draft-ids", "num_draft", "target_start"])
def test_unchecked_values(sim, what):
    """Without DSPARK_OPS_DEBUG the CUDA glue does not check values (nor does the sim build,
    csrc/common/checks.cpp): out-of-range draft ids, also as int32, are rejected at their row
    (never an address) with valid = False, as the reference says; num_draft is clamped to
    [0, G]; a target_start whose rows fall outside target_logits (past the end, negative) makes
    the first missing row target-invalid (token 0, valid = False)."""
    if os.environ.get("DSPARK_OPS_DEBUG", "") not in ("", "0"):
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    batch, block, vocab = 5, 6, 8193
    if what == "draft-ids":
        case = make_case(batch, block, vocab, seed=391, temperature="mixed", num_draft=block)
        junk = torch.tensor([[-1, 8193, 2**40, -(2**40), 7, 7]])
        case.draft_tokens = torch.where(torch.eye(batch, block, dtype=torch.bool), junk[:, :1],
                                        case.draft_tokens)
        case.draft_tokens[1, 2], case.draft_tokens[3, 0] = vocab, 2**40
        out = check(sim, case, cpu=False)
        assert not out.valid.all()
        narrow = case.replace(draft_tokens=case.draft_tokens.clamp(-(2**31), 2**31 - 1).int())
        assert_same_outputs(check(sim, narrow, cpu=False), out, case)
    elif what == "num_draft":
        case = make_case(batch, block, vocab, seed=392, temperature="mixed")
        wild = torch.tensor([7, -1, 2**30, -(2**31), 3], dtype=I32)
        got = case.replace(num_draft=wild).call(_positional(sim.verify))
        clamped = case.replace(num_draft=wild.clamp(0, block))
        assert_same_outputs(got, check(sim, clamped), clamped)
    else:
        gen = generator(393)
        drafts, target, _ = certain_accepts(batch, block, vocab, gen)
        flat = target.reshape(-1, vocab)
        rows = flat.shape[0]
        # Request 0 starts at the last two rows (request 4's rows 5 and 6, one-hot on its drafts
        # 5 and 0), with drafts that they accept: its row 2 is past the end. Requests 1-3 start
        # outside; request 4 at its own rows.
        drafts[0, :2] = torch.stack([drafts[4, 5], drafts[4, 0]])
        start = torch.tensor([rows - 2, rows, -1, -(2**31), 4 * (block + 1)], dtype=I32)
        case = Case(flat, drafts, torch.full((batch,), block, dtype=I32),
                    torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5]), *randoms(batch, gen),
                    target_start=start)
        got = case.call(_positional(sim.verify))
        check_output_contract(case, got)
        assert got.num_accepted.tolist() == [2, 0, 0, 0, block]
        assert got.valid.tolist() == [False, False, False, False, True]
        assert got.tokens[torch.arange(4), got.num_accepted[:4].long()].tolist() == [0, 0, 0, 0]
        assert torch.equal(got.tokens[4, :block], drafts[4])


# --------------------------------------------------------------------------------------------
# The comparison catches broken kernels
# --------------------------------------------------------------------------------------------


def _warp_one_case() -> Case:
    """Greedy requests whose drafts are every row's argmax (all accepted, then the bonus row),
    where each row's argmax lies in chunk offsets [512, 912) of one of the 9 chunks: threads 32-56,
    i.e. warp 1, whose partial reaches the block's result only through block_reduce's shared
    scratch (second level, lane 1). The boosted maxima are distinct and grow with the row, so a
    stale slot (an earlier row's or another block's) never holds a row's true maximum."""
    batch, block, vocab = 3, 7, 8193
    gen = generator(401)
    target = torch.randn(batch, block + 1, vocab, generator=gen)
    chunk = 912  # ceil(ceil(8193 / 9) / 16) * 16
    c = torch.randint(0, 9, (batch, block + 1), generator=gen)
    offset = torch.randint(512, 897, (batch, block + 1), generator=gen)  # the last chunk has 897
    where = c * chunk + offset
    boost = 10.0 + torch.arange(block + 1).float() + torch.arange(batch)[:, None] * (block + 1)
    target.scatter_(-1, where[..., None], boost[..., None].expand(batch, block + 1, 1).clone())
    assert torch.equal(target.argmax(-1), where)
    return Case(target, where[:, :block].clone(), torch.full((batch,), block, dtype=I32),
                torch.zeros(batch), *randoms(batch, gen))


@pytest.mark.parametrize("fault", ["drop_barrier", "shuffle_off_by_one"])
def test_planted_faults_are_caught(sim, fault):
    """The case passes clean; with block_reduce's first barrier dropped (warp 0 may read the
    scratch slots before the other warps write them) or with every shuffle reading the next lane
    (lane 1 never reaches lane 0), the comparison fails."""
    case = _warp_one_case()
    out = check(sim, case)
    assert (out.num_accepted == case.num_draft).all()
    plant = fault
    if fault == "drop_barrier":
        plant = "drop_barrier:" + emulator.barrier_site("reduce.cuh", "T block_reduce(")
    with emulator.planted(plant):
        how = emulator.caught(lambda: check(sim, case))
    assert how, f"{plant} was not caught"


# --------------------------------------------------------------------------------------------
# Sampling filters and logprobs (kernels/filter.cuh: the decider block's radix descent)
# --------------------------------------------------------------------------------------------


def _filtered(op):
    """``op`` (a torch.ops verify) called with the full positional schema."""
    def call(target, drafts, n, temperature, seed, position, *, draft_logits=None,
             target_start=None, draft_temperature=None, top_k=None, top_p=None, min_p=None,
             allowed_token_mask=None, return_logprobs=False):
        tokens, accepted, valid, logprobs = op(
            target, drafts, n, temperature, seed, position, draft_logits, target_start,
            draft_temperature, top_k, top_p, min_p, allowed_token_mask, return_logprobs)
        assert logprobs.shape == (drafts.shape[0], drafts.shape[1] + 1 if return_logprobs else 0)
        return reference.VerifyOutput(tokens, accepted, valid,
                                      logprobs if return_logprobs else None)
    return call


def check_filtered(sim, case: Case, filters: Filters, *, cpu: bool = True):
    """The emulated op with filters and logprobs: output contracts, exact tokens, num_accepted
    and valid against the reference and (unless ``cpu`` is False) the CPU kernel, logprobs
    within 1e-5 of both and of the processed distribution spelt out."""
    call = lambda fn: case.call(fn, **filters.kwargs(), return_logprobs=True)  # noqa: E731
    got = call(_filtered(sim.verify))
    check_output_contract(case, got)
    expected = call(reference.verify)
    assert_same_outputs(got, expected, case)
    torch.testing.assert_close(got.logprobs, expected.logprobs, **LOGPROB_TOLERANCE)
    check_logprob_contract(case, filters, got)
    if cpu:
        on_cpu = call(_filtered(torch.ops.dspark_ops.verify))
        assert_same_outputs(got, on_cpu, case)
        torch.testing.assert_close(got.logprobs, on_cpu.logprobs, **LOGPROB_TOLERANCE)
    return got


# (id, B, G, V, temperature, draft, target dtype, filter kinds, ids dtype). V = 8193 at B <= 3:
# 9 chunks per request, so the decider block's filter passes run over the whole row, past its
# own chunk; V = 17 / 100 / 300 / 8193 end inside a mask word.
FILTER_SHAPES = [
    ("B1-G7-V17-all-mask", 1, 7, 17, "sampled", "logits", F32, "all-mask", I64),
    ("B3-G1-V100-top_k-i32", 3, 1, 100, "mixed", "onehot", F32, "top_k", I32),
    ("B5-G7-V300-top_p-bf16", 5, 7, 300, "mixed", "logits", BF16, "top_p", I64),
    ("B7-G7-V300-min_p-mask-f16", 7, 7, 300, "mixed", "onehot", F16, "all-mask", I32),
    ("B1-G7-V8193-all-mask", 1, 7, 8193, "sampled", "logits", F32, "all-mask", I64),
    ("B3-G1-V8193-all-bf16", 3, 1, 8193, "mixed", "logits", BF16, "all", I32),
]


@pytest.mark.parametrize("params", FILTER_SHAPES, ids=[s[0] for s in FILTER_SHAPES])
def test_filters_match_cpu_and_reference(sim, params):
    """Per-request filter settings (some off) and masks: the emulated kernels equal the CPU
    kernel and the reference, logprobs included."""
    name, batch, block, vocab, temperature, draft, dtype, kind, ids = params
    case = make_case(batch, block, vocab, seed=stable_seed("sim-filter", name),
                     temperature=temperature, draft=draft, dtype=dtype, token_dtype=ids)
    filters = random_filters(case, KINDS[kind], generator(stable_seed("sim-settings", name)))
    if batch == 1:  # one request: make sure its filters are on
        filters = filters.replace(**{k: v for k, v in dict(
            top_k=torch.tensor([vocab // 3 + 1], dtype=I32), top_p=torch.tensor([0.9]),
            min_p=torch.tensor([0.02])).items() if getattr(filters, k) is not None})
    check_filtered(sim, case, filters)


def test_filter_candidate_counts(sim):
    """Over 9 chunks, thresholds whose candidates fit on chip (top_k = 50, min-p alone) and
    ones that do not (top_k = 4000, top-p alone over flat logits: thousands of tokens qualify,
    so the descent goes on over the row), side by side in one call."""
    batch, block, vocab = 4, 2, 8193
    gen = generator(561)
    case = make_case(batch, block, vocab, seed=562, temperature=1.0, num_draft=block)
    case.target_logits = torch.where(torch.arange(batch)[:, None, None] % 2 == 1,
                                     0.1 * torch.randn(batch, block + 1, vocab, generator=gen),
                                     case.target_logits)
    filters = Filters(top_k=torch.tensor([50, 0, 4000, 0], dtype=I32),
                      top_p=torch.tensor([1.0, 0.999, 0.9, 0.5]),
                      min_p=torch.tensor([0.0, 0.0, 0.0, 0.0]))
    check_filtered(sim, case, filters)
    check_filtered(sim, case, filters.replace(top_k=None, top_p=None,
                                              min_p=torch.tensor([0.3, 0.9, 0.01, 0.5])))


def test_filters_with_literal_outcomes(sim):
    """One call over 9 chunks: a request whose draft at row 2 the mask excludes (rejected there
    with the row after it NaN and its mask row zero: unneeded), one whose row 1 allows nothing
    (token 0, valid False, logprob -inf), one whose rows each allow a single token (every token
    it emits is that one, logprob 0), a greedy one with filters (the masked argmax), and one with
    top_k = 1 (its draft is accepted iff it is the argmax)."""
    batch, block, vocab = 5, 4, 8193
    gen = generator(501)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    allowed = torch.ones(batch, block + 1, vocab, dtype=torch.bool)
    target[0, 2] = peaky_logits((), vocab, gen)
    allowed[0, 2, drafts[0, 2]] = False
    target[0, 3:] = NAN
    allowed[0, 3:] = False
    allowed[1, 1] = False
    target[2] = peaky_logits((block + 1,), vocab, gen)
    only = torch.randint(0, vocab, (block + 1,), generator=gen)
    allowed[2] = torch.nn.functional.one_hot(only, vocab).bool()
    drafts[2] = torch.tensor([only[0], only[1], (only[2] + 1) % vocab, only[3]])
    draft_logits[2] = one_hot_logits(drafts[2], vocab, gen=gen)
    target[3] = peaky_logits((block + 1,), vocab, gen)
    target[4, 1] = peaky_logits((), vocab, gen)
    case = Case(target, drafts, torch.full((batch,), block, dtype=I32),
                torch.tensor([0.9, 1.0, 0.7, 0.0, 1.2]), *randoms(batch, gen),
                draft_logits=draft_logits)
    filters = Filters(top_k=torch.tensor([50, 0, 3, 20, 1], dtype=I32),
                      top_p=torch.tensor([0.9, 1.0, 0.5, 0.8, 1.0]),
                      min_p=torch.tensor([0.01, 0.0, 0.0, 0.1, 0.0]),
                      allowed_token_mask=pack_mask(allowed.reshape(-1, vocab), gen))
    out = check_filtered(sim, case, filters)
    assert out.num_accepted[:3].tolist() == [2, 1, 2] and out.valid.tolist() == [
        True, False, True, True, True]
    assert out.tokens[1, 1] == 0 and out.logprobs[1, 1] == -INF
    assert out.tokens[2, :3].tolist() == only[:3].tolist() and (out.logprobs[2, :3] == 0).all()
    greedy_accepted, greedy_token = greedy_expectation(target[3:4], drafts[3:4],
                                                       torch.tensor([block]))
    assert out.num_accepted[3] == greedy_accepted[0]
    assert out.tokens[3, greedy_accepted[0]] == greedy_token[0]
    argmax = finite_or_neg_inf(target[4, 1]).argmax()
    assert (out.num_accepted[4] > 1) == (drafts[4, 1] == argmax)
    assert out.tokens[4, 1] == argmax  # top_k = 1: the only token row 1 can emit


def test_filters_ragged_and_unaligned_masked_rows(sim):
    """A ragged layout (shuffled requests, junk rows with random mask words between them) and
    target rows that start one element past a 16-byte boundary (the scalar loads, and the mask
    words read for elements that are not at the row's start) give the padded results."""
    batch, block, vocab = 5, 4, 1000
    case = make_case(batch, block, vocab, seed=511, temperature="mixed", dtype=BF16)
    filters = random_filters(case, KINDS["all-mask"], generator(512))
    out = check_filtered(sim, case, filters)
    ragged, ragged_mask = to_ragged_with_mask(case, filters.allowed_token_mask, generator(513))
    got = check_filtered(sim, ragged, filters.replace(allowed_token_mask=ragged_mask))
    assert_same_outputs(got, out, ragged)
    assert torch.equal(got.logprobs, out.logprobs)
    shifted = case.replace(target_logits=offset_rows(case.target_logits))
    assert shifted.target_logits[0, 0].data_ptr() % 16 != 0
    got = check_filtered(sim, shifted, filters)
    assert_same_outputs(got, out, shifted)
    assert torch.equal(got.logprobs, out.logprobs)


def test_greedy_with_logprobs(sim):
    """Greedy requests, with and without filters: the tokens are the argmax rule's, the filters
    change only the logprobs (of the processed distribution at T = 1)."""
    batch, block, vocab = 3, 7, 3000
    case = make_case(batch, block, vocab, seed=521, temperature="greedy", num_draft=block)
    plain = check_filtered(sim, case, NO_FILTERS)
    filters = Filters(top_k=torch.tensor([5, 0, 40], dtype=I32),
                      top_p=torch.tensor([1.0, 0.6, 0.9]))
    filtered = check_filtered(sim, case, filters)
    assert_same_outputs(filtered, plain, case)
    emitted = plain.logprobs > -INF
    assert (filtered.logprobs[emitted] > plain.logprobs[emitted]).all()


def test_unchecked_filter_values(sim):
    """Without DSPARK_OPS_DEBUG the CUDA glue does not check the filter values; garbage is read
    as the reference reads it: top_k < 0 or >= V off, top_p NaN or >= 1 off, <= 0 the top tokens
    only, min_p NaN or <= 0 off, > 1 as 1. Nothing is read out of bounds (the emulator checks)."""
    if os.environ.get("DSPARK_OPS_DEBUG", "") not in ("", "0"):
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    batch, block, vocab = 9, 2, 300
    case = make_case(batch, block, vocab, seed=531, temperature="sampled", num_draft=block)
    filters = Filters(top_k=torch.tensor([-1, -(2**31), 300, 2**31 - 1, 0, 7, 1, -7, 299],
                                         dtype=I32),
                      top_p=torch.tensor([NAN, 1.5, -1.0, 0.0, INF, -INF, 1.0, 1e-30, 2.0]),
                      min_p=torch.tensor([NAN, -2.0, 3.0, INF, -INF, 0.0, 1.0, 1.5, -0.0]))
    out = check_filtered(sim, case, filters, cpu=False)
    # The top_k = 300 (= V) and INT32_MAX requests ran unfiltered top-k, as top_k = 0 does.
    same = check_filtered(sim, case, filters.replace(
        top_k=torch.where((filters.top_k < 0) | (filters.top_k >= vocab), 0, filters.top_k)),
        cpu=False)
    assert_same_outputs(same, out, case)


def test_planted_filter_fault_is_caught(sim):
    """The filter comparison can fail: with the barrier after the histogram clearing of the
    radix descent dropped (threads count into buckets other threads have not cleared yet), the
    same all-filters case over 9 chunks no longer matches. Whether the race bites depends on the
    thread interleaving, so four scheduling seeds are tried; the clean kernel passes under each."""
    batch = 3
    case = make_case(batch, 7, 8193, seed=543, temperature="sampled", num_draft=7)
    filters = Filters(top_k=torch.full((batch,), 2000, dtype=I32), top_p=torch.full((batch,), 0.9),
                      min_p=torch.full((batch,), 0.02))
    site = emulator.barrier_site("filter.cuh", "sh.weight[")  # after clearing the histogram
    caught = []
    for schedule in range(4):
        sim.set_seed(550 + schedule)
        check_filtered(sim, case, filters, cpu=False)
        with emulator.planted("drop_barrier:" + site):
            caught.append(emulator.caught(lambda: check_filtered(sim, case, filters, cpu=False)))
    assert any(caught), f"drop_barrier:{site} was not caught"


def test_extreme_position_without_value_checks(sim):
    """position = 2^63 - 1 is refused on CPU; on CUDA without DSPARK_OPS_DEBUG=1 the rows draw
    from p0 + 1 + j modulo 2^64 (no signed overflow: the asan flavour's UBSan checks it), the
    streams the reference's int64 arithmetic gives."""
    from fuzz.ops import BY_NAME

    spec = BY_NAME["verify"]
    for seed in (0, 3):  # one-hot and distribution proposals
        args = spec.build(seed)
        args["position"][1] = 2**63 - 1
        args["position"][2] = 2**63 - 3
        got = sim.verify(*args.values())
        assert spec.compare(args, got, spec.reference(args)) is None


@pytest.mark.parametrize("vocab", [37, 1025, 8193])
def test_last_vocabulary_id_wins_the_race(sim, vocab):
    """The race's chunks must reach id V - 1: nearly all the mass on the last id, for the bonus
    row (num_draft = 0) and for the resampling after a rejected draft, sampled and greedy; the
    last chunk holds few ids at V = 1025 and 8193. The other ids keep ~1e-5 of the mass, above
    the race's residual floor: with all of it on V - 1, a race that missed it would fall back to
    racing the whole row and hide the miss (the one-hot drafts' rows; a draft distribution
    leaves no residual mass outside V - 1, so those rows always take that fallback)."""
    gen = torch.Generator().manual_seed(81)
    batch, block = 4, 2
    target = torch.randn(batch, block + 1, vocab, generator=gen)
    target[..., -1] = math.log(vocab) + 12.0
    drafts = torch.zeros(batch, block, dtype=torch.int64)  # id 0: rejected (p ~ 0)
    num_draft = torch.tensor([0, 1, 2, 0], dtype=torch.int32)
    temperature = torch.tensor([1.0, 0.7, 0.0, 0.0])
    seed = torch.arange(batch) + 11
    position = torch.arange(batch) * 100
    for draft_logits in (None, torch.randn(batch, block, vocab, generator=gen)):
        args = (target, drafts, num_draft, temperature, seed, position, draft_logits)
        got = sim.verify(*args)
        want = reference.verify(*args[:6], draft_logits=draft_logits)
        assert got[0][:, 0].tolist() == [vocab - 1] * batch
        assert torch.equal(got[0], want.tokens) and torch.equal(got[1], want.num_accepted)


@pytest.mark.parametrize("kind", VERIFY_KINDS)
@pytest.mark.parametrize("vocab", VERIFY_VOCABS)
def test_boundary_ids_are_emitted(sim, vocab, kind):
    """Each chunk's first and last id and V - 1 (V one past a CPU block; the CUDA plan's last
    chunk then ends one id past a 16-id group): the race's winner (over the statistics kernel's
    and the emit kernel's chunks), the statistics' maximum and the only token the filters or
    the mask keep are emitted, with the reference's logprobs."""
    args, where = verify_tail_case(vocab, kind, seed=vocab)
    check_verify_tail(sim.verify, args, where)


# --------------------------------------------------------------------------------------------
# Rows decided independently, and top-k's per-chunk candidates (kernels/verify.cuh)
# --------------------------------------------------------------------------------------------


def _rejections_case(batch: int, block: int, vocab: int, seed: int) -> Case:
    """Greedy requests whose drafts are wrong (never the argmax, so rejected) at several rows:
    request b's drafts are right before row b % block and wrong at it and at every other row
    after it, so its first rejection is row b % block and later rows reject too."""
    gen = generator(seed)
    target = peaky_logits((batch, block + 1), vocab, gen)
    argmax = target.argmax(-1)[:, :block]
    first = torch.arange(batch) % block
    wrong = (torch.arange(block)[None, :] >= first[:, None]) & (
        torch.rand(batch, block, generator=gen) < 0.7)
    wrong[torch.arange(batch), first] = True
    drafts = torch.where(wrong, (argmax + 1) % vocab, argmax)
    return Case(target, drafts, torch.full((batch,), block, dtype=I32), torch.zeros(batch),
                *randoms(batch, gen))


def test_first_rejection_is_the_minimum_over_rejected_rows(sim):
    """Blocks that read the rejection mark before any row is decided (as blocks running at once
    may: "polls_see_launch_start") skip nothing, so every row of a request is decided and several
    reject in any order: the mark must keep the earliest (an atomic maximum of G + 1 - j). A
    plain store of the mark keeps whichever rejection was decided last, and the outputs of
    requests whose later rows reject differ (shown once on that variant)."""
    case = _rejections_case(batch=8, block=6, vocab=1025, seed=571)
    filters = Filters(top_k=torch.tensor([0, 5, 0, 60, 0, 100, 0, 3], dtype=I32))
    for schedule in range(3):
        sim.set_seed(580 + schedule)
        with emulator.planted("polls_see_launch_start"):
            out = check(sim, case)
            check_filtered(sim, case, filters)
        assert out.num_accepted.tolist() == (torch.arange(8) % 6).tolist()


def _tied_logits(shape, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Logits on a coarse grid: many tokens share the top values, so a chunk's list of tokens at
    or above its floor overflows (more than kChunkCandidates) and the row gathers from the row."""
    return torch.round(torch.randn(*shape, vocab, generator=gen) * 2.0) / 2.0


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_top_k_candidates_match_cpu_and_reference(sim, dtype):
    """top-k within the per-chunk candidate lists (k <= 64: the decided rows' filters run on the
    lists on chip), beyond them (k in (64, 256]: the chunks' floors only, one gather from the row;
    k > 256: the row's radix descent), with top-p and min-p, over 9 chunks and a short last one,
    with a mask; rows with heavy ties (lists that overflow) and rows with fewer finite logits
    than k. Exact tokens and logprobs against the CPU kernel and the reference, with and without
    every row decided (polls_see_launch_start)."""
    batch, block, vocab = 8, 3, 8193
    case = make_case(batch, block, vocab, seed=591, temperature="mixed", dtype=dtype,
                     num_draft=block)
    gen = generator(592)
    target = case.target_logits.float()
    target[2] = _tied_logits((block + 1,), vocab, gen)
    target[5] = _tied_logits((block + 1,), vocab, gen)
    target[6, :, 40:] = -INF  # 40 finite logits: fewer than its k
    case = case.replace(target_logits=target.to(dtype))
    allowed = torch.rand(batch * (block + 1), vocab, generator=gen) < 0.9
    filters = Filters(top_k=torch.tensor([50, 64, 50, 1, 65, 8, 50, 300], dtype=I32),
                      top_p=torch.tensor([0.9, 1.0, 0.8, 1.0, 0.95, 0.5, 0.9, 0.9]),
                      min_p=torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0]),
                      allowed_token_mask=pack_mask(allowed, gen))
    check_filtered(sim, case, filters)
    with emulator.planted("polls_see_launch_start"):
        check_filtered(sim, case, filters)
