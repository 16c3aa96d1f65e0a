"""What the benchmark modules share: the device to run on, its name, progress logging, and
writing a real-model command's results as JSON.

Timing is in :mod:`bench.timing`, rows, the table and result files in :mod:`bench.report`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """The device to benchmark on.

    Parameters
    ----------
    name : str
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Returns
    -------
    torch.device
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench: --device {name} was asked for but no CUDA device is available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    """Human-readable name of the device (GPU model, or the CPU model where the OS says it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_slug(device: torch.device) -> str:
    """``device_name`` reduced to ``[a-z0-9-]`` for file names (e.g. ``nvidia-h200``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return slug or device.type


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the table (or the JSON with --json-only)."""
    print(message, file=sys.stderr, flush=True)


_reported: set = set()


def report_once(key: str, message: str) -> None:
    """Logs ``message`` the first time ``key`` is seen in this process (anchor status lines)."""
    if key not in _reported:
        _reported.add(key)
        log(message)


def has_kernel(op: str, device_type: str) -> bool:
    """Whether this build registers a kernel of ``torch.ops.dspark_ops.<op>`` for the device."""
    from dspark_ops._library import op_backends

    return device_type.upper() in op_backends(op)


def write_json(path: str, results: dict) -> None:
    """Writes ``results`` to ``path`` (indent 1), making its folder first."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
