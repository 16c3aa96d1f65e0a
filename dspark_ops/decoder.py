"""An end-to-end speculative decoder built only from this library's ops and plain PyTorch
modules: one loop over every proposer (:mod:`dspark_ops.proposers`: DSpark and DFlash block
drafts, Eagle3 chains, prompt lookup, an oracle for measurement).

One round of :meth:`SpeculativeDecoder.generate`, batched over requests of different lengths:

1. how many slots to draft, ``k``: with ``scheduler="goodput"``, the goodput argmax over
   ``0..K`` from the measured cost table and the running acceptance estimates
   (:class:`dspark_ops.goodput.GoodputPolicy`); the other schedulers draft all ``K``. ``k = 0``
   runs **the plain decoding path** (one target forward over the anchor and one draw: no draft
   forward, no drafting op, no verify of drafts), the code plain decoding itself runs;
2. draft: the proposer drafts ``k`` slots (a block draft computes logits for those slots only);
3. schedule: how many drafts of each request to verify: ``goodput``, Algorithm 1 on the fresh
   confidences (or the estimates) with the measured step rates, padded to the cheapest width;
   ``confidence``, ``schedule_verify`` on a given step-rate table; ``budget``,
   ``plan_verify_budget`` on the confidences of two rounds before + ``allocate_verify``;
   ``fixed``, every draft;
4. verify: ``pack_verify_inputs`` -> one target forward over the ragged batch -> ``verify``;
5. commit: the target's cache keeps the anchor and the accepted drafts, the proposer gets their
   features (:meth:`~dspark_ops.proposers.Proposer.commit`), the emitted token becomes the next
   anchor. With ``goodput`` the round's measured times correct the cost table.

Sampling is lossless: with the same ``temperature`` the tokens are distributed exactly as
:func:`generate_target_only` (plain target sampling) produces them, and greedy output is
identical; every decision to verify a draft is made before that draft is known.

The target is anything with this interface (:class:`~dspark_ops.models.TinyTarget`, or
:class:`dspark_ops.hf.HFTarget` for a transformers model):

- ``device``;
- ``new_cache(num_rows, length)``: an empty cache object, passed back as it is;
- ``target(input_ids [B, T], num_valid [B], cache, cache_len [B])``: request ``b``'s first
  ``num_valid[b]`` tokens at positions ``cache_len[b] + i``, after its ``cache_len[b]``
  committed tokens (``cache_len`` only grows; rows of an earlier call past it are dropped);
  returns ``logits [B, T, V]`` and the draft's context features ``[B, T, F]``;
- ``forward_ragged(input_ids, cu_seqlens, cache, cache_len)``: the same over the ragged verify
  batch of :func:`dspark_ops.pack_verify_inputs`, returning ragged rows.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Sequence, Union

import torch

from ._per_request import as_per_request, draw_seeds
from .costs import CostTable
from .goodput import GoodputPolicy, verify_lengths
from .models import TinyTarget
from .ops.schedule import allocate_verify, plan_verify_budget, schedule_verify
from .proposers import make_proposer
from .steps import part, plain_step, prefill, sample_from_target, verify_step

__all__ = ["GenerateOutput", "RoundStats", "SpeculativeDecoder", "generate_target_only",
           "synthetic_step_rate"]

SCHEDULERS = ("goodput", "confidence", "budget", "fixed")


@dataclasses.dataclass
class RoundStats:
    """One round, over the requests that were still generating."""

    accepted: List[int]  # accepted drafts per request
    num_verify: List[int]  # drafts verified per request
    verify_tokens: int  # target tokens of the round: sum of (1 + num_verify)
    draft_seconds: float  # drafting and scheduling (0 on the plain path)
    verify_seconds: float  # target forward, verification (or the plain draw) and commit
    confidence: List[List[float]]  # the drafted slots' conditional confidences per request
    drafted: int = 0  # slots drafted, k; 0: the round ran the plain decoding path

    @property
    def plain(self) -> bool:
        return self.drafted == 0


@dataclasses.dataclass
class GenerateOutput:
    tokens: List[List[int]]  # generated tokens per request (prompt excluded, EOS included)
    rounds: List[RoundStats]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per request-round (accepted drafts + 1), the paper's tau; a plain
        round counts as one token."""
        counts = [a + 1 for r in self.rounds for a in r.accepted]
        return sum(counts) / max(len(counts), 1)

    @property
    def speculative_tau(self) -> float:
        """tau over the rounds that drafted (nan if none did)."""
        counts = [a + 1 for r in self.rounds if not r.plain for a in r.accepted]
        return sum(counts) / len(counts) if counts else float("nan")

    @property
    def plain_share(self) -> float:
        """The share of rounds that ran the plain decoding path."""
        return sum(r.plain for r in self.rounds) / max(len(self.rounds), 1)


def synthetic_step_rate(max_tokens: int, batch: int, cost_per_token: float = 0.1) -> torch.Tensor:
    """A synthetic step-rate table **for toy models and tests**: ``1 / (1 + cost_per_token *
    n / batch)``, each verified token per request costing ``cost_per_token`` of a step. Real
    models are priced by a measured :class:`~dspark_ops.costs.CostTable`
    (:func:`dspark_ops.profile_costs`)."""
    n = torch.arange(max_tokens, dtype=torch.float64)
    return (1.0 / (1.0 + cost_per_token * n / max(batch, 1))).float()


def _filters(top_k, top_p, min_p, batch: int, device) -> dict:
    """The sampling filters as per-request tensors (README "Sampling filters"); None = off."""
    out = {}
    for name, value, dtype in (("top_k", top_k, torch.int32), ("top_p", top_p, torch.float32),
                               ("min_p", min_p, torch.float32)):
        if value is not None:
            out[name] = as_per_request(value, batch, dtype, device)
    return out


def _seeds(seed, batch, device, generator) -> torch.Tensor:
    """``seed`` per request, or seeds drawn from ``generator`` on torch's default device (the
    CPU unless changed), so that a CPU generator serves a model on any device."""
    if seed is None:
        return draw_seeds(batch, generator).to(device)
    return as_per_request(seed, batch, torch.int64, device)


def _stop_ids(eos_token_id) -> frozenset:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


def _finish(generated: List[int], new: List[int], eos: frozenset, limit: int) -> bool:
    """Appends ``new`` up to a stop token or the length limit; True when the request is done."""
    for token in new:
        generated.append(token)
        if token in eos or len(generated) >= limit:
            return True
    return False


class _Clock:
    """Marks on the host clock (CPU) or CUDA events, read after the round's host sync."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, begin, end) -> float:
        return begin.elapsed_time(end) / 1e3 if self.cuda else end - begin


@torch.no_grad()
def generate_target_only(target: TinyTarget, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         temperature: Union[float, torch.Tensor] = 0.0, seed=None, *,
                         eos_token_id: Union[int, Sequence[int], None] = None,
                         top_k=None, top_p=None, min_p=None,
                         generator: Optional[torch.Generator] = None) -> List[List[int]]:
    """Plain autoregressive decoding of the target, one token per forward: the baseline the
    speculative decoder must reproduce (greedy: identical tokens; sampled: the same
    distribution, drawn from the same per-position random streams as ``verify``'s emissions).
    ``top_k``, ``top_p`` and ``min_p`` (per request or shared) filter every draw as
    :func:`dspark_ops.verify` does. Its step is :func:`dspark_ops.steps.plain_step`, the
    speculative decoder's plain path."""
    device = target.device
    batch = len(prompts)
    length = max(len(p) for p in prompts) + max_new_tokens + 1
    temperature = as_per_request(temperature, batch, torch.float32, device)
    seed = _seeds(seed, batch, device, generator)
    filters = _filters(top_k, top_p, min_p, batch, device)
    last, _, cache, cache_len = prefill(target, prompts, length, device)
    position = cache_len.long()
    token = sample_from_target(last, temperature, seed, position - 1, filters)
    generated: List[List[int]] = [[] for _ in range(batch)]
    done = [max_new_tokens <= 0] * batch
    stop = _stop_ids(eos_token_id)
    while True:
        for b, t in enumerate(token.tolist()):
            if not done[b]:
                done[b] = _finish(generated[b], [t], stop, max_new_tokens)
        if all(done):  # the last token needs no forward of its own
            break
        token, _ = plain_step(target, token, cache, cache_len, temperature, seed, position,
                              filters)
        cache_len = cache_len + 1
        position = position + 1
    return generated


class SpeculativeDecoder:
    """Speculative decoding of a target model with any proposer (see the module doc).

    Parameters
    ----------
    target : TinyTarget or dspark_ops.hf.HFTarget
        Anything with the interface of the module doc.
    draft : DSparkDraft, Eagle3Draft or dspark_ops.proposers.Proposer
        A draft model (:func:`dspark_ops.proposers.make_proposer`: a block draft, or an Eagle3
        chain) or a proposer (e.g. :class:`~dspark_ops.proposers.PromptLookupProposer`). A
        model's context features must be the target's ``feature_layers``.
    block_size : int, optional
        ``G``, the most drafts per round (default: the draft's ``block_size``, an Eagle3 draft's
        ``ttt_length``, a proposer's ``max_drafts``).
    scheduler : str, optional
        ``"goodput"`` (needs ``costs``): per round, the goodput argmax over drafting ``0..G``
        slots (0 = the plain path), then Algorithm 1 on the measured costs;
        ``"confidence"``: :func:`schedule_verify` (Algorithm 1) on fresh confidences and
        ``step_rate``; ``"budget"``: :func:`plan_verify_budget` on the confidences of two
        rounds before, then :func:`allocate_verify` on fresh ones (the production variant);
        ``"fixed"``: draft and verify all G. Default: ``"goodput"`` with ``costs``, else
        ``"confidence"`` for a draft with a confidence head, else ``"fixed"``.
    costs : dspark_ops.costs.CostTable, optional
        The measured round costs (:func:`dspark_ops.load_or_profile_costs`); the decoder corrects
        them online from its rounds' timings.
    step_rate : torch.Tensor, optional
        ``confidence`` / ``budget`` only: float32 ``[M]``, target steps per second for an
        ``n``-token verify batch; default the cost table's, else :func:`synthetic_step_rate`.
    calib_temperature : torch.Tensor, optional
        float32 ``[G]``: the confidence head's calibration (see
        :func:`dspark_ops.fit_sequential_temperatures`).
    eos_token_id : int or sequence of int, optional
        Stop token(s): a request ends after emitting one (mid-block tokens after it are
        dropped).
    margin, probe_every, probe_max, prior : optional
        ``goodput`` only: :class:`dspark_ops.goodput.GoodputPolicy`'s.
    """

    def __init__(self, target: TinyTarget, draft, *, block_size: Optional[int] = None,
                 scheduler: Optional[str] = None, costs: Optional[CostTable] = None,
                 step_rate: Optional[torch.Tensor] = None,
                 calib_temperature: Optional[torch.Tensor] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None, margin: float = 1.1,
                 probe_every: int = 8, probe_max: int = 128, prior: float = 0.5):
        proposer = make_proposer(draft, block_size=block_size,
                                 calib_temperature=calib_temperature)
        has_confidence = getattr(proposer, "has_confidence", False)
        if scheduler is None:
            scheduler = ("goodput" if costs is not None
                         else "confidence" if has_confidence else "fixed")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if scheduler in ("confidence", "budget") and not has_confidence:
            raise ValueError(f"scheduler {scheduler!r} needs the draft's confidence head "
                             "(this draft has none: use scheduler='fixed' or 'goodput')")
        if scheduler == "goodput" and costs is None:
            raise ValueError("scheduler 'goodput' needs a measured cost table, 'costs' "
                             "(dspark_ops.load_or_profile_costs)")
        self.target, self.draft, self.proposer = target, draft, proposer
        self.block_size = proposer.max_drafts
        self.scheduler = scheduler
        self.costs = costs
        self.step_rate = step_rate
        self.calib_temperature = calib_temperature
        self.eos_token_id = eos_token_id
        self._stop = _stop_ids(eos_token_id)
        self.policy = None
        if scheduler == "goodput":
            self.policy = GoodputPolicy(costs, self.block_size, margin=margin,
                                        probe_every=probe_every, probe_max=probe_max,
                                        prior=prior)

    # -- the two decisions ----------------------------------------------------------------------

    def _drafts_to_propose(self, batch: int, active: List[int], remaining: int) -> int:
        """``k`` for this round (``remaining``: the most tokens an active request still
        needs; drafting more than ``remaining - 1`` cannot pay)."""
        if self.policy is None:
            return self.block_size
        return self.policy.drafts_to_propose(batch, active, remaining - 1)

    def _num_verify(self, proposal, active, step_rate, history):
        """Drafts to verify per request (int32 ``[B]``)."""
        batch, k = proposal.tokens.shape
        available = proposal.available
        if self.scheduler == "fixed":
            full = torch.full((batch,), k, dtype=torch.int32, device=active.device)
            count = full if available is None else torch.minimum(full, available)
            return torch.where(active, count, 0).int()
        if self.scheduler == "goodput":
            estimates = self.policy.estimated_confidence(batch, k, active.device)
            if proposal.confidence is None:  # the estimates are all there is, known before
                return verify_lengths(estimates, active, self.costs, available)
            return verify_lengths(proposal.confidence, active, self.costs, available, estimates)
        confidence = torch.where(active[:, None], proposal.confidence, 0.0)
        if self.scheduler == "confidence":
            return schedule_verify(confidence, step_rate)
        stale = history[-2] if len(history) >= 2 else None
        if stale is None:  # no confidences two rounds old yet: the full budget
            budget = torch.full((1,), batch * (k + 1), dtype=torch.int32, device=active.device)
        else:
            budget = plan_verify_budget(torch.where(active[:, None], stale, 0.0), step_rate)
        return allocate_verify(confidence, budget)

    def _step_rate(self, batch: int, device):
        if self.scheduler not in ("confidence", "budget"):
            return None
        if self.step_rate is not None:
            return self.step_rate.to(device)
        if self.costs is not None:
            return self.costs.step_rate(batch, self.block_size, device)
        return synthetic_step_rate(batch * (self.block_size + 1) + 1, batch)

    # -- the loop ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: Union[float, torch.Tensor] = 0.0, seed=None, *,
                 top_k=None, top_p=None, min_p=None,
                 generator: Optional[torch.Generator] = None) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens after each prompt.

        Parameters
        ----------
        prompts : sequence of sequences of int
            Token ids per request (lengths may differ).
        max_new_tokens : int
        temperature : float or torch.Tensor
            Per request (``[B]``) or shared; ``<= 1e-5`` is greedy. Drafts are sampled at the
            same temperature.
        seed : int, torch.Tensor or None
            int64 per request (or shared); ``None`` draws them from ``generator``. Each request's
            output depends only on its prompt, temperature and seed, not on its batch neighbours.
        top_k, top_p, min_p : int / float or torch.Tensor, optional
            Sampling filters per request (``[B]``) or shared, in :func:`dspark_ops.verify`'s
            order and meaning. The drafts are sampled with the same filters, so the output is
            distributed as :func:`generate_target_only` with them.

        Returns
        -------
        GenerateOutput
            Tokens per request and the statistics of every round.
        """
        target, proposer, block = self.target, self.proposer, self.block_size
        device = target.device
        batch = len(prompts)
        length = max(len(p) for p in prompts) + max_new_tokens + block + 2
        temperature = as_per_request(temperature, batch, torch.float32, device)
        seed = _seeds(seed, batch, device, generator)
        filters = _filters(top_k, top_p, min_p, batch, device)
        step_rate = self._step_rate(batch, device)
        clock = _Clock(device)

        # Prefill: the target reads the prompts, the proposer their features, and the first
        # token (the first anchor, at position p0 = prompt length) is drawn.
        last, features, cache, cache_len = prefill(target, prompts, length, device)
        position = cache_len.long()  # p0 of each anchor
        anchor = sample_from_target(last, temperature, seed, position - 1, filters)
        proposer.start(prompts, features, cache_len, anchor, length)
        if self.policy is not None:
            self.policy.begin(batch)

        generated, done = self._first_tokens(anchor, max_new_tokens)
        history = [list(p) + g for p, g in zip(prompts, generated)]  # the lookups read these
        rounds: List[RoundStats] = []
        confidences: List[torch.Tensor] = []  # of earlier rounds (the "budget" scheduler)
        while not all(done):
            active_rows = [b for b in range(batch) if not done[b]]
            active = torch.tensor([not d for d in done], device=device)
            remaining = max(max_new_tokens - len(generated[b]) for b in active_rows)
            k = self._drafts_to_propose(batch, active_rows, remaining)
            began = clock.mark()
            if k == 0:  # the plain decoding path
                drafted = began
                token, features = plain_step(target, anchor, cache, cache_len, temperature,
                                             seed, position, filters)
                verified = clock.mark()
                kept = active.int()
                proposer.commit(features, kept, token[:, None], position, plain=True)
                emitted = torch.where(active, token, anchor)
                tokens = emitted[:, None].tolist()
                accepted, num_verify, confidence = [0] * batch, [0] * batch, []
            else:
                proposal = proposer.propose(k, anchor, position, temperature, seed, filters,
                                            history)
                with part("schedule"):
                    verify_count = self._num_verify(proposal, active, step_rate, confidences)
                    if proposal.confidence is not None:
                        confidences = (confidences + [proposal.confidence])[-2:]
                    # The forward is padded to the widest request: verify only that wide.
                    width = int(verify_count.max()) if self.scheduler == "goodput" else k
                drafted = clock.mark()
                drafts = proposal.tokens[:, :width]
                logits = None if proposal.logits is None else proposal.logits[:, :width]
                out, features, starts = verify_step(target, anchor, drafts, logits, verify_count,
                                                    position, cache, cache_len, temperature,
                                                    seed, filters)
                verified = clock.mark()
                with part("commit"):
                    kept = torch.where(active, out.num_accepted + 1, 0).int()
                    rows = starts.long()[:, None] + torch.arange(width + 1, device=device)
                    proposer.commit(features[rows.clamp_max(features.shape[0] - 1)], kept,
                                    out.tokens, position, plain=False)
                    emitted = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0]
                    emitted = torch.where(active, emitted, anchor)
                # The one host sync of the round: what was emitted, and who is done.
                with part("host_sync"):
                    tokens, accepted = out.tokens.tolist(), out.num_accepted.tolist()
                    num_verify = verify_count.tolist()
                    confidence = ([] if proposal.confidence is None
                                  else proposal.confidence.tolist())
            cache_len = cache_len + kept
            position = position + kept
            anchor = emitted
            draft_seconds = clock.seconds(began, drafted)
            verify_seconds = clock.seconds(drafted, verified)
            if self.policy is not None:
                self._learn(batch, k, active_rows, num_verify, accepted, draft_seconds,
                            verify_seconds, tokens)
            rounds.append(self._record_round(
                k, draft_seconds, verify_seconds, tokens, accepted, num_verify, confidence,
                generated, history, done, max_new_tokens))
        return GenerateOutput(generated, rounds)

    def _learn(self, batch, k, active_rows, num_verify, accepted, draft_seconds, verify_seconds,
               tokens) -> None:
        """The goodput rule's online part: the acceptance estimates and the cost table."""
        if k == 0:
            self.costs.observe_target(batch, 1, verify_seconds)
            return
        for b in active_rows:
            self.policy.observe(b, num_verify[b], accepted[b])
        self.costs.observe_draft(k, draft_seconds)
        self.costs.observe_target(batch, len(tokens[0]), verify_seconds)

    def _first_tokens(self, anchor: torch.Tensor, max_new_tokens: int):
        """Each request's output list and done flag after the prefill's token."""
        generated: List[List[int]] = [[] for _ in range(anchor.shape[0])]
        done = [max_new_tokens <= 0] * anchor.shape[0]
        for b, t in enumerate(anchor.tolist()):
            if not done[b]:
                done[b] = _finish(generated[b], [t], self._stop, max_new_tokens)
        return generated, done

    def _record_round(self, drafted: int, draft_seconds: float, verify_seconds: float, tokens,
                      accepted, verified, confidences, generated, history, done,
                      max_new_tokens: int) -> RoundStats:
        """A round's statistics over the requests still generating, whose emitted tokens (the
        accepted drafts and the one after them) are appended; ``done`` is updated in place."""
        stats = RoundStats([], [], 0, draft_seconds, verify_seconds, [], drafted)
        for b in range(len(done)):
            if done[b]:
                continue
            stats.accepted.append(accepted[b])
            stats.num_verify.append(verified[b])
            stats.verify_tokens += 1 + verified[b]
            stats.confidence.append(confidences[b] if confidences else [])
            before = len(generated[b])
            done[b] = _finish(generated[b], tokens[b][: accepted[b] + 1], self._stop,
                              max_new_tokens)
            history[b].extend(generated[b][before:])
        return stats
