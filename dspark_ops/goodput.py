"""Goodput: how many slots to draft, and how many drafts to verify, on this machine
(docs/semantics.md "Goodput").

A plan that drafts ``k`` slots and verifies ``l_r <= k`` drafts of request ``r`` emits, in
expectation, ``sum_r (1 + sum_{i <= l_r} a_{r,i})`` tokens (``a_{r,i}`` the survival of draft
``i``) in ``T_draft(k) + T_target(B, 1 + max_r l_r)`` seconds (:class:`~dspark_ops.costs.CostTable`).
Two decisions per round:

- **before drafting** (:meth:`GoodputPolicy.drafts_to_propose`), from running estimates of the
  per-position acceptance (:class:`AcceptanceEstimate`, an EMA of what verification accepted):
  the ``k`` of the highest goodput, verifying every drafted slot; ``k = 0``, the plain decoding
  path, unless some ``k > 0`` beats it by ``margin`` (once speculating on its merits, it stays
  on while it beats the plain path at all). While speculation is off, a probe round now and
  then keeps the estimates alive;
- **after drafting** (:func:`verify_lengths`): DSpark's Algorithm 1
  (:func:`dspark_ops.schedule_verify`) on the fresh confidences (or, without a confidence head,
  the estimates) with the measured step rates, stopping at the first drop; then the padded
  width, at least as wide, of the highest goodput (expected tokens over the round's drafting and
  verifying time), every request's length raised to it, since the padded forward pays for it
  anyway. A step-shaped cost curve (a width that costs a third more than the one before, then
  flat) stops Algorithm 1 short of widths that pay as a whole.

Both are functions of what is known before each draft is drawn, so sampling stays exact.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .costs import CostTable
from .ops.schedule import schedule_verify

__all__ = ["AcceptanceEstimate", "GoodputPolicy", "expected_tokens", "plan_goodput",
           "verify_lengths"]


class AcceptanceEstimate:
    """Running per-position conditional acceptance: ``c[i]`` estimates P(draft ``i + 1`` is
    accepted | drafts ``1..i`` were), per request and pooled over requests.

    Each position keeps exponentially decayed counts of what verification saw there (``hits``
    and ``seen``, both decayed by ``1 - rate`` per observation of that position), and counts a
    base as ``strength`` observations made before the first, decaying like the others::

        c[i] = (hits[i] + w[i] * base[i]) / (seen[i] + w[i]),   w[i] = strength * (1 - rate)^n[i]

    with ``n[i]`` the observations of position ``i``.

    - Decayed counts, not a plain EMA from the prior: the first observations are averaged
      rather than pulled toward a guess, and once ``seen`` nears ``1 / rate`` each new
      observation weighs ``rate``, as in an EMA of that rate.
    - The base of the pooled estimate at position 1 is ``prior``; at a deeper position it is the
      estimate of the position before, so a position that is rarely reached (a draft mostly
      rejected early) follows its predecessor instead of staying at the prior.
    - A request's base at position 1 is the pooled estimate when it began; at a deeper position
      it is the request's own estimate of the position before, times the pooled estimates' ratio
      of the two positions (at most 1). A new request starts from what the draft achieved on
      earlier ones and moves to its own rate as it runs, at the positions it has not reached
      yet as well: a request that accepts everything it verifies raises the positions past the
      ones it verifies, so the goodput rule comes to verify them (with a fixed base, a position
      never verified would stay at the pooled estimate for the whole request).

    Parameters
    ----------
    max_drafts : int
        Positions tracked.
    prior : float
        The pooled estimate of position 1 before any round.
    rate : float
        Decay per observation: the weight of one observation once a position has seen
        ``1 / rate`` of them.
    strength : float
        Pseudo-observations of the base.
    idle_rate : float
        Decay of every count per round that verified nothing (:meth:`age`).
    """

    def __init__(self, max_drafts: int, prior: float = 0.5, rate: float = 0.03,
                 strength: float = 2.0, idle_rate: float = 0.06):
        if (not 0 <= prior <= 1 or not 0 < rate <= 1 or not strength > 0
                or not 0 <= idle_rate <= 1):
            raise ValueError(f"AcceptanceEstimate: need 0 <= prior <= 1, 0 < rate <= 1, "
                             f"strength > 0 and 0 <= idle_rate <= 1, got {prior}, {rate}, "
                             f"{strength} and {idle_rate}")
        self.max_drafts, self.prior, self.rate, self.strength = max_drafts, prior, rate, strength
        self.idle_rate = idle_rate
        self._pooled_counts = self._no_counts()
        self.pooled = self._estimate(self._pooled_counts, None)
        self.per_request: List[List[float]] = []
        self._counts: List[tuple] = []
        self._profiles: List[List[float]] = []

    def _no_counts(self):
        """``(hits, seen, w)`` before any observation."""
        return ([0.0] * self.max_drafts, [0.0] * self.max_drafts,
                [self.strength] * self.max_drafts)

    def _estimate(self, counts, profile: Optional[Sequence[float]]) -> List[float]:
        """``c`` from the counts; ``profile`` None: the pooled rule (the prior, then the
        predecessor), else a request's (``profile[0]``, then the predecessor scaled by the
        profile's ratio of the two positions)."""
        hits, seen, weight = counts
        out: List[float] = []
        for i in range(self.max_drafts):
            if profile is None:
                b = out[i - 1] if i else self.prior
            elif i == 0:
                b = profile[0]
            elif profile[i - 1] > 0:
                b = min(1.0, out[i - 1] * profile[i] / profile[i - 1])
            else:
                b = profile[i]
            out.append((hits[i] + weight[i] * b) / (seen[i] + weight[i]))
        return out

    def begin(self, batch: int) -> None:
        """New requests, each starting from the pooled estimate."""
        self._profiles = [list(self.pooled) for _ in range(batch)]
        self._counts = [self._no_counts() for _ in range(batch)]
        self.per_request = [list(self.pooled) for _ in range(batch)]

    def observe(self, request: int, verified: int, accepted: int) -> None:
        """One round of ``request``: ``verified`` drafts checked, the first ``accepted``
        accepted. Positions ``1..accepted`` saw an acceptance, ``accepted + 1`` (if verified) a
        rejection; later positions were not reached and learn nothing, but what they saw
        earlier ages (their counts decay, the base's weight does not), so a position that a few
        rejections priced out of verification returns toward its base and is tried again."""
        reached = min(verified, accepted + 1, self.max_drafts)
        keep = 1 - self.rate
        for hits, seen, weight in (self._counts[request], self._pooled_counts):
            for i in range(self.max_drafts):
                hits[i] = keep * hits[i] + (1.0 if i < accepted else 0.0)
                seen[i] = keep * seen[i] + (1.0 if i < reached else 0.0)
                if i < reached:
                    weight[i] *= keep
        self.pooled = self._estimate(self._pooled_counts, None)
        self.per_request[request] = self._estimate(self._counts[request],
                                                   self._profiles[request])

    def age(self) -> None:
        """A round that verified nothing (the plain path). Every count ages by
        ``1 - idle_rate``, the bases' weights do not, and each request's base becomes the aged
        pooled estimate: while speculation is off, what made it off fades, and the estimates
        drift back toward the prior. Without this they froze at the values that turned
        speculation off, and only the backed-off probes (one round in 8 to 128) could move
        them, so a draft that pays about half the time stayed off for most of a request."""
        keep = 1 - self.idle_rate
        for hits, seen, _ in (self._pooled_counts, *self._counts):
            for i in range(self.max_drafts):
                hits[i] *= keep
                seen[i] *= keep
        self.pooled = self._estimate(self._pooled_counts, None)
        self._profiles = [list(self.pooled) for _ in self._counts]
        self.per_request = [self._estimate(counts, profile)
                            for counts, profile in zip(self._counts, self._profiles)]

    def conditional(self, request: int) -> List[float]:
        return self.per_request[request]

    def survival(self, request: int) -> List[float]:
        """``a_i``: the estimated probability that drafts ``1..i`` are all accepted."""
        out, running = [], 1.0
        for c in self.per_request[request]:
            running *= c
            out.append(running)
        return out


def expected_tokens(survival: Sequence[float], k: int) -> float:
    """Tokens a request emits when ``k`` drafts are verified: ``1 + a_1 + ... + a_k``."""
    return 1.0 + sum(survival[:k])


def plan_goodput(costs: CostTable, batch: int, survivals: Sequence[Sequence[float]],
                 max_drafts: int) -> List[float]:
    """Expected tokens per second of drafting and verifying ``k`` slots, ``k = 0..max_drafts``
    (``k = 0``: the plain step), over the requests with ``survivals`` (the active ones) in a
    batch of ``batch`` rows."""
    out = []
    for k in range(max_drafts + 1):
        tokens = sum(expected_tokens(a, k) for a in survivals)
        out.append(tokens / (costs.draft(k) + costs.target(batch, k + 1)))
    return out


class GoodputPolicy:
    """The decision before drafting: how many slots (0 = the plain path), with probes.

    Parameters
    ----------
    costs : CostTable
        The measured table; the decoder corrects it online.
    max_drafts : int
        ``K``, the most slots a round drafts.
    margin : float
        Speculation must promise ``margin`` times the plain path's goodput to run (TurboSpec's
        1.1: the estimates are noisy, and a wrong "on" costs more than a wrong "off").
    probe_every : int
        Plain rounds before the first probe; each probe that does not turn speculation on
        doubles the wait, up to ``probe_max``; a round that speculates on its merits resets it.
    probe_max : int
    prior, rate, idle_rate : float
        Of the :class:`AcceptanceEstimate`.
    """

    def __init__(self, costs: CostTable, max_drafts: int, *, margin: float = 1.1,
                 probe_every: int = 8, probe_max: int = 128, prior: float = 0.5,
                 rate: float = 0.03, idle_rate: float = 0.06):
        if max_drafts < 1:
            raise ValueError(f"GoodputPolicy: 'max_drafts' must be >= 1, got {max_drafts}")
        if max_drafts > costs.max_drafts:
            raise ValueError(f"GoodputPolicy: the cost table prices at most {costs.max_drafts} "
                             f"drafts, 'max_drafts' is {max_drafts}")
        if margin < 1 or probe_every < 1 or probe_max < probe_every:
            raise ValueError(f"GoodputPolicy: need margin >= 1 and 1 <= probe_every <= "
                             f"probe_max, got {margin}, {probe_every} and {probe_max}")
        self.costs, self.max_drafts, self.margin = costs, max_drafts, margin
        self.probe_every, self.probe_max = probe_every, probe_max
        self.estimate = AcceptanceEstimate(max_drafts, prior, rate, idle_rate=idle_rate)
        #: Whether the last round speculated on its merits (not as a probe): the margin guards
        #: turning speculation on against noisy estimates; applied to staying on as well, an
        #: acceptance just above the threshold flaps off, and the backed-off probes then keep
        #: it off for long.
        self.speculating = False
        self.begin(0)

    def begin(self, batch: int) -> None:
        """A new batch of requests (the pooled estimate and the probe schedule carry over)."""
        self.estimate.begin(batch)
        self.plain_streak = 0
        self.probe_wait = getattr(self, "probe_wait", self.probe_every)

    def choose(self, batch: int, active: Sequence[int], limit: int,
               margin: Optional[float] = None) -> int:
        """The goodput argmax over ``k = 0..limit`` for the ``active`` requests, with a margin
        (default ``self.margin``): ``k > 0`` only when its goodput exceeds ``margin`` times the
        plain path's."""
        margin = self.margin if margin is None else margin
        k_max = min(limit, self.max_drafts)
        if k_max < 1 or not active:
            return 0
        rates = plan_goodput(self.costs, batch, [self.estimate.survival(r) for r in active],
                             k_max)
        best = max(range(1, k_max + 1), key=lambda k: (rates[k], -k))
        return best if rates[best] > margin * rates[0] else 0

    def best_positive(self, batch: int, active: Sequence[int], limit: int) -> int:
        """The probe's size: the best ``k >= 1`` by the estimates, margin aside."""
        k_max = min(limit, self.max_drafts)
        rates = plan_goodput(self.costs, batch, [self.estimate.survival(r) for r in active],
                             k_max)
        return max(range(1, k_max + 1), key=lambda k: (rates[k], -k))

    def drafts_to_propose(self, batch: int, active: Sequence[int], limit: int) -> int:
        """This round's ``k``: :meth:`choose` (with the margin to turn speculation on, without
        it to stay on), or a probe when speculation has been off for ``probe_wait`` rounds.
        ``limit`` caps it (e.g. the tokens a request still needs)."""
        k = self.choose(batch, active, limit, 1.0 if self.speculating else self.margin)
        if min(limit, self.max_drafts) < 1 or not active:
            return 0  # nothing to decide: the state stays as it was
        self.speculating = k > 0
        if k > 0:
            self.plain_streak, self.probe_wait = 0, self.probe_every
            return k
        self.estimate.age()
        self.plain_streak += 1
        if self.plain_streak <= self.probe_wait:
            return 0
        self.plain_streak = 0
        self.probe_wait = min(2 * self.probe_wait, self.probe_max)
        return self.best_positive(batch, active, limit)

    def observe(self, request: int, verified: int, accepted: int) -> None:
        self.estimate.observe(request, verified, accepted)

    def estimated_confidence(self, batch: int, k: int, device) -> torch.Tensor:
        """The conditional estimates as a ``[batch, k]`` confidence (for proposers without a
        confidence head: known before drafting, so scheduling on them is exact)."""
        rows = [self.estimate.conditional(r)[:k] for r in range(batch)]
        return torch.tensor(rows, dtype=torch.float32, device=device).reshape(batch, k)


def verify_lengths(confidence: torch.Tensor, active: torch.Tensor, costs: CostTable,
                   available: Optional[torch.Tensor] = None,
                   estimates: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The decision after drafting: Algorithm 1 (:func:`dspark_ops.schedule_verify`) on the
    conditional ``confidence [B, k]`` with the measured step rates; then, among the widths at
    least as wide as its widest request, the one of the highest expected tokens per second of
    the round (drafting included), at its cheapest padding, every active request raised to it
    within what it drafted (``available [B]``, default ``k``). Returns int32 ``[B]`` (one host
    sync: the widest request and the expected tokens per width).

    ``estimates [B, k]``: the conditional acceptance known before drafting, for a
    ``confidence`` computed from the drafts (a confidence head reads the token before each
    slot). The width's expected tokens then read the fresh confidence only up to each
    request's first drop and the estimates past it, so that whether a slot is verified never
    depends on its own draft or a later one (a stopping time, §5.2); None: ``confidence`` is
    itself known before drafting and read whole."""
    batch, k = confidence.shape
    device = confidence.device
    if available is None:
        available = torch.full((batch,), k, dtype=torch.int32, device=device)
    slots = torch.arange(k, device=device)
    usable = active[:, None] & (slots < available[:, None])
    confidence = torch.where(usable, confidence, 0.0)
    num_verify = schedule_verify(confidence, costs.step_rate(batch, k, device))
    planning = confidence
    if estimates is not None:  # past the slot Algorithm 1 stopped at, what was known before
        seen = slots[None, :] <= num_verify[:, None]
        planning = torch.where(seen, confidence, torch.where(usable, estimates, 0.0))
    # Expected tokens of the batch at each width w = 1..k+1: every active request verifies
    # min(w - 1, available) drafts, emitting 1 + the survivals of those.
    gain = torch.cat([planning.new_zeros(batch, 1, dtype=torch.float64),
                      torch.cumprod(planning.double(), 1).cumsum(1)], 1)
    verified = torch.minimum(torch.arange(k + 1, device=device)[None, :],
                             available[:, None].long())
    tokens = torch.where(active[:, None], 1 + gain.gather(1, verified), 0.0).sum(0)
    host = torch.cat([tokens, num_verify.max()[None].double()]).tolist()  # the one sync
    drafting = costs.draft(k)
    width = max(range(int(host[-1]) + 1, k + 2),
                key=lambda w: (host[w - 1] / (drafting + costs.target(batch, w)), -w))
    width = costs.cheapest_width(batch, width, limit=k + 1)
    padded = torch.minimum(available, torch.full_like(available, width - 1))
    return torch.where(active, torch.maximum(num_verify, padded), 0).int()
