"""dspark_ops.prompts: the prompt sets are byte-identical for the same seed (also across
processes with different hash seeds), in DeepSpec's format, of the asked sizes, and the held-out
sets are disjoint from training by construction (disjoint units) and in the files; a leak is
caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_ops import prompts
from dspark_ops.eval import read_first_turns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["train.jsonl"] + [f"eval_{c}.jsonl" for c in prompts.CATEGORIES] + ["manifest.json"]


def read_rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def default_sets(tmp_path_factory):
    """The default sizes and seed, written once for the module."""
    out = tmp_path_factory.mktemp("prompts")
    prompts.write(str(out))
    return out


def test_same_seed_same_bytes_across_processes(default_sets, tmp_path):
    """The command in a fresh interpreter with another hash seed writes the same bytes as the
    in-process writer."""
    env = dict(os.environ, PYTHONHASHSEED="12345",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    result = subprocess.run([sys.executable, "-m", "dspark_ops.prompts", "--out", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (default_sets / name).read_bytes(), name


def test_another_seed_other_prompts_same_split(default_sets, tmp_path):
    prompts.write(str(tmp_path), seed=1)
    for name in FILES[:-1]:
        assert (tmp_path / name).read_bytes() != (default_sets / name).read_bytes(), name
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    default = json.loads((default_sets / "manifest.json").read_text())
    assert manifest["seed"] == 1
    assert manifest["categories"] == default["categories"]


def test_format_and_counts(default_sets):
    train = read_rows(default_sets / "train.jsonl")
    # interleaved, so that any prefix is balanced
    assert [r["category"] for r in train] == [c for _ in range(2000) for c in prompts.CATEGORIES]
    assert [r["id"] for r in train[:6]] == [f"{c}-train-{i:05d}" for i in range(2)
                                            for c in prompts.CATEGORIES]
    ids = [r["id"] for r in train]
    for category in prompts.CATEGORIES:
        held = read_rows(default_sets / f"eval_{category}.jsonl")
        assert len(held) == 40
        assert {r["category"] for r in held} == {category}
        assert [r["id"] for r in held] == [f"{category}-eval-{i:04d}" for i in range(40)]
        ids += [r["id"] for r in held]
        # what python -m dspark_ops.eval --data reads
        assert read_first_turns(str(default_sets / f"eval_{category}.jsonl")) == [
            r["turns"][0] for r in held]
    assert len(set(ids)) == len(ids)
    for row in train + held:
        assert list(row) == ["id", "category", "turns"]
        assert isinstance(row["turns"], list) and len(row["turns"]) == 1
        text = row["turns"][0]
        assert isinstance(text, str) and text == text.strip() and len(text) > 10
        assert "{" not in text and "}" not in text  # no template field left unfilled
    for category in prompts.CATEGORIES:  # no duplicates within a set
        texts = [r["turns"][0] for r in train if r["category"] == category]
        assert len(set(texts)) == len(texts)


def test_held_out_disjoint_in_files(default_sets):
    train = {r["turns"][0] for r in read_rows(default_sets / "train.jsonl")}
    for category in prompts.CATEGORIES:
        held = [r["turns"][0] for r in read_rows(default_sets / f"eval_{category}.jsonl")]
        assert len(set(held)) == len(held)
        assert not set(held) & train, category


@pytest.mark.parametrize("category", ["code", "chat"])
def test_held_out_disjoint_by_construction(category):
    """Every prompt any held-out unit can produce is outside everything the training units can
    produce (code and chat units are finite: enumerate them all)."""
    import random

    pool = prompts.units(category)
    everything = {u.key: set(u.stream(random.Random(0))) for u in pool}
    train = set().union(*(everything[u.key] for u in pool if not u.held_out))
    held = set().union(*(everything[u.key] for u in pool if u.held_out))
    assert held and train and not held & train
    assert len({u.key for u in pool}) == len(pool)


def test_split_fixed_and_sized():
    """The split does not depend on the seed; every category has held-out units of several
    kinds, and room for the default sizes."""
    for category in prompts.CATEGORIES:
        pool = prompts.units(category)
        held = [u for u in pool if u.held_out]
        assert 5 <= len(held) < len(pool) / 3, category
    math_held = {u.key for u in prompts.units("math") if u.held_out}
    assert {"two_step", "lcm", "circle", "share"} <= math_held  # algebra, number theory, ...
    chat_kinds = {u.key.split("/")[0] for u in prompts.units("chat") if u.held_out}
    assert len(chat_kinds) >= 4
    assert prompts.held_out("chat", "place/Paris") == prompts.held_out("chat", "place/Paris")


def test_smaller_set_is_a_prefix(default_sets):
    train, held = prompts.build("code", 300, 10)
    full = [r for r in read_rows(default_sets / "train.jsonl") if r["category"] == "code"]
    assert train == full[:300]
    assert held == read_rows(default_sets / "eval_code.jsonl")[:10]


def test_code_tasks_are_sentences():
    """Tasks read "... a Python function that <third-person verb> ...", later verbs agreeing."""
    import random

    unit = next(u for u in prompts.units("code") if u.key == "heapq.heapreplace")
    texts = list(unit.stream(random.Random(0)))
    assert ("Write a Python function that pops and returns the current smallest value, and adds "
            "the new item.") in texts
    assert prompts._task("Return the sine of z.") == "returns the sine of z."
    assert prompts._task("Return fmod(x, y), according to platform C.") is None
    assert prompts._task("Alternative chain constructor taking a single iterable.") is None


def test_too_many_asked():
    with pytest.raises(ValueError, match="distinct train prompts exist"):
        prompts.build("chat", 10 ** 6, 1)
    with pytest.raises(ValueError, match="unknown categories"):
        prompts.write("unused", categories=["poetry"])


def test_leak_is_caught(monkeypatch):
    """A broken split (a held-out unit that also serves training prompts) must fail the writer's
    disjointness check."""
    import dataclasses

    real = prompts.units

    def leaky(category):
        pool = real(category)
        first_train = next(u for u in pool if not u.held_out)
        return pool + [dataclasses.replace(first_train, key="leak", held_out=True)]

    monkeypatch.setattr(prompts, "units", leaky)
    # Most of the copied unit's prompts are drawn on both sides (4000 of the ~4800 training
    # prompts; about 9 from each of the 34 held-out units).
    with pytest.raises(RuntimeError, match="held-out prompts also in training"):
        prompts.build("chat", 4000, 300)


def test_command_sizes_and_categories(tmp_path, capsys):
    prompts.main(["--out", str(tmp_path), "--train-per-category", "7", "--eval-per-category", "3",
                  "--categories", "math", "chat", "--seed", "5"])
    assert "train" in capsys.readouterr().out
    assert len(read_rows(tmp_path / "train.jsonl")) == 14
    assert len(read_rows(tmp_path / "eval_chat.jsonl")) == 3
    assert not (tmp_path / "eval_code.jsonl").exists()
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 5
