"""Measuring the target's step rate: the ``step_rate`` table the scheduling ops take
(:func:`dspark_ops.schedule_verify`, :func:`dspark_ops.plan_verify_budget`)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

__all__ = ["profile_step_rate"]


def profile_step_rate(
    forward: Callable[[int], object],
    max_tokens: int,
    *,
    device: Optional[torch.device] = None,
    warmup: int = 3,
    repeats: int = 10,
    enforce_non_increasing: bool = False,
) -> torch.Tensor:
    """Measures the target's steps per second for verify batches of 1..max_tokens tokens.

    Parameters
    ----------
    forward : callable
        ``forward(n)`` runs one target forward over a batch of ``n`` tokens (for example a
        decode step over ``n`` flattened tokens with a realistic KV cache behind them).
    max_tokens : int
        Largest batch profiled; the table has ``M = max_tokens + 1`` entries.
    device : torch.device, optional
        Where ``forward`` runs. On CUDA each call is timed with CUDA events; on CPU with a
        monotonic clock. Default: the current CUDA device if available, else CPU.
    warmup : int
        Untimed calls per size before measuring (compilation, autotuning, allocator warm-up).
    repeats : int
        Timed calls per size; the median is used.
    enforce_non_increasing : bool
        Replace each rate by the minimum over it and all smaller sizes. Off by default: real
        profiles are jagged (tensor-core tiles make some sizes cheaper than smaller ones), and the
        schedulers are meant to see those cliffs.

    Returns
    -------
    torch.Tensor
        float32 ``[max_tokens + 1]`` on ``device``: ``step_rate[n]`` in steps per second;
        ``step_rate[0]`` repeats ``step_rate[1]`` (no batch has zero tokens).

    Examples
    --------
    >>> def forward(n):                      # doctest: +SKIP
    ...     model(input_ids[:n], positions[:n], cu_seqlens=...)
    >>> step_rate = dspark_ops.profile_step_rate(forward, max_tokens=512)   # doctest: +SKIP
    >>> num_verify = dspark_ops.schedule_verify(confidence, step_rate)      # doctest: +SKIP
    """
    if max_tokens < 1:
        raise ValueError(f"profile_step_rate(): 'max_tokens' must be >= 1, got {max_tokens}")
    if warmup < 0 or repeats < 1:
        raise ValueError(
            f"profile_step_rate(): need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}"
        )
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    seconds = []
    for n in range(1, max_tokens + 1):
        for _ in range(warmup):
            forward(n)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward(n)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                forward(n)
                times.append(time.perf_counter() - begin)
        seconds.append(max(statistics.median(times), 1e-9))
    rates = torch.tensor([1.0 / s for s in seconds], dtype=torch.float64)
    if enforce_non_increasing:
        rates = torch.cummin(rates, 0).values
    return torch.cat([rates[:1], rates]).to(device=device, dtype=torch.float32)
