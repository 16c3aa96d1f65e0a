"""bfloat16 draft_logits of markov_draft and rnn_draft (``draft_logits_dtype=torch.bfloat16``):
z rounded to bfloat16 before it is filtered, sampled and stored. On the CPU the tokens equal the
reference's bit for bit (greedy, sampled, mixed, filtered, near-ties of the float32 head and of the
rounding), and draft_logits equal the reference's bfloat16 values except at elements whose float32
z lies within the float32 head's bound of a bfloat16 rounding midpoint, where they are one bfloat16
ulp apart; the certificate is shown to be needed (DSPARK_OPS_DRAFT_BOUND_SCALE=0 draws other
tokens); verify accepts every draft against the bfloat16 rows themselves; bad dtypes are rejected
on every device and the fake registration gives the output dtype."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dspark_ops
from dspark_ops import reference
from conftest import DEVICES
from cases.common import generator, stable_seed
from cases.draft import (
    assert_sampled_from_stored_logits,
    describe_token_difference,
    logits_tolerance,
    make_case,
    near_tie_case,
    teacher_forced_logits,
    with_bound_scale,
)
from cases.draft import filters_for

BF16 = dict(draft_logits_dtype=torch.bfloat16)
BF16_RTOL = 2.0**-8  # one bfloat16 ulp relative to the value


def assert_same_values(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), expected.cpu().float(), rtol=0, atol=0,
                               equal_nan=True)


def check_bf16_against_reference(case, **filters):
    got = case.call(**BF16, **filters)
    assert got.draft_logits.dtype == torch.bfloat16
    assert got.draft_logits.shape == case.base_logits.shape
    expected = case.call(reference, **BF16, **filters)
    assert expected.draft_logits.dtype == torch.bfloat16
    assert torch.equal(got.tokens, expected.tokens), describe_token_difference(
        case, got.tokens, expected.tokens)
    # The CPU stores the reference's bfloat16 values on every row (uncertain roundings redone).
    assert_same_values(got.draft_logits, expected.draft_logits)
    return got, expected


def test_reference_rounds_the_float32_logits():
    case = make_case(6, 5, 700, 16, seed=stable_seed("bf16-ref"), temperature="greedy")
    f32 = case.call(reference)
    bf16 = case.call(reference, **BF16)
    # Greedy: the drafts of the rounded rows, and each row the float32 row of those drafts rounded.
    forced = teacher_forced_logits(case, bf16.tokens)
    assert torch.equal(bf16.draft_logits, forced.to(torch.bfloat16))
    assert torch.equal(bf16.tokens, bf16.draft_logits.float().argmax(-1))
    assert torch.equal(case.call(reference, draft_logits_dtype=torch.float32).draft_logits,
                       f32.draft_logits)


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("shape", [(16, 4, 3000, 256), (3, 2, 151936, 64), (9, 7, 100, 8)],
                         ids=lambda s: "B{}-G{}-V{}-r{}".format(*s))
def test_cpu_matches_reference(head, temperature, shape):
    case = make_case(*shape, seed=stable_seed("bf16", head, temperature, shape), head=head,
                     temperature=temperature)
    got, _ = check_bf16_against_reference(case)
    assert_sampled_from_stored_logits(case, got.__class__(got.tokens, got.draft_logits.float()))


@pytest.mark.parametrize("weights", ["f32", "bf16", "f16", "f32full"])
@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_dtypes(weights, base_dtype):
    case = make_case(8, 3, 1000, 64, seed=stable_seed("bf16-dtypes", weights, base_dtype),
                     weights=weights, base_dtype=base_dtype)
    check_bf16_against_reference(case)


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "all"])
def test_cpu_filtered_matches_reference(head, name):
    batch = 8
    case = make_case(batch, 4, 3000, 64, seed=stable_seed("bf16-filters", head, name), head=head,
                     temperature="mixed")
    got, _ = check_bf16_against_reference(case, **filters_for(name, batch, "cpu"))
    tokens = got.tokens
    assert torch.isfinite(got.draft_logits.gather(-1, tokens[..., None])).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6], ids=["greedy", "T1", "T0.6"])
def test_cpu_rounding_near_ties_fall_back_to_the_exact_head(monkeypatch, temperature):
    # The float32 head errs by ~1e-3 on logits near 3 (bfloat16 spacing 2^-6): many elements
    # round differently from the exact z, and the winner depends on it (greedy: the logits spread
    # over [3, 3.05), the lowest id among those rounding to the top value).
    spread = 0.05 if temperature == 0.0 else 0.0
    case = near_tie_case(temperature, stable_seed("bf16-near-tie", temperature), batch=24,
                         spread=spread)
    got, expected = check_bf16_against_reference(case)
    # Without the bound (scale 0) every element counts as certain: other tokens and values.
    broken = with_bound_scale(monkeypatch, "0", lambda: case.call(**BF16))
    assert not torch.equal(broken.tokens, expected.tokens)
    assert not torch.equal(broken.draft_logits, expected.draft_logits)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_cpu_ordinary_rows_need_the_rounding_fix(monkeypatch, head):
    # Ordinary rows: without the bound (scale 0) the float32 head's own roundings are stored, and
    # some elements near a midpoint are then one ulp off the reference (so the exact values above
    # come from the fix, not from luck); a bound x1000 changes nothing.
    case = make_case(16, 4, 3000, 256, seed=stable_seed("bf16-certified", head), head=head,
                     temperature="mixed")
    _, expected = check_bf16_against_reference(case)
    broken = with_bound_scale(monkeypatch, "0", lambda: case.call(**BF16))
    assert not torch.equal(broken.draft_logits, expected.draft_logits)
    # Up to the first changed token the rows are those of the same inputs: the float32 head's
    # bound, plus one bfloat16 ulp (the other side of a midpoint).
    same_prefix = torch.cumprod((broken.tokens == expected.tokens).int(), 1).bool()
    same_inputs = torch.cat([torch.ones_like(same_prefix[:, :1]), same_prefix[:, :-1]], 1)
    tol = logits_tolerance(case)
    torch.testing.assert_close(broken.draft_logits[same_inputs].float(),
                               expected.draft_logits[same_inputs].float(),
                               rtol=tol["rtol"] + 2.0**-7, atol=tol["atol"])
    loose = with_bound_scale(monkeypatch, "1000", lambda: case.call(**BF16))
    assert torch.equal(loose.tokens, expected.tokens)
    assert_same_values(loose.draft_logits, expected.draft_logits)


def test_cpu_greedy_ties_of_rounded_values_go_to_the_lowest_id():
    # Distinct float32 logits that round to one bfloat16 value: the lowest id among them wins.
    batch, vocab = 4, 64
    case = make_case(batch, 1, vocab, 8, seed=3, temperature="greedy")
    base = torch.full((batch, 1, vocab), 1.0)
    base[:, 0, 10:20] = 3.0 + torch.arange(10) * 2.0**-12  # all round to 3.0
    case = case.replace(base_logits=base, w2=torch.zeros_like(case.w2))
    got, _ = check_bf16_against_reference(case)
    assert (got.tokens == 10).all()
    assert torch.equal(case.call().tokens, torch.full((batch, 1), 19))  # float32: the largest


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", ["sampled", "mixed"])
def test_verify_accepts_drafts_against_their_bf16_rows(device, head, temperature):
    # As test_draft's hand-off test: target = the stored bfloat16 rows, so p = q and verify must
    # accept every draft, which holds only if each token was drawn from exactly those values.
    batch, block, vocab = 32, 5, 4000
    case = make_case(batch, block, vocab, 32, seed=stable_seed("bf16-handoff", head, temperature),
                     head=head, temperature=temperature).to(device)
    draft = case.call(**BF16)
    assert draft.draft_logits.dtype == torch.bfloat16
    bonus_row = torch.randn(batch, 1, vocab, generator=generator(7)).to(device)
    target = torch.cat([draft.draft_logits.float(), bonus_row], 1)
    n = torch.full((batch,), block, dtype=torch.int32, device=device)
    out = dspark_ops.verify(target, draft.tokens, n, case.temperature, case.seed, case.position,
                            draft_logits=draft.draft_logits, draft_temperature=case.temperature)
    assert (out.num_accepted == block).all(), out.num_accepted
    assert out.valid.all()
    assert torch.equal(out.tokens[:, :block], draft.tokens)
    expected = reference.verify(target.cpu(), draft.tokens.cpu(), n.cpu(), case.temperature.cpu(),
                                case.seed.cpu(), case.position.cpu(),
                                draft_logits=draft.draft_logits.cpu(),
                                draft_temperature=case.temperature.cpu())
    assert torch.equal(out.tokens.cpu(), expected.tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_bad_dtype_is_rejected(device, head):
    case = make_case(2, 2, 50, 8, seed=1, head=head).to(device)
    for bad in (torch.float16, torch.float64, torch.int32):
        with pytest.raises(ValueError, match="draft_logits_dtype"):
            case.call(draft_logits_dtype=bad)
        with pytest.raises(ValueError, match="draft_logits_dtype"):
            case.call(reference, draft_logits_dtype=bad)
    for bad in ("bfloat16", 16):
        with pytest.raises(TypeError, match="draft_logits_dtype"):
            case.call(draft_logits_dtype=bad)
    # The registered op checks it too (a ValueError naming it).
    op = getattr(torch.ops.dspark_ops, f"{head}_draft")
    args = [case.base_logits, case.anchor] + ([case.hidden] if head == "rnn" else []) + [
        case.w1, case.w2] + ([case.joint_weight, case.joint_bias] if head == "rnn" else []) + [
        case.temperature, case.seed, case.position]
    with pytest.raises(ValueError, match="draft_logits_dtype"):
        op(*args, draft_logits_dtype=torch.float16)
    assert op(*args, draft_logits_dtype=None)[1].dtype == torch.float32
    assert case.call(draft_logits_dtype=torch.float32).draft_logits.dtype == torch.float32


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_fake_registration_gives_the_output_dtype(head, dtype):
    case = make_case(3, 2, 40, 8, seed=2, head=head)
    op = getattr(torch.ops.dspark_ops, f"{head}_draft")
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in case.fields().items() if v is not None}
        args = [fake["base_logits"], fake["anchor"]] + (
            [fake["hidden"]] if head == "rnn" else []) + [fake["w1"], fake["w2"]] + (
            [fake["joint_weight"], fake["joint_bias"]] if head == "rnn" else []) + [
            fake["temperature"], fake["seed"], fake["position"]]
        tokens, logits = op(*args, draft_logits_dtype=dtype)
    assert tokens.dtype == torch.int64 and tokens.shape == (3, 2)
    assert logits.dtype == (dtype or torch.float32) and logits.shape == (3, 2, 40)
    markov = make_case(3, 2, 40, 8, seed=2, head="markov").fields()
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="draft_logits_dtype"):
        fake = [mode.from_tensor(markov[k]) for k in ("base_logits", "anchor", "w1", "w2",
                                                      "temperature", "seed", "position")]
        dspark_ops.ops.draft._markov_draft_fake(*fake, draft_logits_dtype=torch.float16)
