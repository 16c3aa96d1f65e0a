"""The benchmark harness (bench/timing.py, bench/report.py): interleaved rounds, spread and load
flags, the table's legend and where results go. Timing-free: the competitors' durations are
forced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, timing  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def fake_clock(monkeypatch):
    """time_op returns the competitor's own scripted duration; calls are recorded in order."""
    calls = []

    def fake_time_op(fn, device, **budget):
        calls.append(fn.name)
        return fn.next_seconds()

    monkeypatch.setattr(timing, "time_op", fake_time_op)
    # A scripted row takes microseconds of real time, over which the clock-tick counts of
    # /proc/stat say nothing: no load unless a test sets one.
    monkeypatch.setattr(timing.LoadMeter, "others_cores", lambda self: 0.0)
    return calls


class Scripted:
    def __init__(self, name, seconds):
        self.name, self._seconds, self._i = name, list(seconds), 0

    def __call__(self):
        return None

    def next_seconds(self):
        value = self._seconds[self._i % len(self._seconds)]
        self._i += 1
        return value


def _timing(rounds):
    return timing.Timing(dict(min_run_time=1.0), dict(min_run_time=1.0), rounds=rounds)


def test_rounds_interleave_and_rotate(fake_clock):
    row = report.Row("op", "s", "v")
    competitors = {n: Scripted(n, [1e-3]) for n in ("ours", "ref", "eager")}
    timing.measure(row, competitors, CPU, _timing(3))
    assert fake_clock == ["ours", "ref", "eager", "ref", "eager", "ours", "eager", "ours", "ref"]
    assert (row.ours_us, row.reference_us, row.anchors["eager"]) == (1000.0, 1000.0, 1000.0)
    assert row.rounds == 3 and row.flags == [] and row.spread["ours"] == 0.0


def test_medians_of_rounds_and_best_baseline(fake_clock):
    row = report.Row("op", "s", "v")
    timing.measure(row, {"ours": Scripted("ours", [1e-3, 1e-3, 9e-3, 1e-3, 1e-3]),
                         "ref": Scripted("ref", [5e-3]), "eager": Scripted("eager", [2e-3])},
                   CPU, _timing(5))
    assert row.ours_us == 1000.0  # one slow round moves the median not at all
    assert row.best_baseline == ("eager", 2000.0)
    assert row.to_dict()["speedup_vs_best"] == 2.0


def test_noisy_row_is_measured_again_then_flagged(fake_clock):
    row = report.Row("op", "s", "v")
    noisy = Scripted("ours", [1e-3, 4e-3])  # every other round 4x slower
    timing.measure(row, {"ours": noisy, "ref": Scripted("ref", [1e-3])}, CPU, _timing(4))
    assert len([c for c in fake_clock if c == "ours"]) == 8  # 4 rounds, then 4 more
    assert row.rounds == 8 and "noisy" in row.flags
    assert row.spread["ours"] > timing.NOISY_SPREAD


def test_busy_flag_from_other_processes_load(fake_clock, monkeypatch):
    monkeypatch.setattr(timing.LoadMeter, "others_cores", lambda self: 1.7)
    row = report.Row("op", "s", "v")
    timing.measure(row, {"ours": Scripted("ours", [1e-3])}, CPU, _timing(2))
    assert row.flags == ["busy"] and row.others_load == 1.7


def test_failing_or_absent_competitor_is_not_measured(fake_clock):
    def broken():
        raise RuntimeError("no kernel")

    row = report.Row("op", "s", "v")
    timing.measure(row, {"ours": Scripted("ours", [1e-3]), "ref": None, "anchor": broken},
                   CPU, _timing(2))
    assert row.reference_us is None and row.anchors["anchor"] is None
    assert fake_clock == ["ours", "ours"]


def test_smoke_calls_each_competitor_twice_and_never_times_rounds(fake_clock, monkeypatch):
    """--smoke: one warm-up and one timed call per competitor, however noisy; no rounds."""
    class Counting(Scripted):
        calls = 0

        def __call__(self):
            self.calls += 1

    monkeypatch.setattr(timing, "_smoke", True)
    row = report.Row("op", "s", "v")
    competitors = {"ours": Counting("ours", [1e-3, 4e-3]), "ref": Counting("ref", [1e-3])}
    timing.measure(row, competitors, CPU, _timing(5))
    assert fake_clock == []  # time_op (the rounds) never ran
    assert [c.calls for c in competitors.values()] == [2, 2]
    assert row.rounds == 1 and row.ours_us is not None and row.reference_us is not None
    assert "noisy" not in row.flags


def test_smoke_flag_reaches_every_family(monkeypatch):
    """``python -m bench --smoke`` forwards the flag, and each family's parser accepts it."""
    from bench import __main__ as bench_main

    seen = []
    monkeypatch.setattr(bench_main, "families", lambda: ["fake_family"])
    monkeypatch.setattr(bench_main.importlib, "import_module", lambda name: type(
        "M", (), {"main": staticmethod(lambda argv, emit=False: seen.append(argv) or [])}))
    monkeypatch.setattr(bench_main, "write_results", lambda *a, **k: [])
    bench_main.main(["--smoke", "--device", "cpu", "--json-only"])
    assert "--smoke" in seen[0]
    parser = report.family_arg_parser("d", "q", "a")
    assert parser.parse_args(["--smoke"]).smoke


def test_load_meter_sees_a_busy_process():
    import subprocess

    meter = timing.LoadMeter()
    if meter.others_cores() is None:
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.0: pass"])
    spin.wait()
    assert meter.others_cores() > 0.3  # one spinning process over most of the interval


def test_table_legend_explains_every_column():
    row = report.Row("verify", "B=1", "sampled", ours_us=10.0, reference_us=30.0,
                     anchors={"eager-torch": 20.0}, extra={"acc.len": 2.0, "match": "1/1"},
                     others_load=0.1, flags=["noisy"], rounds=5, spread={"ours": 0.1})
    for wide in (False, True):
        text = report.format_table([row], wide=wide)
        header = text.splitlines()[0]
        legend = text.split("\n\n", 1)[1]
        for column in header.split():
            if column in ("us", "%"):  # the second word of "ours us", "% copy", ...
                continue
            assert f"  {column}" in legend, (column, wide)
    compact = report.format_table([row])
    assert "eager-torch" in compact and "2.00" in compact and "acc.len" not in compact.split("\n\n")[0]
    assert "acc.len" in report.format_table([row], wide=True)


def test_unexplained_family_column_is_an_error():
    row = report.Row("op", "s", "v", extra={"mystery": 1})
    with pytest.raises(KeyError, match="mystery"):
        report.format_table([row], wide=True)


def test_results_go_outside_the_tracked_tree(tmp_path):
    assert report.RESULTS_DIR.parts[-2:] == ("build", "bench-results")
    paths = report.write_results([report.Row("op", "s", "v", ours_us=1.0)], "unit", CPU,
                                 {"device": "cpu"}, results_dir=tmp_path)
    assert [p.parent for p in paths] == [tmp_path, tmp_path]
    assert "speedup_vs_best" in paths[1].read_text()


def test_only_the_decisive_competitors_make_a_row_noisy(fake_clock):
    row = report.Row("op", "s", "v")
    slow_and_noisy_ref = Scripted("ref", [1.0, 4.0])  # far slower than the best: not decisive
    timing.measure(row, {"ours": Scripted("ours", [1e-3]), "ref": slow_and_noisy_ref,
                         "eager": Scripted("eager", [2e-3])}, CPU, _timing(4))
    assert row.flags == [] and row.rounds == 4 and row.spread["ref"] > timing.NOISY_SPREAD


def test_smollm2_train_passes_the_recipe_to_each_trainer(tmp_path):
    """bench.smollm2_train's trainer command lines: every draft shares the recipe's flags;
    the Markov rank and the draft vocabulary are DSpark's; --init-from-target reaches the
    block drafts and not Eagle3 (no layer list to start from)."""
    import argparse

    from bench.smollm2_train import train_args

    args = argparse.Namespace(out=str(tmp_path), num_layers=2, anchors=32, batch_tokens=1024,
                              epochs=2, lr=6e-4, seed=42, max_length=512, markov_rank=64,
                              draft_vocab=8192, min_lr_ratio=0.1, init_from_target=True)
    commands = {arch: train_args(args, arch, "data.jsonl", "target")
                for arch in ("dspark", "dflash", "eagle3")}
    for arch, command in commands.items():
        flags = dict(zip(command, command[1:]))
        assert flags["--arch"] == arch and flags["--min-lr-ratio"] == "0.1"
        assert ("--init-from-target" in command) == (arch != "eagle3")
        assert ("--draft-vocab" in command) == (arch == "dspark")
        assert "--resume" not in command  # nothing to resume yet
    args.init_from_target = False
    assert "--init-from-target" not in train_args(args, "dspark", "data.jsonl", "target")
