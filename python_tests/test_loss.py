"""dspark_loss: values and gradients against the eager formula (reference.dspark_loss), the
guards, memory, registration and compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dspark_ops
from bench.memory import peak_memory_bytes
from cases.tails import check_loss_tail, loss_tail_case, loss_vocabs
from cases.loss import TRAINABLE, WITH_LM_HEAD, grads, make_loss_case, with_grad
from conftest import DEVICES, non_contiguous
from dspark_ops import reference

# (loss, gradients) tolerances per input dtype: float32 sums over V elements; bfloat16 rounds
# the chunk's logits (as DeepSpec's bfloat16 logits) and the gradient products.
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 5e-2)}


def run_both(args, names=TRAINABLE, **options):
    """(ours, reference) outputs and gradients of the same loss from fresh leaves."""
    results = []
    for fn in (dspark_ops.dspark_loss, reference.dspark_loss):
        a = with_grad(args, names)
        kwargs = {k: v for k, v in a.items()
                  if k not in ("hidden", "lm_head_weight", "labels", "weights")}
        if fn is dspark_ops.dspark_loss:
            kwargs.update(options)
        out = fn(a["hidden"], a["lm_head_weight"], a["labels"], a["weights"], **kwargs)
        out.loss.backward()
        results.append((out, grads(a, names)))
    return results


def assert_close(ours, ref, dtype, what):
    atol, rtol = TOL[dtype]
    scale = ref.detach().abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(ours.detach().to(ref.dtype), ref.detach(),
                               atol=atol * max(scale, 1.0), rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_against_reference(args, dtype, names=TRAINABLE, **options):
    (ours, g_ours), (ref, g_ref) = run_both(args, names, **options)
    for field in ("loss", "ce", "l1", "confidence"):
        assert_close(getattr(ours, field), getattr(ref, field), dtype, field)
    if ref.accept_rate is None:
        assert ours.accept_rate is None
    else:
        assert_close(ours.accept_rate, ref.accept_rate, dtype, "accept_rate")
    assert g_ours.keys() == g_ref.keys()
    for name in g_ref:
        assert g_ours[name] is not None, name
        assert g_ours[name].dtype == args[name].dtype, name
        assert_close(g_ours[name], g_ref[name], dtype, f"grad {name}")
    return ours, g_ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 2, 17, 1000, 8193])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dspark_matches_reference(device, vocab, dtype):
    args = make_loss_case(11, vocab, 19, rank=5, dtype=dtype, device=device, seed=vocab,
                          zero_weights=2)
    # Chunks of 4 rows: two whole chunks and a tail.
    check_against_reference(args, dtype, chunk_rows=4)


@pytest.mark.parametrize("device", DEVICES)
def test_qwen_size_vocabulary(device):
    """SmolLM2's vocabulary, default chunking (one chunk)."""
    args = make_loss_case(5, 49_152, 33, rank=7, device=device, seed=3, logit_scale=4.0)
    check_against_reference(args, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["dflash", "no_markov", "no_confidence", "lm_head"])
def test_variants(device, variant):
    rank = 0 if variant in ("dflash", "no_markov") else 6
    args = make_loss_case(9, 300, 13, rank=rank, device=device, seed=7,
                          target=variant != "dflash", confidence=variant != "no_confidence")
    if variant == "dflash":
        args["ce_weight"] = 1.0
    names = WITH_LM_HEAD if variant == "lm_head" else TRAINABLE
    ours, g = check_against_reference(args, torch.float32, names, chunk_rows=2)
    if variant == "dflash":
        assert ours.accept_rate is None and ours.l1.item() == 0 and ours.confidence.item() == 0
    if variant == "lm_head":
        assert g["lm_head_weight"].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    args = make_loss_case(6, 257, 24, rank=8, dtype=dtype, seed=11)
    check_against_reference(args, torch.bfloat16 if dtype == torch.float16 else dtype, chunk_rows=5)


def test_non_contiguous_inputs():
    args = make_loss_case(7, 130, 10, rank=4, seed=5)
    for name, kind in (("hidden", "strided"), ("lm_head_weight", "transposed"),
                       ("target_hidden", "padded"), ("markov_w2", "strided"),
                       ("labels", "strided"), ("weights", "strided")):
        args[name] = non_contiguous(args[name], kind)
    check_against_reference(args, torch.float32, chunk_rows=3)


def test_gradcheck_float64():
    """Finite differences of the op in float64. c* is detached, which finite differences cannot
    see, so the fused terms (CE and L1, through every trainable input, the LM head included) and
    the confidence term (through the confidence logits, c* then constant) are checked apart."""
    args = make_loss_case(5, 7, 4, rank=3, dtype=torch.float64, seed=2)
    fixed = {k: v for k, v in args.items() if k in ("labels", "weights", "target_hidden")}

    def fused(hidden, lm_head_weight, markov_latent, markov_w2):
        return dspark_ops.dspark_loss(hidden, lm_head_weight, fixed["labels"], fixed["weights"],
                                      target_hidden=fixed["target_hidden"], markov_latent=markov_latent,
                                      markov_w2=markov_w2, confidence_weight=0.0, chunk_rows=2).loss

    def confidence(confidence_logits):
        return dspark_ops.dspark_loss(args["hidden"], args["lm_head_weight"], fixed["labels"],
                                      fixed["weights"], target_hidden=fixed["target_hidden"],
                                      markov_latent=args["markov_latent"], markov_w2=args["markov_w2"],
                                      confidence_logits=confidence_logits).loss

    leaves = lambda *names: tuple(args[n].detach().clone().requires_grad_(True) for n in names)  # noqa: E731
    assert torch.autograd.gradcheck(fused, leaves("hidden", "lm_head_weight", "markov_latent",
                                                  "markov_w2"), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradcheck(confidence, leaves("confidence_logits"), eps=1e-6, atol=1e-8)


# ---- the logit soft cap (Gemma4's final_logit_softcapping) ------------------------------------

# Logits of spread ~4 under a cap of 3: tanh bends most of them (its slope ranges over (0, 1]).
CAP, CAP_LOGITS = 3.0, 4.0


def capped_case(variant, *, dtype=torch.float32, device="cpu", rows=10, vocab=257, seed=13):
    """A case for the cap: ``dspark`` (Markov head, target, confidence), ``no_markov`` (target,
    no Markov head), ``dflash`` (CE alone) or ``lm_head`` (dspark with a trainable LM head), with
    a larger Markov bias than make_loss_case's, so that capping before or after it differs."""
    rank = 0 if variant in ("dflash", "no_markov") else 5
    args = make_loss_case(rows, vocab, 16, rank=rank, dtype=dtype, device=device, seed=seed,
                          target=variant != "dflash", logit_scale=CAP_LOGITS, zero_weights=1)
    if rank:
        args["markov_latent"] = args["markov_latent"] * 4
    if variant == "dflash":
        args["ce_weight"] = 1.0
    args["logit_softcap"] = CAP
    return args, (WITH_LM_HEAD if variant == "lm_head" else TRAINABLE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["dspark", "no_markov", "dflash", "lm_head"])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_softcap_matches_reference(device, dtype, variant, chunk_rows):
    """Loss, per-row terms and every gradient (hidden, Markov latent, W2, the LM head through z
    and t) against autograd of the eager formula with the cap; chunks of 3 rows or one."""
    args, names = capped_case(variant, dtype=dtype, device=device)
    ours, _ = check_against_reference(args, dtype, names, chunk_rows=chunk_rows)
    uncapped = reference.dspark_loss(**{k: v for k, v in args.items() if k != "logit_softcap"})
    assert abs(ours.loss.item() - uncapped.loss.item()) > 0.05 * abs(uncapped.loss.item())


@pytest.mark.parametrize("variant", ["dspark", "no_markov", "lm_head"])
def test_softcap_float64(variant):
    """float64 on CPU: the op and autograd of the eager formula agree to rounding."""
    args, names = capped_case(variant, dtype=torch.float64, rows=7, vocab=100, seed=3)
    check_against_reference(args, torch.float64, names, chunk_rows=2)


@pytest.mark.parametrize("markov", [True, False])
def test_softcap_gradcheck_float64(markov):
    """Finite differences of the capped op in float64 through every input that gets a gradient
    (hidden, the LM head through z and t, the Markov latent and W2). The confidence term is left
    out: finite differences cannot see that c* is detached."""
    args = make_loss_case(5, 7, 4, rank=3 if markov else 0, dtype=torch.float64, seed=6,
                          logit_scale=3.0)
    names = ("hidden", "lm_head_weight") + (("markov_latent", "markov_w2") if markov else ())

    def fused(*inputs):
        kw = dict(zip(names, inputs))
        return dspark_ops.dspark_loss(kw["hidden"], kw["lm_head_weight"], args["labels"],
                                      args["weights"], target_hidden=args["target_hidden"],
                                      markov_latent=kw.get("markov_latent"),
                                      markov_w2=kw.get("markov_w2"), confidence_weight=0.0,
                                      chunk_rows=2, logit_softcap=1.5).loss

    leaves = tuple(args[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(fused, leaves, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_none_is_the_uncapped_op(device):
    """logit_softcap=None is the op without the argument, bit for bit; a cap far above the
    logits is the identity to float32 rounding."""
    args = make_loss_case(6, 300, 8, rank=4, device=device, seed=8)
    term_scale = torch.tensor([0.1, 0.9], device=device)

    def call(**kw):
        return torch.ops.dspark_ops.dspark_loss(
            args["hidden"], args["lm_head_weight"], args["labels"], args["weights"], term_scale,
            target_hidden=args["target_hidden"], markov_latent=args["markov_latent"],
            markov_w2=args["markov_w2"], compute_grad=True, lm_head_grad=True, chunk_rows=4, **kw)

    plain, none, loose = call(), call(logit_softcap=None), call(logit_softcap=1e6)
    for a, b, c in zip(plain, none, loose):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_saturated_logits(device):
    """Logits of spread ~1e4 under Gemma4's cap of 30: tanh rounds to +-1 (slope 0) for all but
    the few products within ~9 caps of 0, so the hidden states get almost no gradient while the
    Markov bias, added after the cap, gets the logits' own."""
    args = make_loss_case(6, 100, 16, rank=4, device=device, logit_scale=1e4, seed=10)
    args["logit_softcap"] = 30.0
    ours, g = check_against_reference(args, torch.float32, chunk_rows=4)
    assert g["hidden"].abs().max() < 1e-2 * g["markov_latent"].abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_subnormal_cap(device):
    """A cap below float32's normal range (allowed: finite and > 0 as a float32) saturates every
    nonzero product, and a zero product (a zero hidden row) stays 0 rather than 0 * inf = NaN."""
    args = make_loss_case(4, 50, 8, rank=3, device=device, seed=12)
    args["hidden"][0] = 0
    args["logit_softcap"] = 1e-40
    # The reference in float64: in float32 its own backward rounds grad * s to a subnormal.
    wide = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                and k != "weights" else v) for k, v in args.items()}
    results = []
    for fn, leaves in ((dspark_ops.dspark_loss, with_grad(args)),
                       (reference.dspark_loss, with_grad(wide))):
        a = dict(leaves)
        out = fn(a.pop("hidden"), a.pop("lm_head_weight"), a.pop("labels"), a.pop("weights"), **a)
        out.loss.backward()
        results.append((out, grads(leaves)))
    (ours, g_ours), (ref, g_ref) = results
    assert_close(ours.loss, ref.loss, torch.float32, "loss")
    assert g_ours.keys() == g_ref.keys() and "hidden" in g_ours
    for name in g_ref:
        assert torch.isfinite(g_ours[name]).all(), name
        assert_close(g_ours[name], g_ref[name], torch.float32, f"grad {name}")


def test_softcap_memory_stays_within_the_chunk():
    """With the cap and a Markov head the bias takes a third chunk of scratch: still no [N, V]
    tensor."""
    rows, vocab, width, rank, chunk = 256, 4096, 64, 16, 16
    args = make_loss_case(rows, vocab, width, rank=rank)

    def ours():
        a = with_grad(args)
        dspark_ops.dspark_loss(a.pop("hidden"), a.pop("lm_head_weight"), a.pop("labels"),
                               a.pop("weights"), chunk_rows=chunk, logit_softcap=30.0,
                               **a).loss.backward()

    assert peak_memory_bytes(ours, "cpu") < rows * vocab * 4 / 2


@pytest.mark.parametrize("device", DEVICES + [pytest.param("meta", id="meta")])
@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-50])
def test_softcap_argument_errors(device, cap):
    """A cap that is not finite and > 0 as a float32 is refused, by the entry points and by the
    fake kernel (meta tensors) alike."""
    args = make_loss_case(4, 10, 6, rank=3, device=device if device != "meta" else "cpu")
    if device == "meta":
        args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(ValueError, match=r"dspark_loss\(\): 'logit_softcap' must be finite and "
                                         r"> 0 as a float32"):
        torch.ops.dspark_ops.dspark_loss(
            args["hidden"], args["lm_head_weight"], args["labels"], args["weights"],
            torch.tensor([0.1, 0.9], device=args["hidden"].device),
            target_hidden=args["target_hidden"], markov_latent=args["markov_latent"],
            markov_w2=args["markov_w2"], logit_softcap=cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 4])
def test_empty_and_zero_weights(device, rows):
    args = make_loss_case(rows, 50, 8, rank=3, device=device)
    args["weights"] = torch.zeros(rows, device=device)
    a = with_grad(args, WITH_LM_HEAD)
    out = dspark_ops.dspark_loss(a["hidden"], a["lm_head_weight"], a["labels"], a["weights"],
                                 target_hidden=a["target_hidden"], markov_latent=a["markov_latent"],
                                 markov_w2=a["markov_w2"], confidence_logits=a["confidence_logits"],
                                 chunk_rows=3)
    assert out.loss.item() == 0 and out.ce.item() == 0 and out.l1.item() == 0
    assert out.confidence.item() == 0 and out.accept_rate.shape == (rows,)
    out.loss.backward()
    for name, grad in grads(a, WITH_LM_HEAD).items():
        assert grad is not None and torch.all(grad == 0), name


def test_zero_weight_rows_get_no_gradient():
    args = make_loss_case(6, 40, 8, rank=3, zero_weights=3)
    a = with_grad(args)
    out = dspark_ops.dspark_loss(a["hidden"], a["lm_head_weight"], a["labels"], a["weights"],
                                 target_hidden=a["target_hidden"], markov_latent=a["markov_latent"],
                                 markov_w2=a["markov_w2"], confidence_logits=a["confidence_logits"])
    out.loss.backward()
    assert torch.all(a["hidden"].grad[3:] == 0) and torch.all(a["markov_latent"].grad[3:] == 0)
    assert torch.all(a["confidence_logits"].grad[3:] == 0)
    assert torch.all(a["hidden"].grad[:3].abs().sum(1) > 0)


@pytest.mark.parametrize("device", DEVICES)
def test_identical_draft_and_target(device):
    """p = q: l1 = 0, c* = 1 and the L1 term's gradient is exactly 0 (sign(0) = 0, as abs)."""
    args = make_loss_case(5, 64, 12, device=device, confidence=False)
    args["target_hidden"] = args["hidden"].clone()
    a = with_grad(args, ("hidden",))
    out = dspark_ops.dspark_loss(a["hidden"], a["lm_head_weight"], a["labels"], a["weights"],
                                 target_hidden=a["target_hidden"], ce_weight=0.0,
                                 confidence_weight=0.0)
    out.loss.backward()
    assert out.l1.item() == 0 and torch.all(out.accept_rate == 1)
    assert torch.all(a["hidden"].grad == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1e4, -1e4])
def test_extreme_logits(device, scale):
    """Logits of magnitude ~1e4 (one dominant token per row, the rest underflowing to 0)."""
    args = make_loss_case(6, 100, 16, rank=4, device=device, logit_scale=abs(scale), seed=9)
    if scale < 0:
        args["hidden"] = -args["hidden"]
    check_against_reference(args, torch.float32, chunk_rows=4)


@pytest.mark.parametrize("device", DEVICES)
def test_denominators_scale_the_gradients(device):
    """A global divisor (a data-parallel trainer's all-reduced sum) scales loss and gradients
    exactly; one divisor per term scales each term."""
    args = make_loss_case(8, 90, 10, rank=4, device=device)
    local = args["weights"].sum() + 1e-6
    (base, g_base), _ = run_both(args)
    (doubled, g_doubled), (ref, g_ref) = run_both({**args, "denominators": 2 * local})
    torch.testing.assert_close(doubled.loss, base.loss / 2)
    for name in g_base:
        torch.testing.assert_close(g_doubled[name], g_base[name] / 2, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(g_doubled[name], g_ref[name], atol=1e-7, rtol=1e-5)
    per_term = run_both({**args, "denominators": (local, 2 * local, 4 * local)})
    (ours, _), (ref, _) = per_term
    torch.testing.assert_close(ours.loss, ref.loss)
    torch.testing.assert_close(ours.l1, base.l1 / 2)
    torch.testing.assert_close(ours.confidence, base.confidence / 4)


def _deepspec_formula(draft_logits_bf16, target_logits_bf16, target_ids, weight_mask, conf_pred):
    """DeepSpec's compute_dspark_loss at world size 1, as its training notes state it, on its
    shapes ([B, A, K, V] bfloat16 logits): bfloat16 cross-entropy, float32 softmaxes, the full L1
    (no 1/2), c* detached, one denominator sum(w) + 1e-6, weights 0.1 / 0.9 / 1.0."""
    vocab = draft_logits_bf16.shape[-1]
    ce = F.cross_entropy(draft_logits_bf16.reshape(-1, vocab), target_ids.reshape(-1),
                         reduction="none").reshape(target_ids.shape)
    p = torch.softmax(draft_logits_bf16.float(), -1)
    q = torch.softmax(target_logits_bf16.float(), -1)
    l1 = (p - q).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(conf_pred.float(), accept, reduction="none")
    denominator = weight_mask.sum() + 1e-6
    return (0.1 * (weight_mask * ce.float()).sum() + 0.9 * (weight_mask * l1).sum()
            + 1.0 * (weight_mask * bce).sum()) / denominator


def test_reference_is_deepspec_formula():
    """On DeepSpec's shapes and dtypes (bfloat16 model, block 7, weights exp(-k/4) cut by an eval
    mask), the reference equals DeepSpec's formula to bfloat16 accuracy."""
    B, A, K, V, d, r = 1, 6, 7, 500, 32, 8
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    hidden = (torch.randn(B, A, K, d, generator=gen) / d ** 0.5 * 3).to(bf)
    target = (0.6 * hidden.float() + torch.randn(B, A, K, d, generator=gen) / d ** 0.5 * 2).to(bf)
    lm_head = torch.randn(V, d, generator=gen).to(bf)
    w1_prev = (torch.randn(B, A, K, r, generator=gen) * 0.2).to(bf)
    w2 = torch.randn(V, r, generator=gen).to(bf)
    ids = torch.randint(0, V, (B, A, K), generator=gen)
    eval_mask = (torch.rand(B, A, K, generator=gen) > 0.2).long().cumprod(-1).float()
    weights = eval_mask * torch.exp(-torch.arange(K) / 4.0)
    conf = torch.randn(B, A, K, generator=gen).to(bf)
    draft_logits = (hidden @ lm_head.T) + (w1_prev @ w2.T)  # bfloat16, as DeepSpec's model
    target_logits = target @ lm_head.T
    expected = _deepspec_formula(draft_logits, target_logits, ids, weights, conf)
    flat = lambda t: t.reshape(B * A * K, *t.shape[3:])  # noqa: E731
    out = reference.dspark_loss(flat(hidden), lm_head, flat(ids), flat(weights),
                                target_hidden=flat(target), markov_latent=flat(w1_prev),
                                markov_w2=w2, confidence_logits=flat(conf))
    fused = dspark_ops.dspark_loss(flat(hidden), lm_head, flat(ids), flat(weights),
                                   target_hidden=flat(target), markov_latent=flat(w1_prev),
                                   markov_w2=w2, confidence_logits=flat(conf))
    torch.testing.assert_close(out.loss, expected, atol=0, rtol=1e-2)
    torch.testing.assert_close(fused.loss, expected, atol=0, rtol=1e-2)


def test_reference_fails_a_broken_formula():
    """The DeepSpec comparison can fail: an L1 with the 1/2 (total variation) misses it."""
    args = make_loss_case(8, 200, 16, rank=4, logit_scale=3.0)
    ref = reference.dspark_loss(**args)
    halved = reference.dspark_loss(**{**args, "l1_weight": 0.45})
    assert not torch.allclose(ref.loss, halved.loss, rtol=1e-2)


def test_memory_stays_within_the_chunk():
    """No [N, V] float32 tensor: the op's extra memory is one chunk of logits plus gradients,
    where the eager formula's is several [N, V] tensors. The same probe sees the eager peak."""
    rows, vocab, width, rank, chunk = 256, 4096, 64, 16, 16
    args = make_loss_case(rows, vocab, width, rank=rank)
    nv = rows * vocab * 4

    def ours():
        a = with_grad(args)
        dspark_ops.dspark_loss(a.pop("hidden"), a.pop("lm_head_weight"), a.pop("labels"),
                               a.pop("weights"), chunk_rows=chunk, **a).loss.backward()

    def eager():
        a = with_grad(args)
        reference.dspark_loss(a.pop("hidden"), a.pop("lm_head_weight"), a.pop("labels"),
                              a.pop("weights"), **a).loss.backward()

    peak_ours, peak_eager = peak_memory_bytes(ours, "cpu"), peak_memory_bytes(eager, "cpu")
    assert peak_eager >= 4 * nv, peak_eager  # the probe sees [N, V] tensors when there are some
    # Ours: the chunk's logits (2 x 16 x V x 4 B = nv / 8), the gradients (W2's is V r 4 B =
    # nv / 16) and the chunk's products; a single [N, V] float32 tensor would exceed nv / 2.
    assert peak_ours < nv / 2, (peak_ours, nv)
    assert peak_ours * 8 < peak_eager, (peak_ours, peak_eager)


@pytest.mark.parametrize("device", DEVICES)
def test_argument_errors(device):
    args = make_loss_case(4, 10, 6, rank=3, device=device)

    def call(**changes):
        a = {**args, **changes}
        return dspark_ops.dspark_loss(a.pop("hidden"), a.pop("lm_head_weight"), a.pop("labels"),
                                      a.pop("weights"), **a)

    cases = [
        (dict(hidden=args["hidden"][0]), ValueError, r"'hidden' must be 2-D \[N, d\]"),
        (dict(hidden=args["hidden"].long()), TypeError, r"'hidden' must have dtype"),
        (dict(lm_head_weight=args["lm_head_weight"][:, :5]), ValueError,
         r"'lm_head_weight' must have shape \[V, d\]"),
        (dict(lm_head_weight=args["lm_head_weight"].double()), TypeError,
         r"'lm_head_weight' must have hidden's dtype"),
        (dict(lm_head_weight=args["lm_head_weight"][:0]), ValueError,
         r"'lm_head_weight' must have at least one row"),
        (dict(labels=args["labels"][:3]), ValueError, r"'labels' must have shape \[N\]"),
        (dict(labels=args["labels"].float()), TypeError, r"'labels' must have dtype"),
        (dict(weights=args["weights"].double()), TypeError, r"'weights' must have dtype"),
        (dict(weights=args["weights"][:2]), ValueError, r"'weights' must have shape \[N\]"),
        (dict(target_hidden=args["target_hidden"][:2]), ValueError, r"'target_hidden' must have shape"),
        (dict(markov_w2=None), ValueError, r"'markov_latent' and 'markov_w2' must be given together"),
        (dict(markov_w2=args["markov_w2"][:, :2]), ValueError, r"'markov_w2' must have shape \[V, r\]"),
        (dict(target_hidden=None), ValueError, r"'target_hidden' is required"),
        (dict(confidence_logits=None), ValueError, r"'confidence_logits' is required"),
        (dict(confidence_logits=args["confidence_logits"][:2]), ValueError,
         r"'confidence_logits' must have shape \[N\]"),
        (dict(chunk_rows=0), ValueError, r"'chunk_rows' must be positive"),
        (dict(denominators=(1.0, 2.0)), ValueError, r"'denominators' must be one divisor or three"),
        (dict(logit_softcap=0.0), ValueError, r"'logit_softcap' must be finite and > 0"),
    ]
    if device == "cpu":  # value checks: always on CPU, on CUDA with DSPARK_OPS_DEBUG=1
        bad_label = args["labels"].clone()
        bad_label[2] = 10
        negative = args["weights"].clone()
        negative[1] = -1
        nan = args["weights"].clone()
        nan[0] = float("nan")
        cases += [
            (dict(labels=bad_label), ValueError, r"'labels'.*\[0, 9\]"),
            (dict(weights=negative), ValueError, r"'weights'.*finite and >= 0"),
            (dict(weights=nan), ValueError, r"'weights'.*finite and >= 0"),
        ]
    else:
        cases.append((dict(labels=args["labels"].cpu()), ValueError, r"'labels' must be on cuda"))
    for changes, error, message in cases:
        with pytest.raises(error, match=r"dspark_loss\(\): " + message):
            call(**changes)


@pytest.mark.parametrize("cap", [None, 2.0])
def test_compile_fullgraph(cap):
    args = make_loss_case(6, 40, 8, rank=3)

    def step(hidden, markov_latent, markov_w2, confidence_logits):
        return dspark_ops.dspark_loss(hidden, args["lm_head_weight"], args["labels"], args["weights"],
                                      target_hidden=args["target_hidden"], markov_latent=markov_latent,
                                      markov_w2=markov_w2, confidence_logits=confidence_logits,
                                      logit_softcap=cap).loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    names = ("hidden", "markov_latent", "markov_w2", "confidence_logits")
    eager_in = [args[n].clone().requires_grad_(True) for n in names]
    compiled_in = [args[n].clone().requires_grad_(True) for n in names]
    step(*eager_in).backward()
    compiled(*compiled_in).backward()
    for a, b in zip(eager_in, compiled_in):
        torch.testing.assert_close(a.grad, b.grad)


def test_backward_without_gradients_is_refused():
    args = make_loss_case(3, 10, 4)
    h = args["hidden"].clone().requires_grad_(True)
    out = torch.ops.dspark_ops.dspark_loss(h, args["lm_head_weight"], args["labels"], args["weights"],
                                           torch.tensor([1.0, 0.0]), compute_grad=False)
    with pytest.raises(RuntimeError, match="compute_grad=False"):
        out[0].backward()


def test_loss_is_a_weighted_mean():
    """A hand-checkable case: V = 2, one row, equal logits: ce = log 2, p = (1/2, 1/2)."""
    hidden = torch.zeros(1, 3)
    out = dspark_ops.dspark_loss(hidden, torch.ones(2, 3), torch.tensor([1]), torch.tensor([2.0]),
                                 ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)
    assert math.isclose(out.loss.item(), math.log(2) * 2 / (2 + 1e-6), rel_tol=1e-6)


# --------------------------------------------------------------------------------------------
# Vocabulary tails (cases/tails.py): the only mass at V - 1 and at every stride boundary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mass_at_boundary_ids(dtype, spread):
    """The draft's and target's mass on V - 1 and each stride's first and last id, the label
    there, V one past a stride (and the CPU's vector loop) or one vector past: ce, l1, the loss
    and the hidden gradient are the reference's."""
    for vocab in loss_vocabs(torch.tensor([], dtype=dtype).element_size()):
        args, _ = loss_tail_case(vocab, dtype, spread=spread)
        # float32: z - lse rounds at the scale of the logits (20), ~1e-6 of p.
        check_loss_tail(torch.ops.dspark_ops.dspark_loss, args,
                        2e-4 if dtype == torch.float32 else 2e-2)
