"""python -m dspark_ops.prepare_data on a tiny random target: DeepSpec prompts and plain text in,
conversations with input_ids and loss_mask out (1 on the assistant's tokens and end-of-turn),
multi-turn answered turn by turn, resumable, and read by the trainer."""

from __future__ import annotations

import json

import pytest
import torch

from cases.training import save_target, tokenizer, train_args

from dspark_ops.prepare_data import conversation_tokens, main, read_prompts  # noqa: E402
from dspark_ops.train.trainer import main as train_main  # noqa: E402

EOT = 3  # <|im_end|>


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return save_target(str(tmp_path_factory.mktemp("prepare") / "target"))


def _prompts(path):
    path.write_text('{"id": "a", "turns": ["hello there", "and then?"]}\n'
                    '{"turns": ["why is the sky blue?"]}\n'
                    "\n"
                    "a plain line\n")
    return str(path)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_format_and_mask(target, tmp_path):
    out = str(tmp_path / "data.jsonl")
    main(["--target", target, "--prompts", _prompts(tmp_path / "p.jsonl"), "--out", out,
          "--max-new-tokens", "10", "--batch-size", "2", "--no-progress", "--device", "cpu"])
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["a", "2", "4"]
    tok = tokenizer()
    for row in rows:
        roles = [m["role"] for m in row["conversations"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert len(row["input_ids"]) == len(row["loss_mask"])
        rendered = tok.apply_chat_template(row["conversations"], tokenize=False)
        assert row["input_ids"] == tok(rendered, add_special_tokens=False).input_ids
        # the masked tokens are the answers' text, each followed by the end-of-turn token
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        answers = [m["content"] for m in row["conversations"] if m["role"] == "assistant"]
        expected = []
        for answer in answers:
            expected += tok(answer, add_special_tokens=False).input_ids + [EOT]
        assert masked == expected
    assert len(rows[0]["conversations"]) == 4  # two turns, answered in turn
    assert rows[2]["conversations"][0]["content"] == "a plain line"


def test_resumable_and_trainable(target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl")
    out = str(tmp_path / "data.jsonl")
    common = ["--target", target, "--prompts", prompts, "--out", out, "--max-new-tokens", "24",
              "--no-progress", "--temperature", "0"]
    main(common + ["--max-samples", "2"])
    first = _rows(out)
    assert [r["id"] for r in first] == ["a", "2"]
    with open(out, "a") as f:
        f.write('{"id": "4", "input_ids": [1, 2')  # a line cut by an interruption
    main(common)
    rows = _rows(out)  # the cut line is gone
    assert [r["id"] for r in rows] == ["a", "2", "4"]  # done ids skipped, the cut one redone
    assert rows[:2] == first
    main(common)  # nothing left to do
    assert [r["id"] for r in _rows(out)] == ["a", "2", "4"]
    train_out = str(tmp_path / "run")
    train_main(train_args(target, out, train_out, "--max-steps", "2", "--min-loss-tokens", "2",
                          "--calibration-samples", "0", "--batch-tokens", "512"))


@pytest.mark.parametrize("chat", [True, False])
def test_rows_without_a_response_token_are_dropped(target, tmp_path, monkeypatch, capsys, chat):
    """An answer that is only the end-of-turn token trains nothing: its row is not written,
    and the summary counts it (and a multi-turn row with one empty turn is kept)."""
    import dspark_ops.prepare_data as prepare

    real = prepare._generate

    def generate(model, tok, prompts, args, stop, seed):
        answers = real(model, tok, prompts, args, stop, seed)
        # The sky prompt and the first turn of "a" (its second turn repeats the first as
        # history) are answered with the end token alone.
        texts = [tok.decode(p) for p in prompts]
        return [[EOT] if "sky" in t or "hello" in t and "then" not in t else a
                for t, a in zip(texts, answers)]

    monkeypatch.setattr(prepare, "_generate", generate)
    out = str(tmp_path / "data.jsonl")
    if chat:
        path, flags = _prompts(tmp_path / "p.jsonl"), []
    else:  # single-turn prompts: plain text has no turns to keep apart
        path, flags = tmp_path / "p.txt", ["--no-chat-template"]
        path.write_text("why is the sky blue?\na plain line\n")
    main(["--target", target, "--prompts", str(path), "--out", out, "--max-new-tokens", "8",
          "--no-progress", "--temperature", "0", *flags])
    rows = _rows(out)
    assert [r["id"] for r in rows] == (["a", "4"] if chat else ["2"])
    assert all(any(r["loss_mask"]) for r in rows)
    if chat:  # "a": its first answer empty, its second not
        assert rows[0]["conversations"][1]["content"] == ""
    assert "; dropped 1 with no response token" in capsys.readouterr().out


def test_rows_cut_before_their_answer_are_dropped(target, tmp_path, capsys):
    """--max-length shorter than every prompt: nothing of any answer is left, nothing is
    written, and the summary says so."""
    out = str(tmp_path / "data.jsonl")
    main(["--target", target, "--prompts", _prompts(tmp_path / "p.jsonl"), "--out", out,
          "--max-new-tokens", "4", "--max-length", "3", "--no-progress", "--temperature", "0"])
    assert _rows(out) == []
    summary = capsys.readouterr().out
    assert "wrote 0 samples (0 response tokens)" in summary
    assert "dropped 3 with no response token" in summary and "--max-length 3" in summary


def test_plain_text_without_template(target, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\nsecond\n")
    assert read_prompts(str(path)) == [("1", ["first prompt"]), ("2", ["second"])]
    out = str(tmp_path / "data.jsonl")
    main(["--target", target, "--prompts", str(path), "--out", out, "--max-new-tokens", "6",
          "--no-progress", "--no-chat-template", "--temperature", "0"])
    for row in _rows(out):
        prompt = tokenizer()(row["conversations"][0]["content"], add_special_tokens=False)
        n = len(prompt.input_ids)
        assert row["input_ids"][:n] == prompt.input_ids and row["loss_mask"][:n] == [0] * n
        assert all(row["loss_mask"][n:])


def test_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    with pytest.raises(SystemExit, match="non-empty string list 'turns'"):
        read_prompts(str(bad))
    with pytest.raises(SystemExit, match="no such file"):
        read_prompts(str(tmp_path / "none.jsonl"))
    tok = tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    ids, mask = conversation_tokens(tok, messages, [EOT], 4096)
    assert [t for t, m in zip(ids, mask) if m] == tok("yes", add_special_tokens=False).input_ids \
        + [EOT]
    assert conversation_tokens(tok, messages, [EOT], 5)[0] == ids[:5]
