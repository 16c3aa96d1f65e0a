"""verify's sampling filters (top_k, top_p, min_p, allowed_token_mask) and logprobs: exact agreement
with reference.verify (tokens, num_accepted and valid exactly, logprobs within 1e-5) and with the
processed distribution spelt out independently (reference.filter_logits on the masked rows), over
filter kinds, per-request settings, layouts, dtypes and draft kinds; literal outcomes (ties at the
top-k and top-p boundaries, off values, one-token and empty masks, excluded drafts, unneeded rows
holding garbage); statistical losslessness against the processed distribution, with broken
variants shown to fail the same check; every argument check of the new arguments."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import DEVICES, cuda_only, full_tests
from stats import chi_square, chi_square_passes
from cases.arguments import (
    error_params,
    raises,
    sampling_filter_errors,
    sampling_filter_value_errors,
    skip_value_checks_without_debug,
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
    is_greedy,
    stable_seed,
)
from cases.verify import (
    B,
    G,
    STAT_BLOCK,
    V,
    accepted_length_distribution,
    assert_same_outputs,
    Case,
    certain_accepts,
    check_output_contract,
    make_case,
    one_hot_logits,
    positions_distributed_as_target,
    ragged_args,
    stat_rows,
    valid_args,
)
from cases.verify_filters import (
    KINDS,
    LOGPROB_TOLERANCE,
    NO_FILTERS,
    check_logprob_contract,
    Filters,
    pack_mask,
    random_filters,
    to_ragged_with_mask,
)


# --------------------------------------------------------------------------------------------
# Filter arguments
# --------------------------------------------------------------------------------------------


def run(case: Case, filters: Filters, fn=dspark_ops.verify, logprobs: bool = True):
    return case.call(fn, **filters.kwargs(), return_logprobs=logprobs)


def check_filtered(case: Case, filters: Filters):
    """Runs the op with return_logprobs; checks the output contracts, exact equality with the
    reference (logprobs within 1e-5), the processed distribution spelt out, and that the call
    without return_logprobs gives the same tokens and logprobs None. Returns the outputs."""
    got = run(case, filters)
    check_output_contract(case, got[:3])
    expected = run(case, filters, reference.verify)
    assert_same_outputs(got, expected, case)
    torch.testing.assert_close(got.logprobs.cpu(), expected.logprobs.cpu(), **LOGPROB_TOLERANCE)
    check_logprob_contract(case, filters, got)
    plain = run(case, filters, logprobs=False)
    assert plain.logprobs is None
    assert_same_outputs(plain, got, case)
    return got


def differs(a, b) -> torch.Tensor:
    """bool [B]: requests whose tokens or num_accepted differ."""
    return (a.tokens != b.tokens).any(1) | (a.num_accepted != b.num_accepted)


# --------------------------------------------------------------------------------------------
# Exact agreement with the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_reference(device, kind, draft):
    # Greedy and sampled requests with per-request settings (some off) in one launch.
    batch, block, vocab = 48, 7, 1000
    case = make_case(batch, block, vocab, seed=stable_seed("filters", kind, draft),
                     temperature="mixed", draft=draft)
    filters = random_filters(case, KINDS[kind], generator(stable_seed("settings", kind)))
    out = check_filtered(case.to(device), filters.to(device))
    accepted = out.num_accepted.cpu()
    assert (accepted > 0).any() and (accepted < case.num_draft).any()
    # The arguments are read: the same call without them changes sampled requests' results.
    changed = differs(out, run(case.to(device), NO_FILTERS)).cpu()
    assert changed[~is_greedy(case.temperature)].any()
    # Greedy requests emit the argmax of the masked logits: top-k, top-p, min-p cannot change it.
    if "mask" not in KINDS[kind]:
        assert not changed[is_greedy(case.temperature)].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 2), (5, 3, 33), (3, 16, 8193), (7, 2, 151936)],
                         ids=lambda s: "B{}-G{}-V{}".format(*s))
def test_shapes(device, shape):
    # Vocabulary tails around the 32-bit mask words, one-token vocabularies, many rows, the
    # largest vocabulary: all filters and a mask at once.
    batch, block, vocab = shape
    case = make_case(batch, block, vocab, seed=stable_seed("shapes", shape), temperature="mixed")
    filters = random_filters(case, KINDS["all-mask"], generator(stable_seed("shape-f", shape)))
    check_filtered(case.to(device), filters.to(device))


def _full_sweep():
    if not full_tests():
        return [pytest.param(None, marks=pytest.mark.skip(reason="set DSPARK_OPS_TEST_FULL=1"))]
    return [pytest.param((batch, block, vocab), id=f"B{batch}-G{block}-V{vocab}")
            for batch, block, vocab in [(64, 16, 8193), (64, 1, 10000), (3, 32, 151936),
                                        (64, 32, 2), (1, 7, 151936)]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", _full_sweep())
def test_matches_reference_full_sweep(device, shape):
    for i, (kind, draft, dtype) in enumerate([("all-mask", "logits", torch.float32),
                                              ("all", "onehot", torch.bfloat16),
                                              ("mask", "logits", torch.float16)]):
        case = make_case(*shape, seed=stable_seed("full", shape, i), temperature="mixed",
                         draft=draft, dtype=dtype)
        filters = random_filters(case, KINDS[kind], generator(stable_seed("full-f", shape, i)))
        check_filtered(case.to(device), filters.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_layouts_agree(device, draft):
    # Padded [B, G+1, V], flat [R, V] with and without target_start, and ragged rows with the
    # mask rows following them: the same results.
    batch, block, vocab = 24, 5, 700
    case = make_case(batch, block, vocab, seed=stable_seed("layouts", draft), temperature="mixed",
                     draft=draft)
    filters = random_filters(case, KINDS["all-mask"], generator(stable_seed("layouts-f", draft)))
    out = check_filtered(case.to(device), filters.to(device))
    flat = case.replace(target_logits=case.target_logits.reshape(-1, vocab))
    explicit = flat.replace(target_start=torch.arange(batch, dtype=torch.int32) * (block + 1))
    ragged, ragged_mask = to_ragged_with_mask(case, filters.allowed_token_mask, generator(7))
    assert ragged.target_logits.shape[0] != batch * (block + 1)
    for other, mask in ((flat, filters.allowed_token_mask),
                        (explicit, filters.allowed_token_mask), (ragged, ragged_mask)):
        other, other_filters = other.to(device), filters.replace(allowed_token_mask=mask).to(device)
        got = run(other, other_filters)
        assert_same_outputs(got, out, other)
        assert torch.equal(got.logprobs, out.logprobs)
    check_filtered(ragged.to(device), filters.replace(allowed_token_mask=ragged_mask).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_logit_dtypes(device, dtype):
    # Every target dtype, with draft logits of another dtype and with one-hot drafts.
    other = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float16,
             torch.float16: torch.float32}[dtype]
    case = make_case(16, 7, 3001, seed=stable_seed("dtypes", dtype), temperature="mixed",
                     dtype=dtype, draft_dtype=other, draft_temperature="sampled")
    filters = random_filters(case, KINDS["all-mask"], generator(stable_seed("dtype-f", dtype)))
    check_filtered(case.to(device), filters.to(device))
    check_filtered(case.replace(draft_logits=None).to(device), filters.to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_int32_draft_ids(device):
    case = make_case(16, 7, 1000, seed=71, temperature="mixed")
    filters = random_filters(case, KINDS["all-mask"], generator(72)).to(device)
    case = case.to(device)
    wide = check_filtered(case, filters)
    narrow = check_filtered(case.replace(draft_tokens=case.draft_tokens.int()), filters)
    assert_same_outputs(narrow, wide, case)
    assert torch.equal(narrow.logprobs, wide.logprobs)


@pytest.mark.parametrize("device", DEVICES)
def test_one_setting_per_request(device):
    # Requests differ only in their settings (same rows, seeds and drafts): each is verified
    # with its own, as when verified alone.
    batch, block, vocab = 12, 4, 500
    one = make_case(1, block, vocab, seed=74, temperature=0.9, num_draft=block)
    case = Case(one.target_logits.expand(batch, block + 1, vocab).contiguous(),
                one.draft_tokens.expand(batch, block).contiguous(),
                one.num_draft.expand(batch).contiguous(),
                one.temperature.expand(batch).contiguous(),
                one.seed.expand(batch).contiguous(), one.position.expand(batch).contiguous(),
                draft_logits=one.draft_logits.expand(batch, block, vocab).contiguous())
    filters = Filters(top_k=torch.tensor([0, 1, 3, 0, 0, 0, 0, 40, 2, 0, 0, 1], dtype=torch.int32),
                      top_p=torch.tensor([1, 1, 1, .5, .1, 1, 1, 1, .3, .9, 1, 1]).float(),
                      min_p=torch.tensor([0, 0, 0, 0, 0, .3, .05, 0, 0, .1, 0, 1]).float())
    out = check_filtered(case.to(device), filters.to(device))
    for b in range(batch):
        alone = Filters(**{k: v[b : b + 1] for k, v in filters.kwargs().items() if v is not None})
        got = run(one.to(device), alone.to(device))
        assert torch.equal(got.tokens[0], out.tokens[b]) and torch.equal(got.logprobs[0],
                                                                         out.logprobs[b])
    # Request 10 has every filter off, so it equals the unfiltered call.
    plain = run(one.to(device), NO_FILTERS)
    assert torch.equal(plain.tokens[0], out.tokens[10])
    assert torch.equal(plain.logprobs[0], out.logprobs[10])
    assert len({tuple(t) for t in out.tokens.cpu().tolist()}) > 1


# --------------------------------------------------------------------------------------------
# Literal outcomes
# --------------------------------------------------------------------------------------------


def repeated_row_case(row: torch.Tensor, trials: int, seed: int, temperature: float = 1.0):
    """``trials`` requests with num_draft = 0 all emitting from the same row (target_start 0):
    a sample of the row's processed distribution per request."""
    gen = generator(seed)
    return Case(row[None].float(), torch.zeros(trials, 1, dtype=torch.int64),
                torch.zeros(trials, dtype=torch.int32), torch.full((trials,), temperature),
                torch.randint(-(2**62), 2**62, (trials,), generator=gen),
                torch.randint(0, 2**40, (trials,), generator=gen),
                target_start=torch.zeros(trials, dtype=torch.int32))


def emitted_tokens_and_logprobs(case, filters, device):
    """The emitted token and logprob of each request of a repeated_row_case; checks that
    reference.filter_logits keeps exactly the tokens the op emits over the trials."""
    out = check_filtered(case.to(device), filters.to(device))
    tokens = out.tokens[:, 0].cpu()
    one = {k: None if v is None else v[:1] for k, v in filters.kwargs().items()}
    kept = reference.filter_logits(case.target_logits, case.temperature[:1], top_k=one["top_k"],
                                   top_p=one["top_p"], min_p=one["min_p"]) > -INF
    assert kept[0].nonzero()[:, 0].tolist() == sorted(set(tokens.tolist()))
    return tokens, out.logprobs[:, 0].cpu().double()


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_boundary_ties_are_kept(device):
    # Integer logits [3, 2, 2, 2, 1, 0, ...]: top_k = 2 and 3 both end inside the tie of the
    # three 2s, so all of them are kept (4 tokens); top_k = 4 keeps them and nothing more, 5
    # adds the 1. The emitted tokens cover exactly the kept set and their logprobs are
    # log(e^z / kept total).
    vocab, trials = 40, 400
    row = torch.zeros(vocab)
    row[[7, 3, 20, 31, 11]] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    for k, kept in ((2, [3, 7, 20, 31]), (3, [3, 7, 20, 31]), (4, [3, 7, 20, 31]),
                    (5, [3, 7, 11, 20, 31])):
        case = repeated_row_case(row, trials, seed=80 + k)
        tokens, logprobs = emitted_tokens_and_logprobs(
            case, Filters(top_k=torch.full((trials,), k, dtype=torch.int32)), device)
        assert sorted(set(tokens.tolist())) == kept, k
        total = row[kept].double().exp().sum()
        torch.testing.assert_close(logprobs, row[tokens].double() - total.log(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_boundary_ties_are_kept(device):
    # Integer logits: one 2, three 1s, the rest 0 (V = 50). Each 1 has weight above it e^2
    # (strictly larger logits only), so with top_p between e^2 / Z and (e^2 + e) / Z all three
    # 1s are kept (a sorted-cumsum cut would keep one of them); below e^2 / Z only the 2.
    vocab, trials = 50, 400
    row = torch.zeros(vocab)
    ones = [5, 17, 40]
    row[9], row[ones] = 2.0, 1.0
    e = math.e
    z = e**2 + 3 * e + (vocab - 4)
    inside, below = (e**2 + 0.5 * e) / z, 0.5 * e**2 / z
    for top_p, kept in ((inside, [5, 9, 17, 40]), (below, [9])):
        case = repeated_row_case(row, trials, seed=90)
        tokens, logprobs = emitted_tokens_and_logprobs(
            case, Filters(top_p=torch.full((trials,), top_p)), device)
        assert sorted(set(tokens.tolist())) == kept, top_p
        total = row[kept].double().exp().sum()
        torch.testing.assert_close(logprobs, row[tokens].double() - total.log(), rtol=0, atol=1e-5)
    # Top-p runs on the renormalised top-k distribution: after top_k = 4 (the 2 and the 1s) the
    # weight above each 1 is e^2 / (e^2 + 3e) = 0.475 of the kept total, so top_p = 0.5 keeps
    # them and 0.4 drops them (over the whole row, 0.4 would keep them: e^2 / Z = 0.12).
    for top_p, kept in ((0.5, [5, 9, 17, 40]), (0.4, [9])):
        both = Filters(top_k=torch.full((trials,), 4, dtype=torch.int32),
                       top_p=torch.full((trials,), top_p))
        tokens, _ = emitted_tokens_and_logprobs(repeated_row_case(row, trials, seed=91), both,
                                                device)
        assert sorted(set(tokens.tolist())) == kept, top_p


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_literal(device):
    # Weights e^(z - max) at T = 0.5 for logits [0, -0.5, -1, -2, ...]: min_p = 0.3 keeps
    # e^(2 * -0.5) = 0.37 and drops e^-2 = 0.14; min_p = 1 keeps only the max (logprob 0).
    vocab, trials = 30, 300
    row = torch.full((vocab,), -5.0)
    row[[4, 8, 15, 22]] = torch.tensor([0.0, -0.5, -1.0, -2.0])
    for min_p, kept in ((0.3, [4, 8]), (1.0, [4]), (0.1, [4, 8, 15])):
        case = repeated_row_case(row, trials, seed=95, temperature=0.5)
        tokens, logprobs = emitted_tokens_and_logprobs(
            case, Filters(min_p=torch.full((trials,), min_p)), device)
        assert sorted(set(tokens.tolist())) == kept, min_p
        total = (2 * row[kept].double()).exp().sum()
        torch.testing.assert_close(logprobs, 2 * row[tokens].double() - total.log(), rtol=0,
                                   atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_off_values_equal_no_filter(device):
    # top_k = 0 or >= V, top_p = 1, min_p = 0 and an all-ones mask (bits past V random) give
    # bit-identical results, logprobs included, to passing nothing.
    case = make_case(32, 6, 777, seed=100, temperature="mixed").to(device)
    plain = check_filtered(case, NO_FILTERS)
    batch, rows = 32, 32 * 7
    gen = generator(101)
    offs = [
        Filters(top_k=torch.zeros(batch, dtype=torch.int32)),
        Filters(top_k=torch.full((batch,), 777, dtype=torch.int32)),
        Filters(top_k=torch.full((batch,), 2**31 - 1, dtype=torch.int32)),
        Filters(top_p=torch.ones(batch)),
        Filters(min_p=torch.zeros(batch)),
        Filters(allowed_token_mask=pack_mask(torch.ones(rows, 777, dtype=torch.bool), gen)),
        Filters(top_k=torch.zeros(batch, dtype=torch.int32), top_p=torch.ones(batch),
                min_p=torch.zeros(batch),
                allowed_token_mask=torch.full((rows, 25), -1, dtype=torch.int32)),
    ]
    for filters in offs:
        got = check_filtered(case, filters.to(device))
        assert_same_outputs(got, plain, case)
        assert torch.equal(got.logprobs, plain.logprobs)
    # top_k = V - 1 is on: it drops the row's smallest logit (so results can change).
    near = Filters(top_k=torch.full((batch,), 776, dtype=torch.int32))
    check_filtered(case, near.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
def test_mask_allowing_one_token(device, draft):
    # Each row allows one token: a draft is accepted iff it is that token, every emitted token is
    # its row's allowed token and its logprob is exactly 0, greedy or sampled, with the other
    # filters on as well.
    batch, block, vocab = 40, 5, 301
    case = make_case(batch, block, vocab, seed=stable_seed("one", draft), temperature="mixed",
                     draft=draft, num_draft=block)
    gen = generator(111)
    rows = batch * (block + 1)
    only = torch.randint(0, vocab, (rows,), generator=gen).reshape(batch, block + 1)
    # Half the drafts are their row's allowed token, so runs of accepts occur.
    use = torch.rand(batch, block, generator=gen) < 0.7
    case.draft_tokens = torch.where(use, only[:, :block], case.draft_tokens)
    allowed = torch.nn.functional.one_hot(only.reshape(-1), vocab).bool()
    filters = random_filters(case, KINDS["all"], gen).replace(allowed_token_mask=pack_mask(allowed))
    out = check_filtered(case.to(device), filters.to(device))
    tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu().long()
    emitted = torch.arange(block + 1)[None] <= accepted[:, None]
    assert torch.equal(tokens[emitted], only[emitted])
    assert (out.logprobs.cpu()[emitted] == 0).all() and out.valid.all()
    first_other = (case.draft_tokens != only[:, :block]).int().argmax(1)
    all_allowed = (case.draft_tokens == only[:, :block]).all(1)
    assert torch.equal(accepted, torch.where(all_allowed, block, first_other))
    assert (accepted >= 2).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", ["greedy", "sampled"])
@pytest.mark.parametrize("empty", ["no-bit", "only-non-finite"])
def test_mask_allowing_nothing_on_a_needed_row(device, temperature, empty):
    # Rows before k are certain accepts; row k allows no token (or only tokens whose logits are
    # not finite): token 0 there, valid = False, logprob -inf; earlier logprobs are 0 (one-hot).
    batch, block, vocab = 32, 6, 333
    gen = generator(121)
    k = torch.randint(0, block + 1, (batch,), generator=gen)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    allowed = torch.ones(batch, block + 1, vocab, dtype=torch.bool)
    rows = torch.arange(batch)
    target[rows, k] = torch.randn(batch, vocab, generator=gen)
    if empty == "no-bit":
        allowed[rows, k] = False
    else:
        allowed[rows, k] = torch.rand(batch, vocab, generator=gen) < 0.3
        target[rows, k] = torch.where(allowed[rows, k], torch.tensor([NAN, INF, -INF])[
            torch.randint(0, 3, (batch, vocab), generator=gen)], target[rows, k])
    case = Case(target, drafts, torch.maximum(k, torch.randint(0, block + 1, (batch,),
                                                               generator=gen)).int(),
                torch.zeros(batch) if temperature == "greedy" else 0.5 + torch.rand(batch,
                                                                                     generator=gen),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen), draft_logits=draft_logits)
    filters = random_filters(case, KINDS["all"], gen).replace(
        allowed_token_mask=pack_mask(allowed.reshape(-1, vocab)))
    out = check_filtered(case.to(device), filters.to(device))
    assert torch.equal(out.num_accepted.cpu().long(), k)
    assert (out.tokens.cpu()[rows, k] == 0).all() and not out.valid.any()
    logprobs = out.logprobs.cpu()
    assert (logprobs[rows, k] == -INF).all()
    assert (logprobs[torch.arange(block + 1)[None] < k[:, None]] == 0).all()


EXCLUSIONS = ["top_k", "top_p", "min_p", "mask"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "onehot"])
@pytest.mark.parametrize("exclusion", EXCLUSIONS)
def test_excluded_draft_is_always_rejected(device, draft, exclusion):
    # Row k: the draft token is the second most probable (p ~ 0.3 unfiltered, accepted often
    # without the filter) but top_k = 1, top_p = 0.2 (the top token has 0.6), min_p = 0.6 or a
    # mask bit drops it: always rejected at row k, and the correction is never the draft.
    batch, block, vocab = 64, 4, 600
    gen = generator(stable_seed("exclude", exclusion, draft))
    k = torch.randint(0, block, (batch,), generator=gen)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    rows = torch.arange(batch)
    top, x = torch.rand(batch, vocab, generator=gen).argsort(-1)[:, :2].unbind(1)
    row = torch.randn(batch, vocab, generator=gen) - 10.0  # a tail of ~0.1% of the mass
    row[rows, top] = math.log(0.6) + 4.0
    row[rows, x] = math.log(0.3) + 4.0
    target[rows, k] = row
    draft_logits[rows, k] = one_hot_logits(x, vocab, value=0.0)
    drafts[rows, k] = x
    case = Case(target, drafts, torch.full((batch,), block, dtype=torch.int32), torch.ones(batch),
                torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                torch.randint(0, 2**40, (batch,), generator=gen),
                draft_logits=draft_logits if draft == "logits" else None)
    filters = {
        "top_k": Filters(top_k=torch.ones(batch, dtype=torch.int32)),
        "top_p": Filters(top_p=torch.full((batch,), 0.2)),
        "min_p": Filters(min_p=torch.full((batch,), 0.6)),
    }.get(exclusion)
    if exclusion == "mask":
        allowed = torch.ones(batch, block + 1, vocab, dtype=torch.bool)
        allowed[rows, k, x] = False
        filters = Filters(allowed_token_mask=pack_mask(allowed.reshape(-1, vocab)))
    out = check_filtered(case.to(device), filters.to(device))
    assert torch.equal(out.num_accepted.cpu().long(), k) and out.valid.all()
    assert (out.tokens.cpu()[rows, k] != x).all()
    # Without the exclusion the same drafts are accepted at row k about 30% of the time.
    assert (run(case.to(device), NO_FILTERS).num_accepted.cpu().long() > k).sum() > batch // 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("garbage", ["nan", "neg-inf", "random"])
def test_rows_after_the_first_rejection_are_not_needed(device, garbage):
    # Row k rejects for sure (its draft is disallowed); rows after it hold garbage logits and
    # garbage mask rows (all zero or random): the results, logprobs included, do not depend on
    # them, with every filter on.
    batch, block, vocab = 32, 5, 257
    gen = generator(stable_seed("unneeded", garbage))
    k = torch.randint(0, block, (batch,), generator=gen)
    drafts, target, draft_logits = certain_accepts(batch, block, vocab, gen)
    rows = torch.arange(batch)
    target[rows, k] = torch.randn(batch, vocab, generator=gen)
    allowed = torch.ones(batch, block + 1, vocab, dtype=torch.bool)
    allowed[rows, k, drafts[rows, k]] = False
    later = torch.arange(block + 1)[None] > k[:, None]
    junk = {"nan": torch.full((batch, block + 1, vocab), NAN),
            "neg-inf": torch.full((batch, block + 1, vocab), -INF),
            "random": 5 * torch.randn(batch, block + 1, vocab, generator=gen)}[garbage]
    temperature = torch.where(rows % 3 == 0, 0.0, 0.5 + torch.rand(batch, generator=gen))
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    positions = torch.randint(0, 2**40, (batch,), generator=gen)

    def build(target_rows_, allowed_):
        case = Case(target_rows_, drafts, torch.full((batch,), block, dtype=torch.int32),
                    temperature, seeds, positions, draft_logits=draft_logits)
        filters = Filters(top_k=torch.full((batch,), 5, dtype=torch.int32),
                          top_p=torch.full((batch,), 0.9), min_p=torch.full((batch,), 0.01),
                          allowed_token_mask=pack_mask(allowed_.reshape(-1, vocab)))
        return case.to(device), filters.to(device)

    clean = check_filtered(*build(target, allowed))
    garbage_allowed = allowed.clone()
    garbage_allowed[later] = torch.rand(int(later.sum()), vocab, generator=gen) < 0.01
    dirty = check_filtered(*build(torch.where(later[..., None], junk, target), garbage_allowed))
    assert torch.equal(clean.num_accepted.cpu().long(), k) and clean.valid.all()
    assert_same_outputs(dirty, clean, build(target, allowed)[0])
    assert torch.equal(dirty.logprobs, clean.logprobs)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_logprobs_use_temperature_one(device):
    # A greedy request emits the masked argmax whatever the filters; its logprobs come from the
    # processed distribution at T = 1, so they change with the filters (unlike the tokens).
    case = make_case(32, 5, 400, seed=131, temperature="greedy", num_draft=5).to(device)
    gen = generator(132)
    filters = Filters(top_k=torch.randint(1, 10, (32,), generator=gen).int(),
                      top_p=torch.full((32,), 0.7)).to(device)
    plain, filtered = check_filtered(case, NO_FILTERS), check_filtered(case, filters)
    assert_same_outputs(filtered, plain, case)
    emitted = plain.logprobs > -INF
    assert (filtered.logprobs[emitted] > plain.logprobs[emitted]).any()  # renormalised higher
    unit = check_filtered(case.replace(temperature=torch.full_like(case.temperature, 1e-6)),
                          filters)
    assert torch.equal(unit.logprobs, filtered.logprobs)


# --------------------------------------------------------------------------------------------
# Statistical losslessness against the processed distribution
# --------------------------------------------------------------------------------------------

# Per filter: settings (one for every trial) and whether the drafts were sampled from the draft
# distribution filtered the same way (the drafting ops' output) or unfiltered. stat_rows: each
# target row has heads of 0.4, 0.2, 0.1 over a tail of 0.3, so every filter here drops mass; in
# "all" each of the three changes the kept set of some row (checked below).
STAT_FILTERS = {
    "top_k": (dict(top_k=40), False),
    "top_p": (dict(top_p=0.8), False),
    "min_p": (dict(min_p=0.003), False),
    "all": (dict(top_k=200, top_p=0.9, min_p=0.002), True),
    "mask": (dict(mask=0.5, top_p=0.9), False),
}
STAT_TEMPERATURE = 0.8
# test_verify.py's statistical tests use V = 4096; the filtered rows cost more per element, so
# these use V = 2048 with the same 10 V trials per launch.
STAT_VOCAB = 2048
STAT_TRIALS = 10 * STAT_VOCAB


def stat_setup(name: str, seed: int):
    """The shared rows and settings of one statistical launch, the exactly computed processed
    distributions p [G+1, V] (float64) and the drafts' distribution q [G, V]."""
    settings, filtered_drafts = STAT_FILTERS[name]
    gen = generator(seed)
    target, draft = stat_rows(gen, STAT_TEMPERATURE, STAT_VOCAB)
    block, vocab = STAT_BLOCK, STAT_VOCAB
    filters = Filters()
    rows_t = torch.full((block + 1,), STAT_TEMPERATURE)
    if "top_k" in settings:
        filters.top_k = torch.tensor([settings["top_k"]], dtype=torch.int32)
    if "top_p" in settings:
        filters.top_p = torch.tensor([settings["top_p"]])
    if "min_p" in settings:
        filters.min_p = torch.tensor([settings["min_p"]])
    masked = target
    if "mask" in settings:
        # Random bits, with each row's two heaviest tokens allowed so that drafts (whose
        # heaviest token is shared with the target) are accepted often enough to reach every
        # position.
        allowed = torch.rand(block + 1, vocab, generator=gen) < settings["mask"]
        allowed |= target >= target.topk(2, -1).values[:, 1:]
        filters.allowed_token_mask = pack_mask(allowed, gen)
        masked = torch.where(allowed, target, -INF)
    per = lambda t, n: None if t is None else t.expand(n)  # noqa: E731
    processed = reference.filter_logits(masked, rows_t, top_k=per(filters.top_k, block + 1),
                                        top_p=per(filters.top_p, block + 1),
                                        min_p=per(filters.min_p, block + 1))
    p = torch.softmax(processed.double() / STAT_TEMPERATURE, -1)
    if filtered_drafts:
        draft = reference.filter_logits(draft, rows_t[:block],
                                        top_k=per(filters.top_k, block),
                                        top_p=per(filters.top_p, block),
                                        min_p=per(filters.min_p, block))
    q = torch.softmax(draft.double() / STAT_TEMPERATURE, -1)
    return gen, target, draft, filters, p, q


def run_filtered_trials(gen, target, draft, filters: Filters, q, device, *, trials=STAT_TRIALS):
    """``trials`` independent requests sharing the target rows (target_start 0, so the mask rows
    too) and a stride-0 broadcast of the draft rows, drafts sampled from q, the settings
    broadcast to every request. Returns (tokens, num_accepted)."""
    block, vocab = STAT_BLOCK, STAT_VOCAB
    drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True, generator=gen)
                          for j in range(block)], 1)
    case = Case(target, drafts, torch.full((trials,), block, dtype=torch.int32),
                torch.full((trials,), STAT_TEMPERATURE),
                torch.randint(-(2**62), 2**62, (trials,), generator=gen),
                torch.randint(0, 2**40, (trials,), generator=gen),
                draft_logits=draft, target_start=torch.zeros(trials, dtype=torch.int32)).to(device)
    case.draft_logits = case.draft_logits.expand(trials, block, vocab)
    broadcast = Filters(**{k: None if v is None or k == "allowed_token_mask" else v.expand(trials)
                           for k, v in filters.kwargs().items()})
    broadcast.allowed_token_mask = filters.allowed_token_mask
    out = run(case, broadcast.to(device), logprobs=False)
    assert out.valid.all()
    return out.tokens.cpu(), out.num_accepted.cpu().long()


def stat_failures(tokens, accepted, p):
    results = positions_distributed_as_target(tokens, accepted, p)
    assert [r[0] for r in results][:3] == [0, 1, 2], f"too few trials reach positions: {results}"
    return results, [r for r in results if not r[4]]


def processed_stat_probs(target, settings: dict) -> torch.Tensor:
    """The processed distribution of unmasked statistical rows under ``settings``."""
    rows = target.shape[0]
    kwargs = {k: torch.tensor([v], dtype=torch.int32 if k == "top_k" else torch.float32)
              .expand(rows) for k, v in settings.items()}
    z = reference.filter_logits(target, torch.full((rows,), STAT_TEMPERATURE), **kwargs)
    return torch.softmax(z.double() / STAT_TEMPERATURE, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STAT_FILTERS))
def test_output_distribution_is_processed_target(device, name):
    gen, target, draft, filters, p, q = stat_setup(name, stable_seed("stat-filter", name))
    settings = STAT_FILTERS[name][0]
    unfiltered = torch.softmax(target.double() / STAT_TEMPERATURE, -1)
    # The filter matters: every row drops tokens of noticeable mass and keeps several.
    dropped = torch.where(p == 0, unfiltered, 0.0).sum(-1)
    assert (dropped > 0.02).all() and ((p > 0).sum(-1) > 2).all(), dropped
    if name == "all":
        for drop in ("top_k", "top_p", "min_p"):
            fewer = dict(settings)
            fewer.pop(drop)
            assert not torch.equal(processed_stat_probs(target, fewer), p), f"{drop} is idle"
    tokens, accepted = run_filtered_trials(gen, target, draft, filters, q, device)
    emitted = torch.arange(STAT_BLOCK + 1)[None] <= accepted[:, None]
    rows = torch.arange(STAT_BLOCK + 1).expand_as(tokens)
    assert (p[rows[emitted], tokens[emitted]] > 0).all(), "a token outside the kept set"
    results, failed = stat_failures(tokens, accepted, p)
    assert not failed, f"chi-square rejects (k, trials, chi2, df): {failed}"
    # Accepted lengths follow the processed per-row acceptance rates sum(min(p, q)).
    alpha = torch.minimum(p[:STAT_BLOCK], q).sum(-1)
    chi2, df = chi_square(accepted, accepted_length_distribution(alpha))
    assert chi_square_passes(chi2, df), (chi2, df, alpha)


def top_p_on_unrenormalised_top_k(target, top_k: int, top_p: float):
    """A broken rule: top-p over the top-k tokens' unrenormalised probabilities (the bound is
    top_p, not top_p x the kept mass), then renormalised."""
    p = torch.softmax(target.double() / STAT_TEMPERATURE, -1)
    kth = target.sort(-1, descending=True).values[:, top_k - 1 : top_k]
    p = torch.where(target >= kth, p, 0.0)
    order = p.argsort(-1, descending=True)
    above = p.gather(-1, order).cumsum(-1) - p.gather(-1, order)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, above < top_p)
    p = torch.where(keep, p, 0.0)
    return p / p.sum(-1, keepdim=True)


def test_checks_reject_broken_filtering():
    # The op's samples with top_k = 40, top_p = 0.75 pass against the exactly processed
    # distribution but fail against top-p computed on the unrenormalised top-k distribution
    # (which keeps the 0.1 head: 0.6 above it < 0.75, while 0.6 >= 0.75 x kept mass ~0.71);
    # and a pipeline that samples the drafts filtered but verifies without the filters emits the
    # unfiltered target, which fails against the processed one.
    gen, target, draft, filters, p, q = stat_setup("top_k", stable_seed("broken"))
    filters.top_p = torch.tensor([0.75])
    per = lambda t: t.expand(STAT_BLOCK + 1)  # noqa: E731
    rows_t = torch.full((STAT_BLOCK + 1,), STAT_TEMPERATURE)
    p = torch.softmax(reference.filter_logits(target, rows_t, top_k=per(filters.top_k),
                                              top_p=per(filters.top_p)).double()
                      / STAT_TEMPERATURE, -1)
    broken = top_p_on_unrenormalised_top_k(target, 40, 0.75)
    assert ((broken > 0).sum(-1) > (p > 0).sum(-1)).all()
    tokens, accepted = run_filtered_trials(gen, target, draft, filters, q, "cpu")
    _, failed = stat_failures(tokens, accepted, p)
    assert not failed, failed
    results, failed = stat_failures(tokens, accepted, broken)
    assert len(failed) == len(results), f"the broken expectation passes somewhere: {results}"

    filtered_draft = reference.filter_logits(draft, rows_t[:STAT_BLOCK],
                                             top_k=per(filters.top_k)[:STAT_BLOCK],
                                             top_p=per(filters.top_p)[:STAT_BLOCK])
    q_filtered = torch.softmax(filtered_draft.double() / STAT_TEMPERATURE, -1)
    tokens, accepted = run_filtered_trials(gen, target, filtered_draft, NO_FILTERS, q_filtered,
                                           "cpu")
    results, failed = stat_failures(tokens, accepted, p)
    assert len(failed) == len(results), f"target-unfiltered passes somewhere: {results}"
    assert stat_failures(tokens, accepted,
                         torch.softmax(target.double() / STAT_TEMPERATURE, -1))[1] == []


# --------------------------------------------------------------------------------------------
# Argument checks of the new arguments
# --------------------------------------------------------------------------------------------


def call_with_filters(args: dict):
    base = {k: v for k, v in args.items() if k in {f.name for f in dataclasses.fields(Case)}}
    extra = {k: v for k, v in args.items() if k not in base}
    return Case(**base).call(**extra)


def _with(device, overrides) -> dict:
    return with_overrides(valid_args(device), device, overrides)


VERIFY = ["verify"]
MASK_WORDS = -(-V // 32)  # 4
FILTER_STRUCTURE_ERRORS = sampling_filter_errors(VERIFY) + [
    ("mask-int64", VERIFY,
     lambda: dict(allowed_token_mask=torch.zeros(15, MASK_WORDS, dtype=torch.int64)),
     TypeError, r"'allowed_token_mask' must have dtype Int, got Long"),
    ("mask-bool", VERIFY, lambda: dict(allowed_token_mask=torch.ones(15, V, dtype=torch.bool)),
     TypeError, r"'allowed_token_mask' must have dtype Int, got Bool"),
    ("mask-uint8", VERIFY, lambda: dict(allowed_token_mask=torch.ones(15, 13, dtype=torch.uint8)),
     TypeError, r"'allowed_token_mask' must have dtype Int, got Byte"),
    ("mask-words", VERIFY, lambda: dict(allowed_token_mask=torch.zeros(15, 3, dtype=torch.int32)),
     ValueError, r"'allowed_token_mask' must have shape \[R, ceil\(V/32\)\] \(one row per "
     r"target_logits row\) = \[15, 4\], got \[15, 3\]"),
    ("mask-one-per-vocab-entry", VERIFY,
     lambda: dict(allowed_token_mask=torch.ones(15, V, dtype=torch.int32)),
     ValueError, r"'allowed_token_mask' must have shape .* = \[15, 4\], got \[15, 100\]"),
    ("mask-per-request", VERIFY,
     lambda: dict(allowed_token_mask=torch.zeros(B, MASK_WORDS, dtype=torch.int32)),
     ValueError, r"'allowed_token_mask' must have shape .* = \[15, 4\], got \[3, 4\]"),
    ("mask-padded-3d", VERIFY,
     lambda: dict(allowed_token_mask=torch.zeros(B, G + 1, MASK_WORDS, dtype=torch.int32)),
     ValueError, r"'allowed_token_mask' must have shape .* = \[15, 4\], got \[3, 5, 4\]"),
    ("mask-ragged-rows", VERIFY,
     lambda: {**ragged_args(),
              "allowed_token_mask": torch.zeros(15, MASK_WORDS, dtype=torch.int32)},
     ValueError, r"'allowed_token_mask' must have shape .* = \[12, 4\], got \[15, 4\]"),
    ("mask-1d", VERIFY, lambda: dict(allowed_token_mask=torch.zeros(MASK_WORDS, dtype=torch.int32)),
     ValueError, r"'allowed_token_mask' must have shape .* = \[15, 4\], got \[4\]"),
]

# Value checks: always on CPU; on CUDA only with DSPARK_OPS_DEBUG=1.
FILTER_VALUE_ERRORS = sampling_filter_value_errors(VERIFY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message",
                         error_params(FILTER_STRUCTURE_ERRORS, op_in_id=False))
def test_argument_errors(device, op, overrides, error, message):
    with raises(op, error, message):
        call_with_filters(_with(device, overrides))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message",
                         error_params(FILTER_VALUE_ERRORS, op_in_id=False))
def test_value_errors(device, op, overrides, error, message):
    skip_value_checks_without_debug(device)
    with raises(op, error, message):
        call_with_filters(_with(device, overrides))


@pytest.mark.parametrize("device", DEVICES)
def test_limit_values_accepted(device):
    # The ends of every range pass the checks (so each error above is due to its one value):
    # top_k 0 and INT32_MAX, top_p 1 and the smallest positive float, min_p 0 and 1, a mask
    # with every bit set, in both layouts.
    for layout in ({}, ragged_args()):
        rows = 12 if layout else B * (G + 1)
        args = _with(device, lambda: {
            **layout, "top_k": i32(0, 2**31 - 1, 3), "top_p": f32(1.0, 1e-45, 0.5),
            "min_p": f32(0.0, 1.0, 0.5),
            "allowed_token_mask": torch.full((rows, MASK_WORDS), -1, dtype=torch.int32)})
        base = {k: v for k, v in args.items() if k in {f.name for f in dataclasses.fields(Case)}}
        filters = Filters(**{k: v for k, v in args.items() if k not in base})
        check_filtered(Case(**base), filters)


@cuda_only
@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "allowed_token_mask"])
def test_device_mismatch(name):
    args = _with("cuda", lambda: {"top_k": i32(0, 1, 2), "top_p": f32(1, 0.5, 0.9),
                                    "min_p": f32(0, 0.1, 0), "allowed_token_mask": torch.full(
                                        (B * (G + 1), MASK_WORDS), -1, dtype=torch.int32)})
    args[name] = args[name].cpu()
    message = rf"verify\(\): '{name}' must be on cuda:\d+ like 'target_logits', got cpu"
    with pytest.raises(ValueError, match=message):
        call_with_filters(args)


@cuda_only
def test_cuda_unchecked_filter_values():
    # Without DSPARK_OPS_DEBUG the CUDA op does not check the filter values; garbage is read
    # safely: top_k < 0 or >= V off, top_p NaN or >= 1 off, <= 0 the top tokens only, min_p NaN or
    # <= 0 off, > 1 as 1 (the reference spells the same rule).
    if DEBUG:
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    case = make_case(8, 4, 5000, seed=141, temperature="mixed")
    filters = Filters(top_k=i32(-1, -(2**31), 5000, 2**31 - 1, 3, 0, 1, -7),
                      top_p=f32(NAN, 1.5, -1.0, 0.0, INF, -INF, 0.9, 1.0),
                      min_p=f32(NAN, -2.0, 3.0, INF, 0.1, -INF, 0.0, 1.0))
    got = run(case.to("cuda"), filters.to("cuda"))
    expected = run(case, filters, reference.verify)
    assert_same_outputs(got, expected, case)
    torch.testing.assert_close(got.logprobs.cpu(), expected.logprobs, **LOGPROB_TOLERANCE)


@cuda_only
@pytest.mark.parametrize("kind", ["all", "all-mask"])
def test_cpu_and_cuda_agree(kind):
    case = make_case(64, 7, 8193, seed=stable_seed("agree-f", kind), temperature="mixed")
    filters = random_filters(case, KINDS[kind], generator(151))
    cpu, cuda = run(case, filters), run(case.to("cuda"), filters.to("cuda"))
    assert_same_outputs(cpu, type(cpu)(*(t.cpu() for t in cuda)), case)
    torch.testing.assert_close(cpu.logprobs, cuda.logprobs.cpu(), **LOGPROB_TOLERANCE)
