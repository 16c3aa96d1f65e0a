"""The end-to-end decoder: greedy identity with plain target decoding, sampled
losslessness by a chi-square test on the joint distribution of the first tokens (and a broken
variant that fails it), acceptance of an exact draft, EOS, batch invariance, the checkpoint
loader and the demo."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import struct

import pytest
import torch

from dspark_ops import reference
from dspark_ops import steps as steps_module
from dspark_ops.decoder import SpeculativeDecoder, synthetic_step_rate, generate_target_only
from dspark_ops.demo import main as demo_main
from dspark_ops.demo import tiny_pair
from dspark_ops.models import DSparkConfig, DSparkDraft, load_state_dict_file, sample_base_logits
from conftest import cuda_only
from stats import chi_square_of_tokens, chi_square_passes, exact_joint

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def pair():
    """A float64 target (so no float near-tie can split two decodings) and a partial draft."""
    return tiny_pair(vocab=64, block_size=5, context=0.2, noise=0.3, target_dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# Greedy: identical to plain decoding


@pytest.mark.parametrize("scheduler", ["confidence", "budget", "fixed"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block", [1, 4, 7])
def test_greedy_equals_plain_decoding(pair, scheduler, batch, block):
    target, draft = pair
    prompts = PROMPTS[:batch]
    expected = generate_target_only(target, prompts, 20)
    out = SpeculativeDecoder(target, draft, block_size=block, scheduler=scheduler).generate(
        prompts, 20)
    assert out.tokens == expected
    assert all(len(t) == 20 for t in out.tokens)
    # Rounds use fewer target forwards than tokens once drafts get accepted.
    accepted = sum(a for r in out.rounds for a in r.accepted)
    assert len(out.rounds) + 1 + accepted >= 20
    for r in out.rounds:
        assert all(0 <= a <= n <= block for a, n in zip(r.accepted, r.num_verify))
        assert r.verify_tokens == sum(1 + n for n in r.num_verify)


def test_greedy_rnn_head_equals_plain_decoding():
    target, draft = tiny_pair(vocab=64, block_size=4, context=0.1, noise=0.1,
                              target_dtype=torch.float64, markov_head_type="rnn")
    expected = generate_target_only(target, PROMPTS, 16)
    out = SpeculativeDecoder(target, draft).generate(PROMPTS, 16)
    assert out.tokens == expected
    assert out.mean_accepted_length > 1.2  # the RNN head's table drafts well


@cuda_only
def test_greedy_equals_plain_decoding_on_cuda():
    """The same round on the GPU (bfloat16 draft: tensor-core Markov head and 16-bit attention)."""
    target, draft = tiny_pair(vocab=64, block_size=5, context=0.2, noise=0.3,
                              target_dtype=torch.float64, device="cuda")
    expected = generate_target_only(target, PROMPTS, 20)
    out = SpeculativeDecoder(target, draft).generate(PROMPTS, 20)
    assert out.tokens == expected
    sampled = SpeculativeDecoder(target, draft).generate(PROMPTS, 20, 1.0, torch.arange(4))
    assert all(len(t) == 20 for t in sampled.tokens)


def _dflash(draft):
    """The same backbone without the sequential and confidence heads (a DFlash draft); its
    final norm is re-randomised so that the base logits are not all zero."""
    config = dataclasses.replace(draft.config, markov_rank=0, enable_confidence_head=False)
    dflash = DSparkDraft(config).to(draft.fc.weight.dtype)
    state = {k: v for k, v in draft.state_dict().items()
             if not k.startswith(("markov_head.", "confidence_head."))}
    dflash.load_state_dict(state, strict=True)
    with torch.no_grad():
        dflash.norm.weight.copy_(torch.randn(dflash.norm.weight.shape,
                                             generator=torch.Generator().manual_seed(5)))
    return dflash


@pytest.mark.parametrize("block", [1, 5])
def test_dflash_draft_greedy_equals_plain_decoding(pair, block):
    target, draft = pair
    dflash = _dflash(draft)
    expected = generate_target_only(target, PROMPTS, 20)
    out = SpeculativeDecoder(target, dflash, block_size=block, scheduler="fixed").generate(
        PROMPTS, 20)
    assert out.tokens == expected
    with pytest.raises(ValueError, match="confidence head"):
        SpeculativeDecoder(target, dflash, scheduler="confidence")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filters", [False, True])
def test_dflash_sampler_is_markov_draft_with_a_zero_head(dtype, filters):
    """A DFlash draft's proposal: the reference Markov head with W1 = W2 = 0, bit for bit (tokens
    and draft logits), greedy and sampled requests mixed; the draft logits are the base logits."""
    gen = torch.Generator().manual_seed(11)
    batch, block, vocab = 6, 5, 1000
    base = (3 * torch.randn(batch, block, vocab, generator=gen)).to(dtype)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.0, 1.0])
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    position = torch.randint(0, 2**40, (batch,), generator=gen)
    kwargs = {}
    if filters:
        kwargs = dict(top_k=torch.tensor([0, 5, 50, 0, 3, 0], dtype=torch.int32),
                      top_p=torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.8]),
                      min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1]))
    got = sample_base_logits(base, temperature, seed, position, **kwargs)
    zero = torch.zeros(vocab, 1)
    want = reference.markov_draft(base, torch.zeros(batch, dtype=torch.int64), zero, zero,
                                  temperature, seed, position, **kwargs)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.draft_logits, want.draft_logits)
    if not filters:
        assert torch.equal(got.draft_logits, base.float())


def test_exact_draft_is_always_accepted():
    """A bigram target drafted by its own table: every draft is accepted (tau = G + 1)."""
    target, draft = tiny_pair(vocab=64, block_size=6, context=0.0, noise=0.0,
                              target_dtype=torch.float64)
    out = SpeculativeDecoder(target, draft, scheduler="fixed").generate(
        PROMPTS, 36, temperature=1.0, seed=torch.arange(4))
    accepted = [a for r in out.rounds for a in r.accepted]
    assert sum(accepted) / len(accepted) > 0.97 * 6
    assert out.mean_accepted_length > 0.97 * 7


def test_eos_ends_a_request_mid_block(pair):
    target, draft = pair
    plain = generate_target_only(target, PROMPTS, 20)
    # An EOS id that request 1 emits mid-way; the others keep going (or stop at it too).
    eos = plain[1][7]
    expected = generate_target_only(target, PROMPTS, 20, eos_token_id=eos)
    out = SpeculativeDecoder(target, draft, block_size=6, eos_token_id=eos).generate(PROMPTS, 20)
    assert out.tokens == expected
    assert out.tokens[1][-1] == eos and len(out.tokens[1]) <= 8
    for tokens in out.tokens:
        assert eos not in tokens[:-1]


def test_plain_decoding_runs_one_forward_per_token(pair, monkeypatch):
    """The prefill gives the first token and each later token one forward; none after the
    last."""
    target, _ = pair
    calls = []
    forward = type(target).__call__
    monkeypatch.setattr(type(target), "__call__",
                        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    tokens = generate_target_only(target, PROMPTS[:1], 9)
    assert len(tokens[0]) == 9 and len(calls) == 9


def test_batch_invariance_with_fixed_schedule(pair):
    """A request's sampled output depends only on its prompt, temperature and seed."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, scheduler="fixed")
    together = decoder.generate(PROMPTS, 12, temperature=0.8, seed=torch.tensor([5, 6, 7, 8]))
    alone = decoder.generate(PROMPTS[2:3], 12, temperature=0.8, seed=torch.tensor([7]))
    assert together.tokens[2] == alone.tokens[0]
    swapped = decoder.generate(PROMPTS[::-1], 12, temperature=0.8, seed=torch.tensor([8, 7, 6, 5]))
    assert swapped.tokens[::-1] == together.tokens


def test_seed_none_draws_from_generator(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft)
    first = decoder.generate(PROMPTS, 8, 1.0, generator=torch.Generator().manual_seed(3))
    again = decoder.generate(PROMPTS, 8, 1.0, generator=torch.Generator().manual_seed(3))
    assert first.tokens == again.tokens


def test_bad_arguments(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="scheduler must be one of"):
        SpeculativeDecoder(target, draft, scheduler="greedy")
    with pytest.raises(ValueError, match="at least one token"):
        SpeculativeDecoder(target, draft).generate([[1], []], 4)


# --------------------------------------------------------------------------------------------
# Sampling: the joint distribution of the first tokens is the target's


def _chi_square_of_decoder(decoder, target, prompt, steps, trials, temperature, **filters):
    out = decoder.generate([prompt] * trials, steps, temperature, torch.arange(trials), **filters)
    return chi_square_of_tokens(out.tokens, target, prompt, steps, temperature, **filters), out


@pytest.mark.parametrize("scheduler", ["confidence", "budget", "dflash"])
def test_sampled_tokens_follow_the_target(scheduler):
    target, draft = tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                              target_dtype=torch.float64)
    if scheduler == "dflash":  # no Markov head: drafts drawn from the base logits
        draft, scheduler = _dflash(draft), "fixed"
    trials = 12000
    # Each verified token per request costs 30% of a step: the scheduler is selective.
    step_rate = synthetic_step_rate(trials * 5 + 1, trials, cost_per_token=0.3)
    decoder = SpeculativeDecoder(target, draft, scheduler=scheduler, step_rate=step_rate)
    (chi2, df), out = _chi_square_of_decoder(decoder, target, [1, 2, 3], 3, trials, 1.0)
    assert chi_square_passes(chi2, df), (chi2, df)
    # The draft is partial: some drafts are accepted, some rejected (both paths exercised).
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    if scheduler == "fixed":  # the DFlash draft: every draft verified
        assert 0 < accepted < verified
        return
    assert 0.2 * verified < accepted < 0.95 * verified
    assert 0 < verified < 4 * len(out.rounds[0].accepted) * len(out.rounds)  # some, not all


@pytest.mark.parametrize("scheduler", ["confidence", "dflash"])
def test_filtered_sampling_follows_the_filtered_target(scheduler):
    # top-k, top-p and min-p in generate: drafts and verification filtered alike, the output
    # distributed as the filtered target; the same check rejects the unfiltered target.
    target, draft = tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                              target_dtype=torch.float64)
    if scheduler == "dflash":
        draft, scheduler = _dflash(draft), "fixed"
    decoder = SpeculativeDecoder(target, draft, scheduler=scheduler)
    filters = dict(top_k=5, top_p=0.85, min_p=0.05)
    (chi2, df), out = _chi_square_of_decoder(decoder, target, [1, 2, 3], 3, 12000, 1.0, **filters)
    assert chi_square_passes(chi2, df), (chi2, df)
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    assert 0 < accepted < verified
    chi2, df = chi_square_of_tokens(out.tokens, target, [1, 2, 3], 3, 1.0)  # unfiltered
    assert not chi_square_passes(chi2, df), (chi2, df)
    plain = generate_target_only(target, [[1, 2, 3]] * 8, 6, 1.0, torch.arange(8), **filters)
    assert all(len(t) == 6 for t in plain)


def test_chi_square_rejects_a_decoder_with_misaligned_draft_logits(monkeypatch):
    """The same check fails when verify gets the draft logits one slot off (each draft judged
    against the next slot's proposal distribution). Passing no draft logits at all would not be
    such a bug: a sampled draft treated as a fixed one-hot proposal is still verified
    losslessly, only with a lower acceptance."""
    target, draft = tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                              target_dtype=torch.float64)
    real_verify = steps_module.verify

    def verify_with_shifted_draft_logits(*args, draft_logits=None, **kwargs):
        if draft_logits is not None:  # (the prefill's draw has no drafts)
            draft_logits = draft_logits.roll(1, dims=1)
        return real_verify(*args, draft_logits=draft_logits, **kwargs)

    monkeypatch.setattr(steps_module, "verify", verify_with_shifted_draft_logits)
    decoder = SpeculativeDecoder(target, draft, scheduler="fixed")
    (chi2, df), _ = _chi_square_of_decoder(decoder, target, [1, 2, 3], 3, 12000, 1.0)
    assert not chi_square_passes(chi2, df), (chi2, df)


# --------------------------------------------------------------------------------------------
# The draft model's checkpoint format


def _qwen3_dspark_config(**changes):
    values = dict(vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64, intermediate_size=96, num_hidden_layers=2,
                  target_layer_ids=[1, 3, 5], block_size=7, mask_token_id=95, markov_rank=16,
                  markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True, rms_norm_eps=1e-6, rope_theta=1e6,
                  architectures=["Qwen3DSparkModel"], torch_dtype="bfloat16", num_anchors=512)
    values.update(changes)
    return values


def test_parameter_names_follow_deepspec_checkpoints():
    model = DSparkDraft(DSparkConfig.from_dict(_qwen3_dspark_config()))
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    expected = {"embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
                "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                "confidence_head.proj.weight", "confidence_head.proj.bias"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in layer}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert set(shapes) == expected
    assert shapes["fc.weight"] == (64, 3 * 64)
    assert shapes["markov_head.markov_w1.weight"] == (96, 16)
    assert shapes["markov_head.markov_w2.weight"] == (96, 16)
    assert shapes["confidence_head.proj.weight"] == (1, 64 + 16)
    rnn = DSparkDraft(DSparkConfig.from_dict(_qwen3_dspark_config(markov_head_type="rnn")))
    assert tuple(rnn.state_dict()["markov_head.joint_proj.weight"].shape) == (48, 2 * 16 + 64)
    assert tuple(rnn.state_dict()["markov_head.joint_proj.bias"].shape) == (48,)


def _write_safetensors(path, tensors):
    """The safetensors format: little-endian header size, JSON header, raw little-endian data."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_loads_a_checkpoint_strictly(tmp_path, fmt, dtype):
    config = _qwen3_dspark_config()
    source = DSparkDraft(DSparkConfig.from_dict(config))
    state = {k: (torch.randn_like(v) * 0.1).to(dtype) for k, v in source.state_dict().items()}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    if fmt == "safetensors":
        _write_safetensors(os.path.join(tmp_path, "model.safetensors"), state)
    else:
        torch.save(state, os.path.join(tmp_path, "model.pt"))
    model = DSparkDraft.from_pretrained(str(tmp_path), dtype=dtype)
    assert model.config.markov_rank == 16 and model.config.target_layer_ids == (1, 3, 5)
    loaded = model.state_dict()
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name
    assert load_state_dict_file(os.path.join(tmp_path, f"model.{fmt}")).keys() == state.keys()


def test_from_pretrained_rejects_mismatched_checkpoints(tmp_path):
    config = _qwen3_dspark_config()
    state = DSparkDraft(DSparkConfig.from_dict(config)).state_dict()
    state.pop("confidence_head.proj.bias")
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    torch.save(state, os.path.join(tmp_path, "model.pt"))
    with pytest.raises(RuntimeError, match="confidence_head.proj.bias"):
        DSparkDraft.from_pretrained(str(tmp_path))
    os.remove(os.path.join(tmp_path, "model.pt"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DSparkDraft.from_pretrained(str(tmp_path))


def test_gated_markov_head_is_refused():
    with pytest.raises(ValueError, match="markov_head_type"):
        DSparkDraft(DSparkConfig.from_dict(_qwen3_dspark_config(markov_head_type="gated")))


def _transformers5_config(**changes):
    """The same draft as DeepSpec writes it under transformers 5.x: the RoPE base only inside
    ``rope_parameters``, plus the fields a copied Qwen3Config carries."""
    values = _qwen3_dspark_config(**changes)
    theta = values.pop("rope_theta")
    values.pop("torch_dtype")
    values.update(rope_parameters={"rope_theta": theta, "rope_type": "default"}, dtype="bfloat16",
                  model_type="qwen3", hidden_act="silu", tie_word_embeddings=False,
                  layer_types=["full_attention"] * values["num_hidden_layers"],
                  use_sliding_window=False, sliding_window=None, max_window_layers=28,
                  attention_dropout=0.0, attention_bias=False, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, initializer_range=0.02, use_cache=True,
                  max_position_embeddings=40960, num_target_layers=6,
                  transformers_version="5.10.2")
    return values


def test_config_reads_the_rope_base_of_both_layouts():
    assert DSparkConfig.from_dict(_qwen3_dspark_config(rope_theta=5e5)).rope_theta == 5e5
    assert DSparkConfig.from_dict(_transformers5_config(rope_theta=2.5e4)).rope_theta == 2.5e4
    # transformers 4.x with an explicit plain RoPE entry.
    legacy = _qwen3_dspark_config(rope_theta=3e4, rope_scaling={"type": "default"})
    assert DSparkConfig.from_dict(legacy).rope_theta == 3e4


@pytest.mark.parametrize("changes, field", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
    (dict(rope_scaling={"rope_type": "default", "factor": 4.0}), "rope_scaling.factor"),
    (dict(rope_theta=None), "rope_theta"),
    (dict(markov_head_type="gated"), "markov_head_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(model_type="llama"), "model_type"),
    (dict(architectures=["Qwen3Eagle3Model"]), "architectures"),
    (dict(target_layer_ids=[3, 1]), "target_layer_ids"),
    (dict(target_layer_ids=[1, 3, 6], num_target_layers=6), "target_layer_ids"),
    (dict(markov_rank=0, confidence_head_with_markov=True), "confidence_head_with_markov"),
])
def test_unsupported_config_fields_fail_with_their_name(changes, field):
    values = _qwen3_dspark_config(**changes)
    values = {k: v for k, v in values.items() if v is not None}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        DSparkConfig.from_dict(values)


def test_config_requires_deepspec_fields():
    values = _qwen3_dspark_config()
    del values["markov_head_type"]
    with pytest.raises(ValueError, match="markov_head_type"):
        DSparkConfig.from_dict(values)
    values = _qwen3_dspark_config()
    del values["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        DSparkConfig.from_dict(values)
    with pytest.warns(UserWarning, match="some_new_field"):
        DSparkConfig.from_dict(_qwen3_dspark_config(some_new_field=1))


def test_rope_base_changes_the_draft_hidden_states():
    """The RoPE base read from rope_parameters is the one the attention uses."""
    torch.manual_seed(0)
    hidden = []
    for theta in (1e6, 1e4):
        config = DSparkConfig.from_dict(_transformers5_config(rope_theta=theta))
        torch.manual_seed(0)
        draft = DSparkDraft(config).eval()
        k, v = draft.new_caches(1, 16)
        seqlens = torch.zeros(1, dtype=torch.int32)
        torch.manual_seed(1)
        features = torch.randn(1, 9, 3 * 64)
        block = torch.randn(1, 4, 64)
        with torch.no_grad():
            draft.append_context(features, None, torch.tensor([9], dtype=torch.int32), k, v,
                                 seqlens)
            hidden.append(draft(block, None, k, v, seqlens))
    assert not torch.allclose(hidden[0], hidden[1], atol=1e-3)


@pytest.mark.parametrize("kind", ["dspark", "rnn", "dflash"])
def test_save_pretrained_round_trips(tmp_path, kind):
    changes = {"dspark": {}, "rnn": dict(markov_head_type="rnn"),
               "dflash": dict(markov_rank=0, enable_confidence_head=False)}[kind]
    values = _transformers5_config(rope_theta=5e5, **changes)
    if kind == "dflash":  # as DeepSpec writes a DFlash draft: neither head's field
        del values["markov_head_type"], values["confidence_head_with_markov"]
    source = DSparkDraft(DSparkConfig.from_dict(values)).to(torch.bfloat16)
    source.save_pretrained(str(tmp_path))
    with open(os.path.join(tmp_path, "config.json")) as f:
        written = json.load(f)
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    assert "rope_theta" not in written and written["dtype"] == "bfloat16"
    assert written["num_target_layers"] == 6 and written["architectures"] == ["Qwen3DSparkModel"]
    assert ("markov_head_type" in written) == (kind != "dflash")
    assert ("confidence_head_with_markov" in written) == (kind != "dflash")
    loaded = DSparkDraft.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.config == source.config
    assert loaded.markov_head is None if kind == "dflash" else loaded.markov_head is not None
    for name, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


# --------------------------------------------------------------------------------------------
# The demo


def test_demo_runs(capsys):
    demo_main(["--device", "cpu", "--batch", "2", "--max-new-tokens", "12", "--temperature", "0"])
    printed = capsys.readouterr().out
    assert "mean accepted length" in printed
    assert "greedy output identical to plain target decoding: True" in printed
