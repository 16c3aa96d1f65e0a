"""The drafting family (docs/semantics.md §1 steps 3-4, §3.2, §3.3): markov_draft, rnn_draft and
draft_confidence against the reference (tokens exact on CPU, logits within the float32 head's
certified bound; within float32 rounding on CUDA), near-ties that need the CPU's float64
fallback, literal outcomes of constructed heads, layouts, non-finite logits, batch invariance, seeds, statistical
tests of the sampled drafts (docs/semantics.md §5), the lossless hand-off to verify, sequential
temperature scaling and every argument check."""

from __future__ import annotations


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
from cases.calibration import CALIB_BLOCK, survival_ece
from cases.tails import (
    CONFIDENCE_SEGMENT,
    DRAFT_KINDS,
    DRAFT_VOCABS,
    check_draft_tail,
    confidence_tail_cases,
    draft_tail_case,
)
from cases.draft import (
    RNN_RTOL,
    WEIGHTS,
    assert_sampled_from_stored_logits,
    bf16_representable,
    check_output_contract,
    confidence_logits,
    ConfidenceCase,
    cuda_tolerance,
    describe_token_difference,
    DraftCase,
    logits_tolerance,
    make_case,
    make_confidence_case,
    make_temperature,
    make_weight,
    near_tie_case,
    peaky_logits,
    rnn_state_case,
    teacher_forced_logits,
    with_bound_scale,
)


# --------------------------------------------------------------------------------------------
# Building inputs
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Checking outputs
# --------------------------------------------------------------------------------------------


def assert_same_outputs(got, expected, case: DraftCase) -> None:
    assert torch.equal(got.tokens, expected.tokens), describe_token_difference(
        case, got.tokens, expected.tokens)
    torch.testing.assert_close(got.draft_logits, expected.draft_logits, rtol=0, atol=0,
                               equal_nan=True)


def literal_tolerance(case: DraftCase, z: torch.Tensor) -> dict:
    """RNN draft_logits against float64 math spelt out in a test."""
    if case.device.type == "cpu":
        return dict(rtol=RNN_RTOL, atol=1e-6)
    return cuda_tolerance(case, z)


def check_against_reference(case: DraftCase):
    """Runs the op and checks it against the reference: on the CPU tokens bit for bit and
    draft_logits within the float32 head's bound (``logits_tolerance``); on CUDA (float32
    accumulation) draft_logits against the z the reference computes for the CUDA op's own drafts,
    and the drafts against their own stored logits."""
    got = case.call()
    check_output_contract(case, got)
    if case.device.type == "cpu":
        expected = case.call(reference)
        assert torch.equal(got.tokens, expected.tokens), describe_token_difference(
            case, got.tokens, expected.tokens)
        torch.testing.assert_close(got.draft_logits, expected.draft_logits, equal_nan=True,
                                   **logits_tolerance(case))
    else:
        forced = teacher_forced_logits(case, got.tokens)
        full_f32 = case.w1.dtype == torch.float32 and not bf16_representable(case.w1, case.w2)
        torch.testing.assert_close(got.draft_logits.cpu(), forced, equal_nan=True,
                                   **cuda_tolerance(case, forced, 4.0 if full_f32 else 1.0))
        assert_sampled_from_stored_logits(case, got)
    return got


# --------------------------------------------------------------------------------------------
# Exact agreement with the reference over shapes, dtypes and temperatures
# --------------------------------------------------------------------------------------------

# (B, G, V, r, weights, base dtype, anchor dtype, temperature). V in {2, 100, 8193, 151936}, G in
# {1, 2, 7, 16, 32}, both ranks, every weight and base dtype and both id dtypes appear; the
# reference costs tens of ms per slot at V = 151936, so large vocabularies run with small B and G
# here.
MARKOV_CASES = [
    (3, 7, 2, 8, "f32", torch.float32, torch.int64, "mixed"),
    (64, 32, 2, 256, "bf16", torch.bfloat16, torch.int32, "sampled"),
    (64, 16, 100, 8, "f16", torch.float16, torch.int64, "mixed"),
    (5, 32, 100, 256, "f32", torch.bfloat16, torch.int32, "mixed"),
    (16, 7, 100, 256, "bf16", torch.float32, torch.int64, "greedy"),
    (4, 16, 8193, 8, "bf16", torch.float32, torch.int64, "mixed"),
    (3, 7, 8193, 256, "f16", torch.bfloat16, torch.int32, "sampled"),
    (6, 1, 8193, 256, "f32", torch.float16, torch.int64, "mixed"),
    (1, 32, 8193, 256, "bf16", torch.float16, torch.int32, "sampled"),
    (2, 1, 151936, 256, "bf16", torch.bfloat16, torch.int64, "mixed"),
    (2, 2, 151936, 8, "f16", torch.float32, torch.int32, "mixed"),
    (2, 2, 151936, 256, "f32", torch.float32, torch.int64, "sampled"),
]


def _case_id(c) -> str:
    batch, block, vocab, rank, weights, base, ids, temperature = c
    return (f"B{batch}-G{block}-V{vocab}-r{rank}-w{weights}-{DTYPE_IDS[base]}-{DTYPE_IDS[ids]}"
            f"-{temperature}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", MARKOV_CASES, ids=[_case_id(c) for c in MARKOV_CASES])
def test_markov_draft_matches_reference(device, params):
    batch, block, vocab, rank, weights, base_dtype, anchor_dtype, temperature = params
    case = make_case(batch, block, vocab, rank, seed=stable_seed(params), weights=weights,
                     base_dtype=base_dtype, anchor_dtype=anchor_dtype,
                     temperature=temperature).to(device)
    out = check_against_reference(case)
    if device == "cpu":
        # The stored logits are the z of the drafted tokens (an independent spelling of §1 step 3).
        torch.testing.assert_close(out.draft_logits, teacher_forced_logits(case, out.tokens),
                                   **logits_tolerance(case))
    if batch * block >= 100 and vocab > 2 and temperature != "greedy":
        # Sampled drafts are not simply the argmax of their rows.
        assert (out.tokens != out.draft_logits.argmax(-1)).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("base_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_markov_draft_dtypes(device, weights, base_dtype):
    case = make_case(16, 7, 1000, 256, seed=stable_seed("dtypes", weights, base_dtype),
                     weights=weights, base_dtype=base_dtype, anchor_dtype=torch.int32)
    check_against_reference(case.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(8, 7, 3000, 256), (2, 2, 151936, 256), (32, 16, 100, 8)],
                         ids=lambda s: "B{}-G{}-V{}-r{}".format(*s))
def test_markov_draft_full_mantissa_weights(device, shape):
    # float32 weights with 24-bit mantissas: z may differ from the reference by one float32 ulp
    # (float64 sum order); the drafts still agree exactly.
    case = make_case(*shape, seed=stable_seed("f32full", shape), weights="f32full")
    assert not bf16_representable(case.w1, case.w2)
    check_against_reference(case.to(device))


# --------------------------------------------------------------------------------------------
# Near-ties: the CPU's float32 head is certified or redone in float64
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6], ids=["greedy", "T1", "T0.6"])
def test_cpu_near_ties_fall_back_to_the_exact_head(monkeypatch, temperature):
    case = near_tie_case(temperature, stable_seed("near-tie", temperature))
    expected = case.call(reference)
    got = check_against_reference(case)
    # Every request here is a near-tie, so every row was redone in float64: bit for bit.
    torch.testing.assert_close(got.draft_logits, expected.draft_logits, rtol=0, atol=0)
    # The certificate is what makes this so: with a bound of 0 the float32 head's own winners
    # are taken, and they are not the reference's.
    broken = with_bound_scale(monkeypatch, "0", case.call)
    assert not torch.equal(broken.tokens, expected.tokens)
    assert not torch.equal(broken.draft_logits, expected.draft_logits)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_cpu_fast_head_is_certified_on_ordinary_rows(monkeypatch, head):
    # Ordinary inputs: the float32 head's winners lead by far more than the bound, so its logits
    # are kept (within the tolerance, not all bit-equal to float64), and tokens are exact either
    # way; a much looser bound (x1000) only sends more rows to the exact head.
    case = make_case(16, 4, 3000, 256, seed=stable_seed("certified", head), head=head,
                     temperature="mixed")
    got = check_against_reference(case)
    expected = case.call(reference)
    assert not torch.equal(got.draft_logits, expected.draft_logits)
    loose = with_bound_scale(monkeypatch, "1000", case.call)
    assert torch.equal(loose.tokens, expected.tokens)


def _full_sweep():
    if not full_tests():
        return [pytest.param(None, marks=pytest.mark.skip(reason="set DSPARK_OPS_TEST_FULL=1"))]
    params, i = [], 0
    for vocab in (2, 100, 8193, 10000, 151936):
        for block in (1, 2, 7, 16, 32):
            for rank in (8, 256):
                for weights in ("f32", "bf16", "f16"):
                    base = FLOAT_DTYPES[i % 3]
                    ids = (torch.int64, torch.int32)[i % 2]
                    i += 1
                    batch = 2 if vocab == 151936 else (64 if vocab <= 100 else 3)
                    params.append(pytest.param(
                        (batch, block, vocab, rank, weights, base, ids, "mixed"),
                        id=f"B{batch}-G{block}-V{vocab}-r{rank}-w{weights}-{DTYPE_IDS[base]}"))
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", _full_sweep())
def test_markov_draft_full_sweep(device, params):
    batch, block, vocab, rank, weights, base_dtype, anchor_dtype, temperature = params
    case = make_case(batch, block, vocab, rank, seed=stable_seed("sweep", params),
                     weights=weights, base_dtype=base_dtype, anchor_dtype=anchor_dtype,
                     temperature=temperature)
    check_against_reference(case.to(device))


# (B, G, V, r, d, weights, base/hidden dtype, anchor dtype)
RNN_CASES = [
    (8, 7, 100, 8, 16, "f32", torch.float32, torch.int64),
    (4, 16, 8193, 8, 64, "bf16", torch.bfloat16, torch.int32),
    (8, 5, 100, 256, 16, "f16", torch.float16, torch.int64),
    (3, 4, 300, 256, 64, "f32full", torch.float32, torch.int32),
    (16, 3, 2, 8, 64, "bf16", torch.float32, torch.int64),
    (2, 2, 151936, 8, 16, "bf16", torch.bfloat16, torch.int64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", RNN_CASES, ids=lambda c: "B{}-G{}-V{}-r{}-d{}-w{}".format(*c))
def test_rnn_draft_matches_reference(device, params):
    batch, block, vocab, rank, hidden_size, weights, base_dtype, anchor_dtype = params
    case = make_case(batch, block, vocab, rank, seed=stable_seed("rnn", params), weights=weights,
                     base_dtype=base_dtype, anchor_dtype=anchor_dtype, head="rnn",
                     hidden_size=hidden_size)
    out = check_against_reference(case.to(device))
    if device == "cpu":
        torch.testing.assert_close(out.draft_logits, teacher_forced_logits(case, out.tokens),
                                   **logits_tolerance(case))


def _rnn_full_sweep():
    if not full_tests():
        return [pytest.param(None, marks=pytest.mark.skip(reason="set DSPARK_OPS_TEST_FULL=1"))]
    params, i = [], 0
    for vocab in (2, 100, 8193, 151936):
        for block in (1, 7, 32):
            for rank, hidden_size in ((8, 16), (8, 64), (256, 16), (256, 64)):
                weights = ("f32", "bf16", "f16")[i % 3]
                base = FLOAT_DTYPES[i // 3 % 3]
                i += 1
                batch = 2 if vocab == 151936 else 8
                params.append(pytest.param(
                    (batch, block, vocab, rank, hidden_size, weights, base, torch.int64),
                    id=f"B{batch}-G{block}-V{vocab}-r{rank}-d{hidden_size}-w{weights}"))
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", _rnn_full_sweep())
def test_rnn_draft_full_sweep(device, params):
    batch, block, vocab, rank, hidden_size, weights, base_dtype, anchor_dtype = params
    case = make_case(batch, block, vocab, rank, seed=stable_seed("rnn-sweep", params),
                     weights=weights, base_dtype=base_dtype, anchor_dtype=anchor_dtype,
                     head="rnn", hidden_size=hidden_size)
    check_against_reference(case.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["f32", "bf16", "f16"])
def test_rnn_draft_dtypes(device, weights):
    for i, base_dtype in enumerate(FLOAT_DTYPES):
        case = make_case(8, 6, 700, 32, seed=stable_seed("rnn-dtypes", weights, i),
                         weights=weights, base_dtype=base_dtype, head="rnn", hidden_size=24)
        # The hidden states in another dtype than the base logits.
        case.hidden = case.hidden.to(FLOAT_DTYPES[(i + 1) % 3])
        check_against_reference(case.to(device))


# --------------------------------------------------------------------------------------------
# Constructed heads with literal outcomes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["f32", "bf16", "f16"])
def test_markov_permutation_chain(device, weights):
    # W1 = identity (r = V) and W2 = 100 * a permutation: the bias after token i is +100 on
    # perm[i] only, so every slot drafts perm[previous token], starting from the anchor (slot 0 is
    # biased too). Holds for greedy and sampled requests (100 / T dwarfs the Gumbel noise).
    batch, block, vocab = 32, 9, 50
    gen = generator(101)
    perm = torch.randperm(vocab, generator=gen)
    dtype = WEIGHTS[weights][0]
    w1 = torch.eye(vocab).to(dtype)
    w2 = torch.zeros(vocab, vocab)
    w2[perm, torch.arange(vocab)] = 100.0
    base = torch.randn(batch, block, vocab, generator=gen)
    anchor = torch.randint(0, vocab, (batch,), generator=gen)
    case = DraftCase(base, anchor, w1, w2.to(dtype),
                     make_temperature("mixed", batch, gen).clamp_max(1.5),
                     torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                     torch.randint(0, 2**40, (batch,), generator=gen)).to(device)
    out = check_against_reference(case)
    expected, prev = [], anchor
    for _ in range(block):
        prev = perm[prev]
        expected.append(prev)
    expected = torch.stack(expected, 1)
    assert torch.equal(out.tokens.cpu(), expected)
    bias = torch.zeros(batch, block, vocab)
    bias.scatter_(-1, expected[..., None], 100.0)
    torch.testing.assert_close(out.draft_logits.cpu(), base + bias, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_rnn_gate_candidate_output_order(device):
    # J = 0 and a bias whose gate, candidate and output parts differ: every slot's logit bias is
    # W2 . tanh(o_bias), whatever the tokens and the state (the output part is the third chunk).
    batch, block, vocab, rank, hidden_size = 8, 5, 300, 8, 16
    gen = generator(102)
    w2 = torch.randn(vocab, rank, generator=gen)
    joint_bias = torch.cat([torch.full((rank,), 5.0), torch.full((rank,), -3.0),
                            torch.linspace(-1.5, 1.5, rank)])
    case = DraftCase(
        peaky_logits((batch, block), vocab, gen), torch.randint(0, vocab, (batch,), generator=gen),
        torch.randn(vocab, rank, generator=gen), w2, make_temperature("mixed", batch, gen),
        torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        torch.randint(0, 2**40, (batch,), generator=gen),
        hidden=torch.randn(batch, block, hidden_size, generator=gen),
        joint_weight=torch.zeros(3 * rank, 2 * rank + hidden_size), joint_bias=joint_bias,
    ).to(device)
    out = check_against_reference(case)
    bias = w2.double() @ torch.tanh(joint_bias[2 * rank:].double())
    expected = (case.base_logits.cpu().double() + bias).float()
    torch.testing.assert_close(out.draft_logits.cpu(), expected,
                               **literal_tolerance(case, expected))


@pytest.mark.parametrize("device", DEVICES)
def test_rnn_state_update_is_after_the_bias(device):
    # See rnn_state_case: the literal logits of a state walked slot by slot.
    gen = generator(103)
    case, expected = rnn_state_case(gen, torch.randn(200, 8, generator=gen))
    out = check_against_reference(case.to(device))
    torch.testing.assert_close(out.draft_logits.cpu(), expected,
                               **literal_tolerance(case, expected))
    torch.testing.assert_close(out.draft_logits[:, 0].cpu(), case.base_logits[:, 0].float(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_vocabulary_of_one(device):
    # V = 1: every draft is token 0; z = base + W2[0] . W1[0] (or W2[0] . tanh(o)).
    for head in ("markov", "rnn"):
        case = make_case(5, 4, 1, 8, seed=104, head=head).to(device)
        case.anchor = torch.zeros_like(case.anchor)
        out = check_against_reference(case)
        assert (out.tokens == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("shape", [(4, 0, 50), (0, 5, 50), (0, 0, 7)],
                         ids=lambda s: "B{}-G{}-V{}".format(*s))
def test_empty_block_and_batch(device, head, shape):
    batch, block, vocab = shape
    case = make_case(batch, block, vocab, 8, seed=105, head=head,
                     anchor_dtype=torch.int32).to(device)
    out = case.call()
    check_output_contract(case, out)
    expected = case.call(reference)
    assert expected.tokens.shape == out.tokens.shape
    assert expected.draft_logits.shape == out.draft_logits.shape
    hidden = torch.randn(batch, block, 16, device=device)
    confidence = dspark_ops.draft_confidence(
        hidden, torch.zeros(batch, block, dtype=torch.int32, device=device), case.w1,
        torch.randn(16 + 8, device=device), torch.tensor(0.5, device=device),
        torch.ones(block, device=device))
    assert confidence.shape == (batch, block) and confidence.dtype == torch.float32
    assert confidence.device == case.device


# --------------------------------------------------------------------------------------------
# Layouts: non-contiguous and broadcast inputs
# --------------------------------------------------------------------------------------------


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """[B, G, ...] stored as [G, B, ...]: the batch stride is smaller than the slot stride."""
    out = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not out.is_contiguous() or t.shape[0] <= 1 or t.shape[1] <= 1
    return out


def relayout(value: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "transposed":
        return _transposed(value) if value.dim() == 3 else non_contiguous(value, "strided")
    return non_contiguous(value, kind if value.dim() >= 2 else "strided")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("kind", ["strided", "padded", "transposed"])
def test_non_contiguous_inputs(device, head, kind):
    # Every tensor argument in another layout (gaps hold NaN / INT_MIN, never to be read): the
    # same tokens and draft_logits as with contiguous inputs.
    case = make_case(16, 7, 1000, 32, seed=stable_seed("layout", head), head=head,
                     base_dtype=torch.bfloat16, anchor_dtype=torch.int32).to(device)
    out = check_against_reference(case)
    changed = {k: relayout(v, kind) for k, v in case.fields().items() if v is not None}
    other = case.replace(**changed)
    assert_same_outputs(other.call(), out, case)


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_base_logits(device):
    # A stride-0 batch (one shared row per slot, as the statistical tests use) and weights sliced
    # out of wider buffers: the same results as materialised copies.
    case = make_case(24, 5, 999, 16, seed=106, weights="f32").to(device)
    shared = case.base_logits[:1].expand_as(case.base_logits)
    out = case.replace(base_logits=shared).call()
    wide = torch.randn(case.vocab, 40, device=device)
    w1 = wide[:, 3:19].copy_(case.w1)
    w2 = wide[:, 21:37].copy_(case.w2)
    expected = case.replace(base_logits=shared.contiguous(), w1=w1.contiguous(),
                            w2=w2.contiguous()).call()
    assert_same_outputs(out, expected, case)
    assert_same_outputs(case.replace(base_logits=shared, w1=w1, w2=w2).call(), expected, case)


# --------------------------------------------------------------------------------------------
# Non-finite base logits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", ["greedy", "sampled", "mixed"])
def test_non_finite_base_logits(device, head, temperature):
    # NaN and +-inf base logits make z non-finite there: such tokens are never drafted, even at
    # each row's would-be winner; a slot without any finite z drafts 0; draft_logits keep the
    # computed values (NaN and inf propagate).
    batch, block, vocab = 64, 6, 500
    case = make_case(batch, block, vocab, 16, seed=stable_seed("nonfinite", head, temperature),
                     head=head, temperature=temperature)
    gen = generator(107)
    base = case.base_logits.clone()
    poison = torch.rand(base.shape, generator=gen)
    base[poison < 0.3] = NAN
    base[(poison >= 0.3) & (poison < 0.33)] = INF
    base[(poison >= 0.33) & (poison < 0.36)] = -INF
    top = case.base_logits.topk(2, dim=-1).indices  # where the drafts would mostly land
    rows, slots = torch.arange(batch)[:, None, None], torch.arange(block)[None, :, None]
    base[rows, slots, top] = torch.tensor([NAN, INF])
    # Whole slots without a finite logit.
    dead = torch.rand(batch, block, generator=gen) < 0.15
    kinds = torch.tensor([NAN, -INF, INF])[torch.arange(vocab) % 3]
    for b, j in dead.nonzero().tolist():
        base[b, j] = [torch.full((vocab,), NAN), torch.full((vocab,), -INF), kinds][(b + j) % 3]
    case = case.replace(base_logits=base).to(device)
    out = check_against_reference(case)
    z, tokens = out.draft_logits.cpu(), out.tokens.cpu()
    finite = torch.isfinite(z)
    assert torch.equal(finite, torch.isfinite(base))
    assert torch.equal(torch.isnan(z), torch.isnan(base))
    assert torch.equal(z == INF, base == INF) and torch.equal(z == -INF, base == -INF)
    assert finite.gather(-1, tokens[..., None])[..., 0][~dead].all()
    assert (tokens[dead] == 0).all() and dead.any()


@pytest.mark.parametrize("device", DEVICES)
def test_keys_overflowing_float32(device):
    # Finite z whose Gumbel-max key z / T overflows float32 (|z| / T > FLT_MAX): -inf keys never
    # beat finite ones and +inf keys beat everything (ties to the lowest id); a sampled row whose
    # keys are all -inf drafts 0, as the reference's argmax over all -inf keys does. Greedy rows
    # compare z itself, which is finite. Zero weights: z = base exactly on every device.
    vocab = 40
    base = torch.full((6, 1, vocab), -3e38)
    base[0, 0, 0] = NAN  # all keys -inf, id 0 not even finite
    base[2, 0, 7] = -1e38  # the one finite key
    base[3, 0, [5, 9]] = 3e38  # two +inf keys
    base[3, 0, 6] = 3.2e38
    base[4, 0, :5] = NAN
    base[5, 0, 0] = NAN  # greedy: the first finite maximum, id 1
    temperature = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.25, 0.0])
    case = DraftCase(base, torch.zeros(6, dtype=torch.int64), torch.zeros(vocab, 4),
                     torch.zeros(vocab, 4), temperature, torch.arange(6) * 7919,
                     torch.arange(6) * 1000).to(device)
    out = check_against_reference(case)
    assert out.tokens[:, 0].tolist() == [0, 0, 7, 5, 0, 1]


# --------------------------------------------------------------------------------------------
# Batch invariance, greedy requests, seeds and positions
# --------------------------------------------------------------------------------------------


def _assert_request_equal(got, i, expected, b, context):
    assert torch.equal(got.tokens[i], expected.tokens[b]), (context, b)
    torch.testing.assert_close(got.draft_logits[i], expected.draft_logits[b], rtol=0, atol=0,
                               equal_nan=True, msg=lambda m: f"{context} b={b}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_batch_invariance(device, head):
    batch, block, vocab = 24, 8, 2048
    case = make_case(batch, block, vocab, 64, seed=stable_seed("invariance", head),
                     head=head).to(device)
    out = check_against_reference(case)
    gen = generator(108)
    arrangements = {
        "alone": [torch.tensor([b]) for b in range(0, batch, 5)],
        "reordered": [torch.randperm(batch, generator=gen)],
        "subset": [torch.randperm(batch, generator=gen)[:7]],
    }
    for name, index_lists in arrangements.items():
        for index in index_lists:
            got = case.select(index.to(device)).call()
            for i, b in enumerate(index.tolist()):
                _assert_request_equal(got, i, out, b, name)
    # Other requests (their own inputs, seeds and positions) interleaved with these.
    others = make_case(40, block, vocab, 64, seed=109, head=head).to(device)
    joined = case.replace(**{
        k: torch.cat([getattr(case, k), getattr(others, k)]) for k in DraftCase.PER_REQUEST
        if getattr(case, k) is not None})
    mix = torch.randperm(batch + 40, generator=gen)
    got = joined.select(mix.to(device)).call()
    for i, b in enumerate(mix.tolist()):
        if b < batch:
            _assert_request_equal(got, i, out, b, "joined")


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_cpu_results_do_not_depend_on_thread_count(head):
    # The CPU kernels split the vocabulary (and the RNN's joint rows) over threads and merge in a
    # fixed order: one thread gives the same drafts, logits and confidences as many.
    case = make_case(16, 5, 20000, 64, seed=stable_seed("threads", head), head=head)
    confidence = make_confidence_case(512, 5, 1000, 64, 64, seed=136)
    threads = torch.get_num_threads()
    out, conf = case.call(), confidence.call()
    try:
        torch.set_num_threads(1)
        single, single_conf = case.call(), confidence.call()
    finally:
        torch.set_num_threads(threads)
    assert_same_outputs(single, out, case)
    assert torch.equal(single_conf, conf)


@cuda_only
def test_cuda_calls_on_concurrent_streams_and_in_sequence():
    # The CUDA ops keep their counters in one buffer per stream (shared with verify), returned to
    # zero by every call: calls of changing shapes and heads in a row on one stream, with verify
    # calls among them, and calls overlapping on two streams, each give the first call's outputs.
    cases = [make_case(64, 7, 8193, 64, seed=137, temperature="mixed"),
             make_case(70, 3, 700, 40, seed=138, head="rnn", hidden_size=40),
             make_case(3, 2, 100, 8, seed=139, weights="f32", temperature="greedy")]
    on_gpu = [case.to("cuda") for case in cases]
    first = [check_against_reference(case) for case in on_gpu]
    target = torch.randn(4, 5, 8193, generator=generator(140))
    drafts = target[:, :4].argmax(-1)
    drafts[:, 2] = (drafts[:, 2] + 1) % 8193  # greedy: rows 0 and 1 accepted, row 2 rejected
    verify_args = tuple(t.cuda() for t in (target, drafts, torch.full((4,), 4).int(),
                                           torch.zeros(4), torch.zeros(4, dtype=torch.int64),
                                           torch.zeros(4, dtype=torch.int64)))
    verified = dspark_ops.verify(*verify_args)
    assert verified.num_accepted.tolist() == [2] * 4
    assert torch.equal(verified.tokens[:, 2].cpu(), target[:, 2].argmax(-1))
    for _ in range(2):
        for case, want in zip(on_gpu, first):
            assert_same_outputs(case.call(), want, case)
            assert torch.equal(dspark_ops.verify(*verify_args).tokens, verified.tokens)
    outputs = on_two_streams([on_gpu[0].call, on_gpu[1].call])
    for k in range(2):
        for got in outputs[k]:
            assert_same_outputs(got, first[k], on_gpu[k])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ignores_seed_and_position(device):
    case = make_case(32, 6, 1500, 16, seed=110, temperature="greedy").to(device)
    out = check_against_reference(case)
    for other in (case.replace(seed=case.seed + 1), case.replace(position=case.position + 7)):
        assert_same_outputs(other.call(), out, case)
    # Greedy: each slot drafts the argmax of its stored logits (ties to the lowest id).
    assert torch.equal(out.tokens, out.draft_logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ties_go_to_the_lowest_id(device):
    # Integer-valued logits and a zero bias: many ties; greedy requests take the lowest tied id.
    batch, block, vocab = 32, 5, 64
    gen = generator(111)
    base = torch.randint(0, 3, (batch, block, vocab), generator=gen).float()
    case = DraftCase(base, torch.randint(0, vocab, (batch,), generator=gen),
                     torch.zeros(vocab, 4), torch.randn(vocab, 4, generator=gen),
                     torch.zeros(batch), torch.randint(-(2**62), 2**62, (batch,), generator=gen),
                     torch.randint(0, 2**40, (batch,), generator=gen)).to(device)
    out = check_against_reference(case)
    first_max = (base == base.amax(-1, keepdim=True)).int().argmax(-1)
    assert torch.equal(out.tokens.cpu(), first_max)
    assert ((base == base.amax(-1, keepdim=True)).sum(-1) > 1).any()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_threshold(device):
    # T <= 1e-5 is greedy (including exactly 1e-5); the next float32 above it samples.
    batch, block, vocab = 16, 3, 400
    threshold = torch.tensor(reference.GREEDY_TEMPERATURE, dtype=torch.float32)
    above = torch.nextafter(threshold, torch.tensor(1.0))
    case = make_case(batch, block, vocab, 8, seed=112)
    gen = generator(113)
    # Nearly flat rows (z / T ~ 0.1 above the threshold): a sampled draft is rarely the argmax.
    case.base_logits = 1e-6 * torch.randn(batch, block, vocab, generator=gen)
    case.w1 = torch.zeros_like(case.w1)
    for t, greedy in ((threshold, True), (above, False)):
        out = check_against_reference(case.replace(temperature=t.expand(batch).clone()).to(device))
        is_argmax = out.tokens == out.draft_logits.argmax(-1)
        assert bool(is_argmax.all()) == greedy


def _fraction_of_requests_changed(a, b) -> float:
    return (a.tokens != b.tokens).any(1).float().mean().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_seed_and_position_change_drafts(device, head):
    # Spread-out rows: another seed or position redraws almost every sampled request.
    batch, block, vocab = 64, 4, 1000
    case = make_case(batch, block, vocab, 16, seed=114, temperature=1.0, head=head)
    case.base_logits = torch.randn(batch, block, vocab, generator=generator(115))
    case = case.to(device)
    out = check_against_reference(case)
    assert _fraction_of_requests_changed(out, case.call()) == 0  # deterministic
    assert_same_outputs(case.call(), out, case)
    for other in (case.replace(seed=case.seed + 1), case.replace(seed=case.seed ^ (1 << 40)),
                  case.replace(position=case.position + 1),
                  case.replace(position=case.position + 2**32)):
        assert _fraction_of_requests_changed(out, check_against_reference(other)) > 0.75


@pytest.mark.parametrize("device", DEVICES)
def test_slot_j_draws_at_position_plus_one_plus_j(device):
    # Slot j draws from the draft stream of position p0 + 1 + j: drafting the block's tail on its
    # own (base rows 1.., the first draft as the anchor, p0 + 1) reproduces the tail exactly.
    case = make_case(32, 6, 3000, 16, seed=116, temperature="mixed",
                     weights="f32").to(device)
    out = check_against_reference(case)
    tail = case.replace(base_logits=case.base_logits[:, 1:], anchor=out.tokens[:, 0],
                        position=case.position + 1)
    got = check_against_reference(tail)
    assert torch.equal(got.tokens, out.tokens[:, 1:])
    torch.testing.assert_close(got.draft_logits, out.draft_logits[:, 1:], rtol=0, atol=0)
    # The draft stream is not the acceptance or resampling stream at the same position.
    z, t = out.draft_logits[:, 0].cpu(), case.temperature.cpu()
    u = {purpose: reference.philox_uniform(case.seed.cpu(), case.position.cpu() + 1, purpose,
                                           case.vocab)
         for purpose in (reference.PURPOSE_DRAFT, reference.PURPOSE_ACCEPT)}
    assert not torch.equal(u[reference.PURPOSE_DRAFT], u[reference.PURPOSE_ACCEPT])
    keys = z / t.clamp_min(1e-5)[:, None] - torch.log(-torch.log1p(-u[reference.PURPOSE_ACCEPT]))
    sampled = ~is_greedy(t)
    assert (keys.argmax(-1) != out.tokens[:, 0].cpu())[sampled].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_seed_none_uses_generator(device, head):
    case = make_case(32, 4, 1000, 16, seed=117, temperature=1.0, head=head).to(device)
    case.base_logits = torch.randn(case.base_logits.shape, generator=generator(118)).to(device)

    def run(generator_seed):
        gen = torch.Generator(device).manual_seed(generator_seed)
        return case.replace(seed=None).call(generator=gen)

    first, again, other = run(5), run(5), run(6)
    check_output_contract(case, first)
    assert_same_outputs(again, first, case)
    assert _fraction_of_requests_changed(first, other) > 0.5
    # Without a generator, torch's default generator for the device is used.
    torch.manual_seed(3)
    default = case.replace(seed=None).call()
    torch.manual_seed(3)
    assert_same_outputs(case.replace(seed=None).call(), default, case)


# --------------------------------------------------------------------------------------------
# Statistical tests of the drafts (docs/semantics.md §5)
# --------------------------------------------------------------------------------------------

STAT_VOCAB = 128
STAT_RANK = 16
STAT_TRIALS = 10 * STAT_VOCAB
STAT_GROUPS = 2  # step-2 checks on the most frequent first drafts
MIN_GROUP_TRIALS = 120


def stat_inputs(seed: int):
    """One request's base rows for two slots (slot 0 with three boosted tokens, so a few first
    drafts are frequent) and a Markov head whose bias (std ~1.6) is as large as the base logits'
    spread, so every previous token leads to a clearly different next distribution."""
    gen = generator(seed)
    base = torch.randn(2, STAT_VOCAB, generator=gen)
    heads = torch.randperm(STAT_VOCAB, generator=gen)[:3]
    base[0, heads] += torch.tensor([3.5, 3.0, 2.5])
    scale = 1.3 * STAT_RANK**-0.25
    w1 = make_weight((STAT_VOCAB, STAT_RANK), scale, "f32", gen)
    w2 = make_weight((STAT_VOCAB, STAT_RANK), scale, "f32", gen)
    anchor = int(torch.randint(0, STAT_VOCAB, (), generator=gen))
    return base, anchor, w1, w2, gen


def next_token_probs(base_row, w1, w2, prev: int, temperature: float) -> torch.Tensor:
    """softmax((base + W2 . W1[prev]) / T) in float64."""
    z = base_row.double() + w2.double() @ w1[prev].double()
    return torch.softmax(z / temperature, -1)


def draft_steps_follow_softmax(tokens, base, anchor, w1, w2, temperature):
    """(a) x1 ~ softmax((base[0] + W2 . W1[anchor]) / T) over all trials; (b) for the most
    frequent x1 values, x2 | x1 ~ softmax((base[1] + W2 . W1[x1]) / T). Returns
    [(step, x1, trials, chi2, df, passed)]."""
    results = []
    chi2, df = chi_square(tokens[:, 0], next_token_probs(base[0], w1, w2, anchor, temperature))
    results.append((1, anchor, tokens.shape[0], chi2, df, df > 0 and chi_square_passes(chi2, df)))
    counts = torch.bincount(tokens[:, 0], minlength=STAT_VOCAB)
    for x1 in counts.argsort(descending=True)[:STAT_GROUPS].tolist():
        chosen = tokens[:, 0] == x1
        trials = int(chosen.sum())
        assert trials >= MIN_GROUP_TRIALS, (x1, trials)
        chi2, df = chi_square(tokens[chosen, 1], next_token_probs(base[1], w1, w2, x1, temperature))
        results.append((2, x1, trials, chi2, df, df > 0 and chi_square_passes(chi2, df)))
    return results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_drafts_follow_the_corrected_distribution(device, temperature):
    # STAT_TRIALS independent requests (own seeds and positions) share one base row per slot (a
    # stride-0 batch), the anchor and the head.
    base, anchor, w1, w2, gen = stat_inputs(stable_seed("stat", temperature))
    n = STAT_TRIALS
    case = DraftCase(base.expand(n, 2, STAT_VOCAB), torch.full((n,), anchor), w1, w2,
                     torch.full((n,), temperature),
                     torch.randint(-(2**62), 2**62, (n,), generator=gen),
                     torch.randint(0, 2**40, (n,), generator=gen)).to(device)
    out = case.call()
    check_output_contract(case, out)
    results = draft_steps_follow_softmax(out.tokens.cpu(), base, anchor, w1, w2, temperature)
    failed = [r for r in results if not r[5]]
    assert not failed, f"chi-square rejects (step, x1, trials, chi2, df): {failed}"


def torch_markov_sampler(base, anchor, w1, w2, temperature, trials, gen, bug=None):
    """A plain-torch two-slot Markov drafter (torch.multinomial, no Philox) used to show that the
    checks above detect a wrong rule. ``bug``: None (correct), "anchor_bias_at_slot_1" (slot 1
    biased by the anchor instead of x1) or "bias_on_wrong_slot" (slot 0 unbiased, the anchor's bias
    added to slot 1)."""
    def draw(z):  # z [trials, V] float64
        return torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen)[:, 0]

    bias = w1.double() @ w2.double().T  # bias[x] = W2 . W1[x]
    base = base.double()
    z0 = base[0].expand(trials, -1) + (0.0 if bug == "bias_on_wrong_slot" else bias[anchor])
    x1 = draw(z0)
    prev = torch.full_like(x1, anchor) if bug == "anchor_bias_at_slot_1" else x1
    z1 = base[1] + bias[prev]
    if bug == "bias_on_wrong_slot":
        z1 = z1 + bias[anchor]
    return torch.stack([x1, draw(z1)], 1)


@pytest.mark.parametrize("bug,failing_step", [
    (None, None), ("anchor_bias_at_slot_1", 2), ("bias_on_wrong_slot", 1),
])
def test_checks_reject_a_broken_drafter(bug, failing_step):
    # Same inputs and checks as the op's test; only the drafting rule differs. The correct torch
    # sampler passes (so a failure is the rule's, not the checker's).
    base, anchor, w1, w2, gen = stat_inputs(stable_seed("stat", 1.0))
    tokens = torch_markov_sampler(base, anchor, w1, w2, 1.0, STAT_TRIALS, gen, bug)
    results = draft_steps_follow_softmax(tokens, base, anchor, w1, w2, 1.0)
    if bug is None:
        assert all(r[5] for r in results), results
    else:
        rejected = [r for r in results if r[0] == failing_step and not r[5]]
        assert rejected, results
        if failing_step == 2:
            assert all(not r[5] for r in results if r[0] == 2), results


# --------------------------------------------------------------------------------------------
# Lossless hand-off to verify
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", ["sampled", "greedy", "mixed"])
def test_verify_accepts_drafts_against_their_own_distribution(device, head, temperature):
    # The target's first G rows equal draft_logits (row G anything) at the same temperature: p =
    # q, so verify accepts every draft (u * q(x) < p(x) = q(x); greedy: x is the argmax) and emits
    # a bonus token. This holds only if each token was sampled from exactly the stored logits.
    batch, block, vocab = 64, 7, 5000
    case = make_case(batch, block, vocab, 32, seed=stable_seed("handoff", head, temperature),
                     head=head, temperature=temperature, base_dtype=torch.bfloat16,
                     weights="bf16").to(device)
    draft = check_against_reference(case)
    bonus_row = torch.randn(batch, 1, vocab, generator=generator(119)).to(device)
    target = torch.cat([draft.draft_logits, bonus_row], 1)
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


# --------------------------------------------------------------------------------------------
# draft_confidence
# --------------------------------------------------------------------------------------------


def check_confidence(case: ConfidenceCase) -> torch.Tensor:
    got = case.call()
    batch, block = case.prev_tokens.shape
    assert got.dtype == torch.float32 and got.shape == (batch, block)
    assert got.device == case.hidden.device
    assert ((got >= 0) & (got <= 1)).all()
    cpu = case.to("cpu")
    torch.testing.assert_close(got.cpu(), cpu.call(reference), rtol=1e-5, atol=1e-6)
    tau = 1.0 if case.calib_temperature is None else cpu.calib_temperature.float()
    torch.testing.assert_close(got.cpu(), torch.sigmoid(confidence_logits(case) / tau),
                               rtol=1e-5, atol=1e-6)
    return got


CONFIDENCE_DTYPES = [(h, w) for h in FLOAT_DTYPES for w in FLOAT_DTYPES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", CONFIDENCE_DTYPES,
                         ids=lambda p: f"h{DTYPE_IDS[p[0]]}-w1{DTYPE_IDS[p[1]]}")
@pytest.mark.parametrize("bias,calib", [(False, False), (True, False), (False, True),
                                        (True, True)],
                         ids=["plain", "bias", "calib", "bias-calib"])
def test_draft_confidence_matches_reference(device, dtypes, bias, calib):
    hidden_dtype, w1_dtype = dtypes
    # The head's weight (and bias) in a third dtype.
    weight_dtype = FLOAT_DTYPES[(FLOAT_DTYPES.index(hidden_dtype) + 2) % 3]
    case = make_confidence_case(16, 7, 1000, 256, 64, seed=stable_seed("conf", dtypes, bias, calib),
                                hidden_dtype=hidden_dtype, w1_dtype=w1_dtype,
                                weight_dtype=weight_dtype, bias=bias, calib=calib,
                                ids_dtype=torch.int32 if bias else torch.int64)
    check_confidence(case.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (64, 32, 151936, 256, 128), (3, 16, 2, 8, 7)],
                         ids=lambda s: "B{}-G{}-V{}-r{}-d{}".format(*s))
def test_draft_confidence_shapes(device, shape):
    case = make_confidence_case(*shape, seed=stable_seed("conf-shape", shape), bias_shape=(1,))
    got = check_confidence(case.to(device))
    narrow = case.replace(prev_tokens=case.prev_tokens.int()).to(device)
    assert torch.equal(narrow.call(), got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["strided", "padded", "transposed"])
def test_draft_confidence_non_contiguous(device, kind):
    case = make_confidence_case(16, 7, 500, 32, 48, seed=120, hidden_dtype=torch.bfloat16,
                                ids_dtype=torch.int32).to(device)
    got = check_confidence(case)
    changed = {k: relayout(v, kind) for k, v in case.fields().items()
               if v is not None and v.dim() > 0}
    assert torch.equal(case.replace(**changed).call(), got)


@pytest.mark.parametrize("device", DEVICES)
def test_draft_confidence_literal(device):
    # c = sigmoid((w_h . h + w_r . W1[x] + b) / tau) with one-hot features: w picks one hidden
    # entry and one embedding entry.
    batch, block, vocab, rank, hidden_size = 4, 3, 10, 4, 5
    hidden = torch.arange(batch * block * hidden_size, dtype=torch.float32).reshape(
        batch, block, hidden_size) / 16
    w1 = torch.arange(vocab * rank, dtype=torch.float32).reshape(vocab, rank) / 32
    prev = torch.tensor([[0, 3, 9], [1, 1, 1], [9, 8, 7], [5, 0, 2]])
    weight = torch.zeros(hidden_size + rank)
    weight[2], weight[hidden_size + 1] = 0.5, -0.25
    tau = torch.tensor([1.0, 2.0, 0.5])
    got = dspark_ops.draft_confidence(hidden.to(device), prev.to(device), w1.to(device),
                                      weight.to(device), torch.tensor([0.125], device=device),
                                      tau.to(device))
    logit = 0.5 * hidden[..., 2] - 0.25 * w1[prev, 1] + 0.125
    torch.testing.assert_close(got.cpu(), torch.sigmoid(logit / tau), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Calibrated confidences (the fit itself: test_calibration.py)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_calibrated_confidences_feed_draft_confidence(device):
    # Fitted temperatures go to draft_confidence(calib_temperature=...) and give
    # sigmoid(logit / tau) per slot; the calibrated survivals are calibrated on held-out data.
    batch, vocab, rank, hidden_size = 40000, 300, 16, 32
    gen = generator(123)
    case = make_confidence_case(batch, CALIB_BLOCK, vocab, rank, hidden_size, seed=124,
                                calib=False)
    logit = confidence_logits(case)  # what the head computes, before any temperature
    # Acceptance with true probability sigmoid(logit / 3) (the head is overconfident).
    accepted = torch.rand(batch, CALIB_BLOCK, generator=gen, dtype=torch.float64) < torch.sigmoid(
        logit.double() / 3)
    num_accepted = accepted.int().cumprod(1).sum(1)
    half = batch // 2
    tau = dspark_ops.fit_sequential_temperatures(logit[:half], num_accepted[:half])
    assert abs(float(tau[0]) - 3) < 0.5, tau
    calibrated = check_confidence(case.replace(calib_temperature=tau).to(device)).cpu()
    torch.testing.assert_close(calibrated, torch.sigmoid(logit / tau), rtol=1e-5, atol=1e-6)
    raw = check_confidence(case.to(device)).cpu()
    before = survival_ece(logit[half:], num_accepted[half:], torch.ones(CALIB_BLOCK))
    survival = calibrated[half:].double().cumprod(1)
    after = [dspark_ops.expected_calibration_error(survival[:, k], num_accepted[half:] > k)
             for k in range(CALIB_BLOCK)]
    assert max(after) < 0.02 and after[0] < before[0] / 4, (before, after)
    # Per slot, temperature scaling keeps the ranking of requests: in the order of the logits,
    # raw and calibrated confidences both ascend.
    order = logit.argsort(0)
    for c in (raw, calibrated):
        assert (c.gather(0, order).diff(dim=0) >= 0).all()


# --------------------------------------------------------------------------------------------
# Argument checks: every check of csrc/args/draft_args.{h,cpp} with its message
# --------------------------------------------------------------------------------------------

B, G, V, R, D = 3, 4, 100, 8, 16


def valid_draft_args(device) -> dict:
    gen = generator(131)
    args = dict(
        base_logits=torch.randn(B, G, V, generator=gen),
        anchor=i64(0, 7, V - 1),
        w1=torch.randn(V, R, generator=gen),
        w2=torch.randn(V, R, generator=gen),
        temperature=f32(0.0, 0.8, 1.0),
        seed=i64(1, -2, 3),
        position=i64(10, 20, 2**33),
        hidden=torch.randn(B, G, D, generator=gen),
        joint_weight=torch.randn(3 * R, 2 * R + D, generator=gen) / 6,
        joint_bias=torch.randn(3 * R, generator=gen),
    )
    return {k: v.to(device) for k, v in args.items()}


def call_draft(op: str, args: dict):
    case = DraftCase(**{k: v for k, v in args.items()
                        if op == "rnn_draft" or k not in ("hidden", "joint_weight", "joint_bias")})
    return case.call()


def valid_confidence_args(device) -> dict:
    gen = generator(132)
    args = dict(
        hidden=torch.randn(B, G, D, generator=gen),
        prev_tokens=torch.randint(0, V, (B, G), generator=gen),
        w1=torch.randn(V, R, generator=gen),
        weight=torch.randn(D + R, generator=gen),
        bias=f32(0.25),
        calib_temperature=f32(1.0, 0.5, 2.0, 3.0),
    )
    return {k: v.to(device) for k, v in args.items()}


def _huge_base():
    # A stride-0 view: a 2^31 - 1 vocabulary without the memory (moved to the device as a view).
    return dict(base_logits=torch.randn(1, 1, 1).expand(B, G, 2**31 - 1))


def _huge_w1():
    return dict(w1=torch.randn(1, 1).expand(2**31 - 1, R))


DRAFT_OPS = ["markov_draft", "rnn_draft"]
RNN = ["rnn_draft"]
CONFIDENCE = ["draft_confidence"]

# Rows (id, ops, overrides, exception, message) as cases/arguments.py runs them.
# The checks both heads share (check_common); run for markov_draft and rnn_draft.
COMMON_ERRORS = vocabulary_errors(
    DRAFT_OPS, "base_logits",
    lambda: dict(base_logits=torch.randn(B, G, 0), w1=torch.randn(0, R), w2=torch.randn(0, R)),
    _huge_base,
) + per_request_errors(DRAFT_OPS, B) + [
    ("base-2d", DRAFT_OPS, lambda: dict(base_logits=torch.randn(B, V)), ValueError,
     r"'base_logits' must be 3-D \[B, G, V\], got a 2-D tensor of shape \[3, 100\]"),
    ("base-4d", DRAFT_OPS, lambda: dict(base_logits=torch.randn(B, G, 1, V)), ValueError,
     r"'base_logits' must be 3-D \[B, G, V\], got a 4-D tensor of shape \[3, 4, 1, 100\]"),
    ("base-float64", DRAFT_OPS, lambda: dict(base_logits=torch.randn(B, G, V, dtype=torch.float64)),
     TypeError, r"'base_logits' must have dtype Float or BFloat16 or Half, got Double"),
    ("base-int32", DRAFT_OPS, lambda: dict(base_logits=torch.zeros(B, G, V, dtype=torch.int32)),
     TypeError, r"'base_logits' must have dtype Float or BFloat16 or Half, got Int"),
    ("anchor-float", DRAFT_OPS, lambda: dict(anchor=f32(1, 2, 3)), TypeError,
     r"'anchor' must have dtype Long or Int, got Float"),
    ("anchor-int16", DRAFT_OPS, lambda: dict(anchor=torch.tensor([1, 2, 3], dtype=torch.int16)),
     TypeError, r"'anchor' must have dtype Long or Int, got Short"),
    ("anchor-shape", DRAFT_OPS, lambda: dict(anchor=i64(1, 2, 3, 4)), ValueError,
     r"'anchor' must have shape \[B\] = \[3\], got \[4\]"),
    ("anchor-2d", DRAFT_OPS, lambda: dict(anchor=i64(1, 2, 3)[:, None]), ValueError,
     r"'anchor' must have shape \[B\] = \[3\], got \[3, 1\]"),
    ("w1-float64", DRAFT_OPS, lambda: dict(w1=torch.randn(V, R, dtype=torch.float64)), TypeError,
     r"'w1' must have dtype Float or BFloat16 or Half, got Double"),
    ("w1-1d", DRAFT_OPS, lambda: dict(w1=torch.randn(V)), ValueError,
     r"'w1' must be 2-D \[V, r\], got a 1-D tensor of shape \[100\]"),
    ("w1-3d", DRAFT_OPS, lambda: dict(w1=torch.randn(V, R, 1)), ValueError,
     r"'w1' must be 2-D \[V, r\], got a 3-D tensor of shape \[100, 8, 1\]"),
    ("rank-0", DRAFT_OPS, lambda: dict(w1=torch.randn(V, 0), w2=torch.randn(V, 0)), ValueError,
     r"'w1' must have a rank r in \[1, 1024\], got \[100, 0\]"),
    ("rank-1025", DRAFT_OPS,
     lambda: dict(w1=torch.randn(V, 1025), w2=torch.randn(V, 1025)), ValueError,
     r"'w1' must have a rank r in \[1, 1024\], got \[100, 1025\]"),
    ("w1-vocab", DRAFT_OPS, lambda: dict(w1=torch.randn(V - 1, R)), ValueError,
     r"'w1' must have shape \[V, r\] = \[100, 8\], got \[99, 8\]"),
    ("w2-dtype", DRAFT_OPS, lambda: dict(w2=torch.randn(V, R).bfloat16()), TypeError,
     r"'w2' must have dtype Float like 'w1', got BFloat16"),
    ("w2-dtype-like-w1", DRAFT_OPS, lambda: dict(w1=torch.randn(V, R).half(), w2=torch.randn(V, R)),
     TypeError, r"'w2' must have dtype Half like 'w1', got Float"),
    ("w2-rank", DRAFT_OPS, lambda: dict(w2=torch.randn(V, R + 1)), ValueError,
     r"'w2' must have shape \[V, r\] like 'w1' = \[100, 8\], got \[100, 9\]"),
    ("w2-transposed", DRAFT_OPS, lambda: dict(w2=torch.randn(R, V)), ValueError,
     r"'w2' must have shape \[V, r\] like 'w1' = \[100, 8\], got \[8, 100\]"),
]

# The RNN head's own arguments (ops::rnn_draft).
RNN_ERRORS = [
    ("hidden-float64", RNN, lambda: dict(hidden=torch.randn(B, G, D, dtype=torch.float64)),
     TypeError, r"'hidden' must have dtype Float or BFloat16 or Half, got Double"),
    ("hidden-2d", RNN, lambda: dict(hidden=torch.randn(B, D)), ValueError,
     r"'hidden' must be 3-D \[B, G, d\], got a 2-D tensor of shape \[3, 16\]"),
    ("hidden-G", RNN, lambda: dict(hidden=torch.randn(B, G + 1, D)), ValueError,
     r"'hidden' must have shape \[B, G, d\] = \[3, 4, 16\], got \[3, 5, 16\]"),
    ("hidden-B", RNN, lambda: dict(hidden=torch.randn(B - 1, G, D)), ValueError,
     r"'hidden' must have shape \[B, G, d\] = \[3, 4, 16\], got \[2, 4, 16\]"),
    ("joint_weight-dtype", RNN, lambda: dict(joint_weight=torch.randn(3 * R, 2 * R + D).half()),
     TypeError, r"'joint_weight' must have dtype Float like 'w1', got Half"),
    ("joint_weight-width", RNN, lambda: dict(joint_weight=torch.randn(3 * R, 2 * R + D + 1)),
     ValueError, r"'joint_weight' must have shape \[3r, 2r \+ d\] = \[24, 32\], got \[24, 33\]"),
    ("joint_weight-rows", RNN, lambda: dict(joint_weight=torch.randn(4 * R, 2 * R + D)),
     ValueError, r"'joint_weight' must have shape \[3r, 2r \+ d\] = \[24, 32\], got \[32, 32\]"),
    ("joint_weight-transposed", RNN, lambda: dict(joint_weight=torch.randn(2 * R + D, 3 * R)),
     ValueError, r"'joint_weight' must have shape \[3r, 2r \+ d\] = \[24, 32\], got \[32, 24\]"),
    ("joint_bias-dtype", RNN, lambda: dict(joint_bias=torch.randn(3 * R).bfloat16()), TypeError,
     r"'joint_bias' must have dtype Float like 'w1', got BFloat16"),
    ("joint_bias-shape", RNN, lambda: dict(joint_bias=torch.randn(3 * R - 1)), ValueError,
     r"'joint_bias' must have shape \[3r\] = \[24\], got \[23\]"),
    ("joint_bias-2d", RNN, lambda: dict(joint_bias=torch.randn(3 * R, 1)), ValueError,
     r"'joint_bias' must have shape \[3r\] = \[24\], got \[24, 1\]"),
]

CONFIDENCE_ERRORS = vocabulary_errors(
    CONFIDENCE, "w1", lambda: dict(w1=torch.randn(0, R)), _huge_w1, prefix="w1-") + [
    ("hidden-2d", CONFIDENCE, lambda: dict(hidden=torch.randn(B, D)), ValueError,
     r"'hidden' must be 3-D \[B, G, d\], got a 2-D tensor of shape \[3, 16\]"),
    ("hidden-float64", CONFIDENCE, lambda: dict(hidden=torch.randn(B, G, D, dtype=torch.float64)),
     TypeError, r"'hidden' must have dtype Float or BFloat16 or Half, got Double"),
    ("prev_tokens-float", CONFIDENCE, lambda: dict(prev_tokens=torch.zeros(B, G)), TypeError,
     r"'prev_tokens' must have dtype Long or Int, got Float"),
    ("prev_tokens-int16", CONFIDENCE,
     lambda: dict(prev_tokens=torch.zeros(B, G, dtype=torch.int16)),
     TypeError, r"'prev_tokens' must have dtype Long or Int, got Short"),
    ("prev_tokens-shape", CONFIDENCE,
     lambda: dict(prev_tokens=torch.zeros(B, G + 1, dtype=torch.int64)),
     ValueError, r"'prev_tokens' must have shape \[B, G\] = \[3, 4\], got \[3, 5\]"),
    ("prev_tokens-1d", CONFIDENCE, lambda: dict(prev_tokens=i64(1, 2, 3)), ValueError,
     r"'prev_tokens' must have shape \[B, G\] = \[3, 4\], got \[3\]"),
    ("w1-1d", CONFIDENCE, lambda: dict(w1=torch.randn(V)), ValueError,
     r"'w1' must be 2-D \[V, r\], got a 1-D tensor of shape \[100\]"),
    ("w1-float64", CONFIDENCE, lambda: dict(w1=torch.randn(V, R, dtype=torch.float64)), TypeError,
     r"'w1' must have dtype Float or BFloat16 or Half, got Double"),
    ("rank-0", CONFIDENCE, lambda: dict(w1=torch.randn(V, 0), weight=torch.randn(D)), ValueError,
     r"'w1' must have a rank r in \[1, 1024\], got \[100, 0\]"),
    ("rank-1025", CONFIDENCE, lambda: dict(w1=torch.randn(V, 1025), weight=torch.randn(D + 1025)),
     ValueError, r"'w1' must have a rank r in \[1, 1024\], got \[100, 1025\]"),
    ("weight-float64", CONFIDENCE, lambda: dict(weight=torch.randn(D + R, dtype=torch.float64)),
     TypeError, r"'weight' must have dtype Float or BFloat16 or Half, got Double"),
    ("weight-shape", CONFIDENCE, lambda: dict(weight=torch.randn(D + R + 1)), ValueError,
     r"'weight' must have shape \[d \+ r\] = \[24\], got \[25\]"),
    ("weight-2d", CONFIDENCE, lambda: dict(weight=torch.randn(1, D + R)), ValueError,
     r"'weight' must have shape \[d \+ r\] = \[24\], got \[1, 24\]"),
    ("bias-float64", CONFIDENCE,
     lambda: dict(bias=torch.tensor(0.5, dtype=torch.float64)), TypeError,
     r"'bias' must have dtype Float or BFloat16 or Half, got Double"),
    ("bias-two", CONFIDENCE, lambda: dict(bias=f32(0.5, 0.5)), ValueError,
     r"'bias' must have exactly one element, got shape \[2\]"),
    ("bias-empty", CONFIDENCE, lambda: dict(bias=torch.zeros(0)), ValueError,
     r"'bias' must have exactly one element, got shape \[0\]"),
    ("calib-float64", CONFIDENCE,
     lambda: dict(calib_temperature=torch.ones(G, dtype=torch.float64)),
     TypeError, r"'calib_temperature' must have dtype Float, got Double"),
    ("calib-bf16", CONFIDENCE, lambda: dict(calib_temperature=torch.ones(G, dtype=torch.bfloat16)),
     TypeError, r"'calib_temperature' must have dtype Float, got BFloat16"),
    ("calib-shape", CONFIDENCE, lambda: dict(calib_temperature=torch.ones(G + 1)), ValueError,
     r"'calib_temperature' must have shape \[G\] = \[4\], got \[5\]"),
    ("calib-per-request", CONFIDENCE, lambda: dict(calib_temperature=torch.ones(B, G)), ValueError,
     r"'calib_temperature' must have shape \[G\] = \[4\], got \[3, 4\]"),
]

# Value checks: always on CPU; on CUDA only with DSPARK_OPS_DEBUG=1 (they cost a sync).
DRAFT_VALUE_ERRORS = per_request_value_errors(DRAFT_OPS, B) + [
    ("anchor-V", DRAFT_OPS, lambda: dict(anchor=i64(0, 100, 5)), ValueError,
     r"'anchor' values must lie in \[0, 99\], got 100 at index \[1\]"),
    ("anchor-negative-int32", DRAFT_OPS, lambda: dict(anchor=i32(0, 5, -1)), ValueError,
     r"'anchor' values must lie in \[0, 99\], got -1 at index \[2\]"),
    # Offenders at the last element (the CPU checks loop over the data), int64 beyond int32.
    ("anchor-int64-beyond-int32-last", DRAFT_OPS, lambda: dict(anchor=i64(0, 5, 2**32)), ValueError,
     r"'anchor' values must lie in \[0, 99\], got 4294967296 at index \[2\]"),
]

CONFIDENCE_VALUE_ERRORS = [
    ("prev_tokens-V", CONFIDENCE,
     lambda: dict(prev_tokens=i64([0, 1, 2, 3], [4, 5, 100, 7], [1, 1, 1, 1])),
     ValueError, r"'prev_tokens' values must lie in \[0, 99\], got 100 at index \[1, 2\]"),
    ("prev_tokens-negative-int32", CONFIDENCE,
     lambda: dict(prev_tokens=i32([0, 1, 2, 3], [4, 5, 6, 7], [1, 1, 1, -3])), ValueError,
     r"'prev_tokens' values must lie in \[0, 99\], got -3 at index \[2, 3\]"),
    ("calib-zero", CONFIDENCE, lambda: dict(calib_temperature=f32(1.0, 0.0, 1.0, 1.0)), ValueError,
     r"'calib_temperature' must be finite and > 0, got 0 at index \[1\]"),
    ("calib-negative", CONFIDENCE,
     lambda: dict(calib_temperature=f32(1.0, 1.0, -1.0, 1.0)), ValueError,
     r"'calib_temperature' must be finite and > 0, got -1 at index \[2\]"),
    ("calib-nan", CONFIDENCE, lambda: dict(calib_temperature=f32(NAN, 1.0, 1.0, 1.0)), ValueError,
     r"'calib_temperature' must be finite and > 0, got nan at index \[0\]"),
    ("calib-inf", CONFIDENCE, lambda: dict(calib_temperature=f32(1.0, 1.0, 1.0, INF)), ValueError,
     r"'calib_temperature' must be finite and > 0, got inf at index \[3\]"),
    # The CPU checks read the data through its strides: offenders at the last element read, in
    # non-contiguous layouts, and int64 ids beyond int32.
    ("prev_tokens-last-strided", CONFIDENCE,
     lambda: dict(prev_tokens=non_contiguous(i64([0, 1, 2, 3], [4, 5, 6, 7], [1, 1, 1, 100]),
                                             fill=7)),
     ValueError, r"'prev_tokens' values must lie in \[0, 99\], got 100 at index \[2, 3\]"),
    ("prev_tokens-last-transposed-int32", CONFIDENCE,
     lambda: dict(prev_tokens=non_contiguous(i32([0, 1, 2, 3], [4, 5, 6, 7], [1, 1, 1, -1]),
                                             "transposed")),
     ValueError, r"'prev_tokens' values must lie in \[0, 99\], got -1 at index \[2, 3\]"),
    ("prev_tokens-int64-beyond-int32", CONFIDENCE,
     lambda: dict(prev_tokens=i64([0, 1, 2, 3], [4, 5, 6, 7], [1, 1, 1, 2**32 + 1])),
     ValueError,
     r"'prev_tokens' values must lie in \[0, 99\], got 4294967297 at index \[2, 3\]"),
    ("calib-nan-last-strided", CONFIDENCE,
     lambda: dict(calib_temperature=non_contiguous(f32(1.0, 1.0, 1.0, NAN), fill=1.0)), ValueError,
     r"'calib_temperature' must be finite and > 0, got nan at index \[3\]"),
]


STRUCTURE_ERRORS = COMMON_ERRORS + RNN_ERRORS + CONFIDENCE_ERRORS
VALUE_ERRORS = DRAFT_VALUE_ERRORS + CONFIDENCE_VALUE_ERRORS


def call_with_overrides(op: str, device, overrides):
    if op == "draft_confidence":
        return ConfidenceCase(**with_overrides(valid_confidence_args(device), device,
                                               overrides)).call()
    return call_draft(op, with_overrides(valid_draft_args(device), device, overrides))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message", error_params(STRUCTURE_ERRORS))
def test_argument_errors(device, op, overrides, error, message):
    with raises(op, error, message):
        call_with_overrides(op, device, overrides)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,overrides,error,message", error_params(VALUE_ERRORS))
def test_value_errors(device, op, overrides, error, message):
    skip_value_checks_without_debug(device)
    with raises(op, error, message):
        call_with_overrides(op, device, overrides)


@pytest.mark.parametrize("device", DEVICES)
def test_valid_arguments_accepted(device):
    # The bases of the error tests are themselves valid, so each error above is due to its one
    # change; the limits (ids 0 and V - 1, position 0 and 2^62, T = 0, r = 1 and 1024, int32
    # ids, a one-element bias of any shape) are accepted.
    args = valid_draft_args(device)
    for op in DRAFT_OPS:
        check_against_reference(DraftCase(**{k: v for k, v in args.items() if op == "rnn_draft"
                                             or k not in ("hidden", "joint_weight",
                                                          "joint_bias")}))
    edge = {**args, "anchor": i32(0, V - 1, 0).to(device),
            "position": i64(0, 2**62, 2**32 - 1).to(device),
            "temperature": f32(0, 0, 1e-5).to(device)}
    check_against_reference(DraftCase(**edge))
    for rank in (1, 1024):
        gen = generator(133)
        w = {k: torch.randn(V, rank, generator=gen).bfloat16().to(device) for k in ("w1", "w2")}
        jw = torch.randn(3 * rank, 2 * rank + D, generator=gen).bfloat16().to(device) / 50
        jb = torch.randn(3 * rank, generator=gen).bfloat16().to(device)
        check_against_reference(DraftCase(**{**args, **w, "joint_weight": jw, "joint_bias": jb}))
        check_against_reference(DraftCase(**{**args, **w, "hidden": None, "joint_weight": None,
                                             "joint_bias": None}))
    conf = valid_confidence_args(device)
    check_confidence(ConfidenceCase(**conf))
    for bias in (f32(0.5), f32(0.5)[None, None], torch.tensor(0.5).bfloat16()):
        check_confidence(ConfidenceCase(**{**conf, "bias": bias.to(device),
                                           "prev_tokens": conf["prev_tokens"].int()}))
    check_confidence(ConfidenceCase(**{**conf, "prev_tokens": torch.full(
        (B, G), V - 1, device=device), "calib_temperature": f32(1e-3, 1e3, 1, 1).to(device)}))


@cuda_only
@pytest.mark.parametrize("op", DRAFT_OPS)
@pytest.mark.parametrize("name", ["anchor", "w1", "w2", "temperature", "seed", "position",
                                  "hidden", "joint_weight", "joint_bias"])
def test_draft_device_mismatch(op, name):
    if op == "markov_draft" and name in ("hidden", "joint_weight", "joint_bias"):
        pytest.skip("not an argument of markov_draft")
    args = valid_draft_args("cuda")
    args[name] = args[name].cpu()
    message = rf"^{op}\(\): '{name}' must be on cuda:\d+ like 'base_logits', got cpu"
    with pytest.raises(ValueError, match=message):
        call_draft(op, args)


@cuda_only
@pytest.mark.parametrize("op", DRAFT_OPS)
def test_draft_device_mismatch_base_on_cpu(op):
    args = valid_draft_args("cuda")
    args["base_logits"] = args["base_logits"].cpu()
    message = rf"^{op}\(\): 'anchor' must be on cpu like 'base_logits', got cuda:\d+"
    with pytest.raises(ValueError, match=message):
        call_draft(op, args)


@cuda_only
@pytest.mark.parametrize("name", ["prev_tokens", "w1", "weight", "bias", "calib_temperature"])
def test_confidence_device_mismatch(name):
    args = valid_confidence_args("cuda")
    args[name] = args[name].cpu()
    message = rf"^draft_confidence\(\): '{name}' must be on cuda:\d+ like 'hidden', got cpu"
    with pytest.raises(ValueError, match=message):
        ConfidenceCase(**args).call()


@cuda_only
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_cuda_out_of_range_anchors_without_value_checks(head):
    # Without DSPARK_OPS_DEBUG the CUDA op does not check ids: an out-of-range anchor embeds as a
    # zero row (never read out of bounds), and the drafts stay inside [0, V).
    if DEBUG:
        pytest.skip("DSPARK_OPS_DEBUG=1 turns the value checks on")
    case = make_case(64, 5, 5000, 32, seed=134, head=head)
    junk = torch.tensor([-1, 5000, 2**40, -(2**40)])
    case.anchor = junk[torch.arange(64) % 4]
    out = check_against_reference(case.to("cuda"))
    narrow = case.replace(anchor=torch.tensor([-1, 5000, 2**31 - 1, -(2**31)],
                                              dtype=torch.int32)[torch.arange(64) % 4])
    check_against_reference(narrow.to("cuda"))
    if head == "markov":  # slot 0 is unbiased
        torch.testing.assert_close(out.draft_logits[:, 0].cpu(), case.base_logits[:, 0],
                                   rtol=0, atol=0)
    confidence = make_confidence_case(8, 4, 300, 16, 8, seed=135)
    confidence.prev_tokens[:, 1] = torch.tensor([-1, 300, 2**40, -(2**40)]).repeat(2)
    check_confidence(confidence.to("cuda"))


# --------------------------------------------------------------------------------------------
# CPU and CUDA agree
# --------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("shape", [(64, 7, 8193, 256), (8, 3, 151936, 256), (64, 16, 100, 8)],
                         ids=lambda s: "B{}-G{}-V{}-r{}".format(*s))
@pytest.mark.parametrize("weights", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_cpu_and_cuda_agree(shape, weights, head):
    # The same seeds give the same drafts on CPU and CUDA except where the Gumbel-max keys of two
    # candidates are within float rounding of each other; slot 0 (same inputs on both devices) is
    # compared for sampled requests, the whole block for greedy ones up to their first near-tie.
    case = make_case(*shape, seed=stable_seed("agree", shape, weights, head), weights=weights,
                     head=head, base_dtype=torch.bfloat16, temperature="mixed")
    cpu, cuda = case.call(), case.to("cuda").call()
    sampled = ~is_greedy(case.temperature)
    agree = cpu.tokens[:, 0] == cuda.tokens[:, 0].cpu()
    assert agree[sampled].float().mean() >= 0.95, agree
    torch.testing.assert_close(cuda.draft_logits[:, 0].cpu(), cpu.draft_logits[:, 0],
                               rtol=1e-3, atol=1e-3 * max(1.0, float(cpu.draft_logits.abs().max())))
    same_block = (cpu.tokens == cuda.tokens.cpu()).all(1)
    assert same_block.float().mean() >= 0.8
    torch.testing.assert_close(cuda.draft_logits.cpu()[same_block], cpu.draft_logits[same_block],
                               rtol=1e-3, atol=1e-3 * max(1.0, float(cpu.draft_logits.abs().max())))
    conf = make_confidence_case(shape[0], shape[1], shape[2], shape[3], 64,
                                seed=stable_seed("agree-conf", shape))
    torch.testing.assert_close(conf.to("cuda").call().cpu(), conf.call(), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Python numbers for the per-request sampling arguments; the confidence logits
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["markov_draft", "rnn_draft"])
def test_scalars_broadcast_like_tensors(device, op):
    args = valid_draft_args(device)
    args.pop("temperature")
    common = [args["base_logits"], args["anchor"]]
    if op == "rnn_draft":
        common.append(args["hidden"])
    common += [args["w1"], args["w2"]]
    if op == "rnn_draft":
        common += [args["joint_weight"], args["joint_bias"]]
    run = getattr(dspark_ops, op)
    for temperature, filters in ((0.7, {}), (0.0, {}), (1, dict(top_k=5, top_p=0.8, min_p=0.1))):
        got = run(*common, temperature, args["seed"], args["position"], **filters)
        want = run(*common, torch.full((B,), float(temperature), device=device), args["seed"],
                   args["position"],
                   **{k: torch.full((B,), v, device=device,
                                    dtype=torch.int32 if k == "top_k" else torch.float32)
                      for k, v in filters.items()})
        assert torch.equal(got.tokens, want.tokens), (temperature, filters)
        assert torch.equal(got.draft_logits, want.draft_logits)
    with pytest.raises(TypeError, match=rf"{op}\(\): 'temperature' must be a tensor \[B\] or a "
                                        r"float shared by every request, got str"):
        run(*common, "0.7", args["seed"], args["position"])
    with pytest.raises(TypeError, match=rf"{op}\(\): 'top_k' must be a tensor \[B\] or an int"):
        run(*common, 0.7, args["seed"], args["position"], top_k=0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("calib", [False, True])
def test_draft_confidence_return_logits(device, calib):
    case = make_confidence_case(8, 5, 300, 16, 24, seed=stable_seed("conf-logits", calib),
                                hidden_dtype=torch.bfloat16, bias=True, calib=calib).to(device)
    # Saturate the sigmoid on some requests: torch.logit of the confidence cannot recover those.
    case = case.replace(hidden=case.hidden * torch.tensor([1.0, 40.0], device=device).repeat(4)
                        [:, None, None].to(case.hidden.dtype))
    confidence, logits = dspark_ops.draft_confidence(
        case.hidden, case.prev_tokens, case.w1, case.weight, case.bias, case.calib_temperature,
        return_logits=True)
    assert logits.dtype == torch.float32 and logits.shape == confidence.shape
    assert logits.device == case.hidden.device
    assert torch.equal(confidence, case.call())
    exact = confidence_logits(case)
    if device == "cpu":  # float64 dot product rounded once, as the CPU kernel's
        assert torch.equal(logits, exact)
    else:
        torch.testing.assert_close(logits.cpu(), exact, rtol=1e-5, atol=1e-5)
    assert exact.abs().max() > 30  # saturated rows exist, and their logits are still exact
    tau = 1.0 if case.calib_temperature is None else case.calib_temperature.float()
    torch.testing.assert_close(torch.sigmoid(logits / tau), confidence, rtol=1e-5, atol=1e-6)
    # What fit_sequential_temperatures takes: the uncalibrated logits, whatever calibration ran.
    plain = dspark_ops.draft_confidence(case.hidden, case.prev_tokens, case.w1, case.weight,
                                        case.bias, return_logits=True)[1]
    assert torch.equal(plain, logits)


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=[5, 5]), dict(top_p=[0.9, 0.9]),
                                     dict(min_p=[0.1, 0.1])])
def test_overflowing_float32_head_falls_back_to_float64(head, filters):
    # |W2| ~ 3e38: the float32 head's per-lane sums overflow (+-inf, NaN) while the float64 dot
    # products cancel to finite logits. The certificate's bound is then not finite, so every such
    # row is redone in float64 and stores what the reference stores, with or without filters (a
    # filtered row whose fast logits were all non-finite once went out as all -inf, token 0).
    gen = generator(91)
    batch, block, vocab, rank, hidden_size = 2, 2, 40, 16, 4
    base = torch.randn(batch, block, vocab, generator=gen)
    anchor = torch.randint(0, vocab, (batch,), generator=gen)
    signs = torch.tensor([1.0] * 4 + [-1.0] * 4 + [1.0] * 4 + [-1.0] * 4)
    w1 = (0.9 * signs).repeat(vocab, 1)
    w1[:, 0] = 0.95
    w2 = torch.full((vocab, rank), 3e38)  # W2 . W1[x] = 3e38 * 0.05: finite in float64
    temperature, seed = torch.tensor([1.0, 0.0]), torch.tensor([3, 4])
    position = torch.tensor([0, 7])
    kw = {k: torch.tensor(v, dtype=torch.int32 if k == "top_k" else torch.float32)
          for k, v in filters.items()}
    if head == "markov":
        args = (base, anchor, w1, w2, temperature, seed, position)
        got = dspark_ops.markov_draft(*args, **kw)
        want = reference.markov_draft(*args, **kw)
    else:
        hidden = torch.randn(batch, block, hidden_size, generator=gen)
        joint_weight = torch.zeros(3 * rank, 2 * rank + hidden_size)
        # tanh(o) = +-tanh(3) (one lane a little larger), cancelling as W1[x] does above
        joint_bias = torch.cat([torch.zeros(2 * rank), 3.0 * signs])
        joint_bias[2 * rank] = 3.2
        args = (base, anchor, hidden, w1, w2, joint_weight, joint_bias, temperature, seed,
                position)
        got = dspark_ops.rnn_draft(*args, **kw)
        want = reference.rnn_draft(*args, **kw)
    assert torch.isfinite(want.draft_logits).any()
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.draft_logits, want.draft_logits)


# --------------------------------------------------------------------------------------------
# Vocabulary tails (cases/tails.py): the winner at V - 1 and at every chunk and tile boundary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("vocab", DRAFT_VOCABS)
def test_boundary_ids_are_drafted(vocab, head, kind):
    """With V one past a chunk (and tile), every slot drafts its request's boundary id: the
    sampled and greedy winner, or the only token top-k / top-p / min-p keep; the stored logits
    are the reference's."""
    case, filters, where = draft_tail_case(vocab, head, kind, seed=vocab)
    out = case.call(**filters)
    check_draft_tail(out.tokens, out.draft_logits, case, filters, where)


@pytest.mark.parametrize("hidden_size", [CONFIDENCE_SEGMENT - 7, 5])
def test_confidence_reads_every_weight_segment_edge(hidden_size):
    """The only nonzero confidence weight at each edge of the weight segments ([h; W1[x]] one
    past a segment, the W1 part read from W1's last row), or inside a short vector."""
    for hidden, prev, w1, weight in confidence_tail_cases(hidden_size, 8, 37):
        got = dspark_ops.draft_confidence(hidden, prev, w1, weight)
        want = reference.draft_confidence(hidden, prev, w1, weight)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert (got != 0.5).all()  # the weighted feature was read
