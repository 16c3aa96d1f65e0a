"""bench/learning_curve.py: windowed means of a training log against the tokens seen, what the
last doubling of tokens bought, and its errors. Synthetic logs with known answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import learning_curve  # noqa: E402


def write_log(path: Path, taus, tokens_per_step=100, accept=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, tau in enumerate(taus):
            row = {"step": i + 1, "tokens": tokens_per_step, "tau_probabilistic": tau,
                   "accept_rate@0": (accept or taus)[i] - 1.0, "lr": 1e-3 / (i + 1)}
            f.write(json.dumps(row) + "\n")


def test_windows_tokens_and_gain(tmp_path):
    # 8 steps of 100 tokens, windows of 2: means 1.1, 1.3, 1.5, 1.7 at 200, 400, 600, 800 tokens.
    log = tmp_path / "dspark" / "metrics.jsonl"
    write_log(log, [1.0, 1.2, 1.2, 1.4, 1.4, 1.6, 1.6, 1.8])
    entry = learning_curve.read_curve(str(log), window=2)
    curve = entry["curve"]
    assert entry["steps"] == 8 and entry["tokens_total"] == 800
    assert curve["tokens"] == [200, 400, 600, 800]
    assert curve["tau"] == pytest.approx([1.1, 1.3, 1.5, 1.7])
    assert curve["accept_rate@0"] == pytest.approx([0.1, 0.3, 0.5, 0.7])
    assert curve["lr"] == pytest.approx([1e-3 / 2, 1e-3 / 4, 1e-3 / 6, 1e-3 / 8])
    # Half the tokens (400) ends the second window: 1.7 - 1.3.
    assert entry["tau_gain_last_doubling"] == pytest.approx(0.4)
    assert entry["tau_last_window"] == pytest.approx(1.7)


def test_a_partial_last_window_is_left_out(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write_log(log, [1.0, 1.2, 1.4, 1.6, 9.0])
    curve = learning_curve.read_curve(str(log), window=2)["curve"]
    assert curve["tokens"] == [200, 400] and curve["tau"] == pytest.approx([1.1, 1.5])


def test_command_writes_json_and_reads_it_back(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_log(runs / "dspark" / "metrics.jsonl", [1.0, 1.1, 1.2, 1.3])
    write_log(runs / "dflash" / "metrics.jsonl", [1.0, 1.05, 1.1, 1.15])
    out = tmp_path / "curve.json"
    results = learning_curve.main(["--runs", str(runs), "--window", "1", "--json", str(out),
                                   "--chart", ""])
    assert set(results["drafts"]) == {"dspark", "dflash"}
    assert json.loads(out.read_text())["drafts"]["dspark"]["curve"]["tau"] == \
        pytest.approx([1.0, 1.1, 1.2, 1.3])
    again = learning_curve.main(["--json", str(out), "--chart", "", "--chart-only"])
    assert again == json.loads(out.read_text())
    assert "dflash" in capsys.readouterr().out


def test_errors_name_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="no dspark, dflash, eagle3 training log"):
        learning_curve.main(["--runs", str(tmp_path), "--json", "", "--chart", ""])
    empty = tmp_path / "dspark" / "metrics.jsonl"
    empty.parent.mkdir()
    empty.write_text("")
    with pytest.raises(SystemExit, match="has no steps"):
        learning_curve.read_curve(str(empty), window=2)
    with pytest.raises(SystemExit):
        learning_curve.main(["--runs", str(tmp_path), "--window", "0"])
