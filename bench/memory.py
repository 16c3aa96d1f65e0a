"""Peak memory of one call: what a benchmark reports next to its times, and what memory-bound
tests assert on."""

from __future__ import annotations

from typing import Callable

import torch


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The most bytes held at once during ``fn()`` beyond what was held before it.

    CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's own count). CPU: every
    allocation and free the CPU allocator reported to the profiler, replayed in time order, so
    allocations inside C++ kernels count too.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak
