"""Benchmark of ``block_draft_attention`` and ``append_context_kv`` (docs/semantics.md §3.5)
against SDPA and FlashAttention.

``block_draft_attention`` rows, at ``G = 8``, ``Hq = 32``, ``Hkv = 8``, ``D = 128`` (Qwen3-8B's
attention) and every request at ``p0 = ctx`` context rows; on GPU bf16 with ``B`` in {1, 16, 64}
and ``ctx`` in {1k, 4k, 16k}, on CPU float32 and bf16 with ``B`` in {1, 4} and ``ctx`` in
{1k, 4k}. Each row times the same inputs with:

* ``ours``       — ``dspark_ops.block_draft_attention``;
* ``ref``        — ``dspark_ops.reference.block_draft_attention_sdpa``: PyTorch SDPA over
                   ``[cache row ; block]`` with a boolean mask, as an engine without a block-draft
                   kernel computes it (it copies every cache row it reads, all ``L`` of them);
* ``flash-attn`` — (GPU) ``flash_attn.flash_attn_with_kvcache`` cannot express "context up to
                   ``p0`` plus all ``G`` block keys, non-causal" in one call without writing the
                   block into the cache, so it runs twice: block queries over the context
                   (``cache_seqlens = p0``) and over the block keys alone, both returning the
                   log-sum-exp, then the two halves are merged by LSE (a few small eager ops,
                   timed with it);
* ``fa-append``  — (GPU) the one-call form engines use: ``flash_attn_with_kvcache`` with
                   ``k=k_block, v=v_block`` writes the block's K/V into the cache at ``p0`` and
                   attends to ``[0, p0 + G)``. Same result, but it writes scratch rows into the
                   cache, which therefore needs ``G`` spare rows per request.

Before timing, every competitor's output is compared with ``reference.block_draft_attention``
(explicit float32 softmax); ``err`` is ours' largest absolute difference, and a competitor that
disagrees beyond rounding is reported. ``MB`` counts the bytes the op must move: the K and V
context rows it reads, ``sum_b min(p0_b, window) * Hkv * D * 2`` elements, plus q, the block K/V
and the output; GB/s follows, and on GPU its share of the measured copy bandwidth
(the floor of the K/V read at ``B = 64, ctx = 4k``: docs/semantics.md §4).

``append_context_kv`` rows append up to ``G + 1`` rows per request (the anchor and the accepted
drafts; counts uniform in ``[1, G + 1]``) at ``p0 = ctx``, timed with ``ref``
(``reference.append_context_kv``, a Python loop over requests) and ``eager-torch`` (the same
write as a user would vectorise it: boolean-mask ``index_put_`` and a clamped length update).
Each timed call first restores ``cache_seqlens``, so every call appends at the same place;
``match`` says whether the caches and lengths equal the reference's.

On CPU one more row per dtype, ``busy``, times ``B = 4, ctx = 4k`` while another process runs
2-thread PyTorch matmuls (:func:`busy_machine`), the case of a shared machine: a kernel that nests
parallel regions (ATen GEMMs inside ``at::parallel_for`` tasks) oversubscribes the cores there
and slows down by orders of magnitude.

docs/semantics.md §4 asks the CPU kernel to be at least as fast as the masked-SDPA reference;
the ``target`` column judges that at ``B = 4, ctx = 4k`` (both dtypes). On a GPU whose build has
no CUDA kernel for an op, ``ours`` is reported as not built and left out; the other competitors
still run.

Run from the repository root: ``python bench/bench_attention.py [--quick] [--device D]
[--json-only] [--no-anchors]`` (or ``python -m bench`` for every family).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

if __package__ in (None, ""):
    # Run as a script: make `bench` and `dspark_ops` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import dspark_ops
from dspark_ops import reference
from bench.common import has_kernel, log, report_once, synchronize
from bench.report import Row, family_arg_parser, family_main, finish_row, format_us
from bench.timing import Timing, measure, measure_copy_bandwidth

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 128
WINDOW: Optional[int] = None  # full attention, as the DeepSpec drafts

GPU_PLAN = dict(batches=(1, 16, 64), contexts=(1024, 4096, 16384), dtypes=(torch.bfloat16,),
                append_batches=(1, 16, 64), append_context=4096)
GPU_QUICK = dict(batches=(1, 64), contexts=(4096,), dtypes=(torch.bfloat16,),
                 append_batches=(64,), append_context=4096)
CPU_PLAN = dict(batches=(1, 4), contexts=(1024, 4096), dtypes=(torch.float32, torch.bfloat16),
                append_batches=(4,), append_context=4096)
CPU_QUICK = dict(batches=(4,), contexts=(4096,), dtypes=(torch.float32, torch.bfloat16),
                 append_batches=(4,), append_context=4096)
# CPU: the shape timed again while another process keeps two threads busy.
CPU_BUSY_SHAPE = (4, 4096)

# docs/semantics.md §4: on CPU the op must be at least as fast as the masked-SDPA reference;
# judged here.
CPU_TARGET_SHAPE = (4, 4096)

_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# Largest acceptable |out - exact| per dtype: output rounding plus the inputs' rounding.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


# --------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class AttentionCase:
    """One set of ``block_draft_attention`` inputs."""

    q: torch.Tensor  # [B, G, Hq, D]
    k_block: torch.Tensor  # [B, G, Hkv, D]
    v_block: torch.Tensor
    k_cache: torch.Tensor  # [N, L, Hkv, D], L = ctx + G (room for the fa-append anchor)
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor  # int32 [B], p0 of each request
    context: int

    @property
    def shape(self) -> str:
        batch, block, heads, dim = self.q.shape
        return (f"B={batch} G={block} Hq={heads} Hkv={self.k_block.shape[2]} D={dim} "
                f"ctx={self.context}")

    def args(self):
        return (self.q, self.k_block, self.v_block, self.k_cache, self.v_cache,
                self.cache_seqlens)


def make_attention_inputs(batch: int, context: int, dtype: torch.dtype, *, device="cpu",
                          seed: int = 0) -> AttentionCase:
    """Random inputs with every request at ``p0 = context``.

    Parameters
    ----------
    batch, context : int
        ``B`` and ``p0``; the caches have ``L = context + G`` rows and one row per request.
    dtype : torch.dtype
        Of q, the block K/V and the caches.
    device : str or torch.device
        Where the tensors are made (with a seeded generator there).
    seed : int

    Returns
    -------
    AttentionCase
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    length = context + BLOCK
    return AttentionCase(
        q=randn(batch, BLOCK, HEADS, HEAD_DIM),
        k_block=randn(batch, BLOCK, KV_HEADS, HEAD_DIM),
        v_block=randn(batch, BLOCK, KV_HEADS, HEAD_DIM),
        k_cache=randn(batch, length, KV_HEADS, HEAD_DIM),
        v_cache=randn(batch, length, KV_HEADS, HEAD_DIM),
        cache_seqlens=torch.full((batch,), context, dtype=torch.int32, device=device),
        context=context,
    )


def attention_bytes(case: AttentionCase, window: Optional[int] = WINDOW) -> int:
    """Bytes ``block_draft_attention`` must move: K and V context rows read, q and the block
    K/V read, the output written."""
    p0 = case.cache_seqlens.long().cpu()
    rows = p0 if window is None else p0.clamp(max=window)
    _, _, kv_heads, dim = case.k_cache.shape
    kv = int(rows.sum()) * kv_heads * dim * case.k_cache.element_size() * 2
    small = 2 * case.q.numel() * case.q.element_size()  # q in, out
    small += 2 * case.k_block.numel() * case.k_block.element_size()
    return kv + small


@dataclasses.dataclass
class AppendCase:
    """One set of ``append_context_kv`` inputs."""

    k_cache: torch.Tensor  # [B, L, Hkv, D]
    v_cache: torch.Tensor
    k_new: torch.Tensor  # [B, n_max, Hkv, D]
    v_new: torch.Tensor
    num_new: torch.Tensor  # int32 [B], in [1, n_max]
    start: torch.Tensor  # int32 [B]: cache_seqlens before the append
    context: int

    @property
    def shape(self) -> str:
        batch, rows, kv_heads, dim = self.k_new.shape
        return (f"B={batch} n<={rows} Hkv={kv_heads} D={dim} ctx={self.context} "
                f"L={self.k_cache.shape[1]}")


def make_append_inputs(batch: int, context: int, dtype: torch.dtype, *, device="cpu",
                       seed: int = 0) -> AppendCase:
    """Zeroed caches at ``p0 = context`` and ``1 .. G + 1`` new rows per request."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = BLOCK + 1
    length = context + rows
    new = (batch, rows, KV_HEADS, HEAD_DIM)
    return AppendCase(
        k_cache=torch.zeros(batch, length, KV_HEADS, HEAD_DIM, dtype=dtype, device=device),
        v_cache=torch.zeros(batch, length, KV_HEADS, HEAD_DIM, dtype=dtype, device=device),
        k_new=torch.randn(new, generator=generator, device=device, dtype=dtype),
        v_new=torch.randn(new, generator=generator, device=device, dtype=dtype),
        num_new=torch.randint(1, rows + 1, (batch,), generator=generator, device=device,
                              dtype=torch.int32),
        start=torch.full((batch,), context, dtype=torch.int32, device=device),
        context=context,
    )


def append_bytes(case: AppendCase) -> int:
    """Bytes ``append_context_kv`` must move: each appended K and V row read once, written once."""
    _, _, kv_heads, dim = case.k_new.shape
    return int(case.num_new.long().sum()) * kv_heads * dim * case.k_new.element_size() * 2 * 2


# --------------------------------------------------------------------------------------------
# Competitors


def eager_append_context_kv(k_cache, v_cache, k_new, v_new, num_new, cache_seqlens,
                            cache_slot=None) -> None:
    """``append_context_kv`` as a user would vectorise it in eager PyTorch (boolean-mask
    ``index_put_``, which syncs with the host to count the rows)."""
    batch, rows = k_new.shape[:2]
    length = k_cache.shape[1]
    slot = (cache_slot.long() if cache_slot is not None
            else torch.arange(batch, device=k_new.device))
    j = torch.arange(rows, device=k_new.device)
    position = cache_seqlens.long()[:, None] + j
    keep = (j < num_new.long()[:, None]) & (position < length)
    index = (slot[:, None].expand(batch, rows)[keep], position[keep])
    k_cache.index_put_(index, k_new[keep])
    v_cache.index_put_(index, v_new[keep])
    cache_seqlens.copy_((cache_seqlens + num_new).clamp_(max=length))


def _merge_by_lse(out_a, lse_a, out_b, lse_b, dtype):
    """Softmax-weighted merge of two attention halves; ``lse`` is FlashAttention's ``[B, H, S]``.

    A half with no keys has a non-finite LSE (FlashAttention writes +inf there) and weighs
    nothing.
    """
    lse_a = torch.where(torch.isfinite(lse_a), lse_a, float("-inf"))
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).transpose(1, 2)[..., None]  # [B, S, H, 1]
    w_b = torch.exp(lse_b - lse).transpose(1, 2)[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b).to(dtype)


def _flash_factory() -> Optional[Callable[[AttentionCase], Dict[str, Optional[Callable]]]]:
    """Builds the FlashAttention competitors for a case, or None when flash-attn is absent."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception as error:  # ImportError, or a broken install raising anything else
        report_once("flash-attn", f"anchor flash-attn: not installed ({type(error).__name__}: "
                    f"{error})")
        return None
    params = inspect.signature(flash_attn_with_kvcache).parameters
    has_lse = "return_softmax_lse" in params
    report_once("flash-attn", "anchor flash-attn: flash_attn.flash_attn_with_kvcache "
                "(flash-attn: context and block halves merged by LSE; fa-append: block K/V "
                "written into the cache at p0, one call)")
    if not has_lse:
        report_once("flash-attn-lse", "anchor flash-attn: skipped, this flash_attn_with_kvcache "
                    "cannot return the log-sum-exp (flash-attn < 2.6), so the context and block "
                    "halves cannot be merged; fa-append still runs")

    def make(case: AttentionCase) -> Dict[str, Optional[Callable]]:
        q, k_block, v_block, k_cache, v_cache, seqlens = case.args()
        scale = q.shape[-1] ** -0.5

        def two_calls():
            out_ctx, lse_ctx = flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=scale, causal=False,
                return_softmax_lse=True)
            out_blk, lse_blk = flash_attn_with_kvcache(
                q, k_block, v_block, softmax_scale=scale, causal=False, return_softmax_lse=True)
            return _merge_by_lse(out_ctx, lse_ctx, out_blk, lse_blk, q.dtype)

        def append_call():
            # Writes the block's K/V at rows [p0, p0 + G) of the cache; they lie past p0, where
            # the other competitors do not look.
            return flash_attn_with_kvcache(
                q, k_cache, v_cache, k=k_block, v=v_block, cache_seqlens=seqlens,
                softmax_scale=scale, causal=False)

        return {"flash-attn": two_calls if has_lse else None, "fa-append": append_call}

    return make


# --------------------------------------------------------------------------------------------
# Measurement


# A 2-thread PyTorch process doing matmuls until it is stopped.
_BUSY_SCRIPT = """
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
print("ready", flush=True)
while True:
    a = torch.tanh(a @ a)
"""


@contextlib.contextmanager
def busy_machine():
    """Runs :data:`_BUSY_SCRIPT` in a subprocess for the duration of the block (started and
    warm before the block begins, stopped after it)."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_SCRIPT], stdout=subprocess.PIPE,
                            text=True)
    try:
        proc.stdout.readline()  # "ready"
        time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _timings(device: torch.device, quick: bool) -> Timing:
    return Timing.for_device(device, quick, cpu_seconds=(0.3, 0.2), cpu_quick_seconds=(0.15, 0.1))


@functools.lru_cache(maxsize=None)
def _ours_or_none(op: str, fn: Callable, device: torch.device) -> Optional[Callable]:
    """``fn``, or None (said once) when the build has no kernel of ``op`` for the device."""
    if not has_kernel(op, device.type):
        report_once(f"no-kernel-{op}-{device.type}",
                    f"ours: dspark_ops.{op} has no {device.type.upper()} kernel in this build; "
                    f"not timed (the other competitors still are)")
        return None
    return fn


def _max_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return (out.float() - exact.float()).abs().max().item()


def bench_attention(case: AttentionCase, device: torch.device, timing: Timing,
                    flash: Optional[Callable], copy_gbps: Optional[float]) -> Row:
    """Times one ``block_draft_attention`` input set with every competitor."""
    args = case.args()
    dtype = case.q.dtype
    batch = case.q.shape[0]
    row = Row(op="block_draft_attention", shape=case.shape, variant=_SHORT[dtype])

    def ours():
        return dspark_ops.block_draft_attention(*args, window=WINDOW)

    def ref():
        return reference.block_draft_attention_sdpa(*args, window=WINDOW)

    competitors: Dict[str, Optional[Callable]] = {"ours": _ours_or_none(
        "block_draft_attention", ours, device), "ref": ref}
    if flash is not None:
        try:
            competitors.update(flash(case))
        except Exception as error:
            log(f"  flash-attn: not run ({type(error).__name__}: {error})")

    # Same answer first, or the times compare different work.
    exact, _ = reference.block_draft_attention(*args, window=WINDOW)
    tolerance = _TOLERANCE[dtype]
    for name, fn in list(competitors.items()):
        if fn is None:
            continue
        try:
            error = _max_error(fn(), exact)
        except Exception as exc:  # e.g. a kernel missing for this dtype or device
            log(f"  {name}: not run ({type(exc).__name__}: {exc})")
            competitors[name] = None
            continue
        if name == "ours":
            row.extra["err"] = f"{error:.1e}"  # a string: the table's fixed 2 decimals hide it
        if not error <= tolerance:
            log(f"WARNING {row.op} {case.shape} {row.variant}: {name} differs from the exact "
                f"reference by {error:.3g} (tolerance {tolerance:g})")
    synchronize(device)
    if "err" not in row.extra:
        row.extra["err"] = None

    timed = {"ours": competitors["ours"], "ref": competitors["ref"]}
    if device.type == "cuda":
        timed.update({name: competitors.get(name) for name in ("flash-attn", "fa-append")})
    measure(row, timed, device, timing)

    row.extra["target"] = None
    if device.type == "cpu" and (batch, case.context) == CPU_TARGET_SHAPE:
        if row.ours_us is not None and row.reference_us is not None:
            row.extra["target"] = "met" if row.ours_us <= row.reference_us else "not met"
    row.bytes_moved = attention_bytes(case)
    finish_row(row, copy_gbps)
    return row


def bench_append(case: AppendCase, device: torch.device, timing: Timing,
                 copy_gbps: Optional[float]) -> Row:
    """Times one ``append_context_kv`` input set with every competitor."""
    dtype = case.k_cache.dtype
    row = Row(op="append_context_kv", shape=case.shape, variant=_SHORT[dtype])
    row.extra["err"] = None
    seqlens = case.start.clone()

    def call(fn, k_cache, v_cache, lengths):
        def run():
            lengths.copy_(case.start)  # append at the same place on every call
            fn(k_cache, v_cache, case.k_new, case.v_new, case.num_new, lengths)
        return run

    ours_fn = _ours_or_none("append_context_kv", dspark_ops.append_context_kv, device)
    fns = {"ours": ours_fn, "ref": reference.append_context_kv,
           "eager-torch": eager_append_context_kv}

    # Each competitor once on its own zeroed caches; all must agree with the reference.
    results = {}
    for name, fn in fns.items():
        if fn is None:
            continue
        k_cache, v_cache = torch.zeros_like(case.k_cache), torch.zeros_like(case.v_cache)
        lengths = case.start.clone()
        try:
            call(fn, k_cache, v_cache, lengths)()
            results[name] = (k_cache, v_cache, lengths)
        except Exception as error:
            log(f"  {name}: not run ({type(error).__name__}: {error})")
            fns[name] = None
    synchronize(device)
    expected = results.get("ref")
    for name, got in results.items() if expected is not None else ():
        same = all(torch.equal(a, b) for a, b in zip(got, expected))
        if name == "ours":
            row.extra["match"] = "yes" if same else "no"
        elif not same:
            log(f"WARNING {row.op} {case.shape}: {name} differs from the reference")
    row.extra.setdefault("match", None)
    del results, expected

    # The timed calls all write identical values to the same caches.
    def timed(name):
        fn = fns[name]
        return None if fn is None else call(fn, case.k_cache, case.v_cache, seqlens)

    measure(row, {name: timed(name) for name in ("ours", "ref", "eager-torch")}, device, timing)
    row.extra["target"] = None
    row.bytes_moved = append_bytes(case)
    finish_row(row, copy_gbps)
    return row


def plan(device: torch.device, quick: bool) -> dict:
    """The shapes and dtypes to run on ``device``."""
    if device.type == "cuda":
        return GPU_QUICK if quick else GPU_PLAN
    return CPU_QUICK if quick else CPU_PLAN


def run(device: torch.device, quick: bool = False, use_anchors: bool = True,
        checkpoint: Optional[Callable[[List[Row]], None]] = None) -> List[Row]:
    """Runs every planned row on ``device`` and returns the rows.

    ``checkpoint(rows)`` is called after each row, so an interrupted run keeps what it measured.
    """
    copy_gbps, flash = None, None
    if device.type == "cuda":
        copy_gbps = measure_copy_bandwidth(device)
        log(f"copy bandwidth ({device}): {copy_gbps:.0f} GB/s (read + write)")
        if use_anchors:
            flash = _flash_factory()
        else:
            report_once("attention-anchors", "anchor flash-attn: skipped (--no-anchors)")
    else:
        report_once("attention-anchors", "anchor flash-attn: GPU only, not measured on CPU")
    timing = _timings(device, quick)
    p = plan(device, quick)

    rows: List[Row] = []

    def done(row: Row, started: float) -> None:
        rows.append(row)
        anchors = ", ".join(f"{k} {format_us(v)} us" for k, v in row.anchors.items())
        log(f"  {row.op} {row.shape} {row.variant}: ours {format_us(row.ours_us)} us, "
            f"ref {format_us(row.reference_us)} us" + (f", {anchors}" if anchors else "")
            + f" [{time.perf_counter() - started:.1f} s]")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows)

    seed = 0
    for dtype in p["dtypes"]:
        for context in p["contexts"]:
            for batch in p["batches"]:
                started = time.perf_counter()
                seed += 1
                case = make_attention_inputs(batch, context, dtype, device=device, seed=seed)
                row = bench_attention(case, device, timing, flash, copy_gbps)
                del case
                done(row, started)
        if device.type == "cpu":
            started = time.perf_counter()
            seed += 1
            batch, context = CPU_BUSY_SHAPE
            case = make_attention_inputs(batch, context, dtype, device=device, seed=seed)
            with busy_machine():
                row = bench_attention(case, device, timing, flash, copy_gbps)
            row.variant += " busy"
            del case
            done(row, started)
        for batch in p["append_batches"]:
            started = time.perf_counter()
            seed += 1
            case = make_append_inputs(batch, p["append_context"], dtype, device=device,
                                      seed=seed)
            row = bench_append(case, device, timing, copy_gbps)
            del case
            done(row, started)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    return family_arg_parser(
        __doc__.split("\n")[0],
        quick_help="fewer shapes (GPU: B in {1, 64} at ctx 4k; CPU: B = 4 at ctx 4k), fewer "
                   "repeats",
        anchors_help="skip FlashAttention",
    ).parse_args(argv)


def main(argv=None, *, emit: bool = True) -> List[Row]:
    """Command-line entry point; returns the rows (``emit=False``: print nothing to stdout)."""
    return family_main(
        "attention", parse_args(argv),
        lambda device, args, checkpoint: run(device, quick=args.quick,
                                             use_anchors=not args.no_anchors,
                                             checkpoint=checkpoint),
        emit=emit, after_table=_print_cpu_target)


def _print_cpu_target(rows: List[Row], device: torch.device) -> None:
    """One line per dtype: SDPA reference time over ours at the CPU target shape."""
    if device.type != "cpu":
        return
    for row in rows:
        if row.extra.get("target") is not None:
            print(f"target of docs/semantics.md §4 (CPU at least as fast as masked SDPA) at "
                  f"{row.shape} {row.variant}: "
                  f"ref/ours = {row.speedup:.2f} -> {row.extra['target']}")


if __name__ == "__main__":
    main()
