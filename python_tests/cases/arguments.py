"""The argument-error tables of the ops' tests and the one way they run.

A table row is ``(id, ops, overrides, exception, message)``: ``overrides()`` returns the
arguments that replace those of a valid call (CPU tensors, moved to the device under test with
their layout), and ``message`` is the regular expression that follows ``"<op>(): "``. The rows of
the per-request sampling arguments (temperature, seed, position) and of the vocabulary bound are
generated here once and instantiated for each op that takes them.
"""

from __future__ import annotations

import pytest
import torch

from cases.common import DEBUG, INF, NAN, f32, i32, i64


def error_params(rows, *, op_in_id: bool = True) -> list:
    """pytest parameters ``op, overrides, error, message``, one per row and op; the id is
    ``<op>-<row id>`` (the row id alone with ``op_in_id=False``, for a family of one op)."""
    return [pytest.param(op, overrides, error, message,
                         id=f"{op}-{name}" if op_in_id else name)
            for name, ops, overrides, error, message in rows for op in ops]


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with its layout: .to() would make a view with gaps (or a stride-0
    expansion) contiguous, so a view is rebuilt as the same view of its copied base."""
    if t._base is None:
        return t.to(device)
    return t._base.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def with_overrides(valid: dict, device, overrides) -> dict:
    """The valid arguments ``valid`` (on ``device``) with the row's overrides."""
    changed = {k: on_device(v, device) if isinstance(v, torch.Tensor) else v
               for k, v in overrides().items()}
    return {**valid, **changed}


def raises(op: str, error, message):
    """``pytest.raises`` for the message of ``op``'s argument checks."""
    return pytest.raises(error, match=rf"^{op}\(\): " + message)


def skip_value_checks_without_debug(device) -> None:
    """Value checks run on CPU always, on CUDA only with DSPARK_OPS_DEBUG=1 (they cost a sync)."""
    if device == "cuda" and not DEBUG:
        pytest.skip("value checks run on CUDA only with DSPARK_OPS_DEBUG=1")


def per_request_errors(ops, batch: int, names=("temperature", "seed", "position")) -> list:
    """Structure rows of the per-request sampling arguments, [B] each: ``temperature`` float32,
    ``seed`` and ``position`` int64 (check_dtype / check_shape of csrc/args)."""
    shape = rf"must have shape \[B\] = \[{batch}\]"
    rows = {
        "temperature": [
            ("temperature-float64", lambda: dict(temperature=torch.ones(batch).double()),
             TypeError, r"'temperature' must have dtype Float, got Double"),
            ("temperature-bf16", lambda: dict(temperature=torch.ones(batch).bfloat16()),
             TypeError, r"'temperature' must have dtype Float, got BFloat16"),
            ("temperature-shape", lambda: dict(temperature=torch.ones(batch - 1)), ValueError,
             rf"'temperature' {shape}, got \[{batch - 1}\]"),
            ("temperature-0d", lambda: dict(temperature=torch.tensor(1.0)), ValueError,
             rf"'temperature' {shape}, got \[\]"),
        ],
        "seed": [
            ("seed-int32", lambda: dict(seed=i32(*range(1, batch + 1))), TypeError,
             r"'seed' must have dtype Long, got Int"),
            ("seed-shape", lambda: dict(seed=i64(*range(1, batch + 1))[:, None]), ValueError,
             rf"'seed' {shape}, got \[{batch}, 1\]"),
        ],
        "position": [
            ("position-int32", lambda: dict(position=i32(*range(1, batch + 1))), TypeError,
             r"'position' must have dtype Long, got Int"),
            ("position-float", lambda: dict(position=f32(*range(1, batch + 1))), TypeError,
             r"'position' must have dtype Long, got Float"),
            ("position-shape", lambda: dict(position=i64(*range(1, batch + 3))), ValueError,
             rf"'position' {shape}, got \[{batch + 2}\]"),
        ],
    }
    return [(name, ops, overrides, error, message)
            for key in names for name, overrides, error, message in rows[key]]


def per_request_value_errors(ops, batch: int = 3) -> list:
    """Value rows of ``temperature`` (finite, >= 0) and ``position`` (in [0, 2^62]), with the
    offender first, inside and last (the CPU checks loop over the data)."""
    assert batch == 3, "the rows below are written for three requests"
    bound = r"\[0, 4611686018427387904\]"
    rows = [
        ("position-negative", lambda: dict(position=i64(5, -1, 9)), ValueError,
         rf"'position' values must lie in {bound}, got -1 at index \[1\]"),
        ("position-overflows", lambda: dict(position=i64(2**62 + 1, 0, 9)), ValueError,
         rf"'position' values must lie in {bound}, got 4611686018427387905 at index \[0\]"),
        ("temperature-negative", lambda: dict(temperature=f32(0.0, -0.5, 1.0)), ValueError,
         r"'temperature' must be finite and >= 0, got -0.5 at index \[1\]"),
        ("temperature-nan", lambda: dict(temperature=f32(NAN, 1.0, 1.0)), ValueError,
         r"'temperature' must be finite and >= 0, got nan at index \[0\]"),
        ("temperature-inf", lambda: dict(temperature=f32(0.0, 1.0, INF)), ValueError,
         r"'temperature' must be finite and >= 0, got inf at index \[2\]"),
        ("temperature-nan-last", lambda: dict(temperature=f32(0.0, 1.0, NAN)), ValueError,
         r"'temperature' must be finite and >= 0, got nan at index \[2\]"),
    ]
    return [(name, ops, overrides, error, message) for name, overrides, error, message in rows]


def vocabulary_errors(ops, argument: str, empty, huge, prefix: str = "") -> list:
    """The vocabulary bound [1, 2^31 - 1) of every op with a vocabulary, on ``argument``:
    ``empty()`` and ``huge()`` return overrides giving it V = 0 and V = 2^31 - 1."""
    bound = rf"'{argument}' must have a vocabulary size in \[1, 2\^31 - 1\)"
    return [(f"{prefix}vocab-0", ops, empty, ValueError, rf"{bound}, got 0"),
            (f"{prefix}vocab-2^31-1", ops, huge, ValueError, rf"{bound}, got 2147483647")]


def sampling_filter_errors(ops) -> list:
    """Structure rows of the sampling filters every sampling op takes (csrc/args/filter_args.cpp),
    [B] each with B = 3: ``top_k`` int32, ``top_p`` and ``min_p`` float32."""
    rows = [
        ("top_k-int64", lambda: dict(top_k=i64(0, 1, 2)), TypeError,
         r"'top_k' must have dtype Int, got Long"),
        ("top_k-float", lambda: dict(top_k=f32(0, 1, 2)), TypeError,
         r"'top_k' must have dtype Int, got Float"),
        ("top_k-shape", lambda: dict(top_k=i32(0, 1)), ValueError,
         r"'top_k' must have shape \[B\] = \[3\], got \[2\]"),
        ("top_k-2d", lambda: dict(top_k=i32(0, 1, 2)[:, None]), ValueError,
         r"'top_k' must have shape \[B\] = \[3\], got \[3, 1\]"),
        ("top_p-float64", lambda: dict(top_p=f32(1, 1, 1).double()), TypeError,
         r"'top_p' must have dtype Float, got Double"),
        ("top_p-bf16", lambda: dict(top_p=f32(1, 1, 1).bfloat16()), TypeError,
         r"'top_p' must have dtype Float, got BFloat16"),
        ("top_p-shape", lambda: dict(top_p=f32(1, 1, 1, 1)), ValueError,
         r"'top_p' must have shape \[B\] = \[3\], got \[4\]"),
        ("top_p-0d", lambda: dict(top_p=torch.tensor(0.5)), ValueError,
         r"'top_p' must have shape \[B\] = \[3\], got \[\]"),
        ("min_p-float64", lambda: dict(min_p=f32(0, 0, 0).double()), TypeError,
         r"'min_p' must have dtype Float, got Double"),
        ("min_p-int32", lambda: dict(min_p=i32(0, 0, 0)), TypeError,
         r"'min_p' must have dtype Float, got Int"),
        ("min_p-shape", lambda: dict(min_p=f32(0)), ValueError,
         r"'min_p' must have shape \[B\] = \[3\], got \[1\]"),
    ]
    return [(name, ops, overrides, error, message) for name, overrides, error, message in rows]


def sampling_filter_value_errors(ops) -> list:
    """Value rows of the sampling filters: top_k in [0, INT32_MAX], top_p in (0, 1], min_p in
    [0, 1], the offender first, inside and last."""
    rows = [
        ("top_k-negative", lambda: dict(top_k=i32(0, -1, 5)), ValueError,
         r"'top_k' values must lie in \[0, 2147483647\], got -1 at index \[1\]"),
        ("top_k-int-min", lambda: dict(top_k=i32(-(2**31), 0, 5)), ValueError,
         r"'top_k' values must lie in \[0, 2147483647\], got -2147483648 at index \[0\]"),
        ("top_p-zero", lambda: dict(top_p=f32(0.5, 1.0, 0.0)), ValueError,
         r"'top_p' must be in \(0, 1\], got 0 at index \[2\]"),
        ("top_p-negative", lambda: dict(top_p=f32(-0.25, 1.0, 1.0)), ValueError,
         r"'top_p' must be in \(0, 1\], got -0.25 at index \[0\]"),
        ("top_p-above-1", lambda: dict(top_p=f32(0.5, 1.5, 1.0)), ValueError,
         r"'top_p' must be in \(0, 1\], got 1.5 at index \[1\]"),
        ("top_p-nan", lambda: dict(top_p=f32(NAN, 1.0, 1.0)), ValueError,
         r"'top_p' must be in \(0, 1\], got nan at index \[0\]"),
        ("min_p-negative", lambda: dict(min_p=f32(0.0, -0.5, 0.0)), ValueError,
         r"'min_p' must be probabilities in \[0, 1\], got -0.5 at index \[1\]"),
        ("min_p-above-1", lambda: dict(min_p=f32(0.0, 0.0, 1.25)), ValueError,
         r"'min_p' must be probabilities in \[0, 1\], got 1.25 at index \[2\]"),
        ("min_p-nan", lambda: dict(min_p=f32(0.0, NAN, 0.0)), ValueError,
         r"'min_p' must be probabilities in \[0, 1\], got nan at index \[1\]"),
        ("min_p-inf", lambda: dict(min_p=f32(INF, 0.0, 0.0)), ValueError,
         r"'min_p' must be probabilities in \[0, 1\], got inf at index \[0\]"),
        # Offenders at the last element (the CPU checks loop over the data).
        ("top_k-negative-last", lambda: dict(top_k=i32(0, 5, -1)), ValueError,
         r"'top_k' values must lie in \[0, 2147483647\], got -1 at index \[2\]"),
        ("top_p-nan-last", lambda: dict(top_p=f32(1.0, 0.5, NAN)), ValueError,
         r"'top_p' must be in \(0, 1\], got nan at index \[2\]"),
        ("min_p-nan-last", lambda: dict(min_p=f32(0.0, 0.5, NAN)), ValueError,
         r"'min_p' must be probabilities in \[0, 1\], got nan at index \[2\]"),
    ]
    return [(name, ops, overrides, error, message) for name, overrides, error, message in rows]
