"""``python -m dspark_ops.source_text``: training prompts answered with text the target did not
write: the Python standard library's own functions, each asked for as a coding task and answered
with its source.

``python -m dspark_ops.prepare_data`` trains on such rows teacher-forced: a row's ``"answers"``
are taken as the assistant's turns instead of being generated, so the only cost is one prefill
pass for the target's features (about 390 tokens/s against about 90 generated tokens/s for
SmolLM2 on two CPU cores). The draft still learns the *target's* distribution at every position
(its loss compares the draft with the target's logits there); what changes is that the context
is written by someone else.

The functions are read from the standard library's ``.py`` files with :mod:`ast`, never
imported: every public module-level function and public method of a module-level class that has
a docstring, outside private modules, the test suites and the IDLE, 2to3 and demo packages,
whose source is at most ``--max-chars`` characters. A function whose name is also the name of a held-out code unit
of :mod:`dspark_ops.prompts` (the functions the held-out code prompts ask for) is left out, so no
held-out task is ever answered in training. The functions are drawn in a seeded order; the same
seed, sizes and Python version write byte-identical files::

    python -m dspark_ops.source_text --out runs/code_source.jsonl [--max-samples 2000]
        [--max-chars 1600] [--seed 0]

Each line is ``{"id": "code-source-NNNNN", "category": "code", "source": "<module>.<name>",
"turns": [task], "answers": ["```python\\n<source>\\n```"]}``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import random
import sys
import sysconfig
import textwrap
from typing import Iterator, List, Optional, Sequence

from . import prompts as _prompts

__all__ = ["SourceFunction", "held_out_names", "main", "rows", "stdlib_functions"]

# Standard-library folders that are not library code a user asks for.
_SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip",
                 "site-packages", "dist-packages", "__pycache__", "__phello__"}


@dataclasses.dataclass(frozen=True)
class SourceFunction:
    """One standard-library function or method and what a row needs of it."""

    qualified: str   # module[.Class].name
    name: str
    summary: str     # the docstring's first paragraph on one line
    source: str      # dedented, decorators excluded


def held_out_names() -> set:
    """Short names of the held-out code units: functions no training row may answer with."""
    return {u.key.rsplit(".", 1)[-1] for u in _prompts.units("code") if u.held_out}


def _module_name(path: str, root: str) -> str:
    parts = os.path.relpath(path, root)[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _functions_of(tree: ast.Module) -> Iterator[tuple]:
    """(class name or None, function node): module-level functions and methods of module-level
    classes, public ones only."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, item


def stdlib_functions(max_chars: int, root: Optional[str] = None) -> List[SourceFunction]:
    """Every function of the standard library under ``root`` (default: this Python's) that a
    row may use, in a fixed order (files by path, then by position in the file)."""
    root = root or sysconfig.get_paths()["stdlib"]
    excluded = held_out_names()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for file in sorted(files):
            if not file.endswith(".py") or file == "__main__.py":
                continue
            path = os.path.join(folder, file)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                tree = ast.parse(text)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                continue  # a file this Python cannot read is simply not a source
            module = _module_name(path, root)
            if any(part.startswith("_") for part in module.split(".")):
                continue  # a private module: not what a user asks for
            for owner, node in _functions_of(tree):
                if node.name.startswith("_") or node.name in excluded:
                    continue
                doc = ast.get_docstring(node)
                segment = ast.get_source_segment(text, node, padded=True)
                if not doc or not segment:
                    continue
                source = textwrap.dedent(segment).strip("\n")
                if len(source) > max_chars:
                    continue
                summary = " ".join(doc.split("\n\n", 1)[0].split())
                qualified = ".".join(p for p in (module, owner, node.name) if p)
                found.append(SourceFunction(qualified, node.name, summary, source))
    return found


def _task(function: SourceFunction, rng: random.Random) -> str:
    tasks = _prompts.code_tasks(function.summary, function.name, function.qualified)
    if tasks is not None:
        return rng.choice(tasks)
    owner = function.qualified.rsplit(".", 1)[0]
    return (f"Write the Python function `{function.name}` of `{owner}`. "
            f"Its docstring begins: {function.summary}")


def rows(max_samples: Optional[int] = None, *, max_chars: int = 1600, seed: int = 0,
         root: Optional[str] = None) -> List[dict]:
    """The rows :func:`main` writes: the functions in a seeded order, the first
    ``max_samples`` of them (all by default)."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if max_samples is not None and max_samples < 0:
        raise ValueError(f"max_samples must be >= 0, got {max_samples}")
    functions = stdlib_functions(max_chars, root)
    random.Random(f"{seed}/source/order").shuffle(functions)
    chosen = functions[:max_samples] if max_samples is not None else functions
    return [{"id": f"code-source-{i:05d}", "category": "code", "source": f.qualified,
             "turns": [_task(f, random.Random(f"{seed}/source/{f.qualified}"))],
             "answers": [f"```python\n{f.source}\n```"]}
            for i, f in enumerate(chosen)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.source_text", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output JSONL (overwritten)")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="the first N functions of the seeded order (default: all)")
    parser.add_argument("--max-chars", type=int, default=1600,
                        help="longest source kept, in characters (SmolLM2's tokenizer: about "
                             "3.5 characters a token)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stdlib", default=None,
                        help="standard-library folder to read (default: this Python's)")
    args = parser.parse_args(argv)
    if args.stdlib is not None and not os.path.isdir(args.stdlib):
        raise SystemExit(f"--stdlib {args.stdlib}: no such directory")
    try:
        found = rows(args.max_samples, max_chars=args.max_chars, seed=args.seed,
                     root=args.stdlib)
    except ValueError as error:
        raise SystemExit(f"--{str(error).replace('_', '-', 1)}") from error
    if not found:
        raise SystemExit("no standard-library function qualifies (check --stdlib and "
                         "--max-chars)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in found:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    characters = sum(len(r["answers"][0]) for r in found)
    print(f"wrote {len(found)} rows ({characters} answer characters) to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
