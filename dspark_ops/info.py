"""python -m dspark_ops.info: how this dspark_ops was built and which backends each op has."""

from __future__ import annotations

import torch

import dspark_ops
from dspark_ops._library import OPS, build_info, op_backends


def report() -> str:
    info = build_info()
    lines = [f"dspark_ops {dspark_ops.__version__}"]
    for key in ("flavour", "reason", "torch_version", "torch_cuda_version", "cuda_home",
                "cuda_archs", "cpu_isa", "cpu_openmp"):
        lines.append(f"  built {key:<20} {info.get(key)}")
    lines.append(f"  runtime torch              {torch.__version__} (CUDA {torch.version.cuda})")
    cuda = torch.cuda.is_available()
    lines.append(f"  runtime GPU                {torch.cuda.get_device_name() if cuda else 'none'}")
    lines.append(f"  runtime CPU threads        {torch.get_num_threads()}")
    lines.append("  ops:")
    for name in OPS:
        lines.append(f"    {name:<22} {', '.join(op_backends(name))}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
