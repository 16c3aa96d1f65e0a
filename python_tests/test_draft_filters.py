"""Sampling filters (top-k, top-p, min-p) of markov_draft and rnn_draft: tokens and draft_logits
against the reference, tokens only ever from the kept set, draft_logits -inf exactly where a
filter drops a token, "off" values identical to no filter, the drafts distributed as the filtered
softmax (chi-square, shown to reject the unfiltered distribution), the lossless hand-off to
verify with the same filters, filter decisions within the CPU float32 head's bound redone in
float64, and the argument checks."""

from __future__ import annotations

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import DEVICES, cuda_only
from stats import chi_square, chi_square_passes
from cases.arguments import (
    error_params,
    raises,
    sampling_filter_errors,
    sampling_filter_value_errors,
    skip_value_checks_without_debug,
    with_overrides,
)
from cases.common import generator, stable_seed
from cases.draft import (
    FILTER_SETS,
    assert_sampled_from_stored_logits,
    check_output_contract,
    cuda_tolerance,
    describe_token_difference,
    filters_for,
    logits_tolerance,
    make_case,
    near_tie_case,
    teacher_forced_logits,
    with_bound_scale,
)


def expected_kept(case, tokens: torch.Tensor, filters: dict) -> torch.Tensor:
    """bool [B, G, V]: what the filters keep of the z the drafts' own prefix gives (CPU)."""
    z = teacher_forced_logits(case, tokens)
    batch, block = tokens.shape
    per_slot = {k: v.cpu()[:, None].expand(batch, block) for k, v in filters.items()}
    temperature = case.temperature.cpu()[:, None].expand(batch, block)
    return torch.isfinite(reference.filter_logits(z, temperature, **per_slot))


def check_filtered_against_reference(case, filters: dict):
    got = case.call(**filters)
    check_output_contract(case, got)
    tokens = got.tokens.cpu()
    kept = expected_kept(case, tokens, filters)
    finite = torch.isfinite(got.draft_logits.cpu())
    if case.device.type == "cpu":
        expected = case.call(reference, **filters)
        assert torch.equal(got.tokens, expected.tokens), describe_token_difference(
            case, got.tokens, expected.tokens)
        torch.testing.assert_close(got.draft_logits, expected.draft_logits, equal_nan=True,
                                   **logits_tolerance(case))
        assert torch.equal(finite, kept), "draft_logits are not -inf exactly where filtered"
    else:
        # CUDA's float32 head rounds z differently, which can move a token across a boundary.
        assert (finite != kept).float().mean() < 1e-3
        forced = teacher_forced_logits(case, tokens)
        torch.testing.assert_close(got.draft_logits.cpu()[finite], forced[finite],
                                   **cuda_tolerance(case, forced))
        assert_sampled_from_stored_logits(case, got)
    # Every draft comes from its slot's kept set.
    chosen = finite.gather(-1, tokens[..., None])[..., 0]
    assert chosen.all(), f"{int((~chosen).sum())} drafts outside the kept set"
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("name", list(FILTER_SETS))
@pytest.mark.parametrize("temperature", ["mixed", "sampled"])
def test_filtered_drafts_match_reference(device, head, name, temperature):
    batch, block, vocab = 8, 5, 300
    case = make_case(batch, block, vocab, 16, seed=stable_seed("filters", head, name, temperature),
                     head=head, temperature=temperature).to(device)
    check_filtered_against_reference(case, filters_for(name, batch, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 2, 33, 8193])
def test_filtered_drafts_odd_vocabularies(device, vocab):
    batch, block = 4, 3
    case = make_case(batch, block, vocab, 8, seed=stable_seed("filter-vocab", vocab)).to(device)
    check_filtered_against_reference(case, filters_for("all", batch, device))


@pytest.mark.parametrize("device", DEVICES)
def test_boundary_ties_are_kept(device):
    # Integer-valued base logits and no head bias: many equal logits at the top-k and top-p
    # boundaries; all tied tokens stay (and only they are added).
    batch, block, vocab = 6, 2, 64
    case = make_case(batch, block, vocab, 8, seed=5, temperature="sampled")
    gen = generator(6)
    base = torch.randint(0, 4, (batch, block, vocab), generator=gen).float()
    case = case.replace(base_logits=base, w2=torch.zeros_like(case.w2)).to(device)
    filters = dict(top_k=torch.tensor([1, 2, 5, 17, 30, 63], dtype=torch.int32, device=device))
    got = check_filtered_against_reference(case, filters)
    z = base.to(device)
    for b, k in enumerate(filters["top_k"].tolist()):
        kth = z[b].sort(-1, descending=True).values[:, k - 1:k]
        assert torch.equal(torch.isfinite(got.draft_logits[b]), z[b] >= kth)
    top_p = dict(top_p=torch.tensor([0.01, 0.3, 0.5, 0.7, 0.9, 0.99], device=device))
    check_filtered_against_reference(case, top_p)


# (filters, spread of the logits: 0 = all within ~1e-3, s > 0 = distinct over [3, 3 + s)).
NEAR_TIE_FILTERS = {
    "top_k": (dict(top_k=5), 0.0),
    "top_p": (dict(top_p=0.5), 1.0),
    "min_p": (dict(min_p=0.5), 1.0),
    "all": (dict(top_k=100, top_p=0.9, min_p=0.3), 0.5),
}


@pytest.mark.parametrize("name", list(NEAR_TIE_FILTERS))
def test_cpu_filter_near_ties_fall_back_to_the_exact_head(monkeypatch, name):
    # 512 logits within ~1e-3 of each other, or spread over [3, 3 + s) with float32 errors (~2e-3)
    # above their spacing, sampled at T = 1: the filters' boundaries (the k-th logit, the top-p
    # mass, w >= min_p) fall among tokens the float32 head cannot order, so the CPU kernel redoes
    # these rows in float64.
    settings, spread = NEAR_TIE_FILTERS[name]
    case = near_tie_case(0.0, stable_seed("filter-near-tie", name), dtype=torch.float32,
                         spread=spread)
    case = case.replace(temperature=torch.ones_like(case.temperature))
    batch = case.base_logits.shape[0]
    filters = {k: torch.full((batch,), v, dtype=torch.int32 if k == "top_k" else torch.float32)
               for k, v in settings.items()}
    expected = case.call(reference, **filters)
    check_filtered_against_reference(case, filters)
    # With a bound of 0 the float32 head's own filter decisions are taken: other kept sets.
    broken = with_bound_scale(monkeypatch, "0", lambda: case.call(**filters))
    assert not torch.equal(torch.isfinite(broken.draft_logits),
                           torch.isfinite(expected.draft_logits))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_filters_that_are_off_change_nothing(device, head):
    batch, block, vocab = 6, 4, 500
    case = make_case(batch, block, vocab, 8, seed=stable_seed("off", head), head=head).to(device)
    plain = case.call()
    for off in (dict(top_k=torch.zeros(batch, dtype=torch.int32, device=device)),
                dict(top_k=torch.full((batch,), vocab, dtype=torch.int32, device=device)),
                dict(top_p=torch.ones(batch, device=device)),
                dict(min_p=torch.zeros(batch, device=device))):
        out = case.call(**off)
        assert torch.equal(out.tokens, plain.tokens), off
        torch.testing.assert_close(out.draft_logits, plain.draft_logits, rtol=0, atol=0,
                                   equal_nan=True)


def filtered_distribution_counts(device, trials: int, vocab: int, filters: dict):
    """Slot-0 drafts of `trials` requests sharing one base row and anchor (different seeds)."""
    gen = generator(41)
    base = (torch.randn(1, 1, vocab, generator=gen) * 1.5).expand(trials, 1, vocab)
    rank = 4
    w1 = torch.randn(vocab, rank, generator=gen) * 0.5
    w2 = torch.randn(vocab, rank, generator=gen) * 0.5
    anchor = torch.zeros(trials, dtype=torch.int64)
    temperature = torch.full((trials,), 0.8)
    seed = torch.randint(0, 2**62, (trials,), generator=gen)
    position = torch.full((trials,), 100, dtype=torch.int64)
    per_request = {k: v.expand(trials).contiguous() for k, v in filters.items()}
    out = dspark_ops.markov_draft(*(t.to(device) for t in (base, anchor, w1, w2, temperature, seed,
                                                            position)),
                                  **{k: v.to(device) for k, v in per_request.items()})
    z = (base[0, 0].double() + w1[0].double() @ w2.double().T).float()[None]
    return out.tokens[:, 0].cpu(), z, temperature[:1]


@pytest.mark.parametrize("device", DEVICES)
def test_drafts_follow_the_filtered_distribution(device):
    vocab, trials = 200, 20000
    filters = dict(top_k=torch.tensor([60], dtype=torch.int32), top_p=torch.tensor([0.8]),
                   min_p=torch.tensor([0.02]))
    tokens, z, temperature = filtered_distribution_counts(device, trials, vocab, filters)
    filtered = reference.filter_logits(z, temperature, **filters)
    probs = torch.softmax(filtered / temperature[:, None], -1)[0].double()
    chi2, df = chi_square(tokens, probs)
    assert chi_square_passes(chi2, df), (chi2, df)
    # The same check rejects the unfiltered distribution (the harness can fail), and filtering
    # after renormalising in another order (min-p first, vLLM's order) as well.
    unfiltered = torch.softmax(z / temperature[:, None], -1)[0].double()
    assert not chi_square_passes(*chi_square(tokens, unfiltered))
    other_order = reference.filter_logits(
        reference.filter_logits(z, temperature, min_p=filters["min_p"]), temperature,
        top_k=filters["top_k"], top_p=filters["top_p"])
    other = torch.softmax(other_order / temperature[:, None], -1)[0].double()
    if not torch.allclose(other, probs):
        assert not chi_square_passes(*chi_square(tokens, other))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_verify_with_the_same_filters_accepts_every_draft(device, head):
    # The target's first G rows are the unfiltered z of the drafts' own prefix: with the same
    # filters in verify, p = q, so every draft is accepted and a bonus token follows.
    batch, block, vocab = 16, 6, 1000
    case = make_case(batch, block, vocab, 16, seed=stable_seed("handoff-filters", head),
                     head=head, temperature="mixed", base_dtype=torch.bfloat16).to(device)
    filters = filters_for("all", batch, device)
    draft = case.call(**filters)
    z = teacher_forced_logits(case, draft.tokens).to(device)
    finite = torch.isfinite(draft.draft_logits)
    z = torch.where(finite, draft.draft_logits, z)  # the kept values exactly as stored
    target = torch.cat([z, torch.randn(batch, 1, vocab, generator=generator(3)).to(device)], 1)
    n = torch.full((batch,), block, dtype=torch.int32, device=device)
    out = dspark_ops.verify(target, draft.tokens, n, case.temperature, case.seed, case.position,
                            draft_logits=draft.draft_logits, draft_temperature=case.temperature,
                            **filters)
    assert (out.num_accepted == block).all(), out.num_accepted
    assert out.valid.all()
    assert torch.equal(out.tokens[:, :block], draft.tokens)


# The filter checks are verify's (csrc/args/filter_args.cpp): the same rows, for both heads.
DRAFT_OPS = ["markov_draft", "rnn_draft"]


def _call_with_filters(op: str, device, overrides):
    head = {"markov_draft": "markov", "rnn_draft": "rnn"}[op]
    case = make_case(3, 2, 50, 8, seed=1, head=head).to(device)
    return case.call(**with_overrides({}, device, overrides))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message",
                         error_params(sampling_filter_errors(DRAFT_OPS)))
def test_filter_argument_errors(device, op, overrides, error, message):
    with raises(op, error, message):
        _call_with_filters(op, device, overrides)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message",
                         error_params(sampling_filter_value_errors(DRAFT_OPS)))
def test_filter_value_errors(device, op, overrides, error, message):
    skip_value_checks_without_debug(device)
    with raises(op, error, message):
        _call_with_filters(op, device, overrides)


@cuda_only
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_filter_device_mismatch(head):
    case = make_case(3, 2, 50, 8, seed=1, head=head).to("cuda")
    with pytest.raises(ValueError, match="'top_k' must be on"):
        case.call(top_k=torch.ones(3, dtype=torch.int32))
