"""dspark_ops.hf and the generate / eval commands on tiny random transformers models (no
downloads): greedy output identical to the model's own generate(do_sample=False), sampled output
distributed as the model's own sampling (chi-square), DeepSpec's feature convention, checkpoints
that transformers reads, and both commands end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from dspark_ops import DSparkConfig, DSparkDraft, SpeculativeDecoder  # noqa: E402
from dspark_ops import decoder as decoder_module  # noqa: E402
from dspark_ops.decoder import synthetic_step_rate, generate_target_only  # noqa: E402
from dspark_ops.hf import HFTarget  # noqa: E402
from cases.hf import LAYERS, VOCAB, char_tokenizer, tiny_model  # noqa: E402
from stats import chi_square, chi_square_passes  # noqa: E402

FEATURES = (-1, 1, LAYERS - 1)  # the embedding output, a middle layer and the (raw) last layer
PROMPTS = [[3, 17, 5], [40, 2, 9, 11, 30, 7, 21], [12], [8, 50, 33, 4]]


pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def table_draft(target: HFTarget, sequences=(), *, head: str = "vanilla", block_size: int = 7,
                seed: int = 1) -> DSparkDraft:
    """A draft whose Markov (or RNN) head is a bigram table of ``sequences`` (e.g. the target's
    own greedy outputs): where a token has one successor there the draft is right, where it has
    several it is sometimes wrong, so both the accept and the reject paths run. The backbone is
    random and shares the target's embedding and LM head; ``head="dflash"``: no heads at all."""
    vocab = target.config.vocab_size
    rank = 0 if head == "dflash" else vocab
    config = DSparkConfig(
        vocab_size=vocab, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
        head_dim=64, intermediate_size=96, num_hidden_layers=1,
        target_layer_ids=target.feature_layers,
        target_hidden_size=64, block_size=block_size, mask_token_id=vocab - 1, markov_rank=rank,
        markov_head_type="rnn" if head == "rnn" else "vanilla",
        enable_confidence_head=head != "dflash", rope_theta=1e6)
    gen = torch.Generator().manual_seed(seed)
    draft = DSparkDraft(config)
    for p in draft.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model = target.model
    draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
    if head == "dflash":
        return draft
    counts = torch.zeros(vocab, vocab)
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:]):
            counts[prev, nxt] += 1
    share = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    table = 8.0 * share + 0.3 * torch.randn(vocab, vocab, generator=gen)  # [prev, next] logits
    draft.norm.weight.zero_()  # h = 0: the base logits vanish and the head carries the draft
    draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
    if head == "rnn":  # o = 3 W1[x], so tanh(o) = tanh(3) one-hot(x)
        joint = draft.markov_head.joint_proj
        joint.weight[2 * vocab:] = 0.0
        joint.weight[2 * vocab:, vocab: 2 * vocab] = 3.0 * torch.eye(vocab)
        joint.bias[2 * vocab:] = 0.0
        table = table / torch.tanh(torch.tensor(3.0))
    draft.markov_head.markov_w2.weight.copy_(table.T)
    proj = draft.confidence_head.proj  # a confidence logit growing with the table's certainty
    proj.weight.zero_()
    proj.weight[0, 64:] = 6.0 * share.max(-1).values - 3.0
    proj.bias.zero_()
    return draft


@pytest.fixture(scope="module")
def qwen3():
    return HFTarget(tiny_model("qwen3"), FEATURES)


@pytest.fixture(scope="module")
def llama():
    return HFTarget(tiny_model("llama", seed=3), FEATURES)


@pytest.fixture(scope="module")
def hf_greedy(qwen3, llama):
    """The transformers model's own greedy output, one prompt at a time (no padding)."""
    results = {}
    for name, target in (("qwen3", qwen3), ("llama", llama)):
        rows = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=20, min_new_tokens=20)
            rows.append(out[0, len(prompt):].tolist())
        results[name] = rows
    return results


# --------------------------------------------------------------------------------------------
# Greedy: token for token the model's own generate


@pytest.mark.parametrize("scheduler", ["confidence", "budget", "fixed"])
@pytest.mark.parametrize("block", [1, 4, 7])
@pytest.mark.parametrize("head", ["vanilla", "rnn"])
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_greedy_equals_transformers_generate(request, hf_greedy, model, head, block, scheduler):
    target = request.getfixturevalue(model)
    draft = table_draft(target, [p + t for p, t in zip(PROMPTS, hf_greedy[model])], head=head)
    out = SpeculativeDecoder(target, draft, block_size=block, scheduler=scheduler).generate(
        PROMPTS, 20)
    assert out.tokens == hf_greedy[model]
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    assert 0 < accepted < verified  # both the accept and the reject paths ran
    if block > 1:
        assert len(out.rounds) < 15  # fewer target forwards than tokens


@pytest.mark.parametrize("model, block", [("qwen3", 7), ("llama", 4)])
def test_greedy_dflash_draft_equals_transformers_generate(request, hf_greedy, model, block):
    """A DFlash draft (random backbone, no heads: its proposals are mostly rejected)."""
    target = request.getfixturevalue(model)
    out = SpeculativeDecoder(target, table_draft(target, head="dflash"), block_size=block,
                             scheduler="fixed").generate(PROMPTS, 20)
    assert out.tokens == hf_greedy[model]


# --------------------------------------------------------------------------------------------
# Sampling: the joint distribution of the first tokens is the model's own


@torch.no_grad()
def _model_joint(model, prompt, steps, temperature):
    """P(y_1..y_steps | prompt) for every sequence, from the transformers model's own logits on
    every prefix (no cache, no adapter)."""
    vocab = model.config.vocab_size
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        probs = torch.softmax(model(input_ids=ids).logits[:, -1].double() / temperature, -1)
        joint = {p + (y,): joint[p] * float(probs[i, y])
                 for i, p in enumerate(prefixes) for y in range(vocab)}
    return joint


@pytest.mark.parametrize("scheduler", ["confidence", "fixed"])
def test_sampled_tokens_follow_the_model(scheduler):
    """Chi-square of the joint distribution of the first 3 tokens of many sampled requests
    against the model's probabilities (bins expecting < 5 merged; pass iff
    chi2 < df + 10 sqrt(2 df)). A variant whose cache kept one rejected row per round fails it."""
    model = tiny_model("qwen3", vocab=8, layers=2, seed=4)
    target = HFTarget(model, (-1, 0, 1))
    prompt, steps, trials, temperature = [1, 5, 2], 3, 6000, 1.0
    joint = _model_joint(model, prompt, steps, temperature)
    sequences = [list(s) for s, p in joint.items() if p > 0.02]
    draft = table_draft(target, sequences, block_size=4)
    step_rate = synthetic_step_rate(trials * 5 + 1, trials, cost_per_token=0.3)
    decoder = SpeculativeDecoder(target, draft, scheduler=scheduler, step_rate=step_rate)
    out = decoder.generate([prompt] * trials, steps, temperature, torch.arange(trials))
    index = {seq: i for i, seq in enumerate(joint)}
    samples = torch.tensor([index[tuple(t[:steps])] for t in out.tokens])
    probs = torch.tensor(list(joint.values()))
    chi2, df = chi_square(samples, probs / probs.sum())
    assert chi_square_passes(chi2, df), (chi2, df)
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    assert 0.1 * verified < accepted < 0.95 * verified  # both paths exercised


# --------------------------------------------------------------------------------------------
# Features, checkpoints, errors


@torch.no_grad()
def test_features_follow_deepspec_target_cache(qwen3):
    """-1: hidden_states[0]; l: hidden_states[l + 1]; the last layer raw, not transformers'
    final-normed hidden_states[-1]."""
    model = qwen3.model
    ids = torch.tensor([PROMPTS[1]])
    reference = model(input_ids=ids, output_hidden_states=True).hidden_states
    length = torch.tensor([ids.shape[1]], dtype=torch.int32)
    logits, features = qwen3(ids, length, qwen3.new_cache(1, 16), torch.zeros_like(length))
    embedding, middle, last = features[0].split(64, -1)
    torch.testing.assert_close(embedding, reference[0][0], rtol=0, atol=0)
    torch.testing.assert_close(middle, reference[2][0], rtol=0, atol=0)
    torch.testing.assert_close(model.model.norm(last), reference[-1][0])
    assert not torch.allclose(last, reference[-1][0], atol=1e-3)  # raw, not normed
    torch.testing.assert_close(logits, model(input_ids=ids).logits)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["hf", "tiny"])
def test_logits_at_picks_one_row_per_request(qwen3, kind):
    """``logits_at`` (the prefill's last prompt rows): the rows the full forward gives, with the
    LM head run on those rows only (transformers' ``logits_to_keep``)."""
    if kind == "hf":
        target = qwen3
    else:
        from dspark_ops.demo import tiny_pair

        target, _ = tiny_pair(vocab=VOCAB, target_dtype=torch.float64)
    prompts = [PROMPTS[1], PROMPTS[0][:3], PROMPTS[1][:5]]
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    full, features = target(ids, lengths, target.new_cache(3, 32), torch.zeros_like(lengths))
    at = [len(p) - 1 for p in prompts]
    heads = []
    if kind == "hf":
        head = target.model.lm_head
        head.register_forward_hook(lambda m, a, out: heads.append(a[0].shape[1]))
    some, same = target(ids, lengths, target.new_cache(3, 32), torch.zeros_like(lengths),
                        logits_at=at)
    assert some.shape == (3, 1, full.shape[-1])
    torch.testing.assert_close(some[:, 0], full[torch.arange(3), torch.tensor(at)])
    torch.testing.assert_close(same, features)
    if kind == "hf":
        head._forward_hooks.clear()
        assert heads == [len(set(at))]  # the LM head saw the distinct kept rows only


@pytest.mark.parametrize("theta", [1e6, 2.5e4])
def test_draft_rope_matches_transformers_rope_of_the_loaded_base(theta):
    """The base read from a 5.x config (rope_parameters only) rotates as transformers' Qwen3
    RoPE of that config does (the DeepSpec draft's own rotary embedding)."""
    from transformers.models.qwen3 import modeling_qwen3

    from dspark_ops.models.backbone import apply_rope

    values = transformers.Qwen3Config(hidden_size=128, num_attention_heads=2, head_dim=64,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": theta}).to_dict()
    assert "rope_theta" not in values  # the 5.x layout
    values.update(target_layer_ids=[1], block_size=4, mask_token_id=0, markov_rank=8,
                  markov_head_type="vanilla", enable_confidence_head=False, vocab_size=32,
                  architectures=["Qwen3DSparkModel"])
    config = DSparkConfig.from_dict(values)
    assert config.rope_theta == theta
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(transformers.Qwen3Config(**values))
    positions = torch.tensor([[0, 5, 17, 300, 4000]])
    x = torch.randn(1, 5, 2, 64, generator=torch.Generator().manual_seed(0))  # [B, S, H, D]
    cos, sin = rotary(x, positions)
    expected, _ = modeling_qwen3.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2),
                                                      cos, sin)
    # float32 angles up to position 4000: rounding differs by ~1e-4 between the two formulas
    torch.testing.assert_close(apply_rope(x, positions, config.rope_theta),
                               expected.transpose(1, 2), rtol=0, atol=1e-3)
    other = apply_rope(x, positions, 1e4 if theta != 1e4 else 1e6)
    assert (other - expected.transpose(1, 2)).abs().max() > 0.1  # the base matters


def test_adapter_refuses_what_it_cannot_serve():
    model = tiny_model("qwen3", layers=2)
    with pytest.raises(ValueError, match="feature_layers"):
        HFTarget(model, (-1, 2))
    with pytest.raises(ValueError, match="feature_layers"):
        HFTarget(model, (1, 0))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        HFTarget(model, (-1, 1))


def test_saved_draft_reads_as_a_transformers_qwen3_config(tmp_path):
    """What DeepSpec's loader reads: transformers' Qwen3Config from config.json (the RoPE base
    in rope_parameters, the draft's fields as attributes) and model.safetensors."""
    from safetensors.torch import load_file

    target = HFTarget(tiny_model("qwen3", layers=2), (-1, 1))
    draft = table_draft(target, [PROMPTS[0]])
    draft.config.rope_theta = 2.5e5
    draft.save_pretrained(str(tmp_path))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert type(config).__name__ == "Qwen3Config"
    assert config.rope_parameters["rope_theta"] == 2.5e5
    assert config.architectures == ["Qwen3DSparkModel"]
    assert list(config.target_layer_ids) == [-1, 1] and config.markov_rank == VOCAB
    assert config.markov_head_type == "vanilla" and config.block_size == 7
    assert config.confidence_head_with_markov is True and config.tie_word_embeddings is False
    state = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert state.keys() == draft.state_dict().keys()
    for name, value in draft.state_dict().items():
        assert torch.equal(state[name], value), name


# --------------------------------------------------------------------------------------------
# The commands


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, qwen3, hf_greedy):
    """The tiny Qwen3 target with a tokenizer and a draft, saved as a user would have them."""
    root = tmp_path_factory.mktemp("models")
    target_dir, draft_dir = str(root / "target"), str(root / "draft")
    qwen3.model.save_pretrained(target_dir)
    char_tokenizer(VOCAB).save_pretrained(target_dir)
    draft = table_draft(qwen3, [p + t for p, t in zip(PROMPTS, hf_greedy["qwen3"])])
    draft.save_pretrained(draft_dir)
    return target_dir, draft_dir


def test_generate_command(saved_models, capsys):
    from dspark_ops.generate import main

    target_dir, draft_dir = saved_models
    main(["--target", target_dir, "--draft", draft_dir, "--prompt", "why is the sky blue?",
          "--max-new-tokens", "24", "--device", "cpu", "--dtype", "float64", "--block-size",
          "4"])
    printed = capsys.readouterr().out
    assert "mean accepted length" in printed and "target forwards" in printed
    assert "tokens/s" in printed and "speed-up x" in printed
    assert "greedy output identical to plain decoding: True" in printed


def test_release_command_and_generate_with_the_file(saved_models, tmp_path, capsys):
    """python -m dspark_ops.release writes a file without the target's embedding and LM head;
    generate takes it for --draft and decodes as the directory does (greedy: plain's tokens)."""
    import shutil

    from dspark_ops.generate import main as generate
    from dspark_ops.models.release import release_metadata
    from dspark_ops.release import main as release

    target_dir, draft_dir = saved_models
    draft_dir = shutil.copytree(draft_dir, str(tmp_path / "draft"))
    with open(os.path.join(draft_dir, "calibration.json"), "w") as f:
        json.dump({"calib_temperature": [1.0] * 7}, f)
    path = str(tmp_path / "draft.safetensors")
    summary = release([draft_dir, "--target", target_dir, "--out", path])
    assert sorted(summary["left_out"]) == ["embed_tokens.weight", "lm_head.weight"]
    assert release_metadata(path)["calibration"] == [1.0] * 7
    assert "wrote " + path in capsys.readouterr().out
    outputs = []
    for draft in (draft_dir, path):
        generate(["--target", target_dir, "--draft", draft, "--prompt", "why is the sky blue?",
                  "--max-new-tokens", "24", "--device", "cpu", "--dtype", "float32",
                  "--block-size", "4", "--scheduler", "fixed"])
        printed = capsys.readouterr().out
        assert "greedy output identical to plain decoding: True" in printed
        outputs.append(printed.split("generated tokens")[0])
    assert outputs[0] == outputs[1]
    with pytest.raises(SystemExit):
        release([draft_dir, "--target", target_dir, "--out", str(tmp_path / "draft.bin")])
    assert "'--out' must end in .safetensors" in capsys.readouterr().err


def test_generate_command_sampling_flags(saved_models, capsys):
    from dspark_ops.generate import main

    target_dir, draft_dir = saved_models
    main(["--target", target_dir, "--draft", draft_dir, "--prompt", "why is the sky blue?",
          "--max-new-tokens", "12", "--device", "cpu", "--dtype", "float64", "--block-size",
          "4", "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05"])
    printed = capsys.readouterr().out
    assert "mean accepted length" in printed and "greedy output identical" not in printed
    for flag, value in (("--top-p", "1.5"), ("--top-k", "-1"), ("--min-p", "2")):
        with pytest.raises(SystemExit, match=flag):
            main(["--target", target_dir, "--draft", draft_dir, "--prompt", "x", "--device",
                  "cpu", flag, value])


def test_eval_command(saved_models, tmp_path, capsys):
    from dspark_ops.eval import main

    target_dir, draft_dir = saved_models
    data = tmp_path / "chat.jsonl"
    rows = [{"turns": ["hello there", "and a second turn"]}, {"turns": ["what is two plus two?"]},
            {"turns": ["write a short poem."]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "results.json"
    main(["--target", target_dir, "--draft", draft_dir, "--data", str(data),
          "--max-new-tokens", "16", "--scheduler", "fixed", "--device", "cpu", "--dtype",
          "float64", "--batch-size", "2", "--output", str(output), "--no-progress"])
    printed = capsys.readouterr().out
    assert "chat.jsonl" in printed and "wrote" in printed
    result = json.loads(output.read_text())
    row = result["results"][0]
    assert row["num_samples"] == 3 and row["greedy_identical_to_plain"] is True
    assert 1.0 <= row["mean_accepted_length"] <= 1 + row["mean_verified_drafts"]
    assert row["mean_verified_drafts"] == 7.0  # --scheduler fixed: every draft verified
    assert row["speculative_target_forwards"] < row["plain_target_forwards"] + 3
    assert result["settings"]["draft_kind"] == "dspark" and row["speedup"] > 0
