"""Builds the SIMT emulator library the tests load: g++ compiles the CUDA glue and launchers
(csrc/cuda/) and kernels (csrc/kernels/*.cuh) against csrc/sim/prelude.h into
build/sim/<flavour>/dspark_ops_sim.so, which registers torch.ops.dspark_ops_sim.* (the CUDA entry points, running on CPU tensors).

    python csrc/sim/build.py [plain|race|asan ...]     (default: plain)

Flavours:
  plain  the emulator alone (barrier, shuffle, mma and launch checks);
  race   kernel code compiled with g++'s -fsanitize=thread instrumentation, whose callbacks
         csrc/sim/race.cpp implements as a barrier-aware race and uninitialised-shared-memory checker;
  asan   kernel code under AddressSanitizer + UBSan (load with LD_PRELOAD of libasan, see Makefile);
  coverage  plain with gcov instrumentation of the kernel code (make sim-coverage reports the lines
         of csrc/kernels and csrc/cuda the emulated tests reach).
Incremental (ninja); MAX_JOBS sets the parallelism.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import sysconfig

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIM = os.path.join(ROOT, "csrc", "sim")
FLAVOURS = ("plain", "race", "asan", "coverage")


def cuda_include() -> str:
    """The toolkit's include directory: the headers are compiled in host mode, nothing is linked."""
    candidates = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        nvcc = os.path.join(folder, "nvcc")
        if os.path.exists(nvcc):  # may be a wrapper outside the toolkit: only a candidate
            candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.join(root, "include")
    sys.exit("dspark_ops sim: no CUDA toolkit headers found (set CUDA_HOME to the toolkit root)")


def launch_bounds() -> str:
    """DSPARK_SIM_BOUNDS(name, threads) for every __launch_bounds__ in the kernel sources. Its
    arguments may hold calls of their own (a blocks-per-SM expression), so each is read by
    matching parentheses, not by a regular expression."""
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cuh")))
    sources.append(os.path.join(SIM, "selftest.cpp"))
    lines = []
    for path in sources:
        text = open(path).read()
        for m in re.finditer(r"__launch_bounds__\(", text):
            depth, end, first_comma = 1, m.end(), None
            while depth and end < len(text):
                c = text[end]
                depth += {"(": 1, ")": -1}.get(c, 0)
                if c == "," and depth == 1 and first_comma is None:
                    first_comma = end
                end += 1
            threads = text[m.end():(first_comma if first_comma is not None else end - 1)]
            name = re.match(r"\s*(\w+)\s*\(", text[end:])
            if name:
                lines.append(f'DSPARK_SIM_BOUNDS("{name.group(1)}", {threads.strip()})')
    return "\n".join(lines) + "\n"


def kernel_includes(generated: str) -> str:
    """An #include of every csrc/kernels/*.cuh (bindings.cpp: the launch bounds name their
    constants), relative to the generated folder that holds this list."""
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cuh")))
    return "".join(f'#include "{os.path.relpath(path, generated)}"\n' for path in sources)


def write_if_changed(path: str, text: str) -> None:
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def build(flavour: str) -> str:
    out = os.path.join(ROOT, "build", "sim", flavour)
    os.makedirs(out, exist_ok=True)
    generated = os.path.join(ROOT, "build", "sim", "generated")
    os.makedirs(generated, exist_ok=True)
    write_if_changed(os.path.join(generated, "launch_bounds.inc"), launch_bounds())
    write_if_changed(os.path.join(generated, "kernels.inc"), kernel_includes(generated))

    cuda = cuda_include()
    os.environ.setdefault("CUDA_HOME", os.path.dirname(cuda))  # else torch guesses, and says so
    import torch.utils.cpp_extension as cpp_extension

    includes = [os.path.join(SIM, "include"), generated, *cpp_extension.include_paths(), cuda,
                os.path.join(cuda, "cccl"), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fno-strict-aliasing: the kernels read 16-byte vector loads through pointers of the element
    # type, which nvcc compiles as meant and g++'s type-based alias analysis would not.
    base = ["-std=c++20", "-fPIC", "-O2", "-g1", "-fvisibility=hidden", "-fno-omit-frame-pointer",
            "-fno-strict-aliasing",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wno-unknown-pragmas", "-Wno-attributes",
            *[f"-I{p}" for p in includes]]
    flavour_defines = {"plain": [], "race": ["-DDSPARK_SIM_RACE"], "asan": ["-DDSPARK_SIM_ASAN"],
                       "coverage": []}
    kernel_flags = {
        "plain": [],
        "race": ["-fsanitize=thread"],
        "asan": ["-fsanitize=address,undefined", "-fsanitize-recover=all",
                 "-fno-sanitize=vptr", "-O1"],
        "coverage": ["--coverage", "-O0"],
    }[flavour]
    link_flags = {"asan": ["-fsanitize=address,undefined"], "coverage": ["--coverage"]}.get(flavour, [])

    # Argument checks and output allocation (csrc/args, csrc/common): not kernel code, built once.
    host_sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "args", "*.cpp")) +
                          glob.glob(os.path.join(ROOT, "csrc", "common", "*.cpp")))
    runtime_sources = [os.path.join(SIM, "runtime.cpp")] + (
        [os.path.join(SIM, "race.cpp")] if flavour == "race" else [])
    kernel_sources = sorted(glob.glob(os.path.join(SIM, "glue", "*.cpp"))) + [
        os.path.join(SIM, "bindings.cpp"), os.path.join(SIM, "selftest.cpp")]

    q = shlex.quote
    rules = [
        f"builddir = {q(out)}",
        "rule cxx",
        "  command = g++ $flags -MMD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = sim[" + flavour + "] $in",
        "rule link",
        "  command = g++ -shared $in -o $out $flags",
        "  description = sim[" + flavour + "] link $out",
    ]
    objects = []

    def compile_rule(source: str, obj: str, flags: list[str]) -> None:
        rules.append(f"build {q(obj)}: cxx {q(source)}")
        rules.append("  flags = " + " ".join(q(f) for f in flags))
        objects.append(obj)

    common = os.path.join(ROOT, "build", "sim", "host")
    for s in host_sources:
        compile_rule(s, os.path.join(common, os.path.basename(s) + ".o"), base + ["-DDSPARK_OPS_SIM=1"])
    for s in runtime_sources:
        compile_rule(s, os.path.join(out, os.path.basename(s) + ".o"), base + flavour_defines[flavour])
    for s in kernel_sources:
        name = os.path.relpath(s, SIM).replace(os.sep, "_")
        compile_rule(s, os.path.join(out, name + ".o"),
                     base + flavour_defines[flavour] + kernel_flags)
    library = os.path.join(out, "dspark_ops_sim.so")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    rules.append(f"build {q(library)}: link " + " ".join(q(o) for o in objects))
    rules.append("  flags = " + " ".join(q(f) for f in [
        f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}",
        "-Wl,-z,defs", *link_flags]))
    ninja_file = os.path.join(out, "build.ninja")
    write_if_changed(ninja_file, "\n".join(rules) + "\n")
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
    subprocess.run(["ninja", "-f", ninja_file, "-j", jobs], check=True, cwd=ROOT)
    return library


def main(argv: list[str]) -> None:
    flavours = argv or ["plain"]
    for f in flavours:
        if f not in FLAVOURS:
            sys.exit(f"dspark_ops sim: unknown flavour {f!r}; choose from {', '.join(FLAVOURS)}")
    for f in flavours:
        print("dspark_ops sim: built", build(f), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
