"""Gemma4 DSpark / DFlash drafts: DeepSpec's config and checkpoint layout loaded strictly and
bit-exactly, the forward against an independent eager formula (written here from the
architecture's description, not from DeepSpec's code), each Gemma4 difference pinned by a test
that fails when it is done the Qwen3 way, and greedy speculative decoding equal to plain
decoding."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
from dspark_ops.models import DSparkConfig, DSparkDraft, TargetConfig, TinyTarget
from dspark_ops.models.checkpoint import load_state_dict_file
from dspark_ops.models.gemma4 import (
    Gemma4DSparkConfig, Gemma4DSparkDraft, GemmaRMSNorm, ScaledEmbedding,
    proportional_inv_freq,
)
from dspark_ops.models.backbone import RMSNorm, block_attention_torch
from dspark_ops.ops.attention import block_draft_attention

from cases.gemma4 import (HIDDEN, TARGET_LAYERS, deepspec_config, hf_generate,  # noqa: E402
                          random_state, save_checkpoint, tiny_gemma)



pytestmark = pytest.mark.usefixtures("one_thread")


def expected_names(layers: int, k_eq_v: bool = True) -> set:
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
             "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
             "layer_scalar", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if not k_eq_v:
        layer.append("self_attn.v_proj.weight")
    names = {"embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
             "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
             "confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names | {f"layers.{i}.{name}" for i in range(layers) for name in layer}


# --------------------------------------------------------------------------------------------
# Config and checkpoint


def test_untidy_deepspec_config_loads_with_the_draft_values():
    config = DSparkConfig.from_dict(deepspec_config())
    assert isinstance(config, Gemma4DSparkConfig)
    assert config.draft_class() is Gemma4DSparkDraft
    assert (config.head_dim, config.num_key_value_heads) == (64, 1)  # the global ones
    assert (config.sliding_head_dim, config.sliding_num_key_value_heads) == (16, 2)
    assert (config.rope_type, config.rope_theta, config.partial_rotary_factor) == (
        "proportional", 1e6, 0.25)
    assert config.final_logit_softcapping == 30.0 and config.attention_k_eq_v
    assert config.sliding_window is None and config.target_num_hidden_layers == 4
    again = DSparkConfig.from_dict(config.to_dict())
    assert again == config
    # Without k_eq_v the draft keeps num_key_value_heads and has a v_proj.
    plain = DSparkConfig.from_dict(deepspec_config(attention_k_eq_v=False))
    assert plain.num_key_value_heads == 2
    assert "layers.0.self_attn.v_proj.weight" in Gemma4DSparkDraft(plain).state_dict()


@pytest.mark.parametrize("changes, field", [
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
    (dict(use_double_wide_mlp=True, num_kv_shared_layers=1), "use_double_wide_mlp"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}),
     "rope_parameters.full_attention.rope_type"),
    (dict(rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                              "factor": 8.0}}),
     "rope_parameters.full_attention.factor"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(architectures=["Gemma4Eagle3Model"]), "architectures"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(global_head_dim=None), "global_head_dim"),
    (dict(num_global_key_value_heads=None), "num_global_key_value_heads"),
])
def test_what_changes_the_math_is_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        DSparkConfig.from_dict(deepspec_config(**changes))


def test_unknown_fields_are_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="fancy_new_field"):
        DSparkConfig.from_dict(deepspec_config(fancy_new_field=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checkpoint_loads_strictly_and_bit_exactly(tmp_path, dtype):
    values = deepspec_config()
    state = random_state(DSparkConfig.from_dict(values), dtype=dtype)
    assert set(state) == expected_names(2)
    save_checkpoint(tmp_path, values, state)
    draft = DSparkDraft.from_pretrained(str(tmp_path), dtype=dtype)
    assert type(draft) is Gemma4DSparkDraft
    loaded = draft.state_dict()
    assert set(loaded) == set(state)
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name
    # One tensor short (the layer scalar buffer included) is refused.
    state.pop("layers.1.layer_scalar")
    save_checkpoint(tmp_path, values, state)
    with pytest.raises(RuntimeError, match="layers.1.layer_scalar"):
        DSparkDraft.from_pretrained(str(tmp_path))


def test_save_pretrained_round_trips(tmp_path):
    config = DSparkConfig.from_dict(deepspec_config())
    draft = Gemma4DSparkDraft(config)
    draft.load_state_dict(random_state(config))
    draft.save_pretrained(str(tmp_path))
    again = DSparkDraft.from_pretrained(str(tmp_path))
    assert again.config == config
    for (name, a), b in zip(draft.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert set(load_state_dict_file(os.path.join(tmp_path, "model.safetensors"))) == \
        expected_names(2)


# --------------------------------------------------------------------------------------------
# The forward against an independent eager formula


def _norm(x, weight=None, eps=1e-6):
    """RMS norm in float64, the weight multiplied before any cast."""
    out = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def _rope(x, position, theta, fraction, qwen_way=False):
    """x [n, heads, D] at integer positions [n]: rotate dims (i, i + D/2) by
    position * theta ** (-2i / D) for i < fraction * D / 2; the others stay."""
    dim = x.shape[-1]
    out = x.clone()
    rotated = dim // 2 if qwen_way else int(fraction * dim // 2)
    for i in range(rotated):
        angle = position * theta ** (-2.0 * i / dim)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., i], x[..., i + dim // 2]
        out[..., i] = a * c - b * s
        out[..., i + dim // 2] = b * c + a * s
    return out


def eager_block(state, config, features, anchor, qwen_way=()):
    """Base logits ``[G, V]`` (and the final-normed hidden states) of one request's block,
    float64, from the description of the Gemma4 draft. ``qwen_way`` names differences to do the
    Qwen3 way instead (each must change the result)."""
    w = {k: v.double() for k, v in state.items()}
    cap = config.final_logit_softcapping
    eps, theta, frac = config.rms_norm_eps, config.rope_theta, config.partial_rotary_factor
    heads, kv_heads, dim = (config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim)
    block, length = config.block_size, features.shape[0]
    ids = torch.tensor([anchor] + [config.mask_token_id] * (block - 1))
    scale = 1.0 if "embed_scale" in qwen_way else float(
        torch.tensor(math.sqrt(config.hidden_size)).to(state["embed_tokens.weight"].dtype))
    h = w["embed_tokens.weight"][ids] * scale
    ctx = _norm(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(length, dtype=torch.float64)
    blk_pos = torch.arange(length, length + block, dtype=torch.float64)
    rope_full = "rope" in qwen_way
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        x = _norm(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(block, heads, dim)
        q = _rope(_norm(q, w[p + "self_attn.q_norm.weight"], eps), blk_pos, theta, frac,
                  rope_full)
        keys, values = [], []
        for src, pos in ((ctx, ctx_pos), (x, blk_pos)):
            raw = (src @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
            k = _rope(_norm(raw, w[p + "self_attn.k_norm.weight"], eps), pos, theta, frac,
                      rope_full)
            keys.append(k)
            if p + "self_attn.v_proj.weight" in w:  # no k_eq_v: V from v_proj, same v_norm
                raw = (src @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
            values.append(k if "v" in qwen_way else _norm(raw, None, eps))
        k = torch.cat(keys).repeat_interleave(heads // kv_heads, 1)  # [n, heads, D]
        v = torch.cat(values).repeat_interleave(heads // kv_heads, 1)
        s = 1.0 if "scale" not in qwen_way else dim**-0.5
        attn = torch.softmax(torch.einsum("ghd,nhd->hgn", q, k) * s, -1)
        o = torch.einsum("hgn,nhd->ghd", attn, v).reshape(block, -1)
        o = o @ w[p + "self_attn.o_proj.weight"].T
        if "norms" in qwen_way:
            h = h + o
            m = _norm(h, w[p + "post_attention_layernorm.weight"], eps)
        else:
            h = h + _norm(o, w[p + "post_attention_layernorm.weight"], eps)
            m = _norm(h, w[p + "pre_feedforward_layernorm.weight"], eps)
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        if "gelu" in qwen_way:
            act = torch.nn.functional.silu(gate)
        else:
            act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                               * (gate + 0.044715 * gate**3)))
        m = (act * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        if "norms" in qwen_way:
            h = h + m
        else:
            h = h + _norm(m, w[p + "post_feedforward_layernorm.weight"], eps)
        if "layer_scalar" not in qwen_way:
            h = h * w[p + "layer_scalar"]
    hidden = _norm(h, w["norm.weight"], eps)
    z = hidden @ w["lm_head.weight"].T
    if "softcap" not in qwen_way:
        z = cap * torch.tanh(z / cap)
    return z, hidden


def draft_block(draft, features, anchors):
    """The draft's base logits and hidden states of each request's block through the
    inference path (context caches filled by append_context, the block through the layers)."""
    batch, length = features.shape[:2]
    block = draft.config.block_size
    k, v = draft.new_caches(batch, length + block + 3)
    seqlens = torch.zeros(batch, dtype=torch.int32)
    draft.append_context(features, None, torch.full((batch,), length, dtype=torch.int32), k, v,
                         seqlens)
    hidden = draft(draft.block_hidden(torch.tensor(anchors), block), None, k, v, seqlens)
    return draft.base_logits(hidden), hidden


def _loaded(values, dtype=torch.float32, seed=0):
    config = DSparkConfig.from_dict(values)
    state = random_state(config, seed=seed, dtype=dtype)
    draft = Gemma4DSparkDraft(config).to(dtype)
    draft.load_state_dict(state)
    return config, state, draft


@pytest.mark.parametrize("head_dim", [64, 512])  # both through the kernels
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_block_matches_the_eager_formula(head_dim, k_eq_v):
    config, state, draft = _loaded(deepspec_config(global_head_dim=head_dim,
                                                   attention_k_eq_v=k_eq_v))
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(2, 9, len(TARGET_LAYERS) * HIDDEN, generator=gen)
    logits, hidden = draft_block(draft, features, [7, 30])
    for b, anchor in enumerate([7, 30]):
        want, want_hidden = eager_block(state, config, features[b], anchor)
        torch.testing.assert_close(hidden[b].double(), want_hidden, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(logits[b].double(), want, atol=2e-4, rtol=2e-4)
    assert logits.abs().max() < config.final_logit_softcapping


@pytest.mark.parametrize("difference", ["embed_scale", "rope", "v", "scale", "norms", "gelu",
                                        "layer_scalar", "softcap"])
def test_each_gemma4_difference_done_the_qwen3_way_fails(difference):
    config, state, draft = _loaded(deepspec_config())
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 9, len(TARGET_LAYERS) * HIDDEN, generator=gen)
    logits, _ = draft_block(draft, features, [11])
    right, _ = eager_block(state, config, features[0], 11)
    wrong, _ = eager_block(state, config, features[0], 11, qwen_way={difference})
    torch.testing.assert_close(logits[0].double(), right, atol=2e-4, rtol=2e-4)
    assert (logits[0].double() - wrong).abs().max() > 1e-2, difference


# --------------------------------------------------------------------------------------------
# The arithmetic details, each where float32 would hide it


def test_embedding_scale_is_rounded_to_the_weight_dtype():
    """sqrt(3840) = 61.97 becomes 62.0 in bfloat16, as transformers' Gemma4 embedding does."""
    emb = ScaledEmbedding(2, 3840).to(torch.bfloat16)
    with torch.no_grad():
        emb.weight.fill_(1.0)
    assert emb(torch.tensor([0])).unique().tolist() == [62.0]
    assert math.sqrt(3840) != 62.0
    emb32 = ScaledEmbedding(2, 3840)
    with torch.no_grad():
        emb32.weight.fill_(1.0)
    assert emb32(torch.tensor([0]))[0, 0].item() == pytest.approx(math.sqrt(3840), rel=1e-7)


def test_rms_norm_multiplies_by_the_weight_before_the_cast():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    weight = 1.0 + torch.randn(256, generator=gen)
    gemma, qwen = GemmaRMSNorm(256), RMSNorm(256)
    with torch.no_grad():
        gemma.weight.copy_(weight)
        qwen.weight.copy_(weight)
    xf = x.float()
    want = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * weight).bfloat16()
    assert torch.equal(gemma(x), want)
    assert not torch.equal(qwen.to(torch.bfloat16)(x), want)  # the Qwen3 order rounds twice
    weightless = GemmaRMSNorm(256, with_scale=False)
    assert not list(weightless.parameters())


def test_proportional_rope_rotates_a_quarter_with_the_full_dim_exponent():
    inv = proportional_inv_freq(512, 1e6, 0.25)
    assert inv.shape == (256,)
    assert (inv[:64] > 0).all() and (inv[64:] == 0).all()
    assert inv[1].item() == pytest.approx(1e6 ** (-2 / 512), rel=1e-6)  # not 1e6 ** (-2 / 128)
    full = proportional_inv_freq(128, 1e6, 1.0)
    assert (full > 0).all() and full[1].item() == pytest.approx(1e6 ** (-2 / 128), rel=1e-6)


@pytest.mark.parametrize("dim", [64, 256])
def test_torch_block_attention_equals_the_op(dim):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 5, 4, dim, generator=gen)
    kb, vb = (torch.randn(3, 5, 2, dim, generator=gen) for _ in range(2))
    kc, vc = (torch.randn(4, 12, 2, dim, generator=gen) for _ in range(2))
    seqlens = torch.tensor([0, 7, 12], dtype=torch.int32)
    slot = torch.tensor([2, 0, 3], dtype=torch.int32)
    want = block_draft_attention(q, kb, vb, kc, vc, seqlens, cache_slot=slot, softmax_scale=1.0)
    got = block_attention_torch(q, kb, vb, kc, vc, seqlens, cache_slot=slot, softmax_scale=1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_markov_bias_is_added_after_the_soft_cap():
    """Greedy drafts' logits are cap(lm_head(h)) + W2 W1[prev], not cap(lm_head(h) + bias)."""
    config, state, draft = _loaded(deepspec_config(final_logit_softcapping=2.0))
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(1, 6, len(TARGET_LAYERS) * HIDDEN, generator=gen)
    base, hidden = draft_block(draft, features, [9])
    assert base.abs().max() <= 2.0
    zero = torch.zeros(1)
    out = draft.propose(base, torch.tensor([9]), hidden, zero, torch.zeros(1, dtype=torch.long),
                        torch.tensor([6]))
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    prev = torch.cat([torch.tensor([9]), out.tokens[0, :-1]])
    bias = w1[prev] @ w2.T
    torch.testing.assert_close(out.draft_logits[0], base[0] + bias, atol=1e-5, rtol=1e-5)
    raw = draft.lm_head(hidden)[0]
    assert (out.draft_logits[0] - (2.0 * torch.tanh((raw + bias) / 2.0))).abs().max() > 0.1


# --------------------------------------------------------------------------------------------
# Decoding


@torch.no_grad()
def _decoding_pair(head: str):
    """A float64 TinyTarget and a Gemma4 draft on its features whose Markov head is a bigram
    table of the target's greedy continuations (so drafts are accepted and rejected)."""
    torch.manual_seed(0)
    target = TinyTarget(TargetConfig(vocab_size=96, hidden_size=HIDDEN, num_hidden_layers=4,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     intermediate_size=64), TARGET_LAYERS).double()
    for p in target.parameters():
        p.normal_(0, 0.3)
    dflash = head == "dflash"
    values = deepspec_config(markov_rank=0 if dflash else 96, enable_confidence_head=not dflash,
                             global_head_dim=512 if head == "d512" else 64)
    config = DSparkConfig.from_dict(values)
    draft = Gemma4DSparkDraft(config)
    draft.load_state_dict(random_state(config))
    if not dflash:
        counts = torch.zeros(96, 96)
        for prompt, seq in zip(PROMPTS, generate_target_only(target, PROMPTS, 16)):
            for a, b in zip(prompt[-1:] + seq, seq):
                counts[a, b] += 1
        share = counts / counts.sum(-1, keepdim=True).clamp_min(1)
        draft.norm.weight.zero_()  # h = 0: capped base logits vanish, the table drafts
        draft.markov_head.markov_w1.weight.copy_(torch.eye(96))
        draft.markov_head.markov_w2.weight.copy_((8.0 * share).T)
    return target, draft


PROMPTS = [[5, 17, 9], [40, 2, 9, 11, 30, 7, 21], [12], [8, 50, 33, 6]]


@pytest.mark.parametrize("head, scheduler", [("markov", "fixed"), ("markov", "confidence"),
                                             ("dflash", "fixed"), ("d512", "fixed")])
@pytest.mark.parametrize("block", [1, 5])
def test_greedy_equals_plain_decoding(head, scheduler, block):
    target, draft = _decoding_pair(head)
    expected = generate_target_only(target, PROMPTS, 16)
    out = SpeculativeDecoder(target, draft, block_size=block, scheduler=scheduler).generate(
        PROMPTS, 16)
    assert out.tokens == expected
    if head != "dflash" and scheduler == "fixed" and block > 1:
        assert out.mean_accepted_length > 1.5  # the table drafts are accepted


def test_sampled_decoding_runs():
    target, draft = _decoding_pair("markov")
    out = SpeculativeDecoder(target, draft).generate(PROMPTS, 12, 1.0, torch.arange(4))
    assert all(len(t) == 12 for t in out.tokens)


# --------------------------------------------------------------------------------------------
# Gemma targets through HFTarget: sliding-window layers, each with its own mask


HF_FEATURES = (-1, 1, 2)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@torch.no_grad()
def table_draft_for(sequences, head: str = "markov") -> Gemma4DSparkDraft:
    """A Gemma4 draft on HF_FEATURES whose Markov head is a bigram table of ``sequences``."""
    dflash = head == "dflash"
    config = DSparkConfig.from_dict(deepspec_config(
        target_layer_ids=list(HF_FEATURES), markov_rank=0 if dflash else 96,
        enable_confidence_head=not dflash))
    draft = Gemma4DSparkDraft(config)
    draft.load_state_dict(random_state(config))
    if not dflash:
        counts = torch.zeros(96, 96)
        for seq in sequences:
            for a, b in zip(seq, seq[1:]):
                counts[a, b] += 1
        share = counts / counts.sum(-1, keepdim=True).clamp_min(1)
        draft.norm.weight.zero_()
        draft.markov_head.markov_w1.weight.copy_(torch.eye(96))
        draft.markov_head.markov_w2.weight.copy_((8.0 * share).T)
    return draft


@pytest.mark.parametrize("kind, window", [("gemma4", 3), ("gemma4", 1000), ("gemma3", 3)])
def test_plain_decoding_through_hftarget_equals_generate(transformers, kind, window):
    from dspark_ops.hf import HFTarget

    model = tiny_gemma(transformers, kind, window)
    expected = hf_generate(model, PROMPTS, 12)
    assert generate_target_only(HFTarget(model, HF_FEATURES), PROMPTS, 12) == expected
    if window == 3:  # the window changes the model's output, so the masks above are tested
        assert hf_generate(tiny_gemma(transformers, kind, 1000), PROMPTS, 12) != expected


@pytest.mark.parametrize("head, scheduler", [("markov", "fixed"), ("markov", "confidence"),
                                             ("dflash", "fixed")])
@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("kind", ["gemma4", "gemma3"])
def test_speculative_greedy_equals_generate(transformers, kind, head, scheduler, block):
    from dspark_ops.hf import HFTarget

    model = tiny_gemma(transformers, kind, 3)
    expected = hf_generate(model, PROMPTS, 16)
    draft = table_draft_for([p + e for p, e in zip(PROMPTS, expected)], head)
    out = SpeculativeDecoder(HFTarget(model, HF_FEATURES), draft, block_size=block,
                             scheduler=scheduler).generate(PROMPTS, 16)
    assert out.tokens == expected
    if head == "markov" and scheduler == "fixed" and block > 1:
        assert out.mean_accepted_length > 1.5  # accepted and rejected rows both happen


def test_gemma4_features_follow_deepspec(transformers):
    """-1 is the scaled embedding, l the decoder layer's output after its layer_scalar: the
    model's own hidden_states[0] and hidden_states[l + 1]."""
    from dspark_ops.hf import HFTarget

    model = tiny_gemma(transformers, "gemma4", 3)
    assert not all(float(layer.layer_scalar) == 1.0 for layer in model.model.layers)
    target = HFTarget(model, HF_FEATURES)
    ids = torch.tensor([PROMPTS[1]])
    cache = target.new_cache(1, 32)
    _, features = target(ids, torch.tensor([ids.shape[1]], dtype=torch.int32), cache,
                         torch.zeros(1, dtype=torch.int32))
    states = model(ids, output_hidden_states=True).hidden_states
    want = torch.cat([states[i + 1] for i in HF_FEATURES], -1)
    torch.testing.assert_close(features, want, atol=1e-10, rtol=1e-10)
    scale = torch.tensor(HIDDEN**0.5, dtype=torch.float64)
    torch.testing.assert_close(features[..., :HIDDEN],
                               model.model.embed_tokens.weight[ids] * scale)


def test_hftarget_refuses_windows_it_cannot_place(transformers):
    from dspark_ops.hf import _sliding_window

    class Config:
        pass

    config = Config()
    config.sliding_window, config.layer_types = 8, None
    with pytest.raises(ValueError, match="without 'layer_types'"):
        _sliding_window(config)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        _sliding_window(config)
    config.layer_types = ["sliding_attention", "full_attention"]
    assert _sliding_window(config) == 8
    config.use_sliding_window = False  # Qwen-style switch: the window is off
    config.layer_types = ["full_attention"] * 2
    assert _sliding_window(config) is None


# --------------------------------------------------------------------------------------------
# The training forward takes a Gemma4 draft (its layers, attending over the masked context)


@pytest.mark.parametrize("head_dim", [64, 512])
def test_training_forward_matches_the_inference_path(head_dim):
    from dspark_ops.train import training_forward

    config, state, draft = _loaded(deepspec_config(global_head_dim=head_dim))
    gen = torch.Generator().manual_seed(6)
    length = 24
    input_ids = torch.randint(5, 96, (1, length), generator=gen)
    features = torch.randn(1, length, len(TARGET_LAYERS) * HIDDEN, generator=gen)
    anchors = torch.tensor([[0, 4, 11, 18]])
    with torch.no_grad():
        out = training_forward(draft, input_ids, features, torch.ones(1, length),
                               anchor_positions=anchors)
        p0 = anchors[0]
        k, v = draft.new_caches(4, length + 8)
        seqlens = torch.zeros(4, dtype=torch.int32)
        draft.append_context(features.expand(4, -1, -1), None, p0.int(), k, v, seqlens)
        hidden = draft(draft.block_hidden(input_ids[0, p0], config.block_size), None, k, v,
                       seqlens)
    torch.testing.assert_close(out.hidden[0], hidden, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Training a Gemma4 draft: the loss with the cap, and the trainer on a Gemma4 target


def test_softcapped_loss_caps_before_the_markov_bias():
    from dspark_ops import reference
    from dspark_ops.train.loss import softcapped_dspark_loss

    gen = torch.Generator().manual_seed(7)
    n, d, v, r = 12, 16, 40, 4
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, d, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=gen)
    weights = torch.rand(n, generator=gen)
    latent = torch.randn(n, r, generator=gen, dtype=torch.float64)
    w2 = torch.randn(v, r, generator=gen, dtype=torch.float64)
    target = torch.randn(n, d, generator=gen, dtype=torch.float64)
    conf = torch.randn(n, generator=gen, dtype=torch.float64)
    kw = dict(target_hidden=target, markov_latent=latent, markov_w2=w2, confidence_logits=conf)
    # A cap far above the logits is no cap: the uncapped eager formula of record.
    loose = softcapped_dspark_loss(hidden, head, labels, weights, cap=1e6, **kw)
    plain = reference.dspark_loss(hidden, head, labels, weights, **kw)
    torch.testing.assert_close(loose.loss, plain.loss, rtol=1e-9, atol=1e-9)
    # A tight one: z = cap * tanh(W h / cap) + W2 u, t capped alike, gradients through tanh.
    out = softcapped_dspark_loss(hidden, head, labels, weights, cap=2.0, **kw)
    z = 2.0 * torch.tanh(hidden @ head.T / 2.0) + latent @ w2.T
    t = 2.0 * torch.tanh(target @ head.T / 2.0)
    w = weights.double()
    s = w.sum() + 1e-6
    ce = torch.logsumexp(z, -1) - z.gather(-1, labels[:, None])[:, 0]
    l1 = (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        conf, (1 - 0.5 * l1).clamp(0, 1).detach(), reduction="none")
    want = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / s
    torch.testing.assert_close(out.loss, want)
    grad, = torch.autograd.grad(out.loss, hidden)
    want_grad, = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(grad, want_grad)
    assert abs(float((out.loss - plain.loss).detach())) > 1e-2  # the cap changes the loss
    wrong = 2.0 * torch.tanh((hidden @ head.T + latent @ w2.T) / 2.0)  # bias before the cap
    assert (wrong - z).abs().max() > 0.1


@pytest.mark.parametrize("cap", [30.0, 2.0])
@pytest.mark.parametrize("train_head", [False, True])
def test_gemma4_training_step_fused_matches_eager(cap, train_head):
    """One training step of a tiny Gemma4 draft: draft_loss through the fused op with the cap
    (the trainer's path) and through the eager formula with the same cap
    (reference.dspark_loss, --loss-impl reference) give the same loss, metrics and gradients of
    every trainable parameter (the LM head's too, through the draft and target logits, when it
    trains). The uncapped loss is far from both: the cap was applied."""
    from dspark_ops import reference
    from dspark_ops.train import draft_loss, training_forward
    from dspark_ops.train.loss import flatten_batch

    _, _, draft = _loaded(deepspec_config(final_logit_softcapping=cap))
    draft.lm_head.requires_grad_(train_head)
    gen = torch.Generator().manual_seed(9)
    length = 24
    input_ids = torch.randint(5, 96, (1, length), generator=gen)
    features = torch.randn(1, length, len(TARGET_LAYERS) * HIDDEN, generator=gen)
    last_hidden = torch.randn(1, length, HIDDEN, generator=gen)
    anchors = torch.tensor([[0, 4, 11, 18]])
    results = []
    for loss_fn in (None, reference.dspark_loss):
        draft.zero_grad(set_to_none=True)
        batch = training_forward(draft, input_ids, features, torch.ones(1, length), last_hidden,
                                 anchor_positions=anchors)
        out = draft_loss(draft, batch, loss_fn=loss_fn)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
        results.append((out, grads))
    (fused, g_fused), (eager, g_eager) = results
    for field in ("loss", "ce", "l1", "confidence", "accept_rate"):
        torch.testing.assert_close(getattr(fused, field).detach(), getattr(eager, field).detach(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{field}: {m}")
    assert g_fused.keys() == g_eager.keys()
    assert ("lm_head.weight" in g_fused) == train_head and "markov_head.markov_w2.weight" in g_fused
    for name in g_eager:
        scale = g_eager[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(g_fused[name], g_eager[name], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m: f"grad {name}: {m}")
    with torch.no_grad():
        inputs = flatten_batch(draft, batch)
        positional = [inputs.pop(k) for k in ("hidden", "lm_head_weight", "labels", "weights")]
        uncapped = reference.dspark_loss(*positional, **inputs)
    assert abs(uncapped.loss.item() - eager.loss.item()) > 1e-3 * abs(eager.loss.item())


def test_trainer_trains_a_gemma4_draft_for_a_gemma4_target(transformers, tmp_path):
    from cases.gemma4 import training_target_and_data
    from dspark_ops.train.trainer import main

    _, target, data = training_target_and_data(transformers, tmp_path, eos_token_id=3)
    out = str(tmp_path / "run")
    main(["--target", target, "--data", data, "--out", out, "--num-layers", "1",
          "--block-size", "4", "--anchors", "8", "--target-layers", "0", "1", "2",
          "--markov-rank", "16", "--batch-tokens", "256", "--device", "cpu", "--dtype",
          "float32", "--no-progress", "--min-loss-tokens", "4", "--max-steps", "16", "--lr",
          "3e-3", "--calibration-samples", "0", "--mask-token-id", "4"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    first = sum(r["loss"] for r in metrics[:4]) / 4
    last = sum(r["loss"] for r in metrics[-4:]) / 4
    assert last < first, [r["loss"] for r in metrics]
    draft = DSparkDraft.from_pretrained(os.path.join(out, "step_latest"))
    assert isinstance(draft, Gemma4DSparkDraft)
    assert draft.config.head_dim == 32 and draft.config.final_logit_softcapping == 30.0
    assert draft.config.partial_rotary_factor == 0.25 and draft.config.attention_k_eq_v
    assert draft.config.mask_token_id == 4 and draft.config.target_layer_ids == (0, 1, 2)


@pytest.mark.parametrize("per_layer_input", [8, 0])
def test_gemma4_target_with_kv_shared_layers(transformers, per_layer_input):
    """The Gemma4 layout of the small models: the last layers reuse earlier layers' K/V
    (num_kv_shared_layers), with every layer taking a per-layer input or none (transformers
    runs both). Plain and speculative greedy decoding through HFTarget give the model's own
    generate output."""
    from dspark_ops.hf import HFTarget

    config = transformers.Gemma4TextConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"] * 3, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=per_layer_input, vocab_size_per_layer_input=96,
        num_kv_shared_layers=2,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or "layer_scalar" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("weight"):
                p.normal_(0, 0.3)
    model = model.double().eval()
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    expected = hf_generate(model, PROMPTS, 10)
    target = HFTarget(model, HF_FEATURES)
    assert generate_target_only(target, PROMPTS, 10) == expected
    draft = table_draft_for([p + e for p, e in zip(PROMPTS, expected)])
    out = SpeculativeDecoder(target, draft, block_size=4, scheduler="fixed").generate(PROMPTS, 10)
    assert out.tokens == expected
