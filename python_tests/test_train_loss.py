"""draft_loss (dspark_ops.train): DeepSpec's weights and coefficients around the fused
dspark_loss, equal to the eager reference on the same flattened inputs, values and gradients into
every draft parameter; and DeepSpec's acceptance metrics."""

from __future__ import annotations

import math

import pytest
import torch

import dspark_ops
from dspark_ops.models import DSparkConfig, DSparkDraft
from dspark_ops.train import (block_metrics, draft_loss, flatten_batch, loss_coefficients,
                              training_forward)

VOCAB, MASK, BLOCK, HIDDEN = 48, 47, 4, 64


def _draft(kind: str, dtype=torch.float64, seed: int = 0) -> DSparkDraft:
    rank = 0 if kind == "dflash" else 8
    config = DSparkConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=64, intermediate_size=96,
                          num_hidden_layers=2, target_layer_ids=(0, 1), block_size=BLOCK,
                          mask_token_id=MASK, markov_rank=rank,
                          markov_head_type="rnn" if kind == "rnn" else "vanilla",
                          enable_confidence_head=kind != "dflash",
                          confidence_head_with_markov=kind != "dflash", rope_theta=10_000.0)
    torch.manual_seed(seed)
    draft = DSparkDraft(config).to(dtype)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    return draft


def _forward(draft, seed: int = 1, batch: int = 2, length: int = 23):
    g = torch.Generator().manual_seed(seed)
    dtype = draft.fc.weight.dtype
    ids = torch.randint(0, VOCAB - 1, (batch, length), generator=g)
    features = torch.randn(batch, length, 2 * HIDDEN, generator=g, dtype=dtype)
    loss_mask = (torch.rand(batch, length, generator=g) < 0.85).float()
    last = torch.randn(batch, length, HIDDEN, generator=g, dtype=dtype)
    return training_forward(draft, ids, features, loss_mask, last, num_anchors=7,
                            generator=torch.Generator().manual_seed(seed + 1))


def _loss_and_grads(draft, kind, **kwargs):
    draft.zero_grad(set_to_none=True)
    out = draft_loss(draft, _forward(draft), **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    return out, grads


@pytest.mark.parametrize("kind", ["vanilla", "rnn", "dflash"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)],
                         ids=["float64", "float32"])
def test_draft_loss_equals_reference(kind, dtype, tol):
    draft = _draft(kind, dtype)
    fused, fused_grads = _loss_and_grads(draft, kind)
    ref, ref_grads = _loss_and_grads(draft, kind, loss_fn=dspark_ops.reference.dspark_loss)
    for name in ("loss", "ce", "l1", "confidence"):
        torch.testing.assert_close(getattr(fused, name).double(), getattr(ref, name).double(),
                                   rtol=tol, atol=tol, msg=name)
    torch.testing.assert_close(fused.accept_rate.double(), ref.accept_rate.double(), rtol=tol,
                               atol=tol)
    assert fused_grads.keys() == ref_grads.keys()
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=tol, atol=tol, msg=name)
    trained = [n for n, g in fused_grads.items() if g.abs().sum() > 0]
    assert len(trained) == len(fused_grads), set(fused_grads) - set(trained)
    if kind == "dflash":
        assert fused.confidence == 0 and "markov_head.markov_w2.weight" not in fused_grads


def test_draft_loss_is_deepspec_formula():
    """The weights exp(-k/4) over the eval mask and 0.1 / 0.9 / 1.0, written out by hand."""
    draft = _draft("vanilla")
    batch = _forward(draft)
    out = draft_loss(draft, batch)
    # float32 weights, as DeepSpec's
    w = (batch.eval_mask.float() * torch.exp(-torch.arange(BLOCK).float() / 4)).double()
    z = batch.hidden @ draft.lm_head.weight.T + batch.markov_latent @ \
        draft.markov_head.markov_w2.weight.T
    t = batch.target_hidden @ draft.lm_head.weight.T
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, VOCAB), batch.labels.reshape(-1),
                                           reduction="none").view(w.shape)
    l1 = (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    c = (1 - 0.5 * l1).clamp(0, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        batch.confidence_logits.double(), c, reduction="none")
    s = w.sum() + 1e-6
    expected = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / s
    torch.testing.assert_close(out.loss.double(), expected.detach(), rtol=1e-10, atol=1e-10)
    # gamma changes the weights; denominators replace the divisor
    other = draft_loss(draft, batch, loss_decay_gamma=2.0, denominators=10 * s)
    w2 = (batch.eval_mask.float() * torch.exp(-torch.arange(BLOCK).float() / 2)).double()
    expected2 = (0.1 * (w2 * ce).sum() + 0.9 * (w2 * l1).sum() + (w2 * bce).sum()) / (10 * s)
    torch.testing.assert_close(other.loss.double(), expected2.detach(), rtol=1e-10, atol=1e-10)


def test_coefficients_and_errors():
    assert loss_coefficients(_draft("vanilla")) == (0.1, 0.9, 1.0)
    assert loss_coefficients(_draft("dflash")) == (1.0, 0.0, 0.0)
    assert loss_coefficients(_draft("rnn"), ce_weight=1, l1_weight=0) == (1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="no confidence head"):
        loss_coefficients(_draft("dflash"), confidence_weight=1.0)
    with pytest.raises(ValueError, match="l1_weight must be >= 0"):
        loss_coefficients(_draft("vanilla"), l1_weight=-1)
    draft = _draft("vanilla")
    batch = _forward(draft)
    batch.target_hidden = None
    with pytest.raises(ValueError, match="no target_hidden"):
        draft_loss(draft, batch)
    dflash = _draft("dflash")
    batch = _forward(dflash)
    batch.target_hidden = None  # CE alone needs no target states
    assert draft_loss(dflash, batch).accept_rate is None


def test_flatten_casts_to_hidden_dtype():
    draft = _draft("vanilla", torch.float32)
    batch = _forward(draft)
    batch.hidden = batch.hidden.to(torch.bfloat16)
    inputs = flatten_batch(draft, batch)
    assert inputs["hidden"].shape == (2 * 7 * BLOCK, HIDDEN)
    for key in ("lm_head_weight", "markov_w2", "markov_latent", "target_hidden"):
        assert inputs[key].dtype == torch.bfloat16, key
    assert inputs["markov_w2"].requires_grad


def test_block_metrics():
    draft = _draft("vanilla")
    batch = _forward(draft)
    out = draft_loss(draft, batch)
    m = block_metrics(out.accept_rate, batch.eval_mask, batch.block_keep_mask)
    c = out.accept_rate.view(batch.eval_mask.shape).double()
    mask = batch.eval_mask
    for k in range(BLOCK):
        assert m["accept_count"][k] == mask[..., k].sum()
        torch.testing.assert_close(m["accept_sum"][k], (c[..., k] * mask[..., k]).sum())
    tau = 0.0
    blocks = 0
    for b in range(mask.shape[0]):
        for a in range(mask.shape[1]):
            if not (batch.block_keep_mask[b, a] and mask[b, a].any()):
                continue
            blocks += 1
            prod, total = 1.0, 1.0
            for k in range(BLOCK):
                prod *= float(c[b, a, k]) if mask[b, a, k] else 0.0
                total += prod
            tau += total
    assert m["block_count"] == blocks
    assert math.isclose(float(m["tau_sum"]), tau, rel_tol=1e-12)
    empty = block_metrics(None, batch.eval_mask, batch.block_keep_mask)
    assert float(empty["tau_sum"]) == 0.0 and empty["accept_count"].sum() == mask.sum()


# --------------------------------------------------------------------------------------------
# Training with a draft vocabulary: the full vocabulary's loss with the draft at 0 outside


def _eager_vocabulary_loss(draft, batch, inside, weights):
    """The loss of a draft whose logits are -inf outside ``inside``, over the full vocabulary,
    written out (DeepSpec's formula, reference.dspark_loss's conventions)."""
    alpha, beta, gamma = loss_coefficients(draft)
    inputs = flatten_batch(draft, batch, weights=weights)
    z = inputs["hidden"] @ inputs["lm_head_weight"].T
    if inputs["markov_latent"] is not None:
        z = z + inputs["markov_latent"] @ inputs["markov_w2"].T
    z = z.masked_fill(~inside, float("-inf"))
    labels = inputs["labels"]
    w = (inputs["weights"] * inside[labels]).double()
    total = w.sum() + 1e-6
    label_inside = inside[labels]
    ce = torch.where(label_inside, torch.logsumexp(z, -1)
                     - z.gather(-1, labels[:, None])[:, 0].masked_fill(~label_inside, 0), 0.0)
    t = inputs["target_hidden"].detach() @ inputs["lm_head_weight"].T
    l1 = (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    loss = alpha * (w * ce).sum() / total + beta * (w * l1).sum() / total
    if gamma:
        bce = torch.nn.functional.binary_cross_entropy_with_logits(
            inputs["confidence_logits"].double(), accept, reduction="none")
        loss = loss + gamma * (w * bce).sum() / total
    return loss, accept


@pytest.mark.parametrize("kind", ["vanilla", "rnn", "dflash"])
@pytest.mark.parametrize("loss_fn", [None, dspark_ops.reference.dspark_loss],
                         ids=["fused", "reference"])
def test_vocabulary_loss_is_the_full_loss_with_the_draft_at_zero_outside(kind, loss_fn):
    """Loss, c* and every gradient equal the full-vocabulary formula with q = 0 outside the
    vocabulary and the target's p whole: its mass outside counts in l1, and slots whose label
    is outside carry no loss."""
    from dspark_ops.models.vocab import DraftVocabulary

    draft = _draft(kind)
    vocabulary = DraftVocabulary(torch.tensor([0, 3, 4, 9, 11, 17, 20, 21, 30, 33, 40, MASK]),
                                 VOCAB)
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[vocabulary.d2t] = True
    batch = _forward(draft)
    assert not inside[batch.labels[batch.eval_mask]].all()  # some trained labels are outside
    weights = torch.rand(batch.eval_mask.shape, dtype=torch.float32,
                         generator=torch.Generator().manual_seed(3)) * batch.eval_mask

    def run(fn):
        draft.zero_grad(set_to_none=True)
        out = fn()
        loss = out[0] if isinstance(out, tuple) else out.loss
        loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    expect, expect_grads = run(lambda: _eager_vocabulary_loss(draft, _forward(draft), inside,
                                                              weights))
    draft.draft_vocabulary = vocabulary
    kwargs = {} if loss_fn is None else {"loss_fn": loss_fn}
    got, got_grads = run(lambda: draft_loss(draft, _forward(draft), weights=weights, **kwargs))
    torch.testing.assert_close(got.loss, expect[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.accept_rate, expect[1], rtol=1e-9, atol=1e-9)
    for name, grad in expect_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-9, msg=name)
    if kind != "dflash":  # W2 learns only the vocabulary's rows
        w2 = got_grads["markov_head.markov_w2.weight"]
        assert w2[~inside].abs().sum() == 0 and w2[inside].abs().sum() > 0


def test_vocabulary_of_everything_changes_nothing():
    from dspark_ops.models.vocab import DraftVocabulary

    draft = _draft("vanilla")
    batch = _forward(draft)
    plain = draft_loss(draft, batch)
    draft.draft_vocabulary = DraftVocabulary(torch.arange(VOCAB), VOCAB)
    every = draft_loss(draft, batch)
    for name in ("loss", "ce", "l1", "confidence"):
        torch.testing.assert_close(getattr(every, name), getattr(plain, name), rtol=1e-12,
                                   atol=1e-12)


def test_vocabulary_loss_refuses_soft_caps():
    from dspark_ops.models.vocab import DraftVocabulary

    draft = _draft("vanilla")
    batch = _forward(draft)
    draft.config.final_logit_softcapping = 30.0
    draft.draft_vocabulary = DraftVocabulary(torch.arange(8), VOCAB)
    with pytest.raises(ValueError, match="soft-capped"):
        draft_loss(draft, batch)
