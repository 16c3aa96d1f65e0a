"""A benchmark's result row, what the timing fills in and the report prints (its own module, so
that :mod:`bench.timing` and :mod:`bench.report` both read it without importing each other)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

__all__ = ["Row", "ratio"]


@dataclasses.dataclass
class Row:
    """One benchmark measurement.

    Attributes
    ----------
    op, shape, variant : str
        What was timed (``shape`` is a short human-readable string).
    ours_us : float or None
        Median time of the dspark_ops kernel, microseconds.
    reference_us : float or None
        Median time of the eager reference (``dspark_ops.reference``) on the same inputs.
    bytes_moved : int or None
        Bytes the op must move at minimum (GPU rows); gives ``gbps`` and ``pct_copy``.
    gbps, pct_copy : float or None
        Achieved bandwidth from ``bytes_moved / ours_us`` and its share of the measured copy
        bandwidth; filled in by :func:`finish_row`.
    anchors : dict
        Anchor name -> median microseconds (``None``: not measured).
    extra : dict
        Family-specific columns printed after ``variant`` (e.g. mean accepted length); each key
        has an entry in ``LEGEND``.
    spread : dict
        Competitor name -> interquartile range of its round times over their median.
    others_load : float or None
        Cores other processes kept busy during the row's measurement (CPU rows).
    rounds : int
        Interleaved rounds per competitor.
    flags : list of str
        ``noisy`` / ``busy`` (see :func:`bench.timing.measure`): read that row's ratios with
        care.
    """

    op: str
    shape: str
    variant: str
    ours_us: Optional[float] = None
    reference_us: Optional[float] = None
    bytes_moved: Optional[int] = None
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    anchors: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    spread: Dict[str, float] = dataclasses.field(default_factory=dict)
    others_load: Optional[float] = None
    rounds: int = 0
    flags: List[str] = dataclasses.field(default_factory=list)

    @property
    def speedup(self) -> Optional[float]:
        """Reference time over our time."""
        return ratio(self.reference_us, self.ours_us)

    @property
    def best_baseline(self) -> tuple:
        """(name, microseconds) of the fastest competitor other than ours: the reference or an
        anchor; ``(None, None)`` when none was measured."""
        timed = {**{"ref": self.reference_us}, **self.anchors}
        timed = {k: v for k, v in timed.items() if v is not None}
        if not timed:
            return None, None
        name = min(timed, key=timed.get)
        return name, timed[name]

    def anchor_speedup(self, name: str) -> Optional[float]:
        """Anchor time over our time."""
        return ratio(self.anchors.get(name), self.ours_us)

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["speedup"] = self.speedup
        out["anchor_speedup"] = {name: self.anchor_speedup(name) for name in self.anchors}
        out["best_baseline"], out["best_baseline_us"] = self.best_baseline
        out["speedup_vs_best"] = ratio(out["best_baseline_us"], self.ours_us)
        return out


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``; None when either is missing or ``den`` is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den
