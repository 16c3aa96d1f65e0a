"""The end-to-end decoder (SPEC §1, §3.6): greedy identity with plain target decoding, sampled
losslessness by a chi-square test on the joint distribution of the first tokens (and a broken
variant that fails it), acceptance of an exact draft, EOS, batch invariance, the checkpoint
loader and the demo."""

from __future__ import annotations

import itertools
import json
import os
import struct

import pytest
import torch

from dspark_ops import decoder as decoder_module
from dspark_ops.decoder import SpeculativeDecoder, default_step_rate, generate_target_only
from dspark_ops.demo import main as demo_main
from dspark_ops.demo import tiny_pair
from dspark_ops.models import DSparkConfig, DSparkDraft, load_state_dict_file
from conftest import cuda_only
from stats import chi_square, chi_square_passes

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


@torch.no_grad()
def _exact_joint(target, prompt, steps, temperature):
    """P(y_1..y_steps | prompt) for every sequence, by running the target on every prefix."""
    vocab = target.config.vocab_size
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        rows = [prompt + list(p) for p in prefixes]
        length = len(rows[0])
        ids = torch.tensor(rows)
        k, v = target.new_cache(len(rows), length)
        zeros = torch.zeros(len(rows), dtype=torch.int32)
        logits = target(ids, zeros + length, k, v, zeros)[0][:, -1].double()
        probs = torch.softmax(logits / temperature, -1)
        joint = {p + (y,): joint[p] * float(probs[i, y])
                 for i, p in enumerate(prefixes) for y in range(vocab)}
    return joint


def _chi_square_of_decoder(decoder, target, prompt, steps, trials, temperature):
    out = decoder.generate([prompt] * trials, steps, temperature, torch.arange(trials))
    joint = _exact_joint(target, prompt, steps, temperature)
    index = {seq: i for i, seq in enumerate(joint)}
    samples = torch.tensor([index[tuple(t[:steps])] for t in out.tokens])
    probs = torch.tensor(list(joint.values()))
    return chi_square(samples, probs / probs.sum()), out


@pytest.mark.parametrize("scheduler", ["confidence", "budget"])
def test_sampled_tokens_follow_the_target(scheduler):
    target, draft = tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                              target_dtype=torch.float64)
    trials = 12000
    # Each verified token per request costs 30% of a step: the scheduler is selective.
    step_rate = default_step_rate(trials * 5 + 1, trials, cost_per_token=0.3)
    decoder = SpeculativeDecoder(target, draft, scheduler=scheduler, step_rate=step_rate)
    (chi2, df), out = _chi_square_of_decoder(decoder, target, [1, 2, 3], 3, trials, 1.0)
    assert chi_square_passes(chi2, df), (chi2, df)
    # The draft is partial: some drafts are accepted, some rejected (both paths exercised).
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    assert 0.2 * verified < accepted < 0.95 * verified
    assert 0 < verified < 4 * len(out.rounds[0].accepted) * len(out.rounds)  # some, not all


def test_chi_square_rejects_a_decoder_with_misaligned_draft_logits(monkeypatch):
    """The same check fails when verify gets the draft logits one slot off (each draft judged
    against the next slot's proposal distribution). Passing no draft logits at all would not be
    such a bug: a sampled draft treated as a fixed one-hot proposal is still verified
    losslessly, only with a lower acceptance."""
    target, draft = tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                              target_dtype=torch.float64)
    real_verify = decoder_module.verify

    def verify_with_shifted_draft_logits(*args, draft_logits=None, **kwargs):
        if draft_logits is not None:  # (the prefill's draw has no drafts)
            draft_logits = draft_logits.roll(1, dims=1)
        return real_verify(*args, draft_logits=draft_logits, **kwargs)

    monkeypatch.setattr(decoder_module, "verify", verify_with_shifted_draft_logits)
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


# --------------------------------------------------------------------------------------------
# The demo


def test_demo_runs(capsys):
    demo_main(["--device", "cpu", "--batch", "2", "--max-new-tokens", "12", "--temperature", "0"])
    printed = capsys.readouterr().out
    assert "mean accepted length" in printed
    assert "greedy output identical to plain target decoding: True" in printed
