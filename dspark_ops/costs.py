"""What a decoding round costs on this machine: the measured cost table the goodput scheduler
prices rounds with (docs/semantics.md "Goodput").

A :class:`CostTable` holds, per batch size ``B``,

- ``target_seconds[B][w - 1]``: one target step whose widest request has ``w`` tokens
  (``w = 1``: the plain decoding step, a forward over the anchor and one draw; ``w = 1 + l``: a
  verify round over ``l`` drafts: packing, the ragged forward and :func:`dspark_ops.verify`);
- ``draft_seconds[k]``: the proposer's cost for ``k`` drafted slots (``k = 0`` costs nothing).

Targets served padded (:class:`~dspark_ops.hf.HFTarget`, :class:`~dspark_ops.models.TinyTarget`)
cost what their widest request costs, so the table is indexed by width, not by total tokens.
The measured curve need not be monotone (on a CPU the matrix products pick poor paths for 2-3
rows: a width of 8 can cost less than 3), so :meth:`CostTable.target` prices a width by the
cheapest width at least as wide (the decoder then verifies up to that width: the extra drafts
cost nothing), and the goodput scheduler sees that envelope.

:func:`profile_costs` measures a table (interleaved repetitions; the median plain step and
the median ratio of every other entry to its own repetition's plain step);
:func:`load_or_profile_costs` keeps tables on disk, keyed by the target, the proposer, the device,
the dtype, the threads and the library version, and :meth:`CostTable.check` refuses a table
measured on anything else, by name. ``python -m dspark_ops.profile`` writes one. The decoder
corrects the table online from its own rounds' timings (:meth:`CostTable.observe_target`,
:meth:`CostTable.observe_draft`), so a machine that slows down or speeds up is followed: each
target timing moves one speed factor that scales every entry, and its own entry's shape more
slowly; a drafting time moves only its own price.
The rule mostly observes the few widths it uses; without the shared factor the widths it does
not use would keep the prices of whatever spell the table was profiled in, and their prices
relative to the plain step (which decide whether to speculate at all) would be wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["CostTable", "CostTableMismatch", "cost_key", "default_cost_dir", "estimate_costs",
           "load_or_profile_costs", "profile_costs", "time_rounds"]

#: Weight of one new timing in the online correction (an EMA of the table's speed factor).
ONLINE_RATE = 0.1

#: How :func:`estimate_costs` turns timings into prices; part of a table's key, so a table
#: estimated another way is measured again rather than reused.
ESTIMATE = "median plain step, median per-repetition ratios to it"

#: A timing moves its own entry at this share of the speed factor's rate: a uniform drift of
#: the machine then goes mostly into the factor, which every entry follows.
ENTRY_SHARE = 0.25


class CostTableMismatch(ValueError):
    """A cost table measured on another target, proposer, device, dtype, thread count or
    library version than the run it is offered to."""


@dataclasses.dataclass
class CostTable:
    """Measured round costs (seconds); see the module doc.

    Attributes
    ----------
    key : dict
        What it was measured on (:func:`cost_key`).
    target_seconds : dict
        ``{batch: [seconds of width 1, 2, ..., W]}``.
    draft_seconds : list of float
        ``[0, cost of 1 slot, ..., cost of K slots]``.
    speed : float
        The online correction's factor on every entry (1 as profiled): a price is
        ``speed * entry``.
    """

    key: dict
    target_seconds: Dict[int, List[float]]
    draft_seconds: List[float]
    speed: float = 1.0

    def __post_init__(self):
        self.target_seconds = {int(b): [float(s) for s in row]
                               for b, row in self.target_seconds.items()}
        self.draft_seconds = [float(s) for s in self.draft_seconds]
        if not self.target_seconds or any(len(r) < 1 for r in self.target_seconds.values()):
            raise ValueError("CostTable: 'target_seconds' needs at least one batch size with "
                             "the plain step (width 1)")
        if not self.draft_seconds or self.draft_seconds[0] != 0.0:
            raise ValueError("CostTable: 'draft_seconds' must start with 0.0 (no drafts)")
        steps = [s for r in self.target_seconds.values() for s in r]
        if any(not (math.isfinite(s) and s > 0) for s in steps):
            raise ValueError("CostTable: every target step time must be finite and > 0")
        if any(not (math.isfinite(s) and s >= 0) for s in self.draft_seconds):
            raise ValueError("CostTable: every drafting time must be finite and >= 0")
        self.speed = float(self.speed)
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"CostTable: 'speed' must be finite and > 0, got {self.speed}")

    # -- reading ----------------------------------------------------------------------------

    @property
    def max_drafts(self) -> int:
        """The most drafts a round can be priced for (the shorter of both tables)."""
        widest = min(len(r) for r in self.target_seconds.values())
        return min(len(self.draft_seconds) - 1, widest - 1)

    def _entries(self, batch: int) -> List[float]:
        """The widths' entries at ``batch`` (before the speed factor): the measured row, else
        the nearest measured batch scaled by the batch ratio (a padded forward's work grows with
        its rows)."""
        if batch in self.target_seconds:
            return self.target_seconds[batch]
        nearest = min(self.target_seconds, key=lambda b: (abs(math.log(b / batch)), b))
        return [s * batch / nearest for s in self.target_seconds[nearest]]

    def _row(self, batch: int) -> List[float]:
        """The widths' prices at ``batch``: the entries times the speed factor."""
        return [self.speed * s for s in self._entries(batch)]

    def cheapest_width(self, batch: int, width: int, limit: Optional[int] = None) -> int:
        """The width ``>= width`` (and ``<= limit``) with the smallest measured time."""
        row = self._row(batch)
        last = len(row) if limit is None else min(len(row), limit)
        if not 1 <= width <= last:
            raise ValueError(f"width {width} is outside the table's 1..{last}")
        return min(range(width, last + 1), key=lambda w: (row[w - 1], w))

    def target(self, batch: int, width: int) -> float:
        """Seconds of a target step of ``width`` tokens per request (its cheapest padding)."""
        return self._row(batch)[self.cheapest_width(batch, width) - 1]

    def draft(self, k: int) -> float:
        """Seconds of drafting ``k`` slots."""
        if not 0 <= k < len(self.draft_seconds):
            raise ValueError(f"{k} drafted slots: the table covers 0..{len(self.draft_seconds) - 1}")
        return self.speed * self.draft_seconds[k]

    def step_rate(self, batch: int, max_drafts: int, device=None) -> torch.Tensor:
        """The table as :func:`dspark_ops.schedule_verify`'s ``step_rate``: float32
        ``[batch * (max_drafts + 1) + 1]``, entry ``n`` the steps per second of an ``n``-token
        verify batch, priced at the mean width ``n / batch``, interpolated between the widths'
        prices. (A padded forward pays for its widest request, a step in ``n``; Algorithm 1,
        which admits one token at a time and stops at the first drop, would never climb it.
        The decoder then pads every request to the cheapest width, which the interpolation
        leaves on the table.)"""
        prices = [self.target(batch, w) for w in range(1, max_drafts + 2)]
        rates = []
        for n in range(batch * (max_drafts + 1) + 1):
            width = min(max(n / batch, 1.0), max_drafts + 1.0)
            low = int(width)
            high = min(low + 1, max_drafts + 1)
            seconds = prices[low - 1] + (width - low) * (prices[high - 1] - prices[low - 1])
            rates.append(1.0 / seconds)
        return torch.tensor(rates, dtype=torch.float32, device=device)

    # -- online correction ------------------------------------------------------------------

    def observe_target(self, batch: int, width: int, seconds: float,
                       rate: float = ONLINE_RATE) -> None:
        """Moves the table toward a measured step time of (``batch``, ``width``): the speed
        factor by ``rate`` (in log space) toward the timing's ratio to its price, then this
        entry by ``ENTRY_SHARE * rate`` toward what is left of it (see the module doc)."""
        row = self.target_seconds.get(batch)
        if row is None:  # a batch not profiled: start its row from the scaled estimate
            row = self.target_seconds[batch] = list(self._entries(batch))
        if not (1 <= width <= len(row) and math.isfinite(seconds) and seconds > 0):
            return
        entry = row[width - 1]  # > 0: a target step is never free
        self.speed *= (seconds / (self.speed * entry)) ** rate
        row[width - 1] = entry + ENTRY_SHARE * rate * (seconds / self.speed - entry)

    def observe_draft(self, k: int, seconds: float, rate: float = ONLINE_RATE) -> None:
        """Moves the price of drafting ``k`` slots toward a measured drafting time, at ``rate``
        (an EMA), leaving the speed factor to the target's timings. A drafting time carries the
        round's bookkeeping (the schedule, the proposer's own Python), which its profile did
        not, and is a ratio to a price that may be microseconds (a lookup or oracle proposer):
        as a speed ratio it drove every target price to 3.5x within one 48-token request of an
        oracle draft, and the plain step's timings then pulled only the narrow entries back, so
        the wide rounds looked dearer against the plain step than they were (t(5) / t(1) 1.81
        against 1.34 profiled) and the rule stayed plain at an acceptance of 0.9."""
        if 1 <= k < len(self.draft_seconds) and math.isfinite(seconds) and seconds > 0:
            self.draft_seconds[k] += rate * (seconds / self.speed - self.draft_seconds[k])

    # -- files ------------------------------------------------------------------------------

    def check(self, key: dict, source: str = "the cost table") -> None:
        """Raises :class:`CostTableMismatch` naming the first field of ``key`` this table was
        not measured with."""
        for field, value in key.items():
            if self.key.get(field) != value:
                raise CostTableMismatch(
                    f"{source} was measured with {field} = {self.key.get(field)!r}, this run has "
                    f"{field} = {value!r}: profile this setting (python -m dspark_ops.profile) "
                    "or pass its own table")

    def to_dict(self) -> dict:
        """The prices (the speed factor folded into every entry)."""
        return {"key": self.key,
                "draft_seconds": [self.speed * s for s in self.draft_seconds],
                "target_seconds": {str(b): [self.speed * s for s in r]
                                   for b, r in sorted(self.target_seconds.items())}}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(temporary, path)  # never a half-written table

    @classmethod
    def load(cls, path: str, key: Optional[dict] = None) -> "CostTable":
        """Reads a table; with ``key``, refuses it unless measured on exactly that
        (:meth:`check`)."""
        with open(path) as f:
            data = json.load(f)
        try:
            table = cls(data["key"], data["target_seconds"], data["draft_seconds"])
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a cost table ({error})") from error
        if key is not None:
            table.check(key, path)
        return table

    def summary(self, batch: int = 1) -> str:
        """One line per part, in milliseconds."""
        row = self._row(batch)
        widths = " ".join(f"{w}:{s * 1e3:.1f}" for w, s in enumerate(row, 1))
        drafts = " ".join(f"{k}:{s * 1e3:.1f}" for k, s in enumerate(self.draft_seconds) if k)
        return (f"target step by width, ms (batch {batch}): {widths}\n"
                f"drafting by slots, ms: {drafts or '(no drafts)'}")


# -- identity -------------------------------------------------------------------------------

def digest(value) -> str:
    """A short, stable digest of a JSON-able value (Python's hash() changes per process)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def target_identity(target) -> str:
    """The target's class, parameter count and configuration digest (not its path: a moved
    model directory is the same model)."""
    model = getattr(target, "model", target)
    config = getattr(model, "config", None) or getattr(target, "config", None)
    if hasattr(config, "to_dict"):
        values = config.to_dict()
        values.pop("_name_or_path", None)
        values.pop("transformers_version", None)
    elif dataclasses.is_dataclass(config):
        values = dataclasses.asdict(config)
    else:
        values = repr(config)
    params = sum(p.numel() for p in model.parameters()) if hasattr(model, "parameters") else 0
    return f"{type(model).__name__}/{params}/{digest(values)}"


def _device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{name}"


def cost_key(target, proposer, *, device, dtype, batch_sizes: Sequence[int] = (1,)) -> dict:
    """What a cost table depends on: the target, the proposer (its kind, configuration and
    most drafts), the device, the dtype, the CPU threads, the library and torch versions, the
    rule of the CPU's few-row linear layers (:mod:`dspark_ops.models.cpu_linear`) and how the
    timings were turned into prices (:data:`ESTIMATE`)."""
    from ._version import __version__
    from .models.cpu_linear import RULE

    return {"target": target_identity(target), "proposer": proposer.identity(),
            "device": _device_name(device), "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "library": __version__,
            "torch": torch.__version__, "linears": RULE,
            "batch_sizes": sorted(int(b) for b in batch_sizes), "estimate": ESTIMATE}


def default_cost_dir() -> str:
    """``$DSPARK_OPS_CACHE/costs`` (the root the converted SmolLM2 is cached under too; the
    older name ``DSPARK_OPS_CACHE_DIR`` is read as well), else
    ``$XDG_CACHE_HOME/dspark_ops/costs`` (default ``~/.cache``)."""
    root = (os.environ.get("DSPARK_OPS_CACHE") or os.environ.get("DSPARK_OPS_CACHE_DIR")
            or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "dspark_ops"))
    return os.path.join(root, "costs")


# -- measuring ------------------------------------------------------------------------------

def _vocab_size(target) -> int:
    config = getattr(target, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        vocab = target.model.get_output_embeddings().weight.shape[0]
    return int(vocab)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _warn_if_loaded(device) -> None:
    """Warns when a CPU profile starts on a machine with more runnable work than cores: its
    table would price the load (SmolLM2 beside a training run: t(2)/t(1) about 1.6 against
    0.95 quiet), and the decoder would act on those prices until its online correction caught
    up."""
    if torch.device(device).type != "cpu" or not hasattr(os, "getloadavg"):
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load >= cores + 1:
        warnings.warn(f"profiling round costs with a load average of {load:.1f} on {cores} "
                      "cores: the table will price a loaded machine; profile where it will "
                      "decode (python -m dspark_ops.profile writes a table to reuse)",
                      RuntimeWarning, stacklevel=3)


@torch.no_grad()
def time_rounds(target, proposer, *, batch_sizes: Sequence[int] = (1,),
                max_drafts: Optional[int] = None, context: int = 128, repeats: int = 9,
                warmup: int = 1, progress: bool = True, seed: int = 0) -> dict:
    """The raw timings :func:`profile_costs` estimates a table from (its parameters).

    Returns ``{"key": cost_key(...), "target": {B: [[seconds of width 1..K+1] per
    repetition]}, "draft": {B: [[seconds of k = 1..K slots] per repetition]}}``: one row per
    timed repetition, so an estimator can compare the entries of one repetition with each
    other."""
    from .steps import plain_step, prefill, verify_step

    max_drafts = proposer.max_drafts if max_drafts is None else int(max_drafts)
    if max_drafts < 0 or repeats < 1 or warmup < 0 or context < 1:
        raise ValueError(f"profile_costs(): need max_drafts >= 0, repeats >= 1, warmup >= 0 and "
                         f"context >= 1, got {max_drafts}, {repeats}, {warmup} and {context}")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"profile_costs(): 'batch_sizes' must be >= 1, got {list(batch_sizes)}")
    device = target.device
    _warn_if_loaded(device)
    vocab = _vocab_size(target)
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(target, "dtype", torch.float32)
    key = cost_key(target, proposer, device=device, dtype=dtype, batch_sizes=batch_sizes)
    timings = {"key": key, "target": {}, "draft": {}}
    items = [("target", w) for w in range(1, max_drafts + 2)]
    items += [("draft", k) for k in range(1, max_drafts + 1)]
    total = len(batch_sizes) * (warmup + repeats)
    started = time.perf_counter()
    for index, batch in enumerate(int(b) for b in batch_sizes):
        target_rows, draft_rows = [], []
        for rep in range(warmup + repeats):
            if progress:
                done = index * (warmup + repeats) + rep
                print(f"\rprofiling round costs: {done}/{total} repetitions, "
                      f"{time.perf_counter() - started:.0f} s", end="", file=sys.stderr,
                      flush=True)
            prompts = torch.randint(0, vocab, (batch, context), generator=generator).tolist()
            length = context + 2 * (max_drafts + 2) * len(items) + 2
            last, features, cache, cache_len = prefill(target, prompts, length, device)
            position = cache_len.long()
            seeds = torch.arange(batch, dtype=torch.int64, device=device)
            temperature = torch.zeros(batch, dtype=torch.float32, device=device)
            anchor = last.argmax(-1)
            proposer.start(prompts, features, cache_len, anchor, length)
            history = [list(p) + [int(a)] for p, a in zip(prompts, anchor.tolist())]
            seconds = {}
            shift = rep % len(items)
            for kind, n in items[shift:] + items[:shift]:
                _sync(device)
                begin = time.perf_counter()
                if kind == "target" and n == 1:
                    plain_step(target, anchor, cache, cache_len, temperature, seeds, position, {})
                elif kind == "target":
                    drafts = torch.randint(0, vocab, (batch, n - 1), generator=generator)
                    num = torch.full((batch,), n - 1, dtype=torch.int32, device=device)
                    verify_step(target, anchor, drafts.to(device), None, num, position, cache,
                                cache_len, temperature, seeds, {})
                else:
                    proposer.propose(n, anchor, position, temperature, seeds, {}, history)
                _sync(device)
                seconds[kind, n] = time.perf_counter() - begin
            if rep >= warmup:
                target_rows.append([seconds["target", w] for w in range(1, max_drafts + 2)])
                draft_rows.append([seconds["draft", k] for k in range(1, max_drafts + 1)])
        timings["target"][batch] = target_rows
        timings["draft"][batch] = draft_rows
    if progress:
        print(f"\rprofiling round costs: {total}/{total} repetitions, "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return timings


def estimate_costs(timings: dict) -> CostTable:
    """A cost table from :func:`time_rounds`' timings: per batch size, the plain step is the
    median of its repetitions, and every other entry is the plain step times the median of its
    ratio to the plain step *of the same repetition*.

    What the scheduler decides on is the ratios (whether a round of ``w`` tokens and ``k``
    drafts pays over ``w`` plain steps), and a shared, noisy machine slows the entries in spells
    that cover part of a profile: medians taken entry by entry then pick their middle values
    from different spells. A ratio within one repetition compares timings a fraction of a
    second apart. Drafting times are priced the same way, on the plain step of the smallest
    batch size. (SmolLM2 on 2 threads, ``bench.cost_noise``: on a quiet machine both estimates
    agree within 3 %; beside a training run, windows of 9 repetitions put t(2)/t(1) at
    1.25-1.93 by ratios and 1.06-2.17 by entries, and the loaded machine's shape was its own,
    about 1.6 against 0.95 quiet: profile on the machine as it will decode.)"""
    target_seconds: Dict[int, List[float]] = {}
    for batch, rows in sorted(timings["target"].items()):
        plain = statistics.median(row[0] for row in rows)
        target_seconds[batch] = [plain] + [
            plain * statistics.median(row[w] / row[0] for row in rows)
            for w in range(1, len(rows[0]))]
    smallest = min(timings["target"])
    pairs = list(zip(timings["draft"][smallest], timings["target"][smallest]))
    draft_seconds = [0.0] + [
        max(target_seconds[smallest][0] * statistics.median(d[k] / t[0] for d, t in pairs), 1e-9)
        for k in range(len(pairs[0][0]))]
    return CostTable(timings["key"], target_seconds, draft_seconds)


def profile_costs(target, proposer, *, batch_sizes: Sequence[int] = (1,),
                  max_drafts: Optional[int] = None, context: int = 128, repeats: int = 9,
                  warmup: int = 1, progress: bool = True, seed: int = 0) -> CostTable:
    """Measures the cost table of ``target`` with ``proposer`` on this machine.

    Per batch size and repetition: a fresh prefill of ``context`` tokens per request, then, in
    an order that rotates from repetition to repetition (so a noisy machine slows every entry
    alike), one plain step, one verify step of every width ``2..K+1`` and one drafting call of
    every ``k = 1..K`` slots, each timed alone (CUDA: synchronised around it)
    (:func:`time_rounds`). The table holds the median plain step and, for every other entry,
    the median of its ratio to the plain step of its own repetition (:func:`estimate_costs`),
    over ``repeats`` repetitions after ``warmup`` untimed ones.

    Parameters
    ----------
    target
        The decoder's target (:class:`~dspark_ops.hf.HFTarget`, :class:`~dspark_ops.models.TinyTarget`).
    proposer : dspark_ops.proposers.Proposer
        What drafts (:func:`dspark_ops.proposers.make_proposer` turns a draft model into one).
    batch_sizes : sequence of int
        The batch sizes to measure (rounds of other sizes are priced from the nearest).
    max_drafts : int, optional
        ``K``, default ``proposer.max_drafts``.
    context : int
        Tokens of context behind each measured step.
    repeats, warmup : int
        Timed and untimed repetitions.
    progress : bool
        A progress line on stderr.

    Returns
    -------
    CostTable
    """
    return estimate_costs(time_rounds(target, proposer, batch_sizes=batch_sizes,
                                      max_drafts=max_drafts, context=context, repeats=repeats,
                                      warmup=warmup, progress=progress, seed=seed))


def load_or_profile_costs(target, proposer, *, batch_sizes: Sequence[int] = (1,),
                          cache_dir: Optional[str] = None, progress: bool = True,
                          **profile_options) -> CostTable:
    """The cached table for exactly this setting (:func:`cost_key`), measured and saved on
    first use under ``cache_dir`` (default :func:`default_cost_dir`)."""
    key = cost_key(target, proposer, device=target.device,
                   dtype=getattr(target, "dtype", torch.float32), batch_sizes=batch_sizes)
    path = os.path.join(cache_dir or default_cost_dir(), digest(key) + ".json")
    if os.path.isfile(path):
        try:
            return CostTable.load(path, key)
        except (ValueError, json.JSONDecodeError) as error:  # damaged: measure again
            print(f"re-profiling: {error}", file=sys.stderr)
    table = profile_costs(target, proposer, batch_sizes=batch_sizes, progress=progress,
                          **profile_options)
    table.save(path)
    if progress:
        print(f"cost table: {path}", file=sys.stderr)
    return table
