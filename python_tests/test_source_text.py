"""python -m dspark_ops.source_text: standard-library functions as teacher-forced coding answers,
read from source without importing it, never one a held-out code prompt asks for."""

from __future__ import annotations

import json
import textwrap

import pytest

from dspark_ops import source_text
from dspark_ops.prepare_data import read_prompts


def _library(root):
    """A small standard library: what qualifies and each reason a function does not."""
    held = sorted(source_text.held_out_names())[0]
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(textwrap.dedent('''
        def shout(text):
            """Return the text in capitals."""
            return text.upper()

        def _private(x):
            """Hidden."""
            return x

        def silent(x):
            return x

        def outer():
            """Has a nested function."""
            def inner():
                """Nested: never its own row."""
            return inner
        '''))
    (root / "pkg" / "shapes.py").write_text(textwrap.dedent(f'''
        class Square:
            def area(self, side):
                """Compute the area of a square."""
                return side * side

            def _helper(self):
                """Private method."""

        class _Hidden:
            def shown(self):
                """A public method of a private class."""

        def {held}(x):
            """A held-out unit's name."""
            return x

        def long_one(x):
            """Far too long."""
            {"x = x + 1; " * 200}
            return x
        '''))
    (root / "test").mkdir()
    (root / "test" / "test_pkg.py").write_text('def check():\n    """In the test suite."""\n')
    (root / "_private_module.py").write_text('def hidden():\n    """A private module."""\n')
    (root / "broken.py").write_text("def (:\n")
    return root


def test_what_qualifies(tmp_path):
    found = source_text.stdlib_functions(400, str(_library(tmp_path)))
    assert [f.qualified for f in found] == ["pkg.shout", "pkg.outer", "pkg.shapes.Square.area"]
    area = found[-1]
    assert area.source.startswith("def area(self, side):\n")  # dedented out of its class
    assert area.summary == "Compute the area of a square."
    # the long function fits a larger limit
    assert "pkg.shapes.long_one" in [f.qualified for f in source_text.stdlib_functions(
        5000, str(tmp_path))]


def test_rows_are_seeded_and_answer_with_the_source(tmp_path):
    root = str(_library(tmp_path))
    rows = source_text.rows(max_chars=400, seed=3, root=root)
    assert rows == source_text.rows(max_chars=400, seed=3, root=root)
    assert [r["id"] for r in rows] == ["code-source-00000", "code-source-00001",
                                       "code-source-00002"]
    by_source = {r["source"]: r for r in rows}
    shout = by_source["pkg.shout"]
    assert shout["answers"] == ['```python\ndef shout(text):\n    """Return the text in '
                                'capitals."""\n    return text.upper()\n```']
    assert "returns the text in capitals." in shout["turns"][0]  # a task, as prompts words it
    outer = by_source["pkg.outer"]  # no imperative summary: asked for by name
    assert outer["turns"] == ["Write the Python function `outer` of `pkg`. Its docstring "
                              "begins: Has a nested function."]
    assert len(source_text.rows(1, max_chars=400, seed=3, root=root)) == 1
    orders = {tuple(r["source"] for r in source_text.rows(max_chars=400, seed=s, root=root))
              for s in range(6)}
    assert len(orders) > 1


def test_main_writes_what_prepare_data_reads(tmp_path, capsys):
    root = str(_library(tmp_path / "lib"))
    out = tmp_path / "rows.jsonl"
    source_text.main(["--out", str(out), "--stdlib", root, "--max-chars", "400"])
    assert "wrote 3 rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = read_prompts(str(out))
    assert [p.answers for p in prompts] == [r["answers"] for r in rows]
    assert [p.id for p in prompts] == [r["id"] for r in rows]


def test_errors(tmp_path):
    with pytest.raises(SystemExit, match="--stdlib .*: no such directory"):
        source_text.main(["--out", str(tmp_path / "o.jsonl"), "--stdlib", str(tmp_path / "no")])
    with pytest.raises(SystemExit, match="--max-chars must be >= 1"):
        source_text.main(["--out", str(tmp_path / "o.jsonl"), "--stdlib", str(tmp_path),
                          "--max-chars", "0"])
    with pytest.raises(SystemExit, match="--max-samples must be >= 0"):
        source_text.main(["--out", str(tmp_path / "o.jsonl"), "--stdlib", str(tmp_path),
                          "--max-samples", "-1"])
    with pytest.raises(SystemExit, match="no standard-library function qualifies"):
        source_text.main(["--out", str(tmp_path / "o.jsonl"), "--stdlib", str(tmp_path)])


def test_no_held_out_code_prompt_is_answered(tmp_path):
    """Every function a held-out code prompt asks for is left out wherever it is defined (by
    name), while a function of any other name is kept."""
    from dspark_ops import prompts

    held = {u.key.rsplit(".", 1)[-1] for u in prompts.units("code") if u.held_out}
    assert held and held == source_text.held_out_names()
    body = "".join(f'def {name}(x):\n    """Return x."""\n    return x\n\n'
                   for name in sorted(held) + ["kept_one"])
    (tmp_path / "everything.py").write_text(body)
    assert [f.name for f in source_text.stdlib_functions(400, str(tmp_path))] == ["kept_one"]
