"""The sm_90 code of a built extension: resource usage and SASS, from cuobjdump."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

from bench.static import sass


class NoDeviceCode(RuntimeError):
    """The binary has no sm_90 machine code (a CPU-only build)."""


def cuda_tool(name: str) -> str:
    """Path of cuobjdump/nvdisasm: $CUDA_HOME/bin, PATH, or the copy triton ships."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton  # noqa: WPS433 (optional)
        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if path.exists():
            return str(path)
    except Exception:
        pass
    raise FileNotFoundError(f"{name} not found (CUDA toolkit or triton)")


def default_so() -> Path:
    """The checkout's built extension, found next to the package without importing it (no CUDA
    runtime needed)."""
    import importlib.util
    spec = importlib.util.find_spec("dspark_ops")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("dspark_ops is not importable from here")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("_C*.so"))
        if found:
            return found[0]
    raise FileNotFoundError("no built dspark_ops/_C*.so next to the package")


def demangled_names(names: List[str]) -> Dict[str, str]:
    """mangled -> demangled (c++filt); a name c++filt cannot read is kept as it is."""
    tool = shutil.which("c++filt")
    if not tool:
        raise FileNotFoundError("c++filt not found (binutils): needed to name the kernels")
    res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = res.stdout.splitlines()
    if len(lines) != len(names):
        raise RuntimeError(f"c++filt returned {len(lines)} names for {len(names)}")
    return dict(zip(names, lines))


@dataclasses.dataclass
class KernelInfo:
    name: str          # mangled
    regs: int
    shared: int        # as cuobjdump reports it for sm_90: static + the 1 KB reserved per block
    local: int
    stack: int

    @property
    def static_smem(self) -> int:
        return max(0, self.shared - 1024)


def parse_resource_usage(text: str) -> Dict[str, KernelInfo]:
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            val = dict(re.findall(r"(\w+):(\d+)", line))
            out[name] = KernelInfo(name, int(val.get("REG", 0)), int(val.get("SHARED", 0)),
                                   int(val.get("LOCAL", 0)), int(val.get("STACK", 0)))
            name = None
    return out


class Binary:
    def __init__(self, so: Path, arch: str = "sm_90"):
        self.path = Path(so)
        self.arch = arch
        tool = cuda_tool("cuobjdump")
        listing = subprocess.run([tool, "--list-elf", str(self.path)], capture_output=True,
                                 text=True)
        if f".{arch}." not in listing.stdout:
            raise NoDeviceCode(f"{self.path} has no {arch} machine code (a CPU-only build?): "
                               "the static model needs a CUDA build for sm_90")
        res = subprocess.run([tool, "--dump-resource-usage", "-arch", arch, str(self.path)],
                             capture_output=True, text=True, check=True).stdout
        self.resources = parse_resource_usage(res)
        text = subprocess.run([tool, "-sass", "-arch", arch, str(self.path)],
                              capture_output=True, text=True, check=True).stdout
        # Split per function now, parse only the kernels the model asks for.
        self._chunks: Dict[str, str] = {}
        starts = [m for m in re.finditer(r"^\s*Function : (\S+)", text, re.M)]
        for k, m in enumerate(starts):
            end = starts[k + 1].start() if k + 1 < len(starts) else len(text)
            self._chunks[m.group(1)] = text[m.start():end]
        self._cfgs: Dict[str, sass.CFG] = {}

    def find(self, pattern: str) -> KernelInfo:
        """The one kernel whose mangled name matches ``pattern`` (a regex)."""
        names = [n for n in self.resources if re.search(pattern, n)]
        if len(names) != 1:
            raise sass.StructureError(
                f"kernel pattern {pattern!r} matches {len(names)} kernels in {self.path.name}"
                + (f": {names[:4]}" if names else ""))
        return self.resources[names[0]]

    def cfg(self, name: str) -> sass.CFG:
        if name not in self._cfgs:
            if name not in self._chunks:
                raise sass.StructureError(f"no SASS for {name}")
            self._cfgs[name] = sass.CFG(sass.parse_functions(self._chunks[name])[name])
        return self._cfgs[name]
