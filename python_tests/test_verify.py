"""verify (docs/semantics.md §3.1): exact agreement with reference.verify, literal outcomes of
constructed cases, layouts, dtypes, non-finite logits, batch invariance, seeds, statistical
losslessness (docs/semantics.md §5) and every argument check."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import DEVICES, cuda_only, full_tests, non_contiguous, on_two_streams
from stats import chi_square, chi_square_passes
from cases.arguments import (
    error_params,
    per_request_errors,
    per_request_value_errors,
    raises,
    skip_value_checks_without_debug,
    vocabulary_errors,
    with_overrides,
)
from cases.common import (
    DEBUG,
    DTYPE_IDS,
    FLOAT_DTYPES,
    INF,
    NAN,
    f32,
    generator,
    i32,
    i64,
    is_greedy,
    stable_seed,
)
from cases.tails import VERIFY_KINDS, VERIFY_VOCABS, check_verify_tail, verify_tail_case
from cases.verify import (
    B,
    BAD_ROWS,
    G,
    STAT_BLOCK,
    STAT_VOCAB,
    V,
    accepted_length_distribution,
    assert_same_outputs,
    Case,
    certain_accepts,
    check_output_contract,
    distinct_tokens,
    finite_or_neg_inf,
    first_rows,
    greedy_expectation,
    make_case,
    make_temperature,
    num_draft_zero_case,
    one_hot_logits,
    padded_rows,
    peaky_logits,
    positions_distributed_as_target,
    ragged_args,
    sample_drafts,
    stat_rows,
    to_ragged,
    valid_args,
    with_non_finite_logits,
)


# --------------------------------------------------------------------------------------------
# Building inputs
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Checking outputs
# --------------------------------------------------------------------------------------------


def check_against_reference(case: Case):
    """Runs the op, checks the output contract and exact equality with the reference."""
    got = case.call(dspark_ops.verify)
    check_output_contract(case, got)
    assert_same_outputs(got, case.call(reference.verify), case)
    return got


# --------------------------------------------------------------------------------------------
# Exact agreement with the reference over shapes, modes and draft kinds
# --------------------------------------------------------------------------------------------

# (B, G, V): every V, G and B of docs/semantics.md §5 appears. The reference draws resampling noise
# over the whole vocabulary of every request, so large B*V shapes run in fewer combinations.
CHEAP_SHAPES = [(1, 1, 1), (3, 2, 2), (64, 7, 100), (3, 32, 100), (64, 32, 2), (3, 16, 8193),
                (1, 7, 151936)]
EXACT_CASES = [
    (shape, temperature, draft)
    for shape in CHEAP_SHAPES
    for temperature in ("greedy", "sampled", "mixed")
    for draft in ("logits", "onehot")
] + [
    (shape, "mixed", draft)
    for shape in [(64, 1, 10000), (3, 2, 151936), (64, 16, 100)]
    for draft in ("logits", "onehot")
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape,temperature,draft", EXACT_CASES,
    ids=["B{}-G{}-V{}-{}-{}".format(*s, t, d) for s, t, d in EXACT_CASES],
)
def test_matches_reference(device, shape, temperature, draft):
    batch, block, vocab = shape
    case = make_case(batch, block, vocab, seed=stable_seed(shape, draft, temperature),
                     temperature=temperature, draft=draft).to(device)
    out = check_against_reference(case)
    if batch == 64 and vocab > 2 and temperature != "greedy":
        # The inputs exercise both outcomes, not only rejections or only full accepts.
        accepted = out.num_accepted.cpu()
        assert (accepted > 0).any()
        assert (accepted < case.num_draft.cpu()).any()


def _full_sweep():
    if not full_tests():
        return [pytest.param(None, marks=pytest.mark.skip(reason="set DSPARK_OPS_TEST_FULL=1"))]
    params = []
    for vocab in (1, 2, 100, 8193, 10000, 151936):
        for block in (1, 2, 7, 16, 32):
            for batch in (1, 3, 64):
                if vocab == 151936 and batch * block > 96:
                    continue
                params.append(pytest.param((batch, block, vocab),
                                           id=f"B{batch}-G{block}-V{vocab}"))
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", _full_sweep())
def test_matches_reference_full_sweep(device, shape):
    batch, block, vocab = shape
    for i, (temperature, draft, dtype) in enumerate([
        ("mixed", "logits", torch.float32),
        ("mixed", "onehot", torch.bfloat16),
        ("sampled", "logits", torch.float16),
        ("sampled", "onehot", torch.float32),
    ]):
        case = make_case(batch, block, vocab, seed=stable_seed(shape, i),
                         temperature=temperature, draft=draft, dtype=dtype,
                         draft_dtype=torch.float32 if dtype == torch.float16 else dtype)
        check_against_reference(case.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_greedy_rule(device, draft):
    # Greedy: accept while the draft is the target's argmax; emit the argmax of the first
    # mismatching (or bonus) row. Integer-valued logits make ties common: the lowest id wins.
    batch, block, vocab = 64, 7, 50
    gen = generator(11)
    target = torch.randint(0, 4, (batch, block + 1, vocab), generator=gen).float()
    argmax = target.argmax(-1)
    tied = target == target.amax(-1, keepdim=True)
    highest_tie = vocab - 1 - tied.flip(-1).int().argmax(-1)
    # Drafts: mostly the argmax, sometimes a tied non-lowest id (must be rejected), sometimes
    # random.
    choice = torch.rand(batch, block, generator=gen)
    drafts = torch.where(choice < 0.75, argmax[:, :block], highest_tie[:, :block])
    drafts = torch.where(choice > 0.92, torch.randint(0, vocab, (batch, block), generator=gen),
                         drafts)
    base = make_case(batch, block, vocab, seed=12, temperature="greedy", draft=draft)
    case = base.replace(target_logits=target, draft_tokens=drafts).to(device)
    out = check_against_reference(case)
    accepted, emitted = greedy_expectation(target, drafts, case.num_draft.cpu())
    assert torch.equal(out.num_accepted.cpu().long(), accepted)
    assert torch.equal(out.tokens.cpu().gather(1, accepted[:, None])[:, 0], emitted)
    assert out.valid.all()
    # Both a rejected non-lowest tie and long accepted runs occur in this batch.
    rows = torch.arange(batch)
    k = accepted.clamp_max(block - 1)
    at_k = drafts[rows, k]
    rejected_tie = accepted < case.num_draft.cpu()
    rejected_tie &= tied[rows, k, at_k] & (at_k != argmax[rows, k])
    assert rejected_tie.any() and (accepted >= 3).any()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ignores_seed_and_draft_logits(device):
    case = make_case(64, 5, 300, seed=13, temperature="greedy").to(device)
    out = check_against_reference(case)
    others = [
        case.replace(seed=case.seed + 1, position=case.position + 7),
        case.replace(draft_logits=None),
        case.replace(draft_logits=torch.randn_like(case.draft_logits)),
    ]
    for other in others:
        assert_same_outputs(other.call(), out, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_mixed_greedy_and_sampled_requests(device, draft):
    # Temperatures around the greedy threshold share one launch; a greedy request's result does
    # not depend on its sampled neighbours.
    batch, block, vocab = 64, 6, 1000
    threshold = torch.tensor(reference.GREEDY_TEMPERATURE, dtype=torch.float32)
    just_above = torch.nextafter(threshold, torch.tensor(1.0))
    choices = torch.stack([torch.tensor(0.0), torch.tensor(1e-7), threshold, just_above,
                           torch.tensor(2e-5), torch.tensor(0.3), torch.tensor(1.0),
                           torch.tensor(2.5)])
    temperature = choices[torch.arange(batch) % len(choices)]
    case = make_case(batch, block, vocab, seed=14, temperature=temperature, draft=draft)
    case = case.to(device)
    out = check_against_reference(case)
    greedy = is_greedy(temperature)
    assert greedy.sum() == 3 * batch // len(choices)  # 0, 1e-7 and exactly the threshold
    accepted, emitted = greedy_expectation(case.target_logits.cpu(), case.draft_tokens.cpu(),
                                           case.num_draft.cpu())
    got_emitted = out.tokens.cpu().gather(1, out.num_accepted.cpu().long()[:, None])[:, 0]
    assert torch.equal(out.num_accepted.cpu()[greedy].long(), accepted[greedy])
    assert torch.equal(got_emitted[greedy], emitted[greedy])
    # The greedy requests verified on their own give the same results.
    index = greedy.nonzero()[:, 0]
    alone = case.select(index.to(device))
    expected = type(out)(*(t[index.to(device)] for t in out[:3]))
    assert_same_outputs(alone.call(), expected, alone)
    # Sampled requests exist whose result is not the greedy one.
    assert ((accepted != out.num_accepted.cpu().long()) | (emitted != got_emitted))[~greedy].any()


# --------------------------------------------------------------------------------------------
# Constructed cases with literal outcomes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("floor", [-INF, -1e4], ids=["neg-inf", "finite"])
def test_forced_rejection_disjoint_supports(device, draft, floor):
    # The target puts all its mass on tokens the draft never proposes: every first draft is
    # rejected and the correction comes from the target's support.
    batch, block, vocab = 64, 4, 500
    gen = generator(21)
    perm = torch.rand(batch, vocab, generator=gen).argsort(-1)
    target_support = torch.zeros(batch, vocab, dtype=torch.bool)
    target_support.scatter_(1, perm[:, : vocab // 3], True)
    outside = floor + (0 if floor == -INF else torch.randn(batch, block + 1, vocab, generator=gen))
    target = torch.where(target_support[:, None],
                         2 * torch.randn(batch, block + 1, vocab, generator=gen), outside)
    draft_logits = torch.where(~target_support[:, None],
                               2 * torch.randn(batch, block, vocab, generator=gen), -INF)
    temperature = 0.5 + torch.rand(batch, generator=gen)
    drafts = sample_drafts(draft_logits, temperature, gen)
    assert not target_support.gather(1, drafts).any()
    case = Case(target, drafts, torch.randint(1, block + 1, (batch,), generator=gen).int(),
                temperature, torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=draft_logits if draft == "logits" else None).to(device)
    out = check_against_reference(case)
    assert (out.num_accepted == 0).all()
    assert out.valid.all()
    first = out.tokens[:, 0].cpu()
    assert target_support.gather(1, first[:, None]).all()
    assert (out.tokens[:, 1:] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_single_nonzero_residual(device, dtype, temperature):
    # Row k: p on {a: 0.6, b: 0.4}, q on {b: 0.5, c: 0.5}, draft c (p(c) = 0, so rejected).
    # max(p - q, 0) is nonzero only at a, so the correction must be a. Rows before k are
    # certain accepts.
    batch, block, vocab = 64, 7, 1000
    gen = generator(22)
    k = torch.randint(0, block, (batch,), generator=gen)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    abc = distinct_tokens(3, vocab, gen, batch)
    a, b_tok, c = abc.unbind(1)
    rows = torch.arange(batch)
    target[rows, k] = -INF
    target[rows, k, a] = math.log(0.6)
    target[rows, k, b_tok] = math.log(0.4)
    draft_logits[rows, k] = -INF
    draft_logits[rows, k, b_tok] = math.log(0.5) + 3.0  # a constant shift keeps q = (.5, .5)
    draft_logits[rows, k, c] = math.log(0.5) + 3.0
    drafts[rows, k] = c
    n = torch.minimum(k + 1 + torch.randint(0, 3, (batch,), generator=gen), torch.tensor(block))
    case = Case(target.to(dtype), drafts, n.int(), torch.full((batch,), temperature),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=draft_logits.to(dtype)).to(device)
    out = check_against_reference(case)
    assert torch.equal(out.num_accepted.cpu().long(), k)
    assert torch.equal(out.tokens.cpu()[rows, k], a)
    assert out.valid.all()


@pytest.mark.parametrize("device", DEVICES)
def test_single_nonzero_residual_one_hot_drafts(device):
    # One-hot drafts: row k has p on {a: 0.5, x: 0.5} and draft x. Accepted half the time; when
    # rejected, the residual is p with x removed, i.e. only a. After an accept the bonus row is
    # one-hot on a known token.
    batch, block, vocab = 64, 5, 777
    gen = generator(23)
    k = torch.randint(0, block, (batch,), generator=gen)
    drafts, target, _ = certain_accepts(batch, block, vocab, gen)
    rows = torch.arange(batch)
    x = drafts[rows, k]
    a = (x + 1 + torch.randint(0, vocab - 1, (batch,), generator=gen)) % vocab
    bonus = torch.randint(0, vocab, (batch,), generator=gen)
    target[rows, k] = -INF
    target[rows, k, a] = 1.25
    target[rows, k, x] = 1.25
    target[rows, k + 1] = one_hot_logits(bonus, vocab, value=0.0)
    case = Case(target, drafts, (k + 1).int(), torch.ones(batch),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen)).to(device)
    out = check_against_reference(case)
    accepted, tokens = out.num_accepted.cpu().long(), out.tokens.cpu()
    rejected = accepted == k
    assert torch.equal(tokens[rows, k], torch.where(rejected, a, x))
    assert ((accepted == k + 1) | rejected).all()
    assert torch.equal(tokens[rows, k + 1][~rejected], bonus[~rejected])
    assert 10 < rejected.sum() < batch - 10  # u < 1/2 splits the batch


@pytest.mark.parametrize("device", DEVICES)
def test_residual_without_mass_falls_back_to_target(device):
    # A rejected draft whose residual max(p - q, 0) has no mass: the token is drawn from p.
    # (1) Greedy draft (T_d = 0) with argmax d, p one-hot on d, draft token x != d: q(x) = 0
    #     rejects, r = max(p - onehot(d), 0) = 0, so the token is d.
    # (2) Identical p and q and a draft token outside their support.
    batch, vocab = 32, 300
    gen = generator(24)
    d, x = distinct_tokens(2, vocab, gen, batch).unbind(1)
    target = one_hot_logits(d[:, None].expand(batch, 2), vocab, gen=gen)
    draft_logits = 3 * torch.randn(batch, 1, vocab, generator=gen)
    draft_logits[torch.arange(batch), 0, d] = 50.0
    case = Case(target, x[:, None], torch.ones(batch, dtype=torch.int32), torch.ones(batch),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen), draft_logits=draft_logits,
                draft_temperature=torch.zeros(batch)).to(device)
    out = check_against_reference(case)
    assert (out.num_accepted == 0).all() and out.valid.all()
    assert torch.equal(out.tokens[:, 0].cpu(), d)

    support = torch.rand(batch, vocab, generator=gen) < 0.2
    support[:, 0] = False
    logits = torch.where(support, torch.randn(batch, vocab, generator=gen), -INF)
    target = torch.stack([logits, torch.randn(batch, vocab, generator=gen)], 1)
    outside = (~support).float().multinomial(1, generator=gen)
    case = case.replace(target_logits=target.to(device), draft_tokens=outside.to(device),
                        draft_logits=logits[:, None].to(device), draft_temperature=None)
    out = check_against_reference(case)
    assert (out.num_accepted == 0).all() and out.valid.all()
    assert support.gather(1, out.tokens[:, :1].cpu()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("block", [1, 7, 32])
def test_bonus_after_full_accept_literal(device, draft, block):
    # One-hot-ish target and draft rows (one token survives exp) with the drafts on them: every
    # draft is accepted and the bonus token is the bonus row's token.
    batch, vocab = 16, 4099
    gen = generator(25 + block)
    ids = torch.randint(0, vocab, (batch, block + 1), generator=gen)
    target = one_hot_logits(ids, vocab, floor=-200.0, gen=gen)
    draft_logits = one_hot_logits(ids[:, :block], vocab, floor=-300.0, gen=gen)
    case = Case(target, ids[:, :block], torch.full((batch,), block, dtype=torch.int32),
                0.5 + torch.rand(batch, generator=gen),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=draft_logits if draft == "logits" else None).to(device)
    out = check_against_reference(case)
    assert (out.num_accepted == block).all() and out.valid.all()
    assert torch.equal(out.tokens.cpu(), ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_full_accept_when_draft_equals_target(device, dtype):
    # q = p (the same logits): u * q(x) < p(x) always holds, so all n drafts are accepted and a
    # bonus token is drawn from p_n.
    batch, block, vocab = 64, 7, 3001
    gen = generator(26)
    target = peaky_logits((batch, block + 1), vocab, gen).to(dtype)
    temperature = 0.5 + torch.rand(batch, generator=gen)
    drafts = sample_drafts(target[:, :block], temperature, gen)
    n = torch.randint(0, block + 1, (batch,), generator=gen).int()
    case = Case(target, drafts, n, temperature,
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=target[:, :block].clone()).to(device)
    out = check_against_reference(case)
    assert torch.equal(out.num_accepted, case.num_draft)
    # The bonus token is a sample, not always the argmax of p_n.
    bonus = out.tokens.cpu().gather(1, n.long()[:, None])[:, 0]
    argmax = finite_or_neg_inf(target).argmax(-1).gather(1, n.long()[:, None])[:, 0]
    assert (bonus != argmax).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_num_draft_zero(device, layout):
    # Only row 0 is needed: its token is emitted, draft ids are ignored (even out of range) and
    # the request's other rows are never consulted (they are NaN here).
    batch, block, vocab = 64, 4, 2000
    case = num_draft_zero_case(batch, block, vocab, 27, layout).to(device)
    out = check_against_reference(case)
    assert (out.num_accepted == 0).all() and out.valid.all()
    assert (out.tokens[:, 1:] == -1).all()
    greedy = is_greedy(case.temperature.cpu())
    argmax = finite_or_neg_inf(first_rows(case)).argmax(-1)
    assert torch.equal(out.tokens[:, 0].cpu()[greedy], argmax[greedy])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    vocab, block = 10, 3
    ids = torch.zeros(0, dtype=torch.int64, device=device)
    out = dspark_ops.verify(
        torch.randn(0, vocab, device=device), ids.reshape(0, block),
        torch.zeros(0, dtype=torch.int32, device=device), torch.ones(0, device=device), ids, ids,
    )
    assert out.tokens.shape == (0, block + 1) and out.tokens.dtype == torch.int64
    assert out.num_accepted.shape == (0,) and out.valid.shape == (0,)


# --------------------------------------------------------------------------------------------
# Draft temperature
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft_temperature", ["sampled", 0.6, 1e-6, 0.0],
                         ids=["random", "0.6", "1e-6", "0"])
def test_draft_temperature(device, draft_temperature):
    batch, block, vocab = 64, 7, 5003
    case = make_case(batch, block, vocab, seed=31, temperature="sampled",
                     draft_temperature=draft_temperature, noise=0.7).to(device)
    out = check_against_reference(case)
    assert (out.num_accepted > 0).any()
    # The argument matters: verifying the same drafts as if drawn at T_d = T changes results.
    as_if_target_temperature = case.replace(draft_temperature=None).call()
    differs = (as_if_target_temperature.tokens != out.tokens).any(1)
    differs |= as_if_target_temperature.num_accepted != out.num_accepted
    assert differs.any()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_draft_rejects_non_argmax_drafts(device):
    # T_d <= 1e-5 makes q one-hot on the draft argmax: any other draft has q(x) = 0 and is
    # rejected at once, whatever p says.
    batch, block, vocab = 64, 3, 400
    case = make_case(batch, block, vocab, seed=32, temperature=1.0, draft_temperature=0.0,
                     num_draft=block)
    argmax = finite_or_neg_inf(case.draft_logits).argmax(-1)
    case.draft_tokens = (argmax + 1) % vocab
    case.target_logits = case.target_logits.clone()
    rows, j = torch.arange(batch)[:, None], torch.arange(block)[None]
    case.target_logits[rows, j, case.draft_tokens] = 30.0  # p(x) ~ 1 for the non-argmax drafts
    out = check_against_reference(case.to(device))
    assert (out.num_accepted == 0).all()


# --------------------------------------------------------------------------------------------
# Layouts, dtypes, token dtypes, strides
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("shape", [(64, 7, 1000), (3, 32, 10000), (16, 1, 8193)],
                         ids=lambda s: "B{}-G{}-V{}".format(*s))
def test_layouts_agree(device, draft, shape):
    batch, block, vocab = shape
    case = make_case(batch, block, vocab, seed=41, temperature="mixed", draft=draft)
    padded = case.to(device)
    out = check_against_reference(padded)
    flat = padded.replace(target_logits=padded.target_logits.reshape(-1, vocab))
    explicit_start = flat.replace(
        target_start=(torch.arange(batch, dtype=torch.int32) * (block + 1)).to(device))
    ragged = to_ragged(case, generator(42)).to(device)
    assert ragged.target_logits.shape[0] != batch * (block + 1)
    for other in (flat, explicit_start, ragged):
        assert_same_outputs(other.call(), out, other)
    check_against_reference(ragged)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_target_rows(device):
    # target_start may point several requests at the same rows (here all of them), and the
    # draft logits may be a stride-0 broadcast: each request is verified as if it had a copy.
    batch, block, vocab = 64, 4, 1500
    gen = generator(43)
    target = peaky_logits((block + 1,), vocab, gen)
    draft_row = target[:block] + 0.5 * torch.randn(block, vocab, generator=gen)
    temperature = torch.full((batch,), 0.9)
    drafts = sample_drafts(draft_row.expand(batch, block, vocab), temperature, gen)
    shared = Case(target, drafts, torch.full((batch,), block, dtype=torch.int32), temperature,
                  torch.arange(batch, dtype=torch.int64) * 1000003,
                  torch.randint(0, 2**40, (batch,), generator=gen),
                  draft_logits=draft_row.expand(batch, block, vocab),
                  target_start=torch.zeros(batch, dtype=torch.int32)).to(device)
    out = check_against_reference(shared)
    copied = shared.replace(
        target_logits=target.expand(batch, block + 1, vocab).contiguous().to(device),
        draft_logits=shared.draft_logits.contiguous(), target_start=None)
    assert_same_outputs(copied.call(), out, shared)


DTYPE_PAIRS = [(t, d) for t in FLOAT_DTYPES for d in FLOAT_DTYPES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS,
                         ids=lambda p: f"{DTYPE_IDS[p[0]]}-{DTYPE_IDS[p[1]]}")
def test_logit_dtypes(device, dtypes):
    target_dtype, draft_dtype = dtypes
    case = make_case(16, 7, 8193, seed=51, temperature="mixed", dtype=target_dtype,
                     draft_dtype=draft_dtype)
    check_against_reference(case.to(device))
    one_hot = make_case(3, 16, 10000, seed=52, temperature="sampled", dtype=target_dtype,
                        draft="onehot")
    check_against_reference(one_hot.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_int32_draft_tokens(device, draft):
    case = make_case(64, 16, 2500, seed=53, temperature="mixed", draft=draft).to(device)
    out = check_against_reference(case)
    narrow = case.replace(draft_tokens=case.draft_tokens.int())
    assert_same_outputs(check_against_reference(narrow), out, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
@pytest.mark.parametrize("kind", ["strided", "padded"])
def test_non_contiguous_inputs(device, draft, ragged, kind):
    # Every tensor argument non-contiguous (gaps hold NaN / INT_MIN, which must never be read).
    batch, block, vocab = 64, 7, 1000
    case = make_case(batch, block, vocab, seed=54, temperature="mixed", draft=draft,
                     draft_temperature="sampled", dtype=torch.bfloat16, draft_dtype=torch.float32)
    if ragged:
        case = to_ragged(case, generator(55))
    case = case.to(device)
    out = check_against_reference(case)
    changed = {}
    for field in dataclasses.fields(case):
        value = getattr(case, field.name)
        if value is None:
            continue
        changed[field.name] = non_contiguous(value, kind if value.dim() >= 2 else "strided")
    strided = case.replace(**changed)
    assert_same_outputs(strided.call(), out, case)
    assert_same_outputs(strided.call(reference.verify), out, case)


# --------------------------------------------------------------------------------------------
# Rows without finite logits, partial NaN
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", ["greedy", "sampled"])
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("bad", list(BAD_ROWS))
def test_target_row_without_finite_logit(device, temperature, draft, bad):
    # Rows before k are certain accepts; row k (a draft row or the bonus row) has no finite
    # logit: the op emits 0 there and reports valid = False. Rows after k are never needed.
    batch, block, vocab = 64, 6, 333
    gen = generator(61)
    k = torch.randint(0, block + 1, (batch,), generator=gen)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    rows = torch.arange(batch)
    target[rows, k] = BAD_ROWS[bad]((batch, vocab))
    n = torch.maximum(k, torch.randint(0, block + 1, (batch,), generator=gen))
    case = Case(target, drafts, n.int(), make_temperature(temperature, batch, gen),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=draft_logits if draft == "logits" else None).to(device)
    out = check_against_reference(case)
    assert torch.equal(out.num_accepted.cpu().long(), k)
    assert (out.tokens.cpu()[rows, k] == 0).all()
    assert not out.valid.any()


@pytest.mark.parametrize("device", DEVICES)
def test_unneeded_invalid_rows_do_not_matter(device):
    # Every first draft is rejected (p(x) = 0); rows after the rejection are NaN but unneeded.
    batch, block, vocab = 32, 5, 200
    gen = generator(62)
    drafts = torch.randint(0, vocab, (batch, block), generator=gen)
    target = torch.full((batch, block + 1, vocab), NAN)
    target[:, 0] = torch.randn(batch, vocab, generator=gen)
    target[torch.arange(batch), 0, drafts[:, 0]] = -INF
    case = Case(target, drafts, torch.full((batch,), block, dtype=torch.int32), torch.ones(batch),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen)).to(device)
    out = check_against_reference(case)
    assert (out.num_accepted == 0).all() and out.valid.all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", list(BAD_ROWS))
def test_draft_row_without_finite_logit(device, bad):
    # A sampled request whose draft row k has no finite logit: the draft is rejected, the
    # request reports valid = False and still emits an id inside [0, V). Greedy requests do not
    # read draft logits at all.
    batch, block, vocab = 64, 6, 333
    gen = generator(63)
    k = torch.randint(0, block, (batch,), generator=gen)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    rows = torch.arange(batch)
    target[rows, k] = torch.randn(batch, vocab, generator=gen)
    draft_logits[rows, k] = BAD_ROWS[bad]((batch, vocab))
    temperature = torch.where(rows % 4 == 0, 0.0, 0.5 + torch.rand(batch, generator=gen))
    case = Case(target, drafts, torch.full((batch,), block, dtype=torch.int32), temperature,
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=draft_logits).to(device)
    out = check_against_reference(case)
    sampled = ~is_greedy(temperature)
    assert torch.equal(out.num_accepted.cpu()[sampled].long(), k[sampled])
    assert not out.valid.cpu()[sampled].any()
    assert out.valid.cpu()[~sampled].all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_non_finite_logits_are_never_emitted(device, temperature, draft):
    # NaN (and, as in the reference, +-inf) logits count as -inf: such tokens are never
    # accepted, sampled or chosen as argmax, even where they would dominate the row.
    batch, block, vocab = 64, 7, 600
    case = make_case(batch, block, vocab, seed=stable_seed(64, temperature, draft),
                     temperature=temperature, noise=0.3)
    case = with_non_finite_logits(case, generator(65), draft).to(device)
    out = check_against_reference(case)
    tokens, n = out.tokens.cpu(), out.num_accepted.cpu().long()
    emitted = tokens.clamp_min(0)
    finite = torch.isfinite(case.target_logits.cpu()).gather(-1, emitted[..., None])[..., 0]
    assert finite[torch.arange(block + 1)[None] <= n[:, None]].all()
    assert out.valid.all()
    assert (n > 0).any() and (n < case.num_draft.cpu()).any()


# --------------------------------------------------------------------------------------------
# Batch invariance, seeds and positions
# --------------------------------------------------------------------------------------------


def _emitted(out, b: int):
    k = int(out.num_accepted[b])
    return out.tokens[b, : k + 1].tolist(), k, bool(out.valid[b])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_batch_invariance(device, draft):
    batch, block, vocab = 24, 8, 2048
    case = make_case(batch, block, vocab, seed=71, temperature="mixed", draft=draft).to(device)
    out = check_against_reference(case)
    gen = generator(72)
    perm = torch.randperm(batch, generator=gen)
    subset = torch.randperm(batch, generator=gen)[:7]
    arrangements = {
        "alone": [torch.tensor([b]) for b in range(0, batch, 5)],
        "reordered": [perm],
        "subset": [subset],
    }
    for name, index_lists in arrangements.items():
        for index in index_lists:
            got = case.select(index.to(device)).call()
            for i, b in enumerate(index.tolist()):
                assert _emitted(got, i) == _emitted(out, b), (name, b)

    # Added requests (others' inputs, seeds and positions) interleaved with these.
    others = make_case(40, block, vocab, seed=73, temperature="mixed", draft=draft).to(device)
    joined = Case(**{
        f.name: None if getattr(case, f.name) is None
        else torch.cat([getattr(case, f.name), getattr(others, f.name)])
        for f in dataclasses.fields(case)
    })
    mix = torch.randperm(batch + 40, generator=gen)
    got = joined.select(mix.to(device)).call()
    for i, b in enumerate(mix.tolist()):
        if b < batch:
            assert _emitted(got, i) == _emitted(out, b), ("joined", b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [2048, 50257])
def test_batch_invariance_is_bitwise(device, vocab):
    # Logprobs too: the float sums of a request's rows do not depend on the batch (on CUDA the
    # vocabulary split depends on V only), so a request alone and among 300 others (B = 1 and
    # B = 301 had different splits before) gives bitwise the same outputs.
    block = 2
    case = make_case(3, block, vocab, seed=78, temperature="mixed").to(device)
    others = make_case(298, block, vocab, seed=79, temperature="mixed")
    joined = Case(**{
        f.name: None if getattr(case, f.name) is None
        else torch.cat([getattr(case, f.name), getattr(others, f.name).to(device)])
        for f in dataclasses.fields(case)
    })
    mix = torch.randperm(301, generator=generator(80))
    big = joined.select(mix.to(device)).call(return_logprobs=True)
    for i, b in enumerate(mix.tolist()):
        if b < 3:
            alone = case.select(torch.tensor([b], device=device)).call(return_logprobs=True)
            assert torch.equal(alone.tokens[0], big.tokens[i]), b
            assert torch.equal(alone.num_accepted[0], big.num_accepted[i]), b
            assert torch.equal(alone.valid[0], big.valid[i]), b
            assert torch.equal(alone.logprobs[0], big.logprobs[i]), b


@pytest.mark.parametrize("device", DEVICES)
def test_batch_invariance_across_block_sizes(device):
    # The same requests padded to a larger G, as when batched with requests that draft more:
    # the extra slots hold junk that is never read, and the results are the same.
    batch, block, big, vocab = 16, 4, 12, 1000
    case = make_case(batch, block, vocab, seed=74, temperature="mixed").to(device)
    out = check_against_reference(case)
    gen = generator(75)
    extra = big - block
    junk_rows = torch.randn(batch, extra, vocab, generator=gen)
    target = torch.cat([padded_rows(case).cpu(), junk_rows], 1)
    junk_ids = torch.randint(0, vocab, (batch, extra), generator=gen)
    drafts = torch.cat([case.draft_tokens.cpu(), junk_ids], 1)
    draft_logits = torch.cat([case.draft_logits.cpu(), junk_rows.flip(-1)], 1)
    wide = case.replace(target_logits=target.to(device), draft_tokens=drafts.to(device),
                        draft_logits=draft_logits.to(device))
    got = check_against_reference(wide)
    assert torch.equal(got.tokens[:, : block + 1], out.tokens)
    assert (got.tokens[:, block + 1 :] == -1).all()
    assert torch.equal(got.num_accepted, out.num_accepted) and torch.equal(got.valid, out.valid)


def _fraction_of_requests_changed(a, b) -> float:
    changed = (a.tokens != b.tokens).any(1) | (a.num_accepted != b.num_accepted)
    return changed.float().mean().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_seed_and_position_change_outputs(device, draft):
    # Spread-out target rows (no dominant token): almost every request's outcome is a fresh
    # random draw, so another seed or position changes most of them.
    batch, block, vocab = 64, 4, 1000
    case = make_case(batch, block, vocab, seed=76, temperature=1.0, num_draft=block)
    gen = generator(77)
    case.target_logits = torch.randn(case.target_logits.shape, generator=gen)
    noise = torch.randn(batch, block, vocab, generator=gen)
    case.draft_logits = case.target_logits[:, :block] + 0.3 * noise
    case.draft_tokens = sample_drafts(case.draft_logits, case.temperature, gen)
    if draft == "onehot":
        case.draft_logits = None
    case = case.to(device)
    out = check_against_reference(case)
    assert _fraction_of_requests_changed(out, case.call()) == 0  # deterministic
    for other in (case.replace(seed=case.seed + 1), case.replace(seed=case.seed ^ (1 << 40)),
                  case.replace(position=case.position + 1),
                  case.replace(position=case.position + 2**32)):
        assert _fraction_of_requests_changed(out, check_against_reference(other)) > 0.75


@pytest.mark.parametrize("device", DEVICES)
def test_position_shift_moves_streams(device):
    # Row j draws from the streams of position p0 + 1 + j. Rows before the last draft row are
    # certain accepts, the last draft row is a coin flip (one-hot draft, p(x) = 1/2), then the
    # bonus row. Dropping the first row and moving p0 up by one keeps every later row at the same
    # absolute position, so the coin flips, corrections and bonus tokens must not change.
    batch, block, vocab = 32, 6, 500
    gen = generator(78)
    target = peaky_logits((batch, block + 1), vocab, gen)
    temperature = torch.ones(batch)
    drafts = sample_drafts(target[:, :block], temperature, gen)
    # The last draft row is a coin flip: p(x) = 1/2, q one-hot (no draft logits).
    rows = torch.arange(batch)
    target[rows, block - 1] = -INF
    target[rows, block - 1, drafts[:, block - 1]] = 0.0
    target[rows, block - 1, (drafts[:, block - 1] + 1) % vocab] = 0.0
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    position = torch.randint(0, 2**40, (batch,), generator=gen)
    target[:, : block - 1] = one_hot_logits(drafts[:, : block - 1], vocab, gen=gen)
    full = Case(target, drafts, torch.full((batch,), block, dtype=torch.int32), temperature,
                seed, position).to(device)
    shifted = Case(target[:, 1:].contiguous(), drafts[:, 1:].contiguous(),
                   torch.full((batch,), block - 1, dtype=torch.int32), temperature, seed,
                   position + 1).to(device)
    a, b = check_against_reference(full), check_against_reference(shifted)
    assert torch.equal(a.num_accepted - 1, b.num_accepted)
    assert torch.equal(a.tokens[:, 1:], b.tokens)
    assert 4 < (a.num_accepted == block).sum() < batch - 4


@pytest.mark.parametrize("device", DEVICES)
def test_seed_none_uses_generator(device):
    case = make_case(64, 4, 1000, seed=79, temperature=1.0).to(device)

    def run(generator_seed):
        gen = torch.Generator(device).manual_seed(generator_seed)
        return case.replace(seed=None).call(generator=gen)

    first, again, other = run(5), run(5), run(6)
    assert_same_outputs(again, first, case)
    assert _fraction_of_requests_changed(first, other) > 0.25
    # Without a generator, torch's default generator for the device is used.
    torch.manual_seed(3)
    default = case.replace(seed=None).call()
    torch.manual_seed(3)
    assert_same_outputs(case.replace(seed=None).call(), default, case)


# --------------------------------------------------------------------------------------------
# Statistical losslessness (docs/semantics.md §5)
# --------------------------------------------------------------------------------------------

STAT_TRIALS = 10 * STAT_VOCAB


def probs_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, -1)


def run_stat_trials(mode: str, temperature: float, seed: int, device="cpu"):
    """STAT_TRIALS independent trials of one verify launch sharing the target rows (through
    target_start = 0) and the draft rows (a stride-0 broadcast); each trial has its own seed and
    its own drafts sampled from q. Returns (tokens, num_accepted, p, q_used, alpha)."""
    gen = generator(seed)
    target, draft = stat_rows(gen, temperature)
    p, q = probs_at(target, temperature), probs_at(draft, temperature)
    n_trials, block = STAT_TRIALS, STAT_BLOCK
    if mode == "greedy_draft":
        drafts = draft.argmax(-1).expand(n_trials, block).contiguous()
        q = torch.nn.functional.one_hot(draft.argmax(-1), STAT_VOCAB).double()
    else:
        drafts = torch.stack([torch.multinomial(q[j], n_trials, replacement=True, generator=gen)
                              for j in range(block)], 1)
    if mode == "logits" or mode == "greedy_draft":
        alpha = torch.minimum(p[:block], q).sum(-1)
    else:  # one-hot drafts: accept with probability p(x), x ~ q
        alpha = (p[:block] * q).sum(-1)
    case = Case(
        target, drafts, torch.full((n_trials,), block, dtype=torch.int32),
        torch.full((n_trials,), temperature),
        torch.randint(-(2**62), 2**62, (n_trials,), generator=gen),
        torch.randint(0, 2**40, (n_trials,), generator=gen),
        draft_logits=None if mode == "onehot" else draft,
        target_start=torch.zeros(n_trials, dtype=torch.int32),
        draft_temperature=torch.zeros(n_trials) if mode == "greedy_draft" else None,
    ).to(device)
    if case.draft_logits is not None:
        case.draft_logits = case.draft_logits.expand(n_trials, block, STAT_VOCAB)
    out = case.call()
    assert out.valid.all()
    return out.tokens.cpu(), out.num_accepted.cpu().long(), p, q, alpha


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["logits", "onehot", "greedy_draft"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_output_distribution_is_target(device, mode, temperature):
    tokens, accepted, p, _, alpha = run_stat_trials(mode, temperature,
                                                    stable_seed("stat", mode, temperature), device)
    results = positions_distributed_as_target(tokens, accepted, p)
    assert [r[0] for r in results][:3] == [0, 1, 2], f"too few trials reach positions: {results}"
    failed = [r for r in results if not r[4]]
    assert not failed, f"chi-square rejects (k, trials, chi2, df): {failed}"

    # Accepted lengths: mean against Σ_i Π_{k<i} α_k (Σ α^i for equal rows), and the whole
    # distribution of num_accepted by chi-square.
    expected_mean = alpha.cumprod(0).sum().item()
    mean = accepted.double().mean().item()
    stderr = accepted.double().std().item() / math.sqrt(accepted.numel())
    assert abs(mean - expected_mean) < 5 * stderr, (mean, expected_mean, stderr)
    chi2, df = chi_square(accepted, accepted_length_distribution(alpha))
    assert chi_square_passes(chi2, df), (chi2, df)


def torch_speculative_sampling(p, q, drafts, gen, bug=None):
    """A plain-torch rejection sampler (torch.rand / torch.multinomial, no Philox) used to show
    that the checks above detect a wrong rule. ``bug``: None (correct), "residual_is_p" (the
    correction drawn from p instead of max(p - q, 0)) or "bonus_row_off_by_one" (the bonus token
    drawn from p_{n-1})."""
    n_trials, block = drafts.shape
    j = torch.arange(block)
    u = torch.rand(n_trials, block, generator=gen, dtype=torch.float64)
    accept = u * q[j, drafts] < p[j, drafts]
    accepted = accept.int().cumprod(1).sum(1)
    tokens = torch.where(torch.arange(block + 1) < accepted[:, None],
                         torch.cat([drafts, torch.full((n_trials, 1), -1)], 1), -1)
    for row in range(block + 1):
        chosen = accepted == row
        if row < block:
            dist = p[row] if bug == "residual_is_p" else (p[row] - q[row]).clamp_min(0)
        else:
            dist = p[row - 1] if bug == "bonus_row_off_by_one" else p[row]
        if chosen.any():
            tokens[chosen, row] = torch.multinomial(dist, int(chosen.sum()), replacement=True,
                                                    generator=gen)
    return tokens, accepted


@pytest.mark.parametrize("bug,failing_position", [
    (None, None), ("residual_is_p", 0), ("bonus_row_off_by_one", STAT_BLOCK),
])
def test_checks_reject_a_broken_rule(bug, failing_position):
    # Same distributions and drafts as the op's test; only the sampling rule differs. The
    # correct torch sampler passes (so a failure is the rule's, not the checker's).
    gen = generator(81)
    target, draft = stat_rows(gen, 1.0)
    p, q = probs_at(target, 1.0), probs_at(draft, 1.0)
    drafts = torch.stack([torch.multinomial(q[j], STAT_TRIALS, replacement=True, generator=gen)
                          for j in range(STAT_BLOCK)], 1)
    tokens, accepted = torch_speculative_sampling(p, q, drafts, gen, bug)
    results = {r[0]: r for r in positions_distributed_as_target(tokens, accepted, p)}
    assert set(results) == set(range(STAT_BLOCK + 1))
    if bug is None:
        assert all(r[4] for r in results.values()), results
    else:
        assert not results[failing_position][4], results[failing_position]


@pytest.mark.parametrize("device", DEVICES)
def test_op_matches_reference_on_statistical_inputs(device):
    # The shared-row, broadcast-draft launch of the statistical tests agrees with the reference
    # token for token (on a slice of the trials; the reference would need the full broadcast).
    gen = generator(82)
    target, draft = stat_rows(gen, 0.7)
    trials = 256
    q = probs_at(draft, 0.7)
    drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True, generator=gen)
                          for j in range(STAT_BLOCK)], 1)
    case = Case(target, drafts, torch.full((trials,), STAT_BLOCK, dtype=torch.int32),
                torch.full((trials,), 0.7),
                torch.randint(-(2**62), 2**62, (trials,), generator=gen),
                torch.randint(0, 2**40, (trials,), generator=gen),
                draft_logits=draft.expand(trials, STAT_BLOCK, STAT_VOCAB),
                target_start=torch.zeros(trials, dtype=torch.int32)).to(device)
    check_against_reference(case)
    check_against_reference(case.replace(draft_logits=None))


# --------------------------------------------------------------------------------------------
# Argument checks: every check of csrc/args/verify_args.h with its message
# --------------------------------------------------------------------------------------------


def call_with(args: dict):
    return Case(**args).call()


def _huge_vocab():
    # A stride-0 view: a 2^31 - 1 vocabulary without the memory (moved to the device as a view).
    return dict(target_logits=torch.randn(1, 1).expand(B * (G + 1), 2**31 - 1),
                draft_logits=None)


VERIFY = ["verify"]

# Rows (id, ops, overrides, exception, message) as cases/arguments.py runs them.
# Shape and dtype checks run on every device.
STRUCTURE_ERRORS = vocabulary_errors(
    VERIFY, "target_logits", lambda: dict(target_logits=torch.randn(B * (G + 1), 0),
                                          draft_logits=torch.randn(B, G, 0)), _huge_vocab,
) + per_request_errors(VERIFY, B) + [
    ("draft_tokens-1d", VERIFY, lambda: dict(draft_tokens=i64(1, 2, 3)), ValueError,
     r"'draft_tokens' must be 2-D \[B, G\], got a 1-D tensor of shape \[3\]"),
    ("draft_tokens-3d", VERIFY, lambda: dict(draft_tokens=torch.zeros(B, G, 1, dtype=torch.int64)),
     ValueError,
     r"'draft_tokens' must be 2-D \[B, G\], got a 3-D tensor of shape \[3, 4, 1\]"),
    ("draft_tokens-float", VERIFY, lambda: dict(draft_tokens=torch.zeros(B, G)), TypeError,
     r"'draft_tokens' must have dtype Long or Int, got Float"),
    ("draft_tokens-int16", VERIFY, lambda: dict(draft_tokens=torch.zeros(B, G, dtype=torch.int16)),
     TypeError, r"'draft_tokens' must have dtype Long or Int, got Short"),
    ("target-1d", VERIFY, lambda: dict(target_logits=torch.randn(V)), ValueError,
     r"'target_logits' must be 2-D \[R, V\] or 3-D \[B, G\+1, V\], "
     r"got a 1-D tensor of shape \[100\]"),
    ("target-4d", VERIFY, lambda: dict(target_logits=torch.randn(B, G + 1, 1, V)), ValueError,
     r"'target_logits' must be 2-D \[R, V\] or 3-D \[B, G\+1, V\], "
     r"got a 4-D tensor of shape \[3, 5, 1, 100\]"),
    ("target-float64", VERIFY,
     lambda: dict(target_logits=torch.randn(B * (G + 1), V, dtype=torch.float64)), TypeError,
     r"'target_logits' must have dtype Float or BFloat16 or Half, got Double"),
    ("target-int32", VERIFY,
     lambda: dict(target_logits=torch.zeros(B * (G + 1), V, dtype=torch.int32)), TypeError,
     r"'target_logits' must have dtype Float or BFloat16 or Half, got Int"),
    ("target-3d-wrong-G", VERIFY, lambda: dict(target_logits=torch.randn(B, G, V)), ValueError,
     r"'target_logits' must have shape \[B, G\+1, V\] = \[3, 5, 100\], got \[3, 4, 100\]"),
    # Drafts narrower or wider than the target's G + 1 rows: the drafts are blamed, unless
    # draft_logits sides with them (then the target is the odd one out, as above).
    ("draft_tokens-narrow", VERIFY, lambda: dict(target_logits=torch.randn(B, G + 1, V),
                                           draft_tokens=torch.zeros(B, G - 1, dtype=torch.int64),
                                           draft_logits=None), ValueError,
     r"'draft_tokens' must have shape \[B, G\] = \[3, 4\] to match 'target_logits' "
     r"\[B, G\+1, V\] = \[3, 5, 100\], got \[3, 3\]"),
    ("draft_tokens-wide-with-draft_logits", VERIFY,
     lambda: dict(target_logits=torch.randn(B, G + 1, V),
                    draft_tokens=torch.zeros(B, G + 2, dtype=torch.int64)), ValueError,
     r"'draft_tokens' must have shape \[B, G\] = \[3, 4\] to match 'target_logits' "
     r"\[B, G\+1, V\] = \[3, 5, 100\], got \[3, 6\]"),
    ("target-3d-wrong-G-draft_logits-agrees", VERIFY,
     lambda: dict(target_logits=torch.randn(B, G + 1, V),
                    draft_tokens=torch.zeros(B, G - 1, dtype=torch.int64),
                    draft_logits=torch.randn(B, G - 1, V)), ValueError,
     r"'target_logits' must have shape \[B, G\+1, V\] = \[3, 4, 100\], got \[3, 5, 100\]"),
    ("target-3d-wrong-B", VERIFY,
     lambda: dict(target_logits=torch.randn(B + 1, G + 1, V)), ValueError,
     r"'target_logits' must have shape \[B, G\+1, V\] = \[3, 5, 100\], got \[4, 5, 100\]"),
    ("num_draft-int64", VERIFY, lambda: dict(num_draft=i64(0, 2, 4)), TypeError,
     r"'num_draft' must have dtype Int, got Long"),
    ("num_draft-shape", VERIFY, lambda: dict(num_draft=i32(0, 2, 4, 1)), ValueError,
     r"'num_draft' must have shape \[B\] = \[3\], got \[4\]"),
    ("num_draft-2d", VERIFY, lambda: dict(num_draft=i32(0, 2, 4)[:, None]), ValueError,
     r"'num_draft' must have shape \[B\] = \[3\], got \[3, 1\]"),
    ("draft_logits-float64", VERIFY, lambda: dict(draft_logits=torch.randn(B, G, V).double()),
     TypeError, r"'draft_logits' must have dtype Float or BFloat16 or Half, got Double"),
    ("draft_logits-vocab", VERIFY, lambda: dict(draft_logits=torch.randn(B, G, V + 1)), ValueError,
     r"'draft_logits' must have shape \[B, G, V\] = \[3, 4, 100\], got \[3, 4, 101\]"),
    ("draft_logits-G+1", VERIFY, lambda: dict(draft_logits=torch.randn(B, G + 1, V)), ValueError,
     r"'draft_logits' must have shape \[B, G, V\] = \[3, 4, 100\], got \[3, 5, 100\]"),
    ("draft_logits-2d", VERIFY, lambda: dict(draft_logits=torch.randn(B * G, V)), ValueError,
     r"'draft_logits' must have shape \[B, G, V\] = \[3, 4, 100\], got \[12, 100\]"),
    ("draft_temperature-float64", VERIFY, lambda: dict(draft_temperature=torch.ones(B).double()),
     TypeError, r"'draft_temperature' must have dtype Float, got Double"),
    ("draft_temperature-shape", VERIFY, lambda: dict(draft_temperature=torch.ones(1)), ValueError,
     r"'draft_temperature' must have shape \[B\] = \[3\], got \[1\]"),
    ("target_start-int64", VERIFY,
     lambda: {**ragged_args(), "target_start": i64(0, 3, 7)}, TypeError,
     r"'target_start' must have dtype Int, got Long"),
    ("target_start-shape", VERIFY, lambda: {**ragged_args(), "target_start": i32(0, 3)}, ValueError,
     r"'target_start' must have shape \[B\] = \[3\], got \[2\]"),
    ("rows-without-target_start", VERIFY,
     lambda: dict(target_logits=torch.randn(B * (G + 1) - 1, V)), ValueError,
     r"without 'target_start', 'target_logits' must hold B\*\(G\+1\) = 15 rows "
     r"\(the padded layout; B and G from 'draft_tokens' of shape \[3, 4\]\), got 14"),
    ("ragged-rows-without-target_start", VERIFY, lambda: {**ragged_args(), "target_start": None},
     ValueError,
     r"without 'target_start', 'target_logits' must hold B\*\(G\+1\) = 15 rows "
     r"\(the padded layout; B and G from 'draft_tokens' of shape \[3, 4\]\), got 12"),
    ("rows-without-target_start-narrow-drafts", VERIFY,
     lambda: dict(draft_tokens=torch.zeros(B, G - 1, dtype=torch.int64), draft_logits=None),
     ValueError,
     r"without 'target_start', 'target_logits' must hold B\*\(G\+1\) = 12 rows "
     r"\(the padded layout; B and G from 'draft_tokens' of shape \[3, 3\]\), got 15"),
]

# Value checks: always on CPU; on CUDA only with DSPARK_OPS_DEBUG=1 (they cost a sync).
VALUE_ERRORS = per_request_value_errors(VERIFY, B) + [
    ("num_draft-above-G", VERIFY, lambda: dict(num_draft=i32(0, 5, 4)), ValueError,
     r"'num_draft' values must lie in \[0, 4\], got 5 at index \[1\]"),
    ("num_draft-negative", VERIFY, lambda: dict(num_draft=i32(0, 2, -1)), ValueError,
     r"'num_draft' values must lie in \[0, 4\], got -1 at index \[2\]"),
    ("draft_token-V", VERIFY,
     lambda: dict(draft_tokens=i64([7, 7, 7, 7], [1, 100, 7, 7], [1, 2, 3, 4])), ValueError,
     r"'draft_tokens' values must lie in \[0, 99\], got 100 at index \[1, 1\]"),
    ("draft_token-negative-int32", VERIFY,
     lambda: dict(draft_tokens=i32([7, 7, 7, 7], [1, 2, 7, 7], [1, 2, 3, -1])), ValueError,
     r"'draft_tokens' values must lie in \[0, 99\], got -1 at index \[2, 3\]"),
    ("draft_temperature-negative", VERIFY, lambda: dict(draft_temperature=f32(1.0, 1.0, -1e-3)),
     ValueError, r"'draft_temperature' must be finite and >= 0, got -0.001 at index \[2\]"),
    ("draft_temperature-nan", VERIFY,
     lambda: dict(draft_temperature=f32(1.0, NAN, 1.0)), ValueError,
     r"'draft_temperature' must be finite and >= 0, got nan at index \[1\]"),
    ("draft_temperature-neg-inf", VERIFY, lambda: dict(draft_temperature=f32(-INF, 1.0, 1.0)),
     ValueError, r"'draft_temperature' must be finite and >= 0, got -inf at index \[0\]"),
    ("target_start-negative", VERIFY, lambda: {**ragged_args(), "target_start": i32(0, -1, 7)},
     ValueError, r"'target_start' values must lie in \[0, 11\], got -1 at index \[1\]"),
    ("target_start-past-rows", VERIFY, lambda: {**ragged_args(), "target_start": i32(12, 3, 7)},
     ValueError, r"'target_start' values must lie in \[0, 11\], got 12 at index \[0\]"),
    ("target_start+num_draft-past-rows", VERIFY,
     lambda: {**ragged_args(), "target_start": i32(0, 3, 8)},
     ValueError,
     r"'target_start \+ num_draft' values must lie in \[0, 11\], got 12 at index \[2\]"),
    # The CPU checks read the data through its strides: offenders at the last element read (of
    # a request's drafts, of the tensor), in non-contiguous layouts, and int64 ids beyond int32.
    ("draft_token-last-drafted-strided", VERIFY,
     lambda: dict(draft_tokens=non_contiguous(i64([7, 7, 7, 7], [1, 100, 7, 7], [1, 2, 3, 4]),
                                              fill=7)),
     ValueError, r"'draft_tokens' values must lie in \[0, 99\], got 100 at index \[1, 1\]"),
    ("draft_token-last-transposed-int32", VERIFY,
     lambda: dict(draft_tokens=non_contiguous(i32([7, 7, 7, 7], [1, 2, 7, 7], [1, 2, 3, 100]),
                                                "transposed")),
     ValueError, r"'draft_tokens' values must lie in \[0, 99\], got 100 at index \[2, 3\]"),
    ("draft_token-int64-beyond-int32", VERIFY,
     lambda: dict(draft_tokens=i64([7, 7, 7, 7], [1, 2, 7, 7], [1, 2, 3, 2**32 + 5])),
     ValueError,
     r"'draft_tokens' values must lie in \[0, 99\], got 4294967301 at index \[2, 3\]"),
    ("draft_temperature-inf-last", VERIFY, lambda: dict(draft_temperature=f32(1.0, 1.0, INF)),
     ValueError, r"'draft_temperature' must be finite and >= 0, got inf at index \[2\]"),
    ("position-int64-beyond-int32-last", VERIFY,
     lambda: dict(position=i64(5, 9, -(2**32))), ValueError,
     r"'position' values must lie in \[0, 4611686018427387904\], got -4294967296 at index \[2\]"),
]


def _with_overrides(device, overrides) -> dict:
    return with_overrides(valid_args(device), device, overrides)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message",
                         error_params(STRUCTURE_ERRORS, op_in_id=False))
def test_argument_errors(device, op, overrides, error, message):
    with raises(op, error, message):
        call_with(_with_overrides(device, overrides))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message", error_params(VALUE_ERRORS, op_in_id=False))
def test_value_errors(device, op, overrides, error, message):
    skip_value_checks_without_debug(device)
    with raises(op, error, message):
        call_with(_with_overrides(device, overrides))


@pytest.mark.parametrize("device", DEVICES)
def test_valid_arguments_accepted(device):
    # The base of the error tests is itself valid, in both layouts, so each error above is due
    # to its one change.
    args = valid_args(device)
    check_against_reference(Case(**args))
    check_against_reference(Case(**_with_overrides(device, lambda: ragged_args())))
    # Limits: num_draft = 0 and G, target_start + num_draft = R - 1, zero temperatures.
    edge = _with_overrides(device, lambda: {
        **ragged_args(), "target_start": i32(11, 0, 7), "num_draft": i32(0, 4, 4),
        "temperature": f32(0, 0, 0), "draft_temperature": f32(0, 0, 0)})
    check_against_reference(Case(**edge))


@pytest.mark.parametrize("device", DEVICES)
def test_ids_past_num_draft_are_not_checked(device):
    # Only positions < num_draft are read; garbage after them is accepted silently.
    args = valid_args(device)
    drafts = args["draft_tokens"].clone()
    drafts[0, :] = -7        # num_draft 0
    drafts[1, 2:] = V + 123  # num_draft 2
    for dtype, kind in [(torch.int64, None), (torch.int32, None), (torch.int64, "strided"),
                        (torch.int32, "transposed")]:
        typed = drafts.to(dtype)
        case = Case(**{**args, "draft_tokens": non_contiguous(typed, kind) if kind else typed})
        out = check_against_reference(case)
        k = int(out.num_accepted[1])
        assert torch.equal(out.tokens[1, :k], drafts[1, :k].to(device))


@cuda_only
@pytest.mark.parametrize("name", ["draft_tokens", "num_draft", "temperature", "seed", "position",
                                  "draft_logits", "target_start", "draft_temperature"])
def test_device_mismatch(name):
    args = _with_overrides("cuda", lambda: ragged_args())
    args[name] = args[name].cpu()
    message = rf"verify\(\): '{name}' must be on cuda:\d+ like 'target_logits', got cpu"
    with pytest.raises(ValueError, match=message):
        call_with(args)


@cuda_only
def test_device_mismatch_target_on_cpu():
    args = valid_args("cuda")
    args["target_logits"] = args["target_logits"].cpu()
    message = r"verify\(\): 'draft_tokens' must be on cpu like 'target_logits', got cuda:\d+"
    with pytest.raises(ValueError, match=message):
        call_with(args)


@cuda_only
def test_cuda_out_of_range_drafts_without_value_checks():
    # Without DSPARK_OPS_DEBUG the CUDA op does not check ids; an out-of-range draft is rejected
    # at its position (never used as an index) and reported with valid = False.
    if DEBUG:
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    case = make_case(64, 6, 5000, seed=95, temperature="mixed", num_draft=6)
    gen = generator(96)
    bad = torch.rand(case.draft_tokens.shape, generator=gen) < 0.15
    junk = torch.tensor([-1, 5000, 2**40, -(2**40)])[torch.randint(0, 4, bad.shape, generator=gen)]
    case.draft_tokens = torch.where(bad, junk, case.draft_tokens)
    out = case.to("cuda").call()
    check_output_contract(case.to("cuda"), out)
    assert_same_outputs(out, case.call(reference.verify), case)


@cuda_only
def test_cuda_calls_on_concurrent_streams_and_in_sequence():
    # The CUDA op keeps its counters in one buffer per stream, returned to zero by every call:
    # calls of changing shapes in a row on one stream, and calls overlapping on two streams,
    # each equal the reference.
    cases = [make_case(b, g, v, seed=101 + i, temperature="mixed")
             for i, (b, g, v) in enumerate([(64, 7, 8193), (3, 2, 100), (17, 12, 5000)])]
    expected = [case.call(reference.verify) for case in cases]
    on_gpu = [case.to("cuda") for case in cases]
    on_cpu = lambda out: reference.VerifyOutput(*(t.cpu() for t in out))  # noqa: E731
    for _ in range(2):
        for case, gpu_case, want in zip(cases, on_gpu, expected):
            assert_same_outputs(on_cpu(gpu_case.call()), want, case)
    outputs = on_two_streams([on_gpu[0].call, on_gpu[1].call])
    for k in range(2):
        for got in outputs[k]:
            assert_same_outputs(on_cpu(got), expected[k], cases[k])


# --------------------------------------------------------------------------------------------
# CPU and CUDA agree
# --------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("shape", [(64, 7, 8193), (3, 32, 151936), (64, 16, 100)],
                         ids=lambda s: "B{}-G{}-V{}".format(*s))
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_cpu_and_cuda_agree(shape, draft, dtype):
    case = make_case(*shape, seed=stable_seed("agree", shape, draft), temperature="mixed",
                     draft=draft, dtype=dtype, draft_temperature="sampled")
    cpu, cuda = case.call(), case.to("cuda").call()
    assert_same_outputs(cpu, type(cpu)(*(t.cpu() for t in cuda)), case)


# --------------------------------------------------------------------------------------------
# Extreme random words
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("position", [579566, 621595], ids=["high-word", "low-word"])
def test_single_candidate_with_extreme_resample_word(device, draft, position):
    # Element 0 of the resampling stream at seed 12345 and ``position`` is an extreme Philox word
    # (test_random.py): 0xffffffb6 or 0x72. The emitting row is placed at that position and has
    # one candidate, token 0 (V = 1, or p one-hot on 0 after a rejected draft), so that element
    # alone decides the race: the op must still emit 0, never "no winner".
    vocab = 1 if draft == "onehot" else 64
    target = torch.randn(2, vocab)
    if draft == "logits":
        target[:, 1:] = -INF  # p one-hot on token 0
    drafts = torch.full((1, 1), 0 if draft == "onehot" else 5)
    draft_logits = None if draft == "onehot" else one_hot_logits(torch.tensor([[5]]), vocab)
    for n in (0, 1):
        # One-hot drafts with n = 1: token 0 is accepted and the bonus row 1 emits; with draft
        # logits the draft (p = 0) is rejected and row 0 emits.
        emitting_row = n if draft == "onehot" else 0
        case = Case(target, drafts, torch.tensor([n], dtype=torch.int32), torch.ones(1),
                    torch.tensor([12345]), torch.tensor([position - 1 - emitting_row]),
                    draft_logits=draft_logits).to(device)
        out = check_against_reference(case)
        assert out.tokens.cpu().tolist() == ([[0, 0]] if emitting_row else [[0, -1]])
        assert bool(out.valid)


# --------------------------------------------------------------------------------------------
# Python numbers for the per-request arguments (broadcast to [B] by the wrapper)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_scalars_broadcast_like_tensors(device):
    args = valid_args(device)
    args.pop("target_start")
    logits, drafts = args.pop("target_logits"), args.pop("draft_tokens")
    num_draft, seed, position = args["num_draft"], args["seed"], args["position"]

    def full(value, dtype):
        return torch.full((B,), value, dtype=dtype, device=device)

    for temperature, draft_temperature in ((0.8, 0.5), (0.0, 0.0), (1, 2)):
        for filters in ({}, dict(top_k=7, top_p=0.9, min_p=0.05)):
            got = dspark_ops.verify(logits, drafts, num_draft, temperature, seed, position,
                                    draft_logits=args["draft_logits"],
                                    draft_temperature=draft_temperature, **filters)
            want = dspark_ops.verify(
                logits, drafts, num_draft, full(temperature, torch.float32), seed, position,
                draft_logits=args["draft_logits"],
                draft_temperature=full(draft_temperature, torch.float32),
                **{k: full(v, torch.int32 if k == "top_k" else torch.float32)
                   for k, v in filters.items()})
            assert torch.equal(got.tokens, want.tokens), (temperature, filters)
            assert torch.equal(got.num_accepted, want.num_accepted)


@pytest.mark.parametrize("name,value,message", [
    ("temperature", "1.0", r"'temperature' must be a tensor \[B\] or a float shared by every "
                           r"request, got str"),
    ("temperature", True, r"'temperature' must be a tensor \[B\] or a float .*, got bool"),
    ("top_k", 2.5, r"'top_k' must be a tensor \[B\] or an int shared by every request, got float"),
    ("top_p", [0.9, 0.9, 0.9], r"'top_p' must be a tensor \[B\] or a float .*, got list"),
])
def test_scalar_of_the_wrong_kind_is_named(name, value, message):
    args = valid_args("cpu")
    args[name] = value
    with pytest.raises(TypeError, match=r"verify\(\): " + message):
        dspark_ops.verify(args.pop("target_logits"), args.pop("draft_tokens"),
                          args.pop("num_draft"), args.pop("temperature"), args.pop("seed"),
                          args.pop("position"), **args)


# --------------------------------------------------------------------------------------------
# Vocabulary tails (cases/tails.py): the winner at V - 1 and at every block boundary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", VERIFY_KINDS)
@pytest.mark.parametrize("vocab", VERIFY_VOCABS)
def test_boundary_ids_are_emitted(vocab, kind):
    """The CPU kernel's blocks (and the CUDA plan's chunks) must reach their first and last id
    and V - 1, with V one past a block: the race's sampled winner, the statistics' maximum and
    the only token the filters or the mask keep are emitted, with the reference's logprobs."""
    args, where = verify_tail_case(vocab, kind, seed=vocab)
    check_verify_tail(torch.ops.dspark_ops.verify, args, where)
