"""The layout's invariants (CONTRIBUTING.md): what every op and every family must have in each
layer, and what the kernel and CUDA glue sources must not do. They read the source tree only."""

from __future__ import annotations

import ast
import re

import pytest

from source_tree import (
    CSRC, ROOT, family_of_file, header_ops, op_families, registrations, strip_comments,
)

# Families without a benchmark of their own, and what their kernels are.
NO_BENCHMARK = {
    "random": "philox_uniform: one thread per uniform writing N x count floats (random.cuh); the "
              "sampling kernels draw their uniforms inline",
}


def _quoted_includes(path):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M)


def _included_files(roots):
    """The files of roots and every file they include by a quoted path, transitively."""
    todo, seen = [p.resolve() for p in roots], {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = path.read_text()
        for name in _quoted_includes(path):
            included = path.parent / name
            if included.exists():
                todo.append(included.resolve())
    return seen


def _offending_includes(roots, pattern):
    pattern = re.compile(r'^\s*#\s*include\s+[<"](' + pattern + r")", re.M)
    return [f"{path.relative_to(ROOT)}: {hit.group(0).strip()}"
            for path, text in sorted(_included_files(roots).items())
            for hit in pattern.finditer(text)]


def test_kernels_are_torch_free():
    """csrc/kernels/ is compiled by nvcc without torch (fast .cu builds) and by g++ inside the
    emulator: neither it nor any header it includes may include torch, ATen or c10."""
    kernels = sorted((CSRC / "kernels").iterdir())
    assert kernels
    assert not _offending_includes(kernels, r"torch/|ATen/|c10/")


def test_kernels_folder_holds_device_code_only():
    """csrc/kernels/ is what nvcc compiles for the device and the emulator runs: every file there
    declares or launches device code (a __global__ or __device__ function, DSPARK_HOST_DEVICE math
    shared with the CPU kernels, or a DSPARK_LAUNCH), or is a family's launch interface
    (<family>_launch.h: the kernels' arguments and the launchers the ATen glue calls). Host-only
    helpers (such as device_cache.h) live in csrc/common/."""
    kernels = sorted((CSRC / "kernels").iterdir())
    assert kernels
    families = set(op_families().values())
    interfaces = {f"{family}_launch.h" for family in families}
    host_only = [p.name for p in kernels if p.name not in interfaces
                 and not re.search(r"__global__|__device__|DSPARK_HOST_DEVICE|DSPARK_LAUNCH",
                                   strip_comments(p.read_text()))]
    assert not host_only, f"host-only files in csrc/kernels/ (move them to csrc/common/): {host_only}"
    for name in sorted(interfaces):
        text = strip_comments((CSRC / "kernels" / name).read_text())
        assert re.search(r"\bcudaError_t launch_\w+\(", text), f"{name} declares no launcher"
        assert not re.search(r"__global__|__device__|DSPARK_LAUNCH|\{\s*DSPARK", text), (
            f"{name}: device code belongs in the family's .cuh, not its launch interface")


def _family_files(csrc=CSRC):
    """{family: the csrc files named after it}: <family>.cuh, <family>_<part>.* in every folder
    and sim/glue/<family>.cpp."""
    families = set(op_families().values())
    files = {f: set() for f in families}
    for path in csrc.rglob("*"):
        if not path.is_file() or "include" in path.relative_to(csrc).parts:
            continue
        for family in families:
            if path.stem == family or path.name.startswith(family + "_"):
                files[family].add(path.resolve())
    return files


def _family_part_owners(csrc=CSRC):
    """For every file of csrc/kernels/ and csrc/cpu/ named after a family: the files of other
    families that include it, and whether the family's own entry points (kernels/<family>.cuh,
    cpu/<family>_cpu.cpp and the family's other cpu/*.cpp) reach it. The map's rule: a file
    named after a family belongs to that family alone; what several families use carries a name
    of its own (sampling_math.h, filter.cuh, convert.cuh)."""
    files = _family_files(csrc)
    includers = {}
    for path in csrc.rglob("*"):
        if path.suffix in (".h", ".cuh", ".cpp", ".cu") and "include" not in path.relative_to(
                csrc).parts:
            for name in _quoted_includes(path):
                included = (path.parent / name).resolve()
                includers.setdefault(included, set()).add(path.resolve())
    problems = []
    for family, owned in sorted(files.items()):
        entries = [p for p in owned if p.parent.name == "cpu" and p.suffix == ".cpp"]
        entries += [p for p in owned if p.parent.name == "kernels" and p.name == f"{family}.cuh"]
        reached = set(_included_files(entries))
        for path in sorted(p for p in owned if p.parent.name in ("kernels", "cpu")):
            strangers = sorted(q.name for q in includers.get(path, ()) if q not in owned)
            if strangers:
                problems.append(f"{path.name} (family {family}) is included by {strangers}")
            if path not in reached:
                problems.append(f"{path.name} (family {family}) is not reached from {family}.cuh "
                                f"or cpu/{family}_*.cpp")
    return problems


def test_family_files_belong_to_their_family():
    """A family's files in csrc/kernels/ and csrc/cpu/ (<family>.cuh, <family>_<part>.cuh,
    <family>_<part>.h, <family>_*_cpu.cpp) are included by that family's files only, and its
    entry points reach every one of them: the map's family columns stay complete when a family is
    split into parts."""
    assert not _family_part_owners()


def test_cuda_launchers_are_torch_free():
    """nvcc compiles csrc/cuda/*.cu, the launchers and the kernels they instantiate: neither they
    nor any header they include may include torch, ATen or c10 (their headers would cost every
    nvcc run half a minute). The ATen glue is csrc/cuda/*_cuda.cpp, compiled by the C++ compiler."""
    launchers = sorted((CSRC / "cuda").glob("*.cu"))
    assert launchers and all(p.stem.endswith("_launch") for p in launchers), launchers
    assert not _offending_includes(launchers, r"torch/|ATen/|c10/")


def test_cuda_glue_includes_light_headers_only():
    """The ATen glue (csrc/cuda/*_cuda.cpp) and what it includes take ATen/c10 headers one by
    one: torch/extension.h (or torch/all.h, ATen/ATen.h) costs tens of seconds per file."""
    glue = sorted((CSRC / "cuda").glob("*_cuda.cpp"))
    assert glue
    assert not _offending_includes(
        glue, r"torch/extension\.h|torch/all\.h|torch/torch\.h|ATen/ATen\.h")


def test_glue_fills_nothing_per_call():
    """A zero-filled allocation in the CUDA glue (at::zeros, or a fill_/zero_ of a fresh tensor)
    would be one more PyTorch kernel on the stream per call, which the static model does not
    charge: counters live in common/stream_counters.h's buffer per stream (filled when made or
    grown, and per call only under CUDA-graph capture), which the kernels return to zero."""
    glue = sorted((CSRC / "cuda").glob("*_cuda.cpp")) + sorted((CSRC / "cuda").glob("*.cu"))
    assert glue
    for path in glue:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0]
            assert not re.search(r"at::zeros|\.zero_\(|\.fill_\(|cudaMemset", code), (
                f"{path.name}:{n}: a fill per call: {line.strip()}")


def test_every_cuda_glue_has_an_emulator_glue():
    """The emulated tests run the CUDA glue and launchers themselves: csrc/sim/glue/<family>.cpp
    includes csrc/cuda/<family>_launch.cu and csrc/cuda/<family>_cuda.cpp (build.py compiles every
    glue/*.cpp), and csrc/cuda/ holds nothing else."""
    cuda = {family_of_file(p, "_cuda"): p for p in sorted((CSRC / "cuda").glob("*_cuda.cpp"))}
    launch = {family_of_file(p, "_launch"): p for p in sorted((CSRC / "cuda").glob("*_launch.cu"))}
    glue = {p.stem: p for p in sorted((CSRC / "sim" / "glue").glob("*.cpp"))}
    assert cuda and set(cuda) == set(glue) == set(launch), (sorted(cuda), sorted(launch),
                                                            sorted(glue))
    assert sorted((CSRC / "cuda").iterdir()) == sorted([*cuda.values(), *launch.values()])
    for family, path in glue.items():
        includes = _quoted_includes(path)
        assert f"../../cuda/{family}_launch.cu" in includes, path.name
        assert f"../../cuda/{family}_cuda.cpp" in includes, path.name


def test_every_op_has_cpu_and_cuda_registrations():
    """Each op of csrc/schemas.h has exactly one CPU and one CUDA kernel, registered by the
    files of one family (cpu/<family>_cpu.cpp, cuda/<family>_cuda.cpp), and nothing else is."""
    ops = header_ops()
    assert ops and len(set(ops)) == len(ops), ops
    cpu = registrations("cpu", "CPU")
    cuda = registrations("cuda", "CUDA")
    for backend, found in (("CPU", cpu), ("CUDA", cuda)):
        registered = [op for names in found.values() for op in names]
        missing = sorted(set(ops) - set(registered))
        extra = sorted(op for op in set(registered) if registered.count(op) > 1 or op not in ops)
        assert not missing and not extra, f"{backend}: no kernel for {missing}; extra: {extra}"
    cpu_family = {op: family_of_file(p, "_cpu") for p, names in cpu.items() for op in names}
    cuda_family = {op: family_of_file(p, "_cuda") for p, names in cuda.items() for op in names}
    split = {op: (cpu_family[op], cuda_family[op]) for op in ops
             if cpu_family[op] != cuda_family[op]}
    assert not split, f"op: (CPU family, CUDA family) differ: {split}"


def test_every_family_has_its_layer_files():
    """The map of CONTRIBUTING.md: a family's files in every layer, named after it."""
    families = sorted(set(op_families().values()))
    assert families
    for family in families:
        paths = [
            f"csrc/args/{family}_args.h",
            f"csrc/cpu/{family}_cpu.cpp",
            f"csrc/kernels/{family}.cuh",
            f"csrc/kernels/{family}_launch.h",
            f"csrc/cuda/{family}_launch.cu",
            f"csrc/cuda/{family}_cuda.cpp",
            f"csrc/sim/glue/{family}.cpp",
            f"dspark_ops/ops/{family}.py",
            f"python_tests/test_{family}.py",
            f"python_tests/test_sim_{family}.py",
        ]
        if family not in NO_BENCHMARK:
            paths.append(f"bench/bench_{family}.py")
        missing = [p for p in paths if not (ROOT / p).is_file()]
        assert not missing, f"family {family}: {missing}"
    assert set(NO_BENCHMARK) <= set(families)


def test_every_op_has_its_fake_in_its_family_module():
    """torch.compile needs a fake kernel per op, kept beside the op's wrapper."""
    for op, family in op_families().items():
        text = (ROOT / "dspark_ops" / "ops" / f"{family}.py").read_text()
        assert f'register_fake("dspark_ops::{op}")' in text, (op, family)


def test_every_op_is_in_the_static_model():
    """bench/static/kernels.py models each op's CUDA kernels, or says in NOT_MODELLED why not."""
    from bench.static import kernels

    tree = ast.parse((ROOT / "bench" / "static" / "kernels.py").read_text())
    statements = [s for s in tree.body
                  if not (isinstance(s, ast.Assign)
                          and any(getattr(t, "id", None) == "NOT_MODELLED" for t in s.targets))]
    strings = {node.value for s in statements for node in ast.walk(s)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    ops = set(header_ops())
    modelled = {op for op in ops if op in strings}
    excused = set(kernels.NOT_MODELLED)
    unknown = sorted(ops - modelled - excused)
    assert not unknown, f"neither modelled nor in NOT_MODELLED: {unknown}"
    assert not excused & modelled, f"modelled, yet in NOT_MODELLED: {sorted(excused & modelled)}"
    assert excused <= ops, f"NOT_MODELLED names no op of csrc/schemas.h: {sorted(excused - ops)}"


def test_static_model_takes_every_launch_from_a_plan():
    """bench/static/kernels.py re-derives no launch configuration: its model launches are made
    by `planned`, from a launch the real code recorded in the emulator (bench/static/plans.py),
    and it sizes no grid by occupancy itself."""
    tree = ast.parse((ROOT / "bench" / "static" / "kernels.py").read_text())
    outside = []
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef) or function.name == "planned":
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                    "Launch", "occ_of", "occupancy"):
                outside.append(f"{function.name}: {node.func.id}(...)")
    # evaluate() computes the occupancy of a planned launch for its time, not for its grid; so do
    # verify_op (the resident blocks its requests' chains are scheduled on) and attention_op
    # (the rounds of blocks on the busiest SM).
    assert outside == ["occ_of: occupancy(...)", "evaluate: occ_of(...)", "verify_op: occ_of(...)",
                       "attention_op: occ_of(...)"], outside


def test_contributing_maps_every_op():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    families = op_families()
    for op in header_ops():
        family = families.get(op, r"\w+")
        assert re.search(rf"^\| `{op}` \| {family} \|", text, re.M), f"no map row for {op}"


def test_sources_are_comment_stripped_as_meant():
    # The helpers above read code, not comments: a commented-out registration does not count.
    assert strip_comments('a // m.impl("x")\nb /* m.impl("y") */ "//kept"') == 'a  \nb   "//kept"'


def _imported_modules(path):
    """The top-level names of every module ``path`` imports, at any depth of its code."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0]


def test_no_test_file_imports_another():
    """Test files are not libraries: what several of them share lives in python_tests/cases/
    (input builders, output checks, argument-error tables) or in conftest.py (fixtures)."""
    tests = ROOT / "python_tests"
    sources = sorted(tests.rglob("*.py"))
    test_modules = {p.stem for p in sources if p.name.startswith("test_")}
    assert len(test_modules) > 10, test_modules
    offending = sorted(f"{p.relative_to(ROOT)} imports {name}" for p in sources
                       for name in set(_imported_modules(p)) if name in test_modules)
    assert not offending, offending


def test_the_import_check_sees_a_test_file_import(tmp_path):
    # The check above reads imports anywhere in a file, including inside a function.
    path = tmp_path / "test_example.py"
    path.write_text("import os\n\ndef helper():\n    from test_verify import make_case\n")
    assert set(_imported_modules(path)) == {"os", "test_verify"}


def _module_imports(package: str = "dspark_ops") -> dict:
    """Each module of ``package`` and the modules of ``package`` it imports, at any depth of its
    code (a lazy import inside a function counts: it is still a dependency)."""
    paths = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        paths[".".join(parts)] = path
    graph = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                for alias in node.names:  # `from . import x` imports the module x
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in paths else base)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _import_circles(graph: dict) -> list:
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


@pytest.mark.parametrize("package", ["dspark_ops", "bench"])
def test_no_import_circles(package):
    """The modules of the package and of the benchmarks import one another without a circle:
    each module can be read knowing only what it imports."""
    circles = _import_circles(_module_imports(package))
    assert not circles, circles


def test_the_circle_check_sees_a_circle():
    assert _import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_import_only_models_and_ops():
    """dspark_ops.models (the draft families, their backbone, the tiny target) stands on the ops
    alone: the decoder, the proposers and the trainer build on it, never the other way."""
    allowed = ("dspark_ops.models", "dspark_ops.ops", "dspark_ops.outputs",
               "dspark_ops.sampling", "dspark_ops._library", "dspark_ops._fake_checks")
    offending = sorted(f"{name} imports {target}"
                       for name, targets in _module_imports().items()
                       if name.startswith("dspark_ops.models") for target in targets
                       if not target.startswith(allowed))
    assert not offending, offending


def test_one_registry_chooses_the_draft_family():
    """Only dspark_ops.models.registry names a family's classes to choose between them: no
    isinstance test against a draft or config class outside the family's own module."""
    family_classes = {"Eagle3Draft", "Eagle3Config", "Gemma4DSparkDraft", "Gemma4DSparkConfig"}
    offending = []
    for path in sorted((ROOT / "dspark_ops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2):
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if named & family_classes and path.stem not in ("eagle3", "gemma4"):
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offending, offending
