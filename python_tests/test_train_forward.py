"""The training forward (dspark_ops.train): anchor sampling, labels and masks, the batched masked
backbone against a per-block loop and against the inference path, the heads' teacher-forced
latents against the inference heads, padding blocks, gradients and the attention backends."""

from __future__ import annotations

import doctest
import warnings

import pytest
import torch

import dspark_ops
import dspark_ops.train.forward as forward_module
from dspark_ops.models import DSparkConfig, DSparkDraft
from dspark_ops.train import (
    TrainingBatch,
    block_attention_mask,
    build_eval_mask,
    position_weights,
    sample_anchor_positions,
    training_forward,
)

VOCAB, MASK, BLOCK = 40, 39, 4
TOL = dict(rtol=2e-5, atol=2e-5)


def _config(**overrides) -> DSparkConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64, intermediate_size=96, num_hidden_layers=2,
                  target_layer_ids=(0, 2), block_size=BLOCK, mask_token_id=MASK, markov_rank=8,
                  markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True, rope_theta=10_000.0, num_anchors=6)
    values.update(overrides)
    return DSparkConfig(**values)


def _draft(seed: int = 0, **overrides) -> DSparkDraft:
    torch.manual_seed(seed)
    draft = DSparkDraft(_config(**overrides))
    with torch.no_grad():  # norms start at 1: give them values, so that a swapped norm shows
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return draft


def _inputs(batch: int, length: int, seed: int = 1, hidden: int = 64):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (batch, length), generator=g)
    features = torch.randn(batch, length, 2 * hidden, generator=g)
    loss_mask = (torch.rand(batch, length, generator=g) < 0.8).float()
    last_hidden = torch.randn(batch, length, hidden, generator=g)
    return input_ids, features, loss_mask, last_hidden


# ------------------------------------------------------------------------------------------------
# An independent computation of one block: its own context rows, explicit softmax attention.


def _naive_block(draft: DSparkDraft, input_ids, features, p0: int, keep: bool) -> torch.Tensor:
    """Final-normed hidden states ``[G, d]`` of one block of one sequence (``input_ids [L]``,
    ``features [L, F]``), computed alone: context rows ``0 .. p0-1`` only, the block's own keys,
    plain softmax attention; a padding block is all MASK at positions 0.. and attends nowhere."""
    G = draft.config.block_size
    ids = torch.full((G,), MASK, dtype=torch.long)
    if keep:
        ids[0] = input_ids[p0]
    else:
        p0 = 0
    positions = (p0 + torch.arange(G))[None]
    h = draft.embed_tokens(ids)[None]
    ctx = draft.hidden_norm(draft.fc(features[None, :p0]))
    ctx_positions = torch.arange(p0)[None]
    for layer in draft.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.query(x, positions)[0]  # [G, Hq, D]
        k_c, v_c = attn.key_value(ctx, ctx_positions)
        k_b, v_b = attn.key_value(x, positions)
        k = torch.cat([k_c, k_b], 1)[0]
        v = torch.cat([v_c, v_b], 1)[0]
        group = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [K, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * attn.scaling
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        if not keep:
            out = torch.zeros_like(out)
        h = h + attn.o_proj(out.reshape(1, G, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)[0]


def test_batched_forward_equals_a_per_block_loop():
    draft = _draft()
    input_ids, features, loss_mask, last = _inputs(2, 21)
    loss_mask[1, 12:] = 0  # few candidates in sequence 1: padding blocks there
    loss_mask[1, :8] = 0
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, last, num_anchors=6,
                               generator=torch.Generator().manual_seed(3), attention="sdpa")
    keep = out.block_keep_mask
    assert keep[0].all() and not keep[1].all() and keep[1].any()
    for b in range(2):
        for a in range(6):
            with torch.no_grad():
                want = _naive_block(draft, input_ids[b], features[b],
                                    int(out.anchor_positions[b, a]), bool(keep[b, a]))
            torch.testing.assert_close(out.hidden[b, a], want, **TOL)


def test_anchors_at_the_edges_and_overlapping_blocks():
    # p0 = 0 (no context at all) and p0 = L - 1 (every slot past the end); blocks sharing rows.
    draft = _draft(seed=5)
    input_ids, features, loss_mask, last = _inputs(1, 9, seed=7)
    anchors = torch.tensor([[0, 1, 2, 7, 8]])
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, last,
                               anchor_positions=anchors)
        for a, p0 in enumerate(anchors[0].tolist()):
            want = _naive_block(draft, input_ids[0], features[0], p0, True)
            torch.testing.assert_close(out.hidden[0, a], want, **TOL)
    assert not out.eval_mask[0, 4].any()  # the anchor at L - 1 has no label inside the sequence


def test_slot_hidden_states_match_the_inference_path():
    # The decoder's drafting: context caches filled with the target features of positions
    # 0 .. p0-1 through append_context, then the block [x_{p0}, MASK...] through the backbone with
    # the block_draft_attention op. The training forward must give the same hidden states.
    draft = _draft(seed=2)
    input_ids, features, loss_mask, last = _inputs(1, 30, seed=4)
    anchors = torch.tensor([[0, 3, 11, 20, 27]])
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, last,
                               anchor_positions=anchors)
        p0 = anchors[0]
        rows = p0.numel()
        k_caches, v_caches = draft.new_caches(rows, 32)
        seqlens = torch.zeros(rows, dtype=torch.int32)
        draft.append_context(features.expand(rows, -1, -1), None, p0.int(), k_caches, v_caches,
                             seqlens)
        assert seqlens.tolist() == p0.tolist()
        hidden = draft(draft.block_hidden(input_ids[0, p0], BLOCK), None, k_caches, v_caches,
                       seqlens)
    torch.testing.assert_close(out.hidden[0], hidden, **TOL)


# ------------------------------------------------------------------------------------------------
# Anchors


def _deepspec_style_anchors(loss_mask, num_anchors, keys):
    """DeepSpec's sampler spelled out per sequence: given the keys of the candidate positions."""
    length = loss_mask.shape[1]
    anchors, keep = [], []
    for b in range(loss_mask.shape[0]):
        cands = [p for p in range(length - 1)
                 if loss_mask[b, p] > 0.5 and loss_mask[b, p + 1] > 0.5]
        chosen = sorted(sorted(cands, key=lambda p: float(keys[b, p]))[:num_anchors])
        n = len(chosen)
        anchors.append(chosen + [0] * (num_anchors - n))
        keep.append([True] * n + [False] * (num_anchors - n))
    return torch.tensor(anchors), torch.tensor(keep)


def test_anchor_sampling_candidates_order_and_padding():
    g = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(5, 17, generator=g) < 0.6).float()
    loss_mask[4] = 0
    loss_mask[4, 5:8] = 1  # two candidates only: 5 and 6
    anchors, keep = sample_anchor_positions(loss_mask, 6, torch.Generator().manual_seed(11))
    assert anchors.dtype == torch.int64 and keep.dtype == torch.bool
    assert anchors.shape == keep.shape == (5, 6)
    keys = torch.rand(5, 16, generator=torch.Generator().manual_seed(11))
    want_anchors, want_keep = _deepspec_style_anchors(loss_mask, 6, keys)
    assert torch.equal(anchors, want_anchors) and torch.equal(keep, want_keep)
    assert anchors[4].tolist() == [5, 6, 0, 0, 0, 0]
    assert keep[4].tolist() == [True, True] + [False] * 4
    for b in range(5):
        kept = anchors[b][keep[b]]
        assert torch.all(kept[1:] > kept[:-1])  # sorted, no repeats
        assert all(loss_mask[b, p] > 0.5 and loss_mask[b, p + 1] > 0.5 for p in kept.tolist())
    again, _ = sample_anchor_positions(loss_mask, 6, torch.Generator().manual_seed(11))
    other, _ = sample_anchor_positions(loss_mask, 6, torch.Generator().manual_seed(12))
    assert torch.equal(anchors, again) and not torch.equal(anchors, other)
    bool_anchors, _ = sample_anchor_positions(loss_mask > 0.5, 6, torch.Generator().manual_seed(11))
    assert torch.equal(bool_anchors, anchors)


def test_anchor_sampling_is_uniform_without_replacement():
    # 4000 sequences with the same 8 candidates, 3 anchors each: every candidate is picked with
    # probability 3/8 (binomial standard deviation ~0.0077: 5 sigma below 0.04).
    loss_mask = torch.ones(4000, 9)
    anchors, keep = sample_anchor_positions(loss_mask, 3, torch.Generator().manual_seed(1))
    assert keep.all()
    freq = torch.bincount(anchors.reshape(-1), minlength=8).float() / 4000
    assert torch.all((freq - 3 / 8).abs() < 0.04), freq


def test_anchor_sampling_without_candidates():
    for length in (0, 1, 5):
        anchors, keep = sample_anchor_positions(torch.zeros(2, length), 3)
        assert anchors.tolist() == [[0] * 3] * 2 and not keep.any()


def test_the_global_generator_is_used_without_one():
    loss_mask = torch.ones(2, 30)
    torch.manual_seed(9)
    a, _ = sample_anchor_positions(loss_mask, 4)
    a_again, _ = sample_anchor_positions(loss_mask, 4, torch.Generator().manual_seed(9))
    assert torch.equal(a, a_again)


# ------------------------------------------------------------------------------------------------
# Labels, masks, aligned target states


def test_labels_eval_mask_and_target_rows():
    draft = _draft()
    input_ids, features, loss_mask, last = _inputs(2, 16, seed=3)
    loss_mask[:] = 1
    loss_mask[0, 6] = 0  # a hole: blocks covering position 6 stop there
    loss_mask[1, 13:] = 0
    anchors = torch.tensor([[1, 3, 6, 9, 14], [0, 10, 11, 12, 13]])
    keep = torch.tensor([[True, True, True, False, True], [True, True, True, True, False]])
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, last,
                               anchor_positions=anchors, block_keep_mask=keep)
    L = input_ids.shape[1]
    assert torch.equal(out.anchor_positions, torch.where(keep, anchors, 0))
    assert torch.equal(out.block_keep_mask, keep)
    for b in range(2):
        for a in range(5):
            p0, kept = int(out.anchor_positions[b, a]), bool(keep[b, a])
            alive = kept
            for k in range(BLOCK):
                pos = p0 + 1 + k
                alive = alive and pos < L and bool(loss_mask[b, pos] > 0.5)
                assert bool(out.eval_mask[b, a, k]) == alive, (b, a, k)
                label = int(out.labels[b, a, k])
                assert 0 <= label < VOCAB
                if kept and pos < L:
                    assert label == int(input_ids[b, pos])
                    assert torch.equal(out.target_hidden[b, a, k], last[b, pos - 1])
                prev = int(input_ids[b, p0]) if k == 0 else int(out.labels[b, a, k - 1])
                assert int(out.prev_tokens[b, a, k]) == prev
    assert out.eval_mask[0, 0].tolist() == [True, True, True, True]  # labels 2..5
    assert out.eval_mask[0, 1].tolist() == [True, True, False, False]  # labels 4, 5, (6)
    assert out.eval_mask[0, 2].tolist() == [True, True, True, True]  # labels 7..10
    assert out.eval_mask[1, 2].tolist() == [True, False, False, False]  # 12, (13)
    assert not out.eval_mask[0, 3].any() and not out.eval_mask[1, 4].any()  # padding
    assert out.eval_mask[0, 4].tolist() == [True, False, False, False]  # labels 15, (16+)
    assert not out.eval_mask[1, 3].any()  # kept, but its first label (13) is untrained
    torch.testing.assert_close(build_eval_mask(loss_mask, out.anchor_positions, keep, BLOCK),
                               out.eval_mask)


def test_target_hidden_is_optional():
    draft = _draft()
    input_ids, features, loss_mask, _ = _inputs(1, 12)
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, num_anchors=3,
                               generator=torch.Generator().manual_seed(0))
    assert isinstance(out, TrainingBatch) and out.target_hidden is None


def test_position_weights():
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    w = position_weights(mask)
    want = torch.exp(-torch.arange(4.0) / 4.0)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w[1], want)
    torch.testing.assert_close(w[0], want * torch.tensor([1.0, 1, 0, 0]))
    torch.testing.assert_close(position_weights(mask.float(), 2.0)[1],
                               torch.exp(-torch.arange(4.0) / 2))
    with pytest.raises(ValueError, match="loss_decay_gamma"):
        position_weights(mask, 0.0)


def test_dense_mask_definition():
    anchors = torch.tensor([[2, 0, 5]])
    keep = torch.tensor([[True, True, False]])
    L, G = 6, 2
    mask = block_attention_mask(anchors, keep, L, G)
    assert mask.shape == (1, 6, 12)
    for q in range(6):
        a = q // G
        for kv in range(12):
            if kv < L:
                want = bool(keep[0, a]) and kv < int(anchors[0, a])
            else:
                want = bool(keep[0, a]) and (kv - L) // G == a
            assert bool(mask[0, q, kv]) == want


# ------------------------------------------------------------------------------------------------
# Padding blocks, gradients


def _strict_sdpa(real):
    """SDPA that refuses a fully masked row: some backends and torch versions return NaN there
    (this torch's CPU kernels return zeros, so the output alone would not show it)."""

    def sdpa(q, k, v, attn_mask=None, **kwargs):
        assert attn_mask is not None and attn_mask.any(-1).all(), "a row with no visible key"
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    return sdpa


def test_padding_blocks_are_finite_and_attend_to_nothing(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        _strict_sdpa(torch.nn.functional.scaled_dot_product_attention))
    anchors = torch.tensor([[3, 0], [0, 0]])
    keep = torch.tensor([[True, False], [False, False]])
    L, G, heads, D = 7, 3, 2, 8
    q = torch.randn(2, heads, 2 * G, D, requires_grad=True)
    k = torch.randn(2, 1, L + 2 * G, D, requires_grad=True)
    v = torch.randn(2, 1, L + 2 * G, D, requires_grad=True)
    attend = forward_module._sdpa_attention(anchors, keep, L, G)
    out = attend(q, k, v, D**-0.5)
    assert torch.equal(out[0, :, G:], torch.zeros_like(out[0, :, G:]))  # exact zeros
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    # The kept block: its own keys and the context before its anchor, nothing else.
    visible = torch.cat([torch.arange(3), L + torch.arange(G)])
    kk, vv = k[0, 0, visible], v[0, 0, visible]
    want = ((q[0, :, :G] @ kk.T) * D**-0.5).softmax(-1) @ vv
    torch.testing.assert_close(out[0, :, :G], want, **TOL)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


def test_padding_only_sequences_and_backward_reaches_the_backbone(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        _strict_sdpa(torch.nn.functional.scaled_dot_product_attention))
    draft = _draft(markov_head_type="rnn")
    input_ids, features, loss_mask, last = _inputs(2, 14, seed=5)
    loss_mask[1] = 0  # no candidate at all: every block of sequence 1 is padding
    out = training_forward(draft, input_ids, features, loss_mask, last, num_anchors=5,
                           generator=torch.Generator().manual_seed(0))
    assert not out.block_keep_mask[1].any() and out.block_keep_mask[0].all()
    for t in (out.hidden, out.markov_latent, out.confidence_logits):
        assert torch.isfinite(t).all()
    # A padding block is the MASK embedding through the layers with zero attention output.
    with torch.no_grad():
        want = _naive_block(draft, input_ids[1], features[1], 0, False)
    torch.testing.assert_close(out.hidden[1, 2], want, **TOL)
    loss = (out.hidden.sum() + out.markov_latent.sum() + out.confidence_logits.sum())
    loss.backward()
    for name, param in draft.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), name
    for name in ("fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
                 "layers.0.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight",
                 "layers.1.mlp.down_proj.weight", "norm.weight", "embed_tokens.weight",
                 "markov_head.markov_w1.weight", "markov_head.joint_proj.weight",
                 "confidence_head.proj.weight"):
        grad = dict(draft.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_frozen_embedding_and_hidden_sum_backward():
    draft = _draft()
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    input_ids, features, loss_mask, last = _inputs(1, 10)
    out = training_forward(draft, input_ids, features, loss_mask, last, num_anchors=12,
                           generator=torch.Generator().manual_seed(0))
    assert not out.block_keep_mask.all()  # more anchors than candidates
    out.hidden.sum().backward()
    assert draft.embed_tokens.weight.grad is None
    assert draft.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert torch.isfinite(draft.fc.weight.grad).all() and draft.fc.weight.grad.abs().sum() > 0


def test_bfloat16_draft():
    # DeepSpec trains the draft in bfloat16: same shapes and dtypes, values near float32's.
    draft = _draft(markov_head_type="rnn")
    input_ids, features, loss_mask, last = _inputs(1, 16, seed=2)
    kw = dict(num_anchors=5, attention="sdpa")
    with torch.no_grad():
        want = training_forward(draft, input_ids, features, loss_mask, last,
                                generator=torch.Generator().manual_seed(0), **kw)
    draft = draft.to(torch.bfloat16)
    out = training_forward(draft, input_ids, features.bfloat16(), loss_mask, last.bfloat16(),
                           generator=torch.Generator().manual_seed(0), **kw)
    assert out.hidden.dtype == out.markov_latent.dtype == out.target_hidden.dtype == torch.bfloat16
    assert out.confidence_logits.dtype == torch.float32
    assert torch.equal(out.anchor_positions, want.anchor_positions)
    torch.testing.assert_close(out.hidden.float(), want.hidden, rtol=0.05, atol=0.05)
    (out.hidden.float().sum() + out.markov_latent.float().sum()).backward()
    assert torch.isfinite(draft.fc.weight.grad).all()


# ------------------------------------------------------------------------------------------------
# Heads: the teacher-forced latents and confidences against the inference heads


def _greedy_forced(base, labels):
    """Base logits that make greedy drafting pick ``labels`` (a margin of 100 over the rest)."""
    return base + 100.0 * torch.nn.functional.one_hot(labels, VOCAB).float()


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_markov_latent_is_the_inference_heads_bias(head):
    # Greedy drafting over base logits that force the true tokens reproduces teacher forcing;
    # the head's bias, draft logits minus base logits, must then be latent @ W2.T.
    draft = _draft(seed=4, markov_head_type=head)
    input_ids, features, loss_mask, last = _inputs(2, 18, seed=8)
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, last, num_anchors=4,
                               generator=torch.Generator().manual_seed(1))
        keep = out.block_keep_mask.reshape(-1)
        hidden = out.hidden.reshape(-1, BLOCK, 64)[keep]
        labels = out.labels.reshape(-1, BLOCK)[keep]
        anchor = out.prev_tokens.reshape(-1, BLOCK)[keep][:, 0]
        latent = out.markov_latent.reshape(-1, BLOCK, 8)[keep]
        n = hidden.shape[0]
        base = _greedy_forced(torch.randn(n, BLOCK, VOCAB), labels)
        temperature = torch.zeros(n)
        seed = torch.zeros(n, dtype=torch.int64)
        position = torch.zeros(n, dtype=torch.int64)
        w1 = draft.markov_head.markov_w1.weight
        w2 = draft.markov_head.markov_w2.weight
        if head == "rnn":
            joint = draft.markov_head.joint_proj
            res = dspark_ops.rnn_draft(base, anchor, hidden, w1, w2, joint.weight, joint.bias,
                                       temperature, seed, position)
        else:
            res = dspark_ops.markov_draft(base, anchor, w1, w2, temperature, seed, position)
    assert torch.equal(res.tokens, labels)
    torch.testing.assert_close(res.draft_logits - base, latent @ w2.T, rtol=1e-4, atol=1e-4)
    if head == "vanilla":
        assert torch.equal(latent, w1[out.prev_tokens.reshape(-1, BLOCK)[keep]])


@pytest.mark.parametrize("variant", ["vanilla+markov", "vanilla+h", "rnn+markov", "rnn+h",
                                     "dflash+h", "dflash", "vanilla-noconf"])
def test_head_variants(variant):
    head, _, conf = variant.partition("+")
    overrides = dict(enable_confidence_head=bool(conf),
                     confidence_head_with_markov=conf == "markov")
    if head == "dflash":
        overrides["markov_rank"] = 0
    elif head == "vanilla-noconf":
        overrides.update(markov_head_type="vanilla", enable_confidence_head=False)
    else:
        overrides["markov_head_type"] = head
    draft = _draft(seed=6, **overrides)
    input_ids, features, loss_mask, last = _inputs(1, 15, seed=9)
    out = training_forward(draft, input_ids, features, loss_mask, last, num_anchors=5,
                           generator=torch.Generator().manual_seed(2))
    shape = (1, 5, BLOCK)
    assert out.hidden.shape == (*shape, 64) and out.labels.shape == shape
    if head == "dflash":
        assert out.markov_latent is None
    else:
        assert out.markov_latent.shape == (*shape, 8)
    if not conf:
        assert out.confidence_logits is None
        return
    assert out.confidence_logits.shape == shape and out.confidence_logits.dtype == torch.float32
    with torch.no_grad():  # the inference head (draft_confidence op) on the same inputs
        want = draft.confidence(out.hidden[0], out.prev_tokens[0])
    torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0]).detach(), want, **TOL)
    out.confidence_logits.sum().backward()
    assert draft.confidence_head.proj.weight.grad.abs().sum() > 0
    if conf == "markov":
        assert draft.markov_head.markov_w1.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# Attention backends


def _flex_runs_on_cpu() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention
        q = torch.randn(1, 1, 4, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_attention(q, q, q)
        return True
    except Exception:  # noqa: BLE001 - any failure means: not available here
        return False


@pytest.mark.skipif(not _flex_runs_on_cpu(),
                    reason="flex_attention does not run on CPU in this torch build")
def test_flex_and_sdpa_agree_on_cpu_forward():
    # Flex has no CPU backward in this torch: forward only, without autograd.
    draft = _draft(seed=3, markov_head_type="rnn")
    input_ids, features, loss_mask, last = _inputs(2, 20, seed=2)
    loss_mask[1, 5:] = 0  # padding blocks in sequence 1 (flex gives their rows zeros)
    kw = dict(num_anchors=6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        sdpa = training_forward(draft, input_ids, features, loss_mask, last, attention="sdpa",
                                generator=torch.Generator().manual_seed(4), **kw)
        flex = training_forward(draft, input_ids, features, loss_mask, last, attention="flex",
                                generator=torch.Generator().manual_seed(4), **kw)
    assert not sdpa.block_keep_mask[1].all()
    torch.testing.assert_close(flex.hidden, sdpa.hidden, **TOL)
    torch.testing.assert_close(flex.markov_latent, sdpa.markov_latent, **TOL)


def test_flex_backward_on_cpu_is_refused_by_torch():
    draft = _draft()
    input_ids, features, loss_mask, last = _inputs(1, 10)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        training_forward(draft, input_ids, features, loss_mask, last, attention="flex",
                         num_anchors=2)


def test_default_attention_on_cpu_is_sdpa(monkeypatch):
    used = []
    real = forward_module._sdpa_attention
    monkeypatch.setattr(forward_module, "_sdpa_attention",
                        lambda *a: used.append(1) or real(*a))
    draft = _draft()
    input_ids, features, loss_mask, last = _inputs(1, 10)
    training_forward(draft, input_ids, features, loss_mask, last, num_anchors=2)
    assert used


# ------------------------------------------------------------------------------------------------
# Arguments


def test_argument_checks():
    draft = _draft()
    input_ids, features, loss_mask, last = _inputs(1, 10)
    with pytest.raises(ValueError, match="input_ids must be"):
        training_forward(draft, input_ids[0], features, loss_mask)
    with pytest.raises(ValueError, match="loss_mask must have"):
        training_forward(draft, input_ids, features, loss_mask[:, :5])
    with pytest.raises(ValueError, match=r"target_features must be \[B, L, 128\]"):
        training_forward(draft, input_ids, features[..., :64], loss_mask)
    with pytest.raises(ValueError, match="target_last_hidden must be"):
        training_forward(draft, input_ids, features, loss_mask, last[:, :3])
    with pytest.raises(ValueError, match="without anchor_positions"):
        training_forward(draft, input_ids, features, loss_mask,
                         block_keep_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_keep_mask must have"):
        training_forward(draft, input_ids, features, loss_mask,
                         anchor_positions=torch.zeros(1, 2, dtype=torch.long),
                         block_keep_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="eval_mask is given without anchor_positions"):
        training_forward(draft, input_ids, features, loss_mask,
                         eval_mask=torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"eval_mask must be \[B, A, G\]"):
        training_forward(draft, input_ids, features, loss_mask,
                         anchor_positions=torch.zeros(input_ids.shape[0], 2, dtype=torch.long),
                         eval_mask=torch.ones(input_ids.shape[0], 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention must be one of"):
        training_forward(draft, input_ids, features, loss_mask, attention="dense")
    with pytest.raises(TypeError, match="input_ids must be int64"):
        training_forward(draft, input_ids.float(), features, loss_mask)


def test_docstring_example_runs():
    result = doctest.testmod(forward_module, verbose=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("anchors", [3, 6])
def test_anchor_count_defaults_to_the_config(anchors):
    """Without num_anchors, the forward samples the draft config's num_anchors blocks per
    sequence (DeepSpec's model reads its config's count); an explicit num_anchors still wins."""
    draft = _draft(num_anchors=anchors)
    input_ids, features, _, last = _inputs(2, 24)
    loss_mask = torch.ones(2, 24)  # 23 candidates per sequence: more than either count
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, loss_mask, last, attention="sdpa")
        assert out.anchor_positions.shape == (2, anchors)
        assert out.hidden.shape[:3] == (2, anchors, BLOCK)
        assert bool(out.block_keep_mask.all())
        out = training_forward(draft, input_ids, features, loss_mask, last, num_anchors=5,
                               attention="sdpa")
    assert out.anchor_positions.shape == (2, 5)
