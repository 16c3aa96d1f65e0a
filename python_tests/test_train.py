"""python -m dspark_ops.train on a tiny random transformers target (no downloads): training lowers
the loss and raises tau (DSpark and DFlash); a resumed run equals an uninterrupted one bitwise;
the checkpoint is DeepSpec's layout, loads with DSparkDraft.from_pretrained and decodes
losslessly; the calibration reaches generate/eval; every bad input stops early with its message."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from cases.training import (LAYERS, VOCAB, read_metrics, save_target, train_args,
                                write_greedy_data)

from dspark_ops import DSparkDraft, SpeculativeDecoder  # noqa: E402
from dspark_ops.decoder import generate_target_only  # noqa: E402
from dspark_ops.models import load_state_dict_file  # noqa: E402
from dspark_ops.train.data import Schedule, Sample  # noqa: E402
from dspark_ops.train.draft_config import default_target_layers  # noqa: E402
from dspark_ops.train.trainer import lr_factor, main  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = save_target(str(root / "target"))
    data = write_greedy_data(target, str(root / "data.jsonl"), count=20, new_tokens=32)
    return root, target, data


@pytest.fixture(scope="module")
def trained(setup):
    """A DSpark run of 24 steps (checkpoints every 12), with 2 held-out calibration samples."""
    root, target, data = setup
    out = str(root / "dspark")
    main(train_args(target, data, out, "--max-steps", "24", "--lr", "3e-3", "--markov-rank",
                    "16", "--checkpoint-every", "12", "--calibration-samples", "2"))
    return out


def _improves(rows, key, lower: bool):
    first = sum(r[key] for r in rows[:4]) / 4
    last = sum(r[key] for r in rows[-4:]) / 4
    return last < first if lower else last > first


def test_dspark_training_learns(trained):
    rows = read_metrics(trained)
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert _improves(rows, "loss", lower=True), [r["loss"] for r in rows]
    assert _improves(rows, "tau_probabilistic", lower=False)
    assert _improves(rows, "l1", lower=True)
    row = rows[-1]
    for key in ("ce", "l1", "confidence", "lr", "grad_norm", "accept_rate@0", "accept_rate@3",
                "tokens_per_second", "peak_memory_mib"):
        assert key in row and row[key] is not None, key
    assert row["loss"] == pytest.approx(0.1 * row["ce"] + 0.9 * row["l1"] + row["confidence"],
                                        rel=1e-5)
    assert 1.0 <= row["tau_probabilistic"] <= 5.0
    assert rows[-1]["lr"] < rows[3]["lr"]  # cosine decay after the warm-up


def test_dflash_training_learns(setup):
    root, target, data = setup
    out = str(root / "dflash")
    main(train_args(target, data, out, "--arch", "dflash", "--max-steps", "20", "--lr", "3e-3"))
    rows = read_metrics(out)
    assert _improves(rows, "loss", lower=True)
    assert _improves(rows, "tau_probabilistic", lower=False)
    assert all(r["confidence"] == 0 and r["loss"] == pytest.approx(r["ce"]) for r in rows)
    config = json.load(open(os.path.join(out, "step_latest", "config.json")))
    assert config["markov_rank"] == 0 and config["enable_confidence_head"] is False
    assert not os.path.exists(os.path.join(out, "step_latest", "calibration.json"))


def test_checkpoint_layout_and_config(trained, setup):
    _, target, _ = setup
    assert os.path.islink(os.path.join(trained, "step_latest"))
    assert os.readlink(os.path.join(trained, "step_latest")) == "step_24"
    for step in ("step_12", "step_24"):
        names = set(os.listdir(os.path.join(trained, step)))
        assert {"config.json", "model.safetensors", "training_state.pt",
                "train_args.json"} <= names
    config = json.load(open(os.path.join(trained, "step_24", "config.json")))
    # DeepSpec's field names, the draft built from the target's config
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert config["num_target_layers"] == LAYERS and config["target_layer_ids"] == [0, 2]
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == VOCAB and config["hidden_size"] == 64
    assert config["block_size"] == 4 and config["mask_token_id"] == 37
    assert config["markov_rank"] == 16 and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    assert config["num_anchors"] == 8
    draft = DSparkDraft.from_pretrained(os.path.join(trained, "step_24"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    # the embedding and LM head are the target's, untouched by training
    assert torch.equal(draft.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, model.get_output_embeddings().weight)
    calibration = json.load(open(os.path.join(trained, "step_24", "calibration.json")))
    temps = calibration["calib_temperature"]
    assert len(temps) == 4 and all(t > 0 for t in temps) and calibration["num_blocks"] > 0


def test_checkpoint_decodes_losslessly(trained, setup):
    _, target_dir, data_path = setup
    from transformers import AutoModelForCausalLM

    from dspark_ops.hf import HFTarget

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64,
                                                 attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    draft = DSparkDraft.from_pretrained(os.path.join(trained, "step_latest")).eval()
    target = HFTarget(model, draft.config.target_layer_ids)
    with open(data_path) as f:  # prompts the draft was trained on, the target's own text
        rows = [json.loads(line) for line in f][:3]
    prompts = [r["input_ids"][: r["loss_mask"].index(1) + 2] for r in rows]
    calib = torch.tensor(json.load(open(os.path.join(trained, "step_latest",
                                                     "calibration.json")))["calib_temperature"])
    with torch.no_grad():
        for scheduler in ("fixed", "confidence"):
            decoder = SpeculativeDecoder(target, draft, scheduler=scheduler,
                                         calib_temperature=calib)
            out = decoder.generate(prompts, 24, temperature=0.0)
            plain = generate_target_only(target, prompts, 24, temperature=0.0)
            assert out.tokens == plain
            if scheduler == "fixed":  # the trained draft gets tokens accepted
                assert out.mean_accepted_length > 1.0


def test_resume_is_exact(trained, setup, tmp_path):
    """Resuming from step 12 to step 24 gives the uninterrupted run's step 24, bitwise."""
    root, target, data = setup
    out = str(tmp_path / "resumed")
    main(train_args(target, data, out, "--max-steps", "24", "--lr", "3e-3", "--markov-rank",
                    "16", "--checkpoint-every", "12", "--calibration-samples", "2",
                    "--resume", os.path.join(trained, "step_12")))
    a = load_state_dict_file(os.path.join(trained, "step_24", "model.safetensors"))
    b = load_state_dict_file(os.path.join(out, "step_24", "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa = torch.load(os.path.join(trained, "step_24", "training_state.pt"), weights_only=False)
    sb = torch.load(os.path.join(out, "step_24", "training_state.pt"), weights_only=False)
    for key, value in sa["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(value[name], sb["optimizer"]["state"][key][name])
    assert sa["scheduler"] == sb["scheduler"] and sa["next_step"] == sb["next_step"] == 24
    full, resumed = read_metrics(trained), read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(13, 25))
    for x, y in zip(full[12:], resumed):
        for key in ("loss", "ce", "l1", "confidence", "grad_norm", "lr", "tau_probabilistic"):
            assert x[key] == y[key], key
    calib_a = json.load(open(os.path.join(trained, "step_24", "calibration.json")))
    calib_b = json.load(open(os.path.join(out, "step_24", "calibration.json")))
    assert calib_a["calib_temperature"] == calib_b["calib_temperature"]


def test_draft_vocab_training_saves_resumes_and_decodes(setup, tmp_path, capsys):
    """--draft-vocab N: the N most frequent answer ids (mask token and EOS in) saved with every
    checkpoint; W2 trains on their rows only; a resumed run equals the uninterrupted one bitwise
    and keeps the vocabulary; the draft decodes losslessly through it."""
    from transformers import AutoModelForCausalLM

    from dspark_ops.hf import HFTarget
    from dspark_ops.models.vocab import DraftVocabulary, count_response_tokens

    _, target, data = setup
    flags = ("--max-steps", "6", "--lr", "3e-3", "--markov-rank", "16", "--checkpoint-every", "3",
             "--calibration-samples", "2", "--draft-vocab", "16")
    out = str(tmp_path / "vocab")
    main(train_args(target, data, out, *flags))
    assert "draft vocabulary: 16 of" in capsys.readouterr().out
    vocabulary = DraftVocabulary.load(os.path.join(out, "step_6"))
    assert vocabulary.size == 16 and vocabulary.vocab_size == VOCAB
    eos = AutoModelForCausalLM.from_pretrained(target).config.eos_token_id
    assert {37, eos} <= set(vocabulary.d2t.tolist())
    with open(data) as f:
        counts = count_response_tokens((json.loads(line) for line in f), VOCAB)
    assert 0.0 < vocabulary.coverage(torch.repeat_interleave(torch.arange(VOCAB), counts)) < 1.0
    first = load_state_dict_file(os.path.join(out, "step_3", "model.safetensors"))
    last = load_state_dict_file(os.path.join(out, "step_6", "model.safetensors"))
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[vocabulary.d2t] = True
    w2 = "markov_head.markov_w2.weight"
    assert torch.equal(first[w2][~inside], last[w2][~inside])
    assert not torch.equal(first[w2][inside], last[w2][inside])

    resumed = str(tmp_path / "resumed")
    main(train_args(target, data, resumed, *flags, "--resume", os.path.join(out, "step_3")))
    again = load_state_dict_file(os.path.join(resumed, "step_6", "model.safetensors"))
    assert all(torch.equal(last[name], again[name]) for name in last)
    assert torch.equal(DraftVocabulary.load(os.path.join(resumed, "step_6")).d2t, vocabulary.d2t)
    _fails(train_args(target, data, str(tmp_path / "other"), *flags[:-1], "12", "--resume",
                      os.path.join(out, "step_3")), "vocabulary of 16 ids")

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64,
                                                 attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    draft = DSparkDraft.from_pretrained(os.path.join(out, "step_6")).eval()
    assert draft.draft_vocabulary.size == 16
    hf = HFTarget(model, draft.config.target_layer_ids)
    with open(data) as f:
        rows = [json.loads(line) for line in f][:3]
    prompts = [r["input_ids"][: r["loss_mask"].index(1) + 2] for r in rows]
    with torch.no_grad():
        got = SpeculativeDecoder(hf, draft).generate(prompts, 16, temperature=0.0)
        assert got.tokens == generate_target_only(hf, prompts, 16, temperature=0.0)


def test_draft_vocab_flag_errors(setup, tmp_path):
    _, target, data = setup
    _fails(train_args(target, data, str(tmp_path / "a"), "--draft-vocab", "0"),
           "--draft-vocab must be >= 1")
    _fails(train_args(target, data, str(tmp_path / "b"), "--draft-vocab", str(VOCAB + 1)),
           f"--draft-vocab must be in [1, {VOCAB}]")
    _fails(train_args(target, data, str(tmp_path / "c"), "--arch", "eagle3", "--draft-vocab",
                      "8"), "not --arch eagle3")


def test_resume_latest_continues_in_place(setup, tmp_path):
    root, target, data = setup
    out = str(tmp_path / "run")
    args = train_args(target, data, out, "--max-steps", "4", "--checkpoint-every", "2",
                      "--calibration-samples", "0")
    main(args)
    os.remove(os.path.join(out, "step_latest"))
    os.symlink("step_2", os.path.join(out, "step_latest"))
    main(args + ["--resume"])
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert os.readlink(os.path.join(out, "step_latest")) == "step_4"


# ------------------------------------------------------------------------------------------------
# Errors, before any long work


def _write(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _fails(argv, match):
    with pytest.raises(SystemExit) as error:
        main(argv)
    assert error.value.code != 0
    assert match in str(error.value.code), str(error.value.code)


def test_bad_data(setup, tmp_path):
    _, target, _ = setup
    out = str(tmp_path / "out")
    bad = _write(tmp_path / "turns.jsonl", [{"turns": ["hello"]}])
    _fails(train_args(target, bad, out), "no 'input_ids'/'loss_mask'")
    _fails(train_args(target, bad, out), "python -m dspark_ops.prepare_data")
    zero = _write(tmp_path / "zero.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]}])
    _fails(train_args(target, zero, out), "no row has a response token")
    short = _write(tmp_path / "short.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
    _fails(train_args(target, short, out, "--min-loss-tokens", "5"), "fewer than 5 trained")
    ragged = _write(tmp_path / "ragged.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 1]}])
    _fails(train_args(target, ragged, out), "has 2 entries for 3 input_ids")
    vocab = _write(tmp_path / "vocab.jsonl", [{"input_ids": [5, 99], "loss_mask": [1, 1]}])
    _fails(train_args(target, vocab, out), "token id 99 is outside")
    broken = _write(tmp_path / "broken.jsonl", ["{not json"])
    _fails(train_args(target, broken, out), "broken.jsonl:1: not JSON")
    _fails(train_args(target, str(tmp_path / "missing.jsonl"), out), "no such file")
    assert not os.path.exists(out)


def test_bad_target_layers_and_config(setup, tmp_path):
    _, target, data = setup
    out = str(tmp_path / "out")
    base = train_args(target, data, out)
    layers = base.index("--target-layers")

    def with_layers(*ids):
        return base[:layers + 1] + list(ids) + base[layers + 3:]

    _fails(with_layers(str(LAYERS - 1)), "is the target's final layer")
    _fails(with_layers("0", "7"), "7 is out of range for a 4-layer target")
    _fails(with_layers("-2"), "-2 is out of range")
    _fails(with_layers("2", "1"), "strictly increasing")
    wrong = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": VOCAB,
             "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "target_layer_ids": [0, 2],
             "block_size": 4, "mask_token_id": 37, "markov_rank": 8,
             "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(wrong))
    _fails(base + ["--config", str(path)], "the target's hidden size is 64")
    path.write_text(json.dumps({**wrong, "hidden_size": 64, "vocab_size": 100}))
    _fails(base + ["--config", str(path)], "vocab_size 100 differs from the target's 48")
    path.write_text(json.dumps({**wrong, "hidden_size": 64, "target_layer_ids": [0, 3]}))
    _fails(base + ["--config", str(path)], "is the target's final layer")
    _fails(base + ["--max-steps", "0"], "--max-steps must be >= 1")
    _fails(base + ["--mask-token-id", "48"], "outside the vocabulary")


def test_bad_checkpoint(trained, setup, tmp_path):
    _, target, data = setup
    ckpt = str(tmp_path / "step_12")
    shutil.copytree(os.path.join(trained, "step_12"), ckpt)
    args = train_args(target, data, str(tmp_path / "out"), "--max-steps", "24", "--lr", "3e-3",
                      "--markov-rank", "16", "--checkpoint-every", "12",
                      "--calibration-samples", "2")
    state = os.path.join(ckpt, "training_state.pt")
    with open(state, "rb") as f:
        blob = f.read()
    with open(state, "wb") as f:
        f.write(blob[: len(blob) // 2])
    _fails(args + ["--resume", ckpt], "corrupt checkpoint")
    _fails(args + ["--resume", ckpt], "training_state.pt does not load")
    with open(state, "wb") as f:
        f.write(blob)
    weights = os.path.join(ckpt, "model.safetensors")
    os.rename(weights, weights + ".bak")
    _fails(args + ["--resume", ckpt], "model.safetensors is missing")
    os.rename(weights + ".bak", weights)
    _fails(args + ["--max-steps", "30", "--resume", ckpt], "another data schedule")
    _fails(args + ["--resume"], "no checkpoint in --out yet")
    _fails(args + ["--resume", str(tmp_path / "nowhere")], "is not a checkpoint directory")


# ------------------------------------------------------------------------------------------------
# Pieces


def test_schedule_splits_like_one_process():
    samples = [Sample(i, [1] * (5 + 7 * i % 23), [1] * (5 + 7 * i % 23)) for i in range(40)]
    one = Schedule(samples, batch_tokens=120, world_size=1, grad_accum=1, seed=3, epochs=2)
    two = Schedule(samples, batch_tokens=60, world_size=2, grad_accum=1, seed=3, epochs=2)
    assert one.total_steps == two.total_steps > 2
    for step in range(one.total_steps):
        _, union = one.micro_batch(step, 0, 0)
        parts = [two.micro_batch(step, 0, r)[1] for r in range(2)]
        assert all(parts) and sorted(s.index for p in parts for s in p) == sorted(
            s.index for s in union)
        assert len(union) * max(len(s.input_ids) for s in union) <= 120 or len(union) <= 2
    capped = Schedule(samples, batch_tokens=120, world_size=1, grad_accum=2, seed=3,
                      max_steps=50)
    assert capped.total_steps == 50  # as many epochs as it takes


def test_lr_schedule_and_default_layers():
    assert lr_factor(0, 100, 4) == 0.25 and lr_factor(3, 100, 4) == 1.0
    assert lr_factor(4, 100, 4) == 1.0 and lr_factor(99, 100, 4) < 1e-3
    assert lr_factor(0, 10, 0) == 1.0
    # with a floor: the same warm-up, then a cosine from 1 to the floor
    assert lr_factor(0, 100, 4, 0.1) == 0.25 and lr_factor(4, 100, 4, 0.1) == 1.0
    assert lr_factor(99, 100, 4, 0.1) == pytest.approx(0.1, abs=1e-3)
    assert lr_factor(52, 100, 4, 0.1) == pytest.approx(0.1 + 0.9 * lr_factor(52, 100, 4))
    assert default_target_layers(36) == [1, 9, 17, 25, 33]  # DeepSpec's Qwen3-4B/8B
    assert default_target_layers(4) == [1] and default_target_layers(1) == [-1]
    assert all(max(default_target_layers(n)) < n - 1 for n in range(2, 80))


def test_eval_reads_the_calibration(trained, setup, tmp_path):
    """generate/eval pick up calibration.json from the draft directory (or --calibration)."""
    import argparse

    from dspark_ops import _cli
    from dspark_ops.eval import main as eval_main

    _, target, _ = setup
    ckpt = os.path.join(trained, "step_latest")
    draft = DSparkDraft.from_pretrained(ckpt)
    saved = json.load(open(os.path.join(ckpt, "calibration.json")))["calib_temperature"]
    args = argparse.Namespace(draft=ckpt, calibration=None, block_size=None)
    assert _cli.load_calibration(args, draft).tolist() == pytest.approx(saved)
    args.block_size = 2
    assert len(_cli.load_calibration(args, draft)) == 2
    other = tmp_path / "calib.json"
    other.write_text(json.dumps({"calib_temperature": [2.0] * 4}))
    args.calibration, args.block_size = str(other), None
    assert _cli.load_calibration(args, draft).tolist() == [2.0] * 4
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"turns": ["hello"]}\n{"turns": ["the cat"]}\n')
    result = str(tmp_path / "eval.json")
    eval_main(["--target", target, "--draft", ckpt, "--data", str(prompts), "--device", "cpu",
               "--dtype", "float64", "--max-new-tokens", "16", "--scheduler", "confidence",
               "--no-progress", "--output", result])
    row = json.load(open(result))["results"][0]
    assert row["greedy_identical_to_plain"] and row["mean_accepted_length"] >= 1.0


class _Tokenizer:
    """What the trainer reads of a tokenizer to choose the mask token."""

    def __init__(self, added, size, mask=None, template=""):
        self.added, self.size, self.mask_token_id, self.chat_template = added, size, mask, template
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 1, 2, 2

    def __len__(self):
        return self.size

    def get_added_vocab(self):
        return self.added


def test_mask_token_choice():
    from dspark_ops.train.draft_config import mask_token_id

    assert mask_token_id(_Tokenizer({}, 10, mask=7), 12) == 7  # the tokenizer's own
    assert mask_token_id(_Tokenizer({}, 10), 12) == 10  # a row no text maps to
    # every row is text (SmolLM2): the last added token that is not BOS/EOS/PAD and that the
    # chat template does not write
    added = {"<s>": 1, "</s>": 2, "<|im_start|>": 3, "<spare>": 4, "<other>": 5}
    tok = _Tokenizer(added, 12, template="{{ '<|im_start|>' + m['content'] + '<other>' }}")
    assert mask_token_id(tok, 12) == 4
    with pytest.raises(SystemExit, match="pass --mask-token-id"):
        mask_token_id(_Tokenizer({"<s>": 1, "</s>": 2}, 12), 12)


def test_collate_drops_padding_blocks_only():
    """collate cuts the anchor columns that are padding in every row; the loss with the cut
    anchors equals the loss with DeepSpec's full 512 (zero-weight padding blocks)."""
    from dspark_ops.models import DSparkConfig
    from dspark_ops.train.data import collate_blocks
    from dspark_ops.train.forward import position_weights, training_forward
    from dspark_ops.train.loss import draft_loss

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, (n, masked) in enumerate(((30, 20), (18, 6))):
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        samples.append(Sample(i, ids, [0] * (n - masked) + [1] * masked))
    data = collate_blocks(samples, 0, 42, "cpu", num_anchors=512, block_size=4,
                          loss_decay_gamma=4.0)
    keep = data["block_keep_mask"]
    assert keep.shape == (2, 19) and keep.sum(1).tolist() == [19, 5]
    full = {k: v.clone() for k, v in data.items()}
    pad = 512 - keep.shape[1]
    full["anchor_positions"] = torch.cat([data["anchor_positions"],
                                          torch.full((2, pad), 31)], 1)
    full["block_keep_mask"] = torch.cat([keep, torch.zeros(2, pad, dtype=torch.bool)], 1)
    config = DSparkConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=32, intermediate_size=48,
                          num_hidden_layers=1, target_layer_ids=(0,), block_size=4,
                          mask_token_id=VOCAB - 1, markov_rank=4, enable_confidence_head=True,
                          confidence_head_with_markov=True, rope_theta=10_000.0)
    torch.manual_seed(0)
    draft = DSparkDraft(config)
    width = draft.config.hidden_size
    feats = torch.randn(2, 30, len(draft.config.target_layer_ids) * width, generator=gen)
    last = torch.randn(2, 30, width, generator=gen)
    losses = []
    for d in (data, full):
        batch = training_forward(draft, d["input_ids"], feats, d["loss_mask"], last,
                                 anchor_positions=d["anchor_positions"],
                                 block_keep_mask=d["block_keep_mask"])
        losses.append(draft_loss(draft, batch).loss)
        if d is data:  # the batch's eval mask and weights are the forward's, built once
            assert torch.equal(data["eval_mask"], batch.eval_mask)
            torch.testing.assert_close(data["weights"], position_weights(batch.eval_mask))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_init_from_target_starts_the_layers_from_the_target_top(setup, tmp_path):
    """``--init-from-target``: the draft's one layer is the target's last (layer 3 of 4), every
    tensor, and its final norm the target's; the context projection is not (no counterpart).
    A tiny learning rate keeps one step's update far below the tolerance. Without the flag the
    layer is random."""
    import transformers

    from dspark_ops.train.draft_config import copy_target_layers

    _, target, data = setup
    out = str(tmp_path / "init")
    main(train_args(target, data, out, "--max-steps", "1", "--lr", "1e-9",
                    "--init-from-target"))
    weights = load_state_dict_file(os.path.join(out, "step_latest", "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    top = model.model.layers[LAYERS - 1].state_dict()
    layer = {k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")}
    assert set(layer) == set(top)
    for name, tensor in top.items():
        torch.testing.assert_close(layer[name], tensor, atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(weights["norm.weight"], model.model.norm.weight, atol=1e-6,
                               rtol=0)
    scratch = str(tmp_path / "scratch")
    main(train_args(target, data, scratch, "--max-steps", "1", "--lr", "1e-9"))
    random_layer = load_state_dict_file(os.path.join(scratch, "step_latest", "model.safetensors"))
    assert not torch.allclose(random_layer["layers.0.mlp.up_proj.weight"],
                              top["mlp.up_proj.weight"], atol=1e-3)
    # a draft without a layer list, or with more layers than the target, is refused by name
    with pytest.raises(ValueError, match="no 'layers'"):
        copy_target_layers(torch.nn.Linear(2, 2), model)
    deep = torch.nn.Module()
    deep.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)] * (LAYERS + 1))
    with pytest.raises(ValueError, match=f"the target only {LAYERS}"):
        copy_target_layers(deep, model)
    shallow = torch.nn.Module()
    shallow.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="shares no weight name and shape"):
        copy_target_layers(shallow, model)
