"""Builds the operator library's CPU flavour under AddressSanitizer + UndefinedBehaviorSanitizer:
the sources setup.py compiles for CPU (csrc/*.cpp, csrc/common, csrc/args, csrc/cpu) with the same
CPU flags, plus -fsanitize=address,undefined, into build/cpu-asan/dspark_ops_asan.so.

    python csrc/build_cpu_asan.py [--opt=-O1]

``DSPARK_OPS_LIBRARY=build/cpu-asan/dspark_ops_asan.so`` makes ``import dspark_ops`` load it
instead of dspark_ops._C; Python must run with the sanitizer runtimes preloaded (``make
test-cpu-asan`` does both). Incremental (ninja); MAX_JOBS sets the parallelism. ``--opt``: the
optimisation level, -O1 by default (the sanitizers' advice; the build takes about 2 minutes on 2
cores and the CPU suite under it about 6 with two test processes); -O0 cuts the build by a third
and suits a short run such as the fuzz slice alone.
"""

from __future__ import annotations

import glob
import os
import shlex
import subprocess
import sysconfig

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build", "cpu-asan")
LIBRARY = os.path.join(OUT, "dspark_ops_asan.so")


def build(opt: str = "-O1") -> str:
    import torch.utils.cpp_extension as cpp_extension

    os.makedirs(OUT, exist_ok=True)
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) +
                     glob.glob(os.path.join(ROOT, "csrc", "common", "*.cpp")) +
                     glob.glob(os.path.join(ROOT, "csrc", "args", "*.cpp")) +
                     glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cpu_isa = []
    if os.environ.get("DSPARK_OPS_CPU_ISA", "").lower() != "generic":
        cpu_isa = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize=vptr"]
    # As setup.py's CPU flavour (-ffp-contract=off: the kernels' rounding is the reference's),
    # at -O1 or less so the reports point at the right lines; -g1 keeps the line tables the
    # reports need without full debug information, which only lengthens the build.
    if opt not in ("-O0", "-O1"):
        raise SystemExit(f"build_cpu_asan.py: --opt must be -O0 or -O1, got {opt!r}")
    flags = ["-std=c++20", "-fPIC", opt, "-g1", "-fno-omit-frame-pointer", "-ffp-contract=off",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wno-unknown-pragmas", *cpu_isa, *openmp,
             *sanitize, *[f"-I{p}" for p in cpp_extension.include_paths()],
             f"-I{sysconfig.get_paths()['include']}"]
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    link = [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}",
            *openmp, *sanitize]
    q = shlex.quote
    rules = [
        f"builddir = {q(OUT)}",
        "rule cxx",
        "  command = g++ $flags -MMD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = cpu-asan $in",
        "rule link",
        "  command = g++ -shared $in -o $out $flags",
        "  description = cpu-asan link $out",
    ]
    objects = []
    for source in sources:
        obj = os.path.join(OUT, os.path.relpath(source, ROOT).replace(os.sep, "_") + ".o")
        rules += [f"build {q(obj)}: cxx {q(source)}", "  flags = " + " ".join(map(q, flags))]
        objects.append(obj)
    rules += [f"build {q(LIBRARY)}: link " + " ".join(map(q, objects)),
              "  flags = " + " ".join(map(q, link))]
    ninja_file = os.path.join(OUT, "build.ninja")
    text = "\n".join(rules) + "\n"
    if not os.path.exists(ninja_file) or open(ninja_file).read() != text:
        with open(ninja_file, "w") as f:
            f.write(text)
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
    subprocess.run(["ninja", "-f", ninja_file, "-j", jobs], check=True, cwd=ROOT)
    return LIBRARY


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--opt", default="-O1", help="optimisation level: -O1 (default) or -O0")
    print("dspark_ops cpu-asan: built", build(parser.parse_args().opt), flush=True)
