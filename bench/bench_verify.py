"""Benchmark of ``dspark_ops.verify`` against eager PyTorch and the public anchors.

Semantics: docs/semantics.md §3.1; floors: §4.

Every row times the same inputs with:

* ``ours``        — ``dspark_ops.verify``;
* ``ref``         — ``dspark_ops.reference.verify``, the eager reference of record (same random
                    numbers, so its tokens must equal ours; the "match" column counts requests
                    that do);
* ``eager-torch`` — what a user would write with torch's own RNG: softmax of target and draft,
                    gather, ``torch.rand`` acceptance, first rejection via cumprod, residual
                    ``relu(p - q)`` renormalised and ``torch.multinomial``;
* ``flashinfer``  — (GPU) ``flashinfer.sampling.chain_speculative_sampling``, timed together
                    with the fp32 softmax (with temperature) of target and draft logits it needs;
* ``vllm``        — (GPU) ``vllm.v1.sample.rejection_sampler.rejection_sample``, timed together
                    with what its ``RejectionSampler.forward`` does first (fp32 target softmax with
                    temperature, bonus-token sampling) and the draft softmax.

Rows with sampling filters (variant ``... top-k 50 top-p 0.9``, drafts sampled from the filtered
draft distribution as ``markov_draft`` does with the same filters) time ``ours`` with the filters
fused, and instead of ``eager-torch``:

* ``eager-filter+verify`` — the filters in eager PyTorch (``torch.topk`` threshold, sort + cumsum
                    for top-p, renormalised in that order) written into the target logits as -inf,
                    then the plain ``dspark_ops.verify``;
* ``flashinfer``  — (GPU) ``top_k_renorm_probs`` + ``top_p_renorm_probs`` on the target
                    probabilities, then ``chain_speculative_sampling``.

Inputs: target logits ``2 * randn`` with one peak per row whose probability is uniform in
[0.6, 0.99) (so deterministic drafts can be accepted too); draft logits = target logits + Gaussian
noise whose scale is tuned by bisection so that the expected per-position acceptance
(``sum_x min(p, q)``; for greedy the argmax agreement; for one-hot ``p(x)``) is the asked-for
value. Sampled drafts are drawn from ``q``; greedy and one-hot drafts are the noisy argmax.

Columns besides the times: ``dtypes`` (target/draft logits), ``acc.len`` (measured mean
accepted length), ``alpha`` (measured per-position acceptance: accepted over tested positions),
``match`` (requests identical to the reference); on GPU ``MB`` (bytes the rows actually needed
take, see :func:`bytes_moved`), ``MB all`` (every row), GB/s and % of the measured copy bandwidth.

Run from the repository root: ``python bench/bench_verify.py [--quick] [--device D]
[--json-only]`` (or ``python -m bench`` for every family).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import math
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    # Run as a script: make `bench` and `dspark_ops` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import dspark_ops
from dspark_ops import reference
from bench.common import log, report_once, synchronize
from bench.report import Row, family_arg_parser, family_main, finish_row, format_us
from bench.timing import Timing, measure, measure_copy_bandwidth

GREEDY_TEMPERATURE = reference.GREEDY_TEMPERATURE
VARIANTS = ("sampled", "greedy", "one-hot")

# Default shape (docs/semantics.md §4) and sweeps. CPU sizes keep a full CPU run near a minute
# while keeping the real vocabulary, which is what sets the cost.
GPU_PLAN = dict(batch=64, block=8, vocab=151936, batches=(1, 8, 256), acceptances=(0.3, 0.95))
CPU_PLAN = dict(batch=4, block=8, vocab=151936, batches=(1, 16), acceptances=(0.3, 0.95))
DEFAULT_ACCEPTANCE = 0.7
FILTER_TOP_K, FILTER_TOP_P = 50, 0.9  # the sampling-filter rows


# --------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class VerifyCase:
    """One set of ``verify`` inputs (padded layout) and how it was made."""

    target_logits: torch.Tensor  # [B, G+1, V]
    draft_tokens: torch.Tensor  # int64 [B, G]
    num_draft: torch.Tensor  # int32 [B]
    temperature: torch.Tensor  # float32 [B]
    seed: torch.Tensor  # int64 [B]
    position: torch.Tensor  # int64 [B]
    draft_logits: Optional[torch.Tensor]  # [B, G, V] or None (one-hot / greedy drafts)
    variant: str
    acceptance: float  # the per-position acceptance the noise was tuned for
    noise_scale: float
    filters: Optional[Dict[str, torch.Tensor]] = None  # top_k / top_p per request, or None

    @property
    def shape(self) -> Tuple[int, int, int]:
        batch, block = self.draft_tokens.shape
        return batch, block, self.target_logits.shape[-1]

    @property
    def greedy(self) -> bool:
        return self.variant == "greedy"

    def args(self):
        return (self.target_logits, self.draft_tokens, self.num_draft, self.temperature,
                self.seed, self.position)


def _target_logits(rows: Tuple[int, ...], vocab: int, generator: torch.Generator,
                   device: torch.device, top: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 ``[*rows, vocab]``: 2·N(0,1) logits plus one peak of probability U[0.6, 0.99)
    (or ``top``), which is then each row's argmax."""
    logits = torch.randn(*rows, vocab, generator=generator, device=device).mul_(2.0)
    if top is None:
        top = torch.rand(rows, generator=generator, device=device) * 0.39 + 0.6
    # The other tokens' softmax mass is about V·E[exp(2z)] = V·e² (z standard normal).
    peak = torch.log(top / (1 - top)) + math.log(vocab) + 2.0
    index = torch.randint(0, vocab, rows, generator=generator, device=device)
    return logits.scatter_(-1, index[..., None], peak[..., None])


class _AcceptanceEstimate:
    """Mean per-position acceptance of drafts made from ``target + scale * noise``.

    ``sampled``: ``sum_x min(p, q)``; ``greedy``: how often the argmax is kept; ``one-hot``:
    ``p(argmax of the draft)``. Works in one preallocated buffer because the search calls it
    a dozen times on ~100 full-vocabulary rows.
    """

    def __init__(self, target: torch.Tensor, noise: torch.Tensor, variant: str,
                 temperature: float):
        self.target, self.noise = target, noise
        self.variant, self.temperature = variant, temperature
        self.p = torch.softmax(target / temperature, -1)
        self.argmax = target.argmax(-1)
        self.buffer = torch.empty_like(target)

    def __call__(self, scale: float) -> float:
        draft = torch.add(self.target, self.noise, alpha=scale, out=self.buffer)
        if self.variant == "greedy":
            return (draft.argmax(-1) == self.argmax).float().mean().item()
        if self.variant == "one-hot":
            return self.p.gather(-1, draft.argmax(-1, keepdim=True)).mean().item()
        q = draft.div_(self.temperature)  # softmax in place
        q.sub_(q.amax(-1, keepdim=True)).exp_()
        q.div_(q.sum(-1, keepdim=True))
        return torch.minimum(q, self.p, out=q).sum(-1).mean().item()


@functools.lru_cache(maxsize=None)
def noise_scale(variant: str, acceptance: float, vocab: int, temperature: float,
                target_dtype: torch.dtype, device: torch.device) -> float:
    """Draft-noise scale giving per-position acceptance ``acceptance``, by bisection.

    A row's acceptance is set mostly by its peak probability and the noise on its peak token,
    so the sample rows take those two on a stratified grid (a random sample of affordable size
    misses the target by up to 0.15); the rest of the vocabulary is random. The noise is fixed
    across the search (common random numbers), so the estimate decreases smoothly with the
    scale. An unreachable target returns the nearest end of the search range.
    """
    generator = torch.Generator(device=device).manual_seed(12345)
    levels, quantiles = 16, 8
    top = 0.6 + 0.39 * (torch.arange(levels, device=device) + 0.5) / levels
    peak_noise = torch.special.ndtri((torch.arange(quantiles, device=device) + 0.5) / quantiles)
    top, peak_noise = top.repeat_interleave(quantiles), peak_noise.repeat(levels)
    target = _target_logits(top.shape, vocab, generator, device, top=top)
    target = target.to(target_dtype).float()
    noise = torch.randn(target.shape, generator=generator, device=device)
    noise.scatter_(-1, target.argmax(-1, keepdim=True), peak_noise[:, None])

    acceptance_at = _AcceptanceEstimate(target, noise, variant, temperature)

    def estimate(log_scale: float) -> float:
        return acceptance_at(math.exp(log_scale))

    lo, hi = math.log(1e-3), math.log(30.0)
    if estimate(lo) <= acceptance:
        return math.exp(lo)
    if estimate(hi) >= acceptance:
        return math.exp(hi)
    for _ in range(12):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if estimate(mid) > acceptance else (lo, mid)
    return math.exp(0.5 * (lo + hi))


def make_verify_inputs(batch: int, block: int, vocab: int, *, variant: str = "sampled",
                       acceptance: float = DEFAULT_ACCEPTANCE, temperature: float = 1.0,
                       target_dtype: torch.dtype = torch.bfloat16,
                       draft_dtype: torch.dtype = torch.float32,
                       device="cpu", seed: int = 0, filters: bool = False) -> VerifyCase:
    """Inputs for ``dspark_ops.verify`` with a chosen per-position acceptance rate.

    Parameters
    ----------
    batch, block, vocab : int
        ``B``, ``G`` and ``V``; every request has ``num_draft = G``.
    variant : {"sampled", "greedy", "one-hot"}
        ``sampled``: drafts drawn from ``q = softmax(draft_logits / T)``, ``draft_logits``
        passed. ``greedy``: temperature 0, drafts are the draft argmax, no draft logits.
        ``one-hot``: temperature ``temperature``, drafts are the draft argmax, no draft logits.
    acceptance : float
        Expected per-position acceptance the draft noise is tuned for.
    temperature : float
        Target (and draft) temperature of the sampled and one-hot variants.
    target_dtype, draft_dtype : torch.dtype
        Storage types of target and draft logits.
    device : str or torch.device
        Where the tensors are made (generated there with a seeded generator).
    seed : int
        Seeds the generator; the per-request ``seed`` tensor is drawn from it too.
    filters : bool
        Sampled variant only: every request gets ``top_k = 50`` and ``top_p = 0.9``, and the
        drafts are drawn from the draft distribution filtered the same way (the draft logits
        hold -inf where the filters drop a token, as ``markov_draft`` returns them).

    Returns
    -------
    VerifyCase
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    device = torch.device(device)
    t = 0.0 if variant == "greedy" else temperature
    scale = noise_scale(variant, acceptance, vocab, t if t > 0 else 1.0, target_dtype, device)

    generator = torch.Generator(device=device).manual_seed(seed)
    target = _target_logits((batch, block + 1), vocab, generator, device).to(target_dtype)
    # A copy even for float32 targets: the noise is added in place.
    draft = target[:, :block].to(torch.float32, copy=True)
    draft.add_(torch.randn(draft.shape, generator=generator, device=device), alpha=scale)
    draft_logits = None
    filter_args = None
    if filters:
        if variant != "sampled":
            raise ValueError("filters apply to the sampled variant only")
        filter_args = dict(top_k=torch.full((batch,), FILTER_TOP_K, dtype=torch.int32, device=device),
                           top_p=torch.full((batch,), FILTER_TOP_P, device=device))
        per_row = {k: v[:, None].expand(batch, block) for k, v in filter_args.items()}
        draft = reference.filter_logits(draft, torch.full((batch, block), t, device=device),
                                        **per_row)
    if variant == "sampled":
        draft_logits = draft.to(draft_dtype)
        q = torch.softmax(draft_logits.float() / t, -1).reshape(-1, vocab)
        tokens = torch.multinomial(q, 1, generator=generator).reshape(batch, block)
        del q
    else:
        tokens = draft.argmax(-1)
    del draft

    return VerifyCase(
        target_logits=target,
        draft_tokens=tokens,
        num_draft=torch.full((batch,), block, dtype=torch.int32, device=device),
        temperature=torch.full((batch,), t, dtype=torch.float32, device=device),
        seed=torch.randint(0, 2**62, (batch,), generator=generator, device=device),
        position=torch.randint(0, 8192, (batch,), generator=generator, device=device),
        draft_logits=draft_logits,
        variant=variant,
        acceptance=acceptance,
        noise_scale=scale,
        filters=filter_args,
    )


# --------------------------------------------------------------------------------------------
# Competitors


def _probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """fp32 ``softmax(logits / T)`` over the last axis, with one temporary instead of two."""
    scaled = logits.float()
    scaled = scaled / temperature if scaled is logits else scaled.div_(temperature)
    return torch.softmax(scaled, -1)


def eager_torch_verify(target_logits, draft_tokens, num_draft, temperature, draft_logits=None):
    """Speculative verification as a user would write it in eager PyTorch with torch's RNG.

    Same rule as ``dspark_ops.verify`` (padded ``[B, G+1, V]`` target logits), different random
    numbers. Returns ``(tokens int64 [B, G+1], num_accepted int64 [B])``.
    """
    batch, block = draft_tokens.shape
    vocab = target_logits.shape[-1]
    target = target_logits.reshape(batch, block + 1, vocab)
    x = draft_tokens.long()
    j = torch.arange(block + 1, device=x.device)
    b = torch.arange(batch, device=x.device)
    n = num_draft.long()
    greedy = temperature <= GREEDY_TEMPERATURE
    x_pad = torch.cat([x, torch.full_like(x[:, :1], -1)], 1)

    if bool(greedy.all()):  # the host check a user writes to skip the softmax entirely
        argmax = target.argmax(-1)
        accept = (x == argmax[:, :block]) & (j[:block] < n[:, None])
        num_accepted = accept.long().cumprod(1).sum(1)
        tokens = torch.where(j < num_accepted[:, None], x_pad, -1)
        tokens[b, num_accepted] = argmax[b, num_accepted]
        return tokens, num_accepted

    t = torch.where(greedy, 1.0, temperature)[:, None, None]
    p = _probs(target, t)
    p_x = p[:, :block].gather(-1, x[..., None])[..., 0]
    if draft_logits is None:
        q = None
        q_x = torch.ones_like(p_x)
    else:
        q = _probs(draft_logits, t)
        q_x = q.gather(-1, x[..., None])[..., 0]
    u = torch.rand(p_x.shape, device=p_x.device)
    accept = (u * q_x < p_x) & (j[:block] < n[:, None])
    if bool(greedy.any()):
        argmax = target.argmax(-1)
        accept = torch.where(greedy[:, None], x == argmax[:, :block], accept)
    num_accepted = accept.long().cumprod(1).sum(1)

    is_bonus = num_accepted == n
    row = num_accepted.clamp(max=block - 1)
    p_star = p[b, num_accepted]
    if q is None:
        residual = p_star.scatter(-1, x[b, row][:, None], 0.0)
    else:
        residual = (p_star - q[b, row]).clamp_min_(0.0)
    residual = torch.where(is_bonus[:, None], p_star, residual)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 1e-12, residual / mass, p_star)
    token = torch.multinomial(residual, 1)[:, 0]
    if bool(greedy.any()):
        token = torch.where(greedy, argmax[b, num_accepted], token)

    tokens = torch.where(j < num_accepted[:, None], x_pad, -1)
    tokens[b, num_accepted] = token
    return tokens, num_accepted


def eager_filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p in eager PyTorch, as a user would write it: float32 logits ``[..., V]``
    with -inf where a filter drops a token (per-request ``top_k``/``top_p`` of the leading axis)."""
    z = logits.float() / temperature[:, None, None]
    kth = z.topk(int(top_k.max()), -1).values.gather(-1, (top_k.long() - 1)[:, None, None]
                                                     .expand(*z.shape[:-1], 1))
    z = z.masked_fill(z < kth, float("-inf"))
    sorted_z, order = z.sort(-1, descending=True)
    probs = torch.softmax(sorted_z, -1)
    before = probs.cumsum(-1) - probs
    drop = before >= top_p[:, None, None]
    z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
    return z * temperature[:, None, None]


def _flashinfer_factory() -> Optional[Callable[[VerifyCase], Callable]]:
    """Builds timed callables around FlashInfer's chain kernel, or None when not importable."""
    try:
        from flashinfer.sampling import chain_speculative_sampling
    except Exception as error:  # ImportError, or a broken install raising anything else
        report_once("flashinfer", f"anchor flashinfer: not installed ({type(error).__name__}: "
                    f"{error})")
        return None
    params = inspect.signature(chain_speculative_sampling).parameters
    report_once("flashinfer", "anchor flashinfer: flashinfer.sampling.chain_speculative_sampling")
    try:
        from flashinfer.sampling import top_k_renorm_probs, top_p_renorm_probs
    except Exception:
        top_k_renorm_probs = top_p_renorm_probs = None

    def make(case: VerifyCase):
        if case.greedy:
            return None  # no greedy mode: T = 0 has no probabilities to pass
        batch, block, vocab = case.shape
        t = case.temperature[:, None, None]
        tokens = case.draft_tokens.int()
        kwargs = {}
        if "uniform_samples" in params:  # FlashInfer < 0.2 takes the uniforms as input
            kwargs["uniform_samples"] = torch.rand(batch, block + 1, device=tokens.device)

        if case.filters is not None and top_k_renorm_probs is None:
            return None

        def call():
            target_probs = _probs(case.target_logits, t)
            if case.filters is not None:
                flat = target_probs.reshape(-1, vocab)
                rows_per_request = block + 1
                flat = top_k_renorm_probs(flat, case.filters["top_k"].repeat_interleave(rows_per_request))
                flat = top_p_renorm_probs(flat, case.filters["top_p"].repeat_interleave(rows_per_request))
                target_probs = flat.reshape(batch, block + 1, vocab)
            if case.draft_logits is None:
                draft_probs = torch.zeros(batch, block, vocab, device=tokens.device)
                draft_probs.scatter_(-1, case.draft_tokens[..., None], 1.0)
            else:
                draft_probs = _probs(case.draft_logits, t)
            return chain_speculative_sampling(
                draft_probs=draft_probs, draft_token_ids=tokens, target_probs=target_probs,
                **kwargs,
            )

        return call

    return make


_VLLM_PARAMS = ["draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
                "draft_probs", "target_probs", "bonus_token_ids", "sampling_metadata"]


def _vllm_factory() -> Optional[Callable[[VerifyCase], Callable]]:
    """Builds timed callables around vLLM v1's ``rejection_sample``, or None when unusable.

    ``RejectionSampler.forward`` needs a full engine ``Sampler`` and ``SamplingMetadata``, so
    the harness drives the module-level ``rejection_sample`` with the few metadata fields it
    reads, after doing what ``forward`` does before it (target rows to fp32, temperature,
    softmax; bonus token sampled from the bonus rows with the exponential race).
    """
    try:
        from vllm.v1.sample import rejection_sampler as rs
    except Exception as error:
        report_once("vllm", f"anchor vllm: not installed ({type(error).__name__}: {error})")
        return None
    fn = getattr(rs, "rejection_sample", None)
    params = list(inspect.signature(fn).parameters) if fn is not None else None
    if params != _VLLM_PARAMS:
        report_once("vllm", f"anchor vllm: skipped, rejection_sample has parameters {params}, "
                    f"not the {_VLLM_PARAMS} this harness drives")
        return None
    greedy_value = float(getattr(rs.GREEDY_TEMPERATURE, "value", rs.GREEDY_TEMPERATURE))
    report_once("vllm", "anchor vllm: vllm.v1.sample.rejection_sampler.rejection_sample")

    def make(case: VerifyCase):
        batch, block, vocab = case.shape
        device = case.draft_tokens.device
        greedy = case.greedy
        flat = case.target_logits.reshape(-1, vocab)
        base = torch.arange(batch, device=device)[:, None] * (block + 1)
        target_rows = (base + torch.arange(block, device=device)).reshape(-1)
        bonus_rows = base[:, 0] + block
        draft_ids = case.draft_tokens.int().reshape(-1).contiguous()
        num_draft = case.num_draft.tolist()  # host list, as vLLM keeps it
        cu_num_draft = case.num_draft.cumsum(0).int()  # inclusive
        t_req = case.temperature[:, None]
        t_tok = case.temperature.repeat_interleave(block)[:, None]
        metadata = types.SimpleNamespace(
            all_greedy=greedy, all_random=not greedy, generators={}, top_k=None, top_p=None,
            temperature=torch.full_like(case.temperature, greedy_value) if greedy
            else case.temperature,
        )

        def call():
            logits = flat[target_rows].float()
            bonus_logits = flat[bonus_rows].float()
            if greedy:  # argmax only: the softmax would not change it
                target_probs, bonus = logits, bonus_logits.argmax(-1)
            else:
                target_probs = torch.softmax(logits.div_(t_tok), -1)
                bonus_probs = torch.softmax(bonus_logits.div_(t_req), -1)
                bonus = bonus_probs.div_(torch.empty_like(bonus_probs).exponential_()).argmax(-1)
            draft_probs = None
            if case.draft_logits is not None:
                draft_probs = _probs(case.draft_logits.reshape(-1, vocab), t_tok)
            return rs.rejection_sample(
                draft_ids, num_draft, block, cu_num_draft, draft_probs, target_probs,
                bonus.int()[:, None].contiguous(), metadata,
            )

        out = call()
        if tuple(out.shape) != (batch, block + 1):
            raise RuntimeError(f"unexpected output shape {tuple(out.shape)}")
        return call

    return make


# --------------------------------------------------------------------------------------------
# Measurement


def bytes_moved(case: VerifyCase, num_accepted: torch.Tensor) -> Tuple[int, int]:
    """Bytes a verify kernel must read: (only the rows needed, every row).

    Needed, per request with ``a`` accepted of ``n``: target rows ``0..a``, draft rows
    ``0..min(a, n-1)``, and for sampled/one-hot requests the row the emitted token is drawn
    from read once more (target, plus the draft row unless it is the bonus row), since the
    residual needs the row's normaliser first. Greedy needs no second pass.
    """
    batch, block, vocab = case.shape
    tb = case.target_logits.element_size() * vocab
    db = case.draft_logits.element_size() * vocab if case.draft_logits is not None else 0
    a = num_accepted.long().cpu()
    n = case.num_draft.long().cpu()
    needed = ((a + 1) * tb + torch.minimum(a + 1, n) * db).sum().item()
    if not case.greedy:
        needed += batch * tb + (a < n).sum().item() * db
    every = batch * (block + 1) * tb + batch * block * db
    return int(needed), int(every)


def _timings(device: torch.device, quick: bool) -> Timing:
    return Timing.for_device(device, quick, cpu_seconds=(1.5, 1.0), cpu_quick_seconds=(0.2, 0.05))


def bench_case(case: VerifyCase, device: torch.device, timing: Timing,
               anchors: Dict[str, Optional[Callable]], copy_gbps: Optional[float]) -> Row:
    """Times one input set with every competitor and returns its row."""
    batch, block, vocab = case.shape
    args, kwargs = case.args(), dict(draft_logits=case.draft_logits, **(case.filters or {}))

    def ours():
        return dspark_ops.verify(*args, **kwargs)

    def ref():
        return reference.verify(*args, **kwargs)

    def eager():
        if case.filters is not None:
            filtered = eager_filter_logits(case.target_logits, case.temperature,
                                           case.filters["top_k"], case.filters["top_p"])
            return dspark_ops.verify(filtered, *args[1:], draft_logits=case.draft_logits)
        return eager_torch_verify(case.target_logits, case.draft_tokens, case.num_draft,
                                  case.temperature, case.draft_logits)

    ref_out = ref()
    try:
        out = ours()
        synchronize(device)
    except Exception as error:  # e.g. a build without this device's kernel
        log(f"  ours: not run ({type(error).__name__}: {error})")
        out, ours = None, None
    # Acceptance statistics come from the op's output (the reference's when the op is absent).
    stats = out if out is not None else ref_out
    num_accepted = stats.num_accepted.long()
    tested = torch.minimum(num_accepted + 1, case.num_draft.long()).sum().item()

    row = Row(op="verify", shape=f"B={batch} G={block} V={vocab}", variant=_variant_label(case))
    row.extra["dtypes"] = _dtype_label(case)
    row.extra["acc.len"] = num_accepted.float().mean().item()
    row.extra["alpha"] = num_accepted.sum().item() / tested if tested else None
    if out is not None:
        same = ((out.tokens == ref_out.tokens).all(1) & (out.num_accepted == ref_out.num_accepted)
                & (out.valid == ref_out.valid))
        row.extra["match"] = f"{int(same.sum())}/{batch}"
    else:
        row.extra["match"] = None

    eager_name = "eager-filter+verify" if case.filters is not None else "eager-torch"
    competitors = {"ours": ours, "ref": ref, eager_name: eager}
    for name, factory in anchors.items():
        competitors[name] = None
        if factory is not None:
            try:
                competitors[name] = factory(case)
            except Exception as error:
                log(f"  {name}: not run ({type(error).__name__}: {error})")
    measure(row, competitors, device, timing)

    if device.type == "cuda":
        needed, every = bytes_moved(case, num_accepted)
        row.bytes_moved = needed
        row.extra["MB all"] = every / 1e6
        finish_row(row, copy_gbps)
    return row


def _variant_label(case: VerifyCase) -> str:
    label = f"{case.variant} a~{case.acceptance:g}"
    if case.filters is not None:
        label += f" top-k {FILTER_TOP_K} top-p {FILTER_TOP_P:g}"
    return label


def _dtype_label(case: VerifyCase) -> str:
    short = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
    draft = short[case.draft_logits.dtype] if case.draft_logits is not None else "-"
    return f"{short[case.target_logits.dtype]}/{draft}"


def plan(device: torch.device, quick: bool) -> List[dict]:
    """The rows to run: the default shape, its greedy and one-hot variants, then the sweeps."""
    p = GPU_PLAN if device.type == "cuda" else CPU_PLAN
    base = dict(batch=p["batch"], block=p["block"], vocab=p["vocab"],
                acceptance=DEFAULT_ACCEPTANCE)
    rows = [dict(base, variant=v) for v in VARIANTS]
    rows.append(dict(base, variant="sampled", filters=True))
    if not quick:
        rows += [dict(base, variant="sampled", batch=b) for b in p["batches"]]
        rows += [dict(base, variant="sampled", acceptance=a) for a in p["acceptances"]]
    return rows


def run(device: torch.device, quick: bool = False, use_anchors: bool = True,
        checkpoint: Optional[Callable[[List[Row]], None]] = None) -> List[Row]:
    """Runs every planned row on ``device`` and returns the rows.

    ``checkpoint(rows)`` is called after each row, so an interrupted run keeps what it measured.
    """
    torch.manual_seed(0)  # eager-torch draws from torch's default generator
    copy_gbps = None
    anchors = {}
    if device.type == "cuda":
        copy_gbps = measure_copy_bandwidth(device)
        log(f"copy bandwidth ({device}): {copy_gbps:.0f} GB/s (read + write)")
        if use_anchors:
            anchors = {"flashinfer": _flashinfer_factory(), "vllm": _vllm_factory()}
        else:
            report_once("gpu-anchors", "anchors flashinfer, vllm: skipped (--no-anchors)")
    else:
        report_once("gpu-anchors", "anchors flashinfer, vllm: GPU only, not measured on CPU")
    timing = _timings(device, quick)

    rows = []
    for i, spec in enumerate(plan(device, quick)):
        started = time.perf_counter()
        case = make_verify_inputs(spec["batch"], spec["block"], spec["vocab"],
                                  variant=spec["variant"], acceptance=spec["acceptance"],
                                  device=device, seed=i, filters=spec.get("filters", False))
        row = bench_case(case, device, timing, anchors, copy_gbps)
        rows.append(row)
        eager_name = "eager-filter+verify" if case.filters is not None else "eager-torch"
        log(f"  verify {row.shape} {row.variant}: ours {format_us(row.ours_us)} us, "
            f"ref {format_us(row.reference_us)} us, {eager_name} {format_us(row.anchors[eager_name])} us "
            f"[{time.perf_counter() - started:.1f} s]")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    return family_arg_parser(
        __doc__.split("\n")[0],
        quick_help="only the default shape (sampled, greedy, one-hot), fewer repeats",
        anchors_help="skip FlashInfer and vLLM (their first use may JIT-compile for minutes)",
    ).parse_args(argv)


def main(argv=None, *, emit: bool = True) -> List[Row]:
    """Command-line entry point; returns the rows (``emit=False``: print nothing to stdout)."""
    return family_main(
        "verify", parse_args(argv),
        lambda device, args, checkpoint: run(device, quick=args.quick,
                                             use_anchors=not args.no_anchors,
                                             checkpoint=checkpoint),
        emit=emit)


if __name__ == "__main__":
    main()
