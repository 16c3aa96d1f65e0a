"""Eagle3 drafts: DeepSpec's config and checkpoint layout loaded strictly and bit-exactly (Qwen3
and Gemma4 flavours), the draft layer and its whole-sequence cache against an independent eager
formula (prefill, chain steps, and the crop and re-extend after verification), and speculative
decoding with chain drafts equal to plain decoding (greedy) or distributed as the target
(sampled, chi-square)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dspark_ops import load_draft
from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
from dspark_ops.models import DSparkDraft, TargetConfig, TinyTarget
from dspark_ops.models.eagle3 import Eagle3Config, Eagle3Draft
from stats import chi_square, chi_square_passes

import cases.gemma4 as gemma4_cases
from cases.gemma4 import save_checkpoint

HIDDEN = 32
LAYERS = [0, 1, 2, 3, 4]  # DeepSpec's Eagle3 takes five target layers


pytestmark = pytest.mark.usefixtures("one_thread")


def deepspec_config(family: str = "qwen3", **changes) -> dict:
    """A tiny Eagle3 draft config as DeepSpec saves one (a copy of the target's config plus the
    Eagle3 fields)."""
    values = {
        "vocab_size": 96, "hidden_size": HIDDEN, "intermediate_size": 48,
        "num_hidden_layers": 1, "draft_num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "attention_bias": False, "attention_dropout": 0.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "layer_types": ["full_attention"],
        "target_layer_ids": LAYERS, "num_target_layers": 6, "ttt_length": 5,
        "step_loss_decay": 0.8, "target_model_name_or_path": "tiny/target",
        "dtype": "bfloat16", "transformers_version": "5.10.2", "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    if family == "qwen3":
        values.update(architectures=["Qwen3Eagle3Model"], model_type="qwen3", hidden_act="silu",
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                      use_sliding_window=False, sliding_window=None)
    else:
        values.update(
            architectures=["Gemma4Eagle3Model"], model_type="gemma4_text",
            hidden_activation="gelu_pytorch_tanh", global_head_dim=64,
            num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0,
            sliding_window=1024, enable_moe_block=False, hidden_size_per_layer_input=0,
            rope_parameters={"full_attention": {"rope_type": "proportional",
                                                "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "rope_type": "default", "rope_theta": None})
    values.update(changes)
    return values


def random_state(config: Eagle3Config, seed: int = 0, dtype=torch.float32) -> dict:
    return gemma4_cases.random_state(config, seed, dtype, draft_class=Eagle3Draft)


# --------------------------------------------------------------------------------------------
# Config and checkpoint


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_checkpoint_loads_strictly_and_bit_exactly(tmp_path, family):
    values = deepspec_config(family)
    config = Eagle3Config.from_dict(values)
    state = random_state(config, dtype=torch.bfloat16)
    names = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight",
             "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
             "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight",
             "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.o_proj.weight",
             "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
             "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
             "layers.0.mlp.down_proj.weight"}
    if family == "qwen3":
        names.add("layers.0.self_attn.v_proj.weight")
    else:
        names |= {"layers.0.pre_feedforward_layernorm.weight",
                  "layers.0.post_feedforward_layernorm.weight", "layers.0.layer_scalar"}
    assert set(state) == names
    head = 64 if family == "gemma4" else 16
    assert state["layers.0.self_attn.q_proj.weight"].shape == (4 * head, 2 * HIDDEN)
    assert state["fc.weight"].shape == (HIDDEN, 5 * HIDDEN)
    assert state["lm_head.weight"].shape == (96, HIDDEN)  # the full vocabulary
    save_checkpoint(tmp_path, values, state)
    draft = load_draft(str(tmp_path), dtype=torch.bfloat16)
    assert type(draft) is Eagle3Draft and draft.config == config
    assert draft.config.block_size == 5  # ttt_length
    for name, value in state.items():
        assert torch.equal(draft.state_dict()[name], value), name
    state.pop("layers.0.hidden_norm.weight")
    save_checkpoint(tmp_path, values, state)
    with pytest.raises(RuntimeError, match="hidden_norm"):
        load_draft(str(tmp_path))


def test_load_draft_returns_dspark_drafts_too(tmp_path):
    from cases.gemma4 import deepspec_config as gemma4_dspark, random_state as dspark_state
    from dspark_ops.models import DSparkConfig

    values = gemma4_dspark()
    save_checkpoint(tmp_path, values, dspark_state(DSparkConfig.from_dict(values)))
    assert isinstance(load_draft(str(tmp_path)), DSparkDraft)


def test_save_pretrained_round_trips(tmp_path):
    for family in ("qwen3", "gemma4"):
        config = Eagle3Config.from_dict(deepspec_config(family))
        draft = Eagle3Draft(config)
        draft.load_state_dict(random_state(config))
        draft.save_pretrained(str(tmp_path / family))
        again = load_draft(str(tmp_path / family))
        assert again.config == config
        for (name, a), b in zip(draft.state_dict().items(), again.state_dict().values()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("family, changes, field", [
    ("qwen3", dict(num_hidden_layers=2), "num_hidden_layers"),
    ("qwen3", dict(draft_num_hidden_layers=2), "draft_num_hidden_layers"),
    ("qwen3", dict(target_layer_ids=[-1, 1, 2, 3, 4]), "target_layer_ids"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
    ("qwen3", dict(architectures=["Gemma4Eagle3Model"]), "architectures"),
    ("qwen3", dict(tie_word_embeddings=True), "tie_word_embeddings"),
    ("qwen3", dict(ttt_length=None), "ttt_length"),
    ("gemma4", dict(enable_moe_block=True), "enable_moe_block"),
    ("gemma4", dict(hidden_size_per_layer_input=128), "hidden_size_per_layer_input"),
    ("gemma4", dict(rope_parameters={"full_attention": {"rope_type": "llama3",
                                                        "rope_theta": 1e6}}), "rope_type"),
])
def test_unsupported_fields_are_refused_by_name(family, changes, field):
    with pytest.raises(ValueError, match=field):
        Eagle3Config.from_dict(deepspec_config(family, **changes))


# --------------------------------------------------------------------------------------------
# The layer and its cache against an eager formula


def _norm(x, weight=None, eps=1e-6):
    out = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def _rope(x, position, theta, fraction):
    dim = x.shape[-1]
    out = x.clone()
    for i in range(int(fraction * dim // 2)):
        angle = position * theta ** (-2.0 * i / dim)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., i], x[..., i + dim // 2]
        out[..., i] = a * c - b * s
        out[..., i + dim // 2] = b * c + a * s
    return out


def eager_rows(state, config, hidden, tokens, positions):
    """The layer's outputs for a whole sequence at once, causally, float64: row ``i`` from
    ``hidden[i]`` (already projected) and ``tokens[i]`` at RoPE position ``positions[i]``."""
    w = {k: v.double() for k, v in state.items()}
    gemma = config.family == "gemma4"
    eps, heads, kv, dim = (config.rms_norm_eps, config.num_attention_heads,
                           config.num_key_value_heads, config.head_dim)
    emb = w["embed_tokens.weight"][tokens]
    if gemma:
        emb = emb * float(torch.tensor(math.sqrt(config.hidden_size)))
    x = torch.cat([_norm(emb, w["layers.0.input_layernorm.weight"], eps),
                   _norm(hidden, w["layers.0.hidden_norm.weight"], eps)], -1)
    n = x.shape[0]
    pos = positions.double()
    fraction = config.partial_rotary_factor

    def proj(name, count):
        return (x @ w[f"layers.0.self_attn.{name}_proj.weight"].T).view(n, count, dim)

    q = _rope(_norm(proj("q", heads), w["layers.0.self_attn.q_norm.weight"], eps), pos,
              config.rope_theta, fraction)
    raw = proj("k", kv)
    k = _rope(_norm(raw, w["layers.0.self_attn.k_norm.weight"], eps), pos, config.rope_theta,
              fraction)
    v = _norm(raw, None, eps) if gemma else proj("v", kv)
    k, v = (t.repeat_interleave(heads // kv, 1) for t in (k, v))
    scale = 1.0 if gemma else dim**-0.5
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v).reshape(n, -1)
    o = o @ w["layers.0.self_attn.o_proj.weight"].T

    def mlp(m):
        gate = m @ w["layers.0.mlp.gate_proj.weight"].T
        if gemma:
            act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                               * (gate + 0.044715 * gate**3)))
        else:
            act = torch.nn.functional.silu(gate)
        return (act * (m @ w["layers.0.mlp.up_proj.weight"].T)) @ w[
            "layers.0.mlp.down_proj.weight"].T

    if not gemma:
        h = hidden + o
        return h + mlp(_norm(h, w["layers.0.post_attention_layernorm.weight"], eps))
    h = hidden + _norm(o, w["layers.0.post_attention_layernorm.weight"], eps)
    h = h + _norm(mlp(_norm(h, w["layers.0.pre_feedforward_layernorm.weight"], eps)),
                  w["layers.0.post_feedforward_layernorm.weight"], eps)
    return h * w["layers.0.layer_scalar"]


def eager_logits(state, config, h):
    w = {k: v.double() for k, v in state.items()}
    z = _norm(h, w["norm.weight"], config.rms_norm_eps) @ w["lm_head.weight"].T
    cap = config.final_logit_softcapping
    return z if cap is None else cap * torch.tanh(z / cap)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_prefill_chain_and_update_match_the_eager_formula(family):
    """Prefill of 7 rows, two speculative chain steps, then a re-extension with 2 committed
    rows over the speculative ones: every output, and the logits, as the eager formula of the
    whole sequence gives them."""
    config = Eagle3Config.from_dict(deepspec_config(family))
    state = random_state(config)
    draft = Eagle3Draft(config)
    draft.load_state_dict(state)
    gen = torch.Generator().manual_seed(1)
    w_fc = state["fc.weight"].double()
    features = torch.randn(1, 9, 5 * HIDDEN, generator=gen)
    tokens = torch.randint(0, 96, (1, 12), generator=gen)
    cache = draft.new_cache(1, 16)
    length = torch.tensor([7], dtype=torch.int32)
    with torch.no_grad():
        pre = draft.extend(features[:, :7], tokens[:, :7], torch.arange(7)[None], length, cache,
                           torch.zeros(1, dtype=torch.int32), project=True)
        # Two chain steps at positions 7 and 8 with the draft's own outputs.
        s1 = draft.extend(pre[:, -1:], tokens[:, 7:8], torch.tensor([[7]]),
                          torch.ones(1, dtype=torch.int32), cache, length, project=False)
        s2 = draft.extend(s1, tokens[:, 8:9], torch.tensor([[8]]),
                          torch.ones(1, dtype=torch.int32), cache, length + 1, project=False)
        # Verification kept 2 rows: target features of positions 7, 8 with other tokens.
        upd = draft.extend(features[:, 7:9], tokens[:, 9:11], torch.tensor([[7, 8]]),
                           torch.tensor([2], dtype=torch.int32), cache, length, project=True)
    f = features[0].double() @ w_fc.T
    want = eager_rows(state, config, f[:7], tokens[0, :7], torch.arange(7))
    torch.testing.assert_close(pre[0].double(), want, atol=2e-4, rtol=2e-4)
    chain_hidden = torch.cat([f[:7], pre[0, -1:].double(), s1[0].double()])
    chain = eager_rows(state, config, chain_hidden, tokens[0, :9], torch.arange(9))
    torch.testing.assert_close(s1[0, 0].double(), chain[7], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(s2[0, 0].double(), chain[8], atol=2e-4, rtol=2e-4)
    committed = eager_rows(state, config, f[:9], torch.cat([tokens[0, :7], tokens[0, 9:11]]),
                           torch.arange(9))
    torch.testing.assert_close(upd[0].double(), committed[7:], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(draft.compute_logits(upd[0]).double(),
                               eager_logits(state, config, committed[7:]), atol=2e-4, rtol=2e-4)


# --------------------------------------------------------------------------------------------
# Decoding


PROMPTS = [[5, 17, 9], [40, 2, 9, 11, 30, 7, 21], [12], [8, 50, 33, 6]]


@torch.no_grad()
def _pair(family: str, favour_zero: bool = True):
    """A float64 TinyTarget (five feature layers) that often emits token 0, and an Eagle3 draft:
    random, or (``favour_zero``) with ``norm.weight = 0`` so that its logits vanish and it
    proposes token 0 at every step (greedy), which the target often, not always, accepts."""
    torch.manual_seed(0)
    target = TinyTarget(TargetConfig(vocab_size=96, hidden_size=HIDDEN, num_hidden_layers=6,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     intermediate_size=64), LAYERS).double()
    for p in target.parameters():
        p.normal_(0, 0.3)
    target.lm_head.weight[0] = 0.25  # a target whose greedy outputs repeat a few tokens
    # Relabel the most frequent of them as token 0 (swap its embedding and LM-head rows).
    outputs = generate_target_only(target, PROMPTS, 16)
    common = max(range(1, 96), key=lambda t: sum(o.count(t) for o in outputs))
    for weight in (target.embed_tokens.weight, target.lm_head.weight):
        weight[[0, common]] = weight[[common, 0]]
    config = Eagle3Config.from_dict(deepspec_config(family))
    draft = Eagle3Draft(config)
    draft.load_state_dict(random_state(config))
    if favour_zero:
        draft.norm.weight.zero_()
    return target, draft


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
@pytest.mark.parametrize("favour_zero", [True, False])
@pytest.mark.parametrize("block", [1, 5])
def test_greedy_equals_plain_decoding(family, favour_zero, block):
    target, draft = _pair(family, favour_zero)
    expected = generate_target_only(target, PROMPTS, 16)
    out = SpeculativeDecoder(target, draft, block_size=block, scheduler="fixed").generate(
        PROMPTS, 16)
    assert out.tokens == expected
    accepted = [a for r in out.rounds for a in r.accepted]
    if favour_zero and block > 1:
        assert any(a > 0 for a in accepted) and any(a < block for a in accepted)


def test_default_block_is_ttt_length_and_a_scheduler_needs_a_confidence_head():
    target, draft = _pair("qwen3")
    assert SpeculativeDecoder(target, draft, scheduler="fixed").block_size == 5
    assert SpeculativeDecoder(target, draft).scheduler == "fixed"  # no head, no cost table
    with pytest.raises(ValueError, match="confidence head"):
        SpeculativeDecoder(target, draft, scheduler="confidence")


def _chi_square_of_chain(target, draft, prompt, trials, temperature):
    joint = _exact_joint(target, prompt, 2, temperature)
    decoder = SpeculativeDecoder(target, draft, block_size=3, scheduler="fixed")
    out = decoder.generate([prompt] * trials, 2, temperature, torch.arange(trials))
    index = {seq: i for i, seq in enumerate(joint)}
    samples = torch.tensor([index[tuple(t[:2])] for t in out.tokens])
    probs = torch.tensor(list(joint.values()))
    return chi_square(samples, probs / probs.sum()), out


@torch.no_grad()
def _exact_joint(target, prompt, steps, temperature):
    """P(first ``steps`` tokens) of plain sampling at ``temperature``, by enumeration."""
    vocab = target.config.vocab_size
    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in probs.items():
            ids = torch.tensor([prompt + list(prefix)])
            cache = target.new_cache(1, ids.shape[1] + 1)
            logits, _ = target(ids, torch.tensor([ids.shape[1]], dtype=torch.int32), cache,
                               torch.zeros(1, dtype=torch.int32))
            q = torch.softmax(logits[0, -1].double() / temperature, -1)
            for t in range(vocab):
                nxt[prefix + (t,)] = p * float(q[t])
        probs = nxt
    return probs


def test_sampled_tokens_follow_the_target():
    """Sampled chain drafts (from the draft's own softmax(logits / T)), verified: the first two
    tokens of many independent runs are distributed as plain sampling of the target."""
    target, draft = _pair("qwen3", favour_zero=False)
    with torch.no_grad():  # a sharper target, so that a few hundred runs resolve it
        target.lm_head.weight.mul_(3.0)
    stat, out = _chi_square_of_chain(target, draft, [5, 17, 9], 2000, 1.0)
    assert chi_square_passes(*stat)
    assert sum(a for r in out.rounds for a in r.accepted) > 0  # drafts were accepted too



@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chain_drafts_follow_the_drafts_own_softmax(temperature):
    """A chain step's draft, as the decoder samples it (on the draft stream of its position),
    is distributed as softmax(compute_logits(h) / T) of the draft itself."""
    from dspark_ops.models import sample_base_logits

    config = Eagle3Config.from_dict(deepspec_config("gemma4"))
    draft = Eagle3Draft(config)
    draft.load_state_dict(random_state(config))
    trials = 4000
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        logits = draft.compute_logits(torch.randn(1, HIDDEN, generator=gen) * 3)
    out = sample_base_logits(logits.expand(trials, -1)[:, None],
                             torch.full((trials,), temperature), torch.arange(trials),
                             torch.full((trials,), 17))
    probs = torch.softmax(logits[0].double() / temperature, -1)
    assert chi_square_passes(*chi_square(out.tokens[:, 0], probs))
    torch.testing.assert_close(out.draft_logits[:, 0], logits.expand(trials, -1))
    wrong = torch.softmax(logits[0].double() / (2 * temperature), -1)
    assert not chi_square_passes(*chi_square(out.tokens[:, 0], wrong))


def test_chi_square_rejects_chain_drafts_verified_with_the_wrong_logits(monkeypatch):
    """The same test fails when verify is told the drafts came from softmax(logits / T) at a
    temperature other than the one they were sampled at."""
    from dspark_ops.proposers import chain as chain_module

    target, draft = _pair("qwen3", favour_zero=False)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    real = chain_module.sample_base_logits

    def sharper(logits, temperature, seed, position, **filters):
        out = real(logits, temperature, seed, position, **filters)
        return type(out)(out.tokens, out.draft_logits * 3.0)

    monkeypatch.setattr(chain_module, "sample_base_logits", sharper)
    stat, _ = _chi_square_of_chain(target, draft, [5, 17, 9], 2000, 1.0)
    assert not chi_square_passes(*stat)


@pytest.mark.parametrize("kind", ["gemma4", "qwen3"])
def test_greedy_through_hftarget_equals_generate(kind):
    """Tiny transformers targets (Gemma4 with sliding layers, Qwen3), features of three layers:
    chain drafting with a Gemma4 / Qwen3 Eagle3 draft gives the model's own greedy output."""
    transformers = pytest.importorskip("transformers")
    from dspark_ops.hf import HFTarget
    from cases.gemma4 import hf_generate, tiny_gemma

    if kind == "gemma4":
        model = tiny_gemma(transformers, "gemma4", 3)
    else:
        from cases.hf import tiny_model

        model = tiny_model("qwen3", vocab=96)
    hidden = model.config.hidden_size
    layers = [0, 1, 2]
    config = Eagle3Config.from_dict(deepspec_config(
        kind, hidden_size=hidden, target_layer_ids=layers, num_target_layers=4))
    draft = Eagle3Draft(config)
    draft.load_state_dict(random_state(config))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
    expected = hf_generate(model, PROMPTS, 12)
    out = SpeculativeDecoder(HFTarget(model, layers), draft, scheduler="fixed").generate(
        PROMPTS, 12)
    assert out.tokens == expected


def test_eval_command_runs_an_eagle3_draft(tmp_path, capsys):
    pytest.importorskip("transformers")
    from cases.hf import char_tokenizer
    from dspark_ops.eval import main
    from cases.hf import tiny_model

    model = tiny_model("qwen3", vocab=96)
    target_dir, draft_dir = str(tmp_path / "target"), str(tmp_path / "draft")
    model.save_pretrained(target_dir)
    char_tokenizer(96).save_pretrained(target_dir)
    config = Eagle3Config.from_dict(deepspec_config(
        hidden_size=64, target_layer_ids=[0, 1, 2], num_target_layers=4))
    draft = Eagle3Draft(config)
    draft.load_state_dict(random_state(config))
    draft.save_pretrained(draft_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"turns": ["hello there"]}) + "\n"
                    + json.dumps({"turns": ["what is two plus two?"]}) + "\n")
    output = tmp_path / "results.json"
    main(["--target", target_dir, "--draft", draft_dir, "--data", str(data),
          "--max-new-tokens", "12", "--scheduler", "fixed", "--device", "cpu", "--dtype",
          "float64", "--batch-size", "2", "--output", str(output), "--no-progress"])
    result = json.loads(output.read_text())
    row = result["results"][0]
    assert result["settings"]["draft_kind"] == "eagle3"
    assert result["settings"]["block_size"] == 5  # ttt_length
    assert row["greedy_identical_to_plain"] is True and row["mean_verified_drafts"] == 5.0


# --------------------------------------------------------------------------------------------
# The TTT loss without [B, L, V] logits: the chunked soft cross-entropy against the eager one


def _soft_ce_inputs(rows=7, width=5, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(rows, width, generator=g, dtype=torch.float64)
    row_weights = torch.rand(rows, generator=g, dtype=torch.float64, requires_grad=True)
    return hidden, weight, target, row_weights


def _eager_soft_ce(hidden, weight, target, row_weights, target_weight, cap):
    capped = (lambda x: x) if cap is None else (lambda x: torch.tanh(x / cap) * cap)
    q = torch.softmax(capped(target @ target_weight.T), -1)
    log_p = torch.log_softmax(capped(hidden @ weight.T), -1)
    return (-(q * log_p).sum(-1) * row_weights).sum()


@pytest.mark.parametrize("cap", [None, 2.0])
def test_soft_cross_entropy_values_and_gradcheck(cap):
    """float64: the chunked loss (3 rows a chunk over 7: a short last chunk) is the eager
    formula, and its gradients in the hidden rows, the head and the row weights pass
    gradcheck; the acceptance is 1 - TV of the two distributions."""
    from dspark_ops.train.loss import soft_cross_entropy

    hidden, weight, target, row_weights = _soft_ce_inputs()
    target_weight = weight.detach().clone()  # the target's head: a constant

    def chunked(h, w, r):
        return soft_cross_entropy(h, w, target, r, cap=cap, target_weight=target_weight,
                                  chunk_rows=3)[0]

    want = _eager_soft_ce(hidden, weight, target, row_weights, target_weight, cap)
    torch.testing.assert_close(chunked(hidden, weight, row_weights), want, rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(chunked, (hidden, weight, row_weights))
    _, accept = soft_cross_entropy(hidden, weight, target, row_weights, cap=cap, chunk_rows=3)
    capped = (lambda x: x) if cap is None else (lambda x: torch.tanh(x / cap) * cap)
    p = torch.softmax(capped(hidden @ weight.T), -1)
    q = torch.softmax(capped(target @ weight.T), -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(accept, (1 - tv).float().detach())
    assert not accept.requires_grad


def test_soft_cross_entropy_gradcheck_catches_a_missing_cap_derivative(monkeypatch):
    """The same gradcheck fails when the backward forgets the cap's 1 - tanh^2."""
    from torch.autograd.gradcheck import GradcheckError

    import dspark_ops.train.loss as loss_module

    monkeypatch.setattr(loss_module, "_chunk_logit_grad",
                        lambda z, p, q, w, cap: (p * q.sum(-1, keepdim=True) - q) * w[:, None])
    hidden, weight, target, row_weights = _soft_ce_inputs()
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(
            lambda h: loss_module.soft_cross_entropy(h, weight.detach(), target, row_weights,
                                                     cap=2.0, chunk_rows=3)[0], (hidden,))


def test_soft_cross_entropy_argument_checks():
    from dspark_ops.train.loss import soft_cross_entropy

    hidden, weight, target, row_weights = (t.detach() for t in _soft_ce_inputs())
    cases = [
        ((hidden[:, :4], weight, target, row_weights), {}, "hidden must be"),
        ((hidden, weight, target[:3], row_weights), {}, "target_hidden must have"),
        ((hidden, weight, target, row_weights[:3]), {}, "row_weights must be"),
        ((hidden, weight, target, row_weights), {"target_weight": weight[:4]}, "target_weight"),
        ((hidden, weight, target, row_weights), {"cap": 0.0}, "cap must be"),
        ((hidden, weight, target, row_weights), {"chunk_rows": 0}, "chunk_rows must be"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            soft_cross_entropy(*args, **kwargs)


def _ttt_case(family: str):
    """A float64 Eagle3 draft (frozen embedding and head, as trained) and a ragged batch: rows
    of 13, 9 and 5 valid tokens, a random loss mask."""
    config = Eagle3Config.from_dict(deepspec_config(family))
    draft = Eagle3Draft(config)
    draft.load_state_dict(random_state(config))
    draft = draft.double()
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    batch, length = 3, 13
    ids = torch.randint(0, 96, (batch, length), generator=g)
    features = torch.randn(batch, length, 5 * HIDDEN, generator=g, dtype=torch.float64)
    last = torch.randn(batch, length, HIDDEN, generator=g, dtype=torch.float64)
    valid = torch.arange(length)[None] < torch.tensor([[13], [9], [5]])
    loss_mask = (torch.rand(batch, length, generator=g) < 0.8).float()
    return draft, (ids, features, loss_mask, last, valid)


def _ttt_run(draft, inputs, fused: bool):
    from dspark_ops.train.eagle3 import eagle3_ttt_loss

    draft.zero_grad()
    out = eagle3_ttt_loss(draft, *inputs, fused=fused, chunk_rows=4)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


def _assert_ttt_equal(got, want):
    """Loss, per-step losses, metrics and every trainable parameter's gradient; the eager loss
    is float32 (its logits are cast), hence float32 tolerances."""
    (a, grads_a), (b, grads_b) = got, want
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.loss, b.loss, **tol)
    torch.testing.assert_close(a.step_losses, b.step_losses, **tol)
    torch.testing.assert_close(a.accept_sum, b.accept_sum, **tol)
    torch.testing.assert_close(a.accept_count, b.accept_count, rtol=0, atol=0)
    torch.testing.assert_close(a.tau_sum, b.tau_sum, **tol)
    torch.testing.assert_close(a.row_count, b.row_count, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_b:
        scale = grads_b[name].abs().max().clamp_min(1e-30)  # all-zero gradients compare as 0
        torch.testing.assert_close(grads_a[name] / scale, grads_b[name] / scale, rtol=0,
                                   atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_fused_ttt_loss_equals_the_eager_one(family):
    """The TTT loss through the chunked soft cross-entropy (Gemma4: with its logit cap) gives
    the eager formula's loss, per-step losses, acceptance metrics and gradients."""
    draft, inputs = _ttt_case(family)
    _assert_ttt_equal(_ttt_run(draft, inputs, True), _ttt_run(draft, inputs, False))


def test_fused_ttt_loss_without_trained_rows():
    """A batch with no trained token: no row enters the chunked loss at any step; the loss,
    the metrics and every gradient are zero, as the eager formula's."""
    draft, (ids, features, loss_mask, last, valid) = _ttt_case("qwen3")
    inputs = (ids, features, torch.zeros_like(loss_mask), last, valid)
    got = _ttt_run(draft, inputs, True)
    _assert_ttt_equal(got, _ttt_run(draft, inputs, False))
    assert float(got[0].loss.detach()) == 0 and all(not g.any() for g in got[1].values())


@pytest.mark.parametrize("broken", ["step_weight", "target_row"])
def test_ttt_comparison_catches_a_broken_fused_step(monkeypatch, broken):
    """The same comparison fails for a fused step with a wrong weight (0.8 ** (k + 1) instead
    of 0.8 ** k) or with each row learning the next row's target."""
    import dspark_ops.train.eagle3 as eagle3_module

    draft, inputs = _ttt_case("qwen3")
    want = _ttt_run(draft, inputs, False)
    real = eagle3_module.soft_cross_entropy

    def wrong(hidden, weight, target, row_weights, **kwargs):
        if broken == "step_weight":
            row_weights = row_weights * draft.config.step_loss_decay
        else:
            target = torch.roll(target, 1, 0)
        return real(hidden, weight, target, row_weights, **kwargs)

    monkeypatch.setattr(eagle3_module, "soft_cross_entropy", wrong)
    with pytest.raises(AssertionError):
        _assert_ttt_equal(_ttt_run(draft, inputs, True), want)


def _saved_vocabulary_rows(draft, inputs, fused: bool) -> int:
    """Elements of the tensors autograd saves for the TTT backward whose last dimension is the
    vocabulary (no other dimension of the tiny case is 96)."""
    from dspark_ops.train.eagle3 import eagle3_ttt_loss

    saved = []

    def pack(t):
        if t.dim() and t.shape[-1] == draft.config.vocab_size:
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eagle3_ttt_loss(draft, *inputs, fused=fused, chunk_rows=4)
    return sum(saved)


def test_fused_ttt_loss_saves_no_vocabulary_wide_tensor():
    """Nothing of width V is kept for the backward by the fused loss (the frozen head is
    [V, d]), whereas the eager one keeps [B, L, V] tensors at every step."""
    draft, inputs = _ttt_case("qwen3")
    batch, length = inputs[0].shape
    assert _saved_vocabulary_rows(draft, inputs, True) == 0
    steps = draft.config.ttt_length
    assert _saved_vocabulary_rows(draft, inputs, False) >= steps * batch * length * 96


# --------------------------------------------------------------------------------------------
# Training: python -m dspark_ops.train --arch eagle3


def test_eagle3_training_learns_and_its_checkpoint_decodes(tmp_path):
    pytest.importorskip("transformers")
    from cases.training import read_metrics, save_target, train_args, write_greedy_data
    from dspark_ops.hf import HFTarget
    from dspark_ops.train.trainer import main
    from transformers import AutoModelForCausalLM

    target = save_target(str(tmp_path / "target"))
    data = write_greedy_data(target, str(tmp_path / "data.jsonl"), count=20, new_tokens=32)
    out = str(tmp_path / "eagle3")
    main(train_args(target, data, out, "--arch", "eagle3", "--max-steps", "20", "--lr",
                    "3e-3"))
    rows = read_metrics(out)
    first, last = rows[:4], rows[-4:]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss"), [r["loss"] for r in rows]
    assert mean(last, "tau_probabilistic") > mean(first, "tau_probabilistic")
    assert all(r["loss"] == pytest.approx(r["ce"]) and r["l1"] == 0 for r in rows)
    assert rows[-1]["accept_rate@3"] is not None  # one rate per TTT step (--block-size 4)
    step = os.path.join(out, "step_latest")
    config = json.load(open(os.path.join(step, "config.json")))
    assert config["architectures"] == ["Qwen3Eagle3Model"] and config["ttt_length"] == 4
    assert config["target_layer_ids"] == [0, 2] and config["step_loss_decay"] == 0.8
    draft = load_draft(step)
    assert isinstance(draft, Eagle3Draft)
    model = AutoModelForCausalLM.from_pretrained(target, attn_implementation="sdpa").eval()
    assert torch.equal(draft.lm_head.weight, model.get_output_embeddings().weight)
    model.generation_config.eos_token_id = None
    hf = HFTarget(model, draft.config.target_layer_ids)
    prompts = [[5, 6, 7, 8], [9, 10]]
    out_tokens = SpeculativeDecoder(hf, draft, scheduler="fixed").generate(prompts, 12)
    assert out_tokens.tokens == generate_target_only(hf, prompts, 12)


def test_eagle3_training_on_a_gemma4_target(tmp_path):
    """A Gemma4 target gets a Gemma4 Eagle3 draft (its text config copied): the loss falls and
    the checkpoint is a Gemma4Eagle3Model that decodes losslessly."""
    transformers = pytest.importorskip("transformers")
    from cases.gemma4 import training_target_and_data
    from dspark_ops.hf import HFTarget
    from dspark_ops.train.trainer import main

    model, target, data = training_target_and_data(transformers, tmp_path)
    out = str(tmp_path / "run")
    main(["--target", target, "--data", data, "--out", out, "--arch", "eagle3",
          "--block-size", "4", "--target-layers", "0", "1", "2", "--batch-tokens", "256",
          "--device", "cpu", "--dtype", "float32", "--no-progress", "--min-loss-tokens", "4",
          "--max-steps", "16", "--lr", "3e-3"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert (sum(r["loss"] for r in metrics[-4:]) < sum(r["loss"] for r in metrics[:4])), \
        [r["loss"] for r in metrics]
    draft = load_draft(os.path.join(out, "step_latest"))
    assert draft.config.family == "gemma4" and draft.config.head_dim == 32
    assert draft.config.final_logit_softcapping == 30.0
    hf = HFTarget(model.eval(), draft.config.target_layer_ids)
    model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8], [9, 10]]
    got = SpeculativeDecoder(hf, draft, scheduler="fixed").generate(prompts, 12).tokens
    assert got == generate_target_only(hf, prompts, 12)
