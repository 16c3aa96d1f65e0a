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

    def generate(model, tok, prompts, args, stop, seed, capture=None):
        answers = real(model, tok, prompts, args, stop, seed, capture)
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
    assert read_prompts(str(path)) == [("1", ["first prompt"], None), ("2", ["second"], None)]
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
    for answers in ('["one"]', '"one"', '["one", 2]'):
        bad.write_text('{"turns": ["a", "b"], "answers": %s}\n' % answers)
        with pytest.raises(SystemExit, match="'answers' must be a list of 2 strings"):
            read_prompts(str(bad))
    tok = tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    ids, mask = conversation_tokens(tok, messages, [EOT], 4096)
    assert [t for t, m in zip(ids, mask) if m] == tok("yes", add_special_tokens=False).input_ids \
        + [EOT]
    assert conversation_tokens(tok, messages, [EOT], 5)[0] == ids[:5]


# -- features captured while generating (--cache) ----------------------------------------------

def _close(got, want):
    """float32 agreement of captured (decode-step) features with a prefill's: the same sums in
    another blocking (a [B, 1] step against a [B, L] prefill, attention over the K/V cache
    against a causal one) differ by a few float32 ulps per layer; 2e-5 of the tensor's largest
    magnitude (about 170 ulps at that scale) bounds them with a tenfold margin on these models,
    while one position off changes features by their own size. The cache then stores bfloat16,
    whose rounding (2^-9 relative) is far coarser."""
    assert got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= 2e-5 * want.abs().max()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_target(str(tmp_path_factory.mktemp("capture") / "target"), kind="llama")


def test_captured_features_equal_a_prefill_pass():
    """Left-padded prompts of three lengths, greedy; rows that stop early go on being fed
    padding. Each sample (prompt, answer, then the chat template's end of turn, which generation
    never fed) gets the features a plain prefill of its tokens gives."""
    from cases.training import tiny_target

    from dspark_ops.prepare_data import TAIL_LIMIT, FeatureCapture
    from dspark_ops.train.target import OnlineTarget

    torch.set_num_threads(1)
    model = tiny_target("llama")
    layers = [-1, 0, 2]
    capture = FeatureCapture(model, layers)
    tok = tokenizer()
    prompts = [tok(t, add_special_tokens=False).input_ids
               for t in ["hello there friend", "hi", "why is the sky"]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        attention[row, width - len(p):] = 1
    new = 12
    sequences = capture.generate(ids, attention, max_new_tokens=new, do_sample=False,
                                 pad_token_id=0, eos_token_id=EOT)
    answers = []
    for row in sequences[:, width:].tolist():
        cut = row.index(EOT) if EOT in row else None
        answers.append(row if cut is None else row[:cut + 1])
    # the cases this test is about: a row that runs to the end, rows that stop early
    assert any(len(a) == new for a in answers) and any(len(a) < new for a in answers)
    newline = tok("\n", add_special_tokens=False).input_ids
    samples = {row: prompts[row] + answers[row] + newline for row in range(len(prompts))}
    samples[1] = samples[1][:len(prompts[1]) + 1]  # truncated inside its answer
    got = capture.features(samples, answers)
    online = OnlineTarget(model, layers)
    for row, tokens in samples.items():
        want, want_last = online(torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=bool))
        features, last = got[row]
        _close(features, want[0])
        _close(last, want_last[0])
    # A re-tokenisation that departs from the generated tokens: near the end, the rest runs
    # over the K/V cache; more than TAIL_LIMIT tokens before it, it is left to a prefill pass.
    capture.generate(ids, attention, max_new_tokens=new, do_sample=False, pad_token_id=0,
                     eos_token_id=EOT)
    other = (answers[1][3] + 1) % 41
    departed = {0: prompts[0][:1] + [(prompts[0][1] + 1) % 41] + prompts[0][2:] + answers[0],
                1: prompts[1] + answers[1][:3] + [other] + answers[1][4:] + newline}
    assert len(departed[0]) - 1 > TAIL_LIMIT and len(answers[1]) - 3 <= TAIL_LIMIT
    got = capture.features(departed, answers)
    assert got[0] is None
    want, want_last = online(torch.tensor([departed[1]]),
                             torch.ones(1, len(departed[1]), dtype=torch.bool))
    _close(got[1][0], want[0])
    _close(got[1][1], want_last[0])
    online.close()
    capture.close()


def _prompts_for_the_cache(path):
    path.write_text('{"id": "a", "turns": ["hello there", "and then?"]}\n'
                    '{"turns": ["why is the sky blue?"]}\n'
                    '{"turns": ["hi"]}\n'
                    '{"turns": ["count to ten, slowly please"]}\n')
    return str(path)


def _cache_equals_a_prefill_pass(target, data, cache_dir, layers):
    from transformers import AutoModelForCausalLM

    from dspark_ops.train.cache import TargetCache
    from dspark_ops.train.data import read_training_data
    from dspark_ops.train.target import OnlineTarget

    samples, _ = read_training_data(data, min_loss_tokens=0)
    cache = TargetCache(cache_dir, layers, 64)
    model = AutoModelForCausalLM.from_pretrained(target, attn_implementation="sdpa")
    online = OnlineTarget(model.eval(), layers)
    for s in samples:
        ids, loss, features, last = cache.read(s.index)
        assert ids.tolist() == s.input_ids and loss.tolist() == [float(m) for m in s.loss_mask]
        want, want_last = online(torch.tensor([s.input_ids]),
                                 torch.ones(1, len(s.input_ids), dtype=torch.bool))
        _close(features, want[0])
        _close(last, want_last[0])
    online.close()
    return samples


def test_cache_captured_while_generating(llama, tmp_path, monkeypatch, capsys):
    """--cache: every sample's features, a two-turn conversation (its last turn's prefill holds
    the first) and rows that stopped early among them, equal a prefill pass of the written
    input_ids; what departs from the generated tokens is computed by that pass; the trainer
    reads the cache."""
    from dspark_ops.prepare_data import FeatureCapture
    from dspark_ops.train.cache import FeatureStage

    staged, lengths = [], []
    put, features = FeatureStage.put, FeatureCapture.features
    monkeypatch.setattr(FeatureStage, "put",
                        lambda self, row, *rest: (staged.append(row), put(self, row, *rest)))

    def cut(self, samples, answers):  # the answer lengths of the samples it captured
        got = features(self, samples, answers)
        lengths.extend(len(answers[row]) for row in samples if got[row] is not None)
        return got

    monkeypatch.setattr(FeatureCapture, "features", cut)
    out, cache = str(tmp_path / "data.jsonl"), str(tmp_path / "cache")
    main(["--target", llama, "--prompts", _prompts_for_the_cache(tmp_path / "p.jsonl"), "--out",
          out, "--max-new-tokens", "16", "--batch-size", "4", "--temperature", "0",
          "--no-progress", "--cache", cache, "--target-layers", "0", "2", "--cache-dtype",
          "float32"])
    printed = capsys.readouterr().out
    assert "tokens/s)" in printed
    rows = _rows(out)
    assert len(rows) == 4 and len(rows[0]["conversations"]) == 4
    assert 0 in staged  # the two-turn conversation was captured
    assert min(lengths) < 16 and max(lengths) == 16  # answers that stopped early, and not
    samples = _cache_equals_a_prefill_pass(llama, out, cache, [0, 2])
    captured = sum(s.index in staged for s in samples)
    assert f"{captured} from features captured while generating or already cached, " \
        f"{len(samples) - captured} by a prefill" in printed
    assert not (tmp_path / "cache.staging").exists()
    train_main(train_args(llama, out, str(tmp_path / "run"), "--max-steps", "1",
                          "--min-loss-tokens", "2", "--calibration-samples", "0", "--cache",
                          cache))


def test_cache_resumes(llama, tmp_path, capsys):
    """An interrupted run's features are kept (staged, then in the cache) and a resumed run
    adds the new samples' features; staged rows past the data file's end are dropped; a
    complete cache is left alone."""
    from dspark_ops.train.cache import FeatureStage

    prompts = _prompts_for_the_cache(tmp_path / "p.jsonl")
    out, cache = str(tmp_path / "data.jsonl"), str(tmp_path / "cache")
    common = ["--target", llama, "--prompts", prompts, "--out", out, "--max-new-tokens", "12",
              "--temperature", "0", "--no-progress", "--cache", cache, "--target-layers", "0",
              "2", "--cache-dtype", "float32"]
    main(common + ["--max-samples", "2"])
    _cache_equals_a_prefill_pass(llama, out, cache, [0, 2])
    # a stale staged row, as a crash between staging and writing its line leaves one
    stage = FeatureStage(cache + ".staging", target_layer_ids=[0, 2], hidden_size=64,
                         dtype=torch.float32, target_name=llama)
    stage.put(len(_rows(out)), [5, 6], torch.ones(2, 128), torch.ones(2, 64))
    capsys.readouterr()
    main(common)
    assert "0 by a prefill pass" in capsys.readouterr().out  # the first two came from the cache
    assert len(_rows(out)) == 4
    samples = _cache_equals_a_prefill_pass(llama, out, cache, [0, 2])
    main(common)
    assert f"already holds all {len(samples)} samples" in capsys.readouterr().out


def test_cache_of_data_written_without_it(llama, tmp_path, capsys):
    """Rows generated without --cache get their features from one prefill pass."""
    prompts = _prompts_for_the_cache(tmp_path / "p.jsonl")
    out, cache = str(tmp_path / "data.jsonl"), str(tmp_path / "cache")
    common = ["--target", llama, "--prompts", prompts, "--out", out, "--max-new-tokens", "8",
              "--temperature", "0", "--no-progress"]
    main(common)
    capsys.readouterr()
    main(common + ["--cache", cache, "--cache-dtype", "float32", "--target-layers", "0", "2"])
    printed = capsys.readouterr().out
    assert "0 to generate" in printed
    assert "0 from features captured while generating or already cached" in printed
    _cache_equals_a_prefill_pass(llama, out, cache, [0, 2])


def test_cache_errors(llama, tmp_path):
    prompts = _prompts_for_the_cache(tmp_path / "p.jsonl")
    common = ["--target", llama, "--prompts", prompts, "--out", str(tmp_path / "d.jsonl"),
              "--no-progress"]
    with pytest.raises(SystemExit, match="--target-layers needs --cache"):
        main(common + ["--target-layers", "0"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--cache .*file: a file"):
        main(common + ["--cache", str(tmp_path / "file")])
    with pytest.raises(SystemExit, match=r"--target-layers \[0, 3\]: 3 is the target's final"):
        main(common + ["--cache", str(tmp_path / "c"), "--target-layers", "0", "3"])
    with pytest.raises(SystemExit, match="--max-length must be >= 1"):
        main(common + ["--max-length", "0"])


# -- teacher-forced rows: answers given, not generated ---------------------------------------

def test_teacher_forced_rows(llama, tmp_path, monkeypatch, capsys):
    """Rows with "answers" beside generated ones, in one batch: the given answers are the
    assistant's turns verbatim (a two-turn row too), the loss mask covers exactly their tokens
    and end-of-turn tokens, nothing is generated for them, and their cached features are a
    prefill pass's, as the trainer reads them."""
    import dspark_ops.prepare_data as prepare

    asked = []
    real = prepare._generate

    def generate(model, tok, prompts, args, stop, seed, capture=None):
        asked.extend(tok.decode(p) for p in prompts)
        return real(model, tok, prompts, args, stop, seed, capture)

    monkeypatch.setattr(prepare, "_generate", generate)
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "g", "turns": ["why is the sky blue?"]}\n'
                    '{"id": "f", "turns": ["write add"], "answers": ["def add(a, b):\\n'
                    '    return a + b"]}\n'
                    '{"id": "m", "turns": ["one", "two"], "answers": ["first answer", '
                    '"second answer"]}\n')
    out, cache = str(tmp_path / "data.jsonl"), str(tmp_path / "cache")
    main(["--target", llama, "--prompts", str(path), "--out", out, "--max-new-tokens", "8",
          "--batch-size", "3", "--temperature", "0", "--no-progress", "--cache", cache,
          "--target-layers", "0", "2", "--cache-dtype", "float32"])
    printed = capsys.readouterr().out
    rows = {r["id"]: r for r in _rows(out)}
    assert len(asked) == 1 and "sky" in asked[0]  # only the row without answers generated
    assert [m["content"] for m in rows["f"]["conversations"]] == [
        "write add", "def add(a, b):\n    return a + b"]
    assert [m["content"] for m in rows["m"]["conversations"]] == [
        "one", "first answer", "two", "second answer"]
    tok = tokenizer()
    for key, answers in (("f", ["def add(a, b):\n    return a + b"]),
                         ("m", ["first answer", "second answer"])):
        row = rows[key]
        rendered = tok.apply_chat_template(row["conversations"], tokenize=False)
        assert row["input_ids"] == tok(rendered, add_special_tokens=False).input_ids
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert masked == [t for a in answers for t in tok(a, add_special_tokens=False).input_ids
                          + [EOT]]
    assert "1 to generate, 2 teacher-forced" in printed
    assert "3 answers given (teacher-forced)" in printed
    assert "prefill: " in printed and "tokens/s)" in printed
    _cache_equals_a_prefill_pass(llama, out, cache, [0, 2])
    train_main(train_args(llama, out, str(tmp_path / "run"), "--max-steps", "1",
                          "--min-loss-tokens", "2", "--calibration-samples", "0", "--cache",
                          cache))


def test_teacher_forced_rows_need_the_chat_template(target, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["q"], "answers": ["a"]}\n')
    with pytest.raises(SystemExit, match="given 'answers' need the tokenizer's chat template"):
        main(["--target", target, "--prompts", str(path), "--out", str(tmp_path / "d.jsonl"),
              "--no-progress", "--no-chat-template"])
