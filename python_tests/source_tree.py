"""The source tree read as data, for the tests that hold its layers together: the schemas of
csrc/schemas.h (the one list of ops) and the ops each backend's sources register, by family."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"

_STRING_OR_COMMA = re.compile(r'"((?:[^"\\]|\\.)*)"|(,)')
_IMPL_BLOCK = re.compile(
    r"TORCH_LIBRARY_IMPL\(\s*dspark_ops\s*,\s*(\w+)\s*,\s*m\s*\)\s*\{([^}]*)\}")
_IMPL = re.compile(r'm\.impl\(\s*"(\w+)"')


def strip_comments(text: str) -> str:
    """C++ source without its // and /* */ comments (string literals kept)."""
    pattern = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*.*?\*/', re.S)
    return pattern.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text)


def header_schemas(path: Path = CSRC / "schemas.h") -> list:
    """kSchemas of csrc/schemas.h, in order: each schema's adjacent string literals joined."""
    text = strip_comments(path.read_text())
    start = text.index("kSchemas[]")
    body = text[text.index("{", start) + 1:text.index("};", start)]
    schemas, parts = [], []
    for m in _STRING_OR_COMMA.finditer(body):
        if m.group(2):
            schemas.append("".join(parts))
            parts = []
        else:
            parts.append(m.group(1))
    if parts:
        schemas.append("".join(parts))
    return schemas


def op_name(schema: str) -> str:
    return schema.split("(", 1)[0]


def header_ops() -> list:
    """The op names of csrc/schemas.h, in its order."""
    return [op_name(s) for s in header_schemas()]


def registrations(folder: str, backend: str) -> dict:
    """{source file: [op names]} of every TORCH_LIBRARY_IMPL(dspark_ops, <backend>, m) block in
    csrc/<folder> (m.impl("<op>", ...) lines)."""
    found = {}
    for path in sorted((CSRC / folder).iterdir()):
        if path.suffix not in (".cpp", ".cu"):
            continue
        for block in _IMPL_BLOCK.finditer(strip_comments(path.read_text())):
            if block.group(1) == backend:
                found.setdefault(path, []).extend(_IMPL.findall(block.group(2)))
    return found


def family_of_file(path: Path, suffix: str) -> str:
    """'verify' for csrc/cpu/verify_cpu.cpp (suffix '_cpu') or csrc/cuda/verify_cuda.cpp."""
    assert path.stem.endswith(suffix), path
    return path.stem[: -len(suffix)]


def op_families() -> dict:
    """{op: family}: the family is the file of csrc/cpu/ that registers the op's CPU kernel."""
    return {op: family_of_file(path, "_cpu")
            for path, ops in registrations("cpu", "CPU").items() for op in ops}
