"""An end-to-end DSpark decoder built only from this library's ops and plain PyTorch modules.

One round of :meth:`SpeculativeDecoder.generate`, batched over requests of different
lengths, with no host synchronisation until the loop has to decide whether to stop:

1. draft: the block ``[x0, MASK, ...]`` through the draft backbone (``block_draft_attention``
   over each layer's context cache), ``lm_head`` (soft-capped for a Gemma4 draft) -> base
   logits, ``markov_draft`` (or ``rnn_draft``; for a DFlash draft the base logits themselves)
   -> drafts and the logits they were sampled from, ``draft_confidence``;
2. schedule: ``schedule_verify`` (Algorithm 1), or ``plan_verify_budget`` on the confidences of
   two rounds before + ``allocate_verify`` on fresh ones, or every draft;
3. verify: ``pack_verify_inputs`` -> one target forward over the ragged batch -> ``verify``;
4. commit: the target's cache keeps the anchor and the accepted drafts (the committed length
   advances past them; the rejected rows are overwritten or masked later), their target features go to the draft's context caches with
   ``append_context_kv``, and the emitted token becomes the next anchor.

Sampling is lossless: with the same ``temperature`` the tokens are distributed exactly as
:func:`generate_target_only` (plain target sampling) produces them, and greedy output is identical.

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
from .models import DSparkDraft, TinyTarget, sample_base_logits
from .models.eagle3 import Eagle3Draft
from .ops.schedule import allocate_verify, pack_verify_inputs, plan_verify_budget, schedule_verify
from .ops.verify import verify

__all__ = ["GenerateOutput", "RoundStats", "SpeculativeDecoder", "default_step_rate",
           "generate_target_only"]

SCHEDULERS = ("confidence", "budget", "fixed")


@dataclasses.dataclass
class RoundStats:
    """One round, over the requests that were still generating."""

    accepted: List[int]  # accepted drafts per request
    num_verify: List[int]  # drafts verified per request
    verify_tokens: int  # target tokens of the verify batch: sum of (1 + num_verify)
    draft_seconds: float  # draft forward, heads and scheduling
    verify_seconds: float  # target forward, verification and commit
    confidence: List[List[float]]  # the G conditional confidences per request (calibrated)


@dataclasses.dataclass
class GenerateOutput:
    tokens: List[List[int]]  # generated tokens per request (prompt excluded, EOS included)
    rounds: List[RoundStats]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per request-round (accepted drafts + 1), the paper's tau."""
        counts = [a + 1 for r in self.rounds for a in r.accepted]
        return sum(counts) / max(len(counts), 1)


def _part(name: str):
    """A ``torch.profiler`` label for one part of a decoding round (``dspark_ops.<name>``)."""
    return torch.profiler.record_function("dspark_ops." + name)


def default_step_rate(max_tokens: int, batch: int, cost_per_token: float = 0.1) -> torch.Tensor:
    """A synthetic step-rate table for ``batch`` requests, ``n < max_tokens`` verify tokens:
    ``1 / (1 + cost_per_token * n / batch)``, i.e. each verified token per request costs
    ``cost_per_token`` of a step. Measure the real one with :func:`dspark_ops.profile_step_rate`."""
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


def _prefill(target: TinyTarget, prompts: Sequence[Sequence[int]], length: int, device):
    """Target prefill of padded prompts: logits of each prompt's last token, the prompts'
    features, the caches and the prompt lengths (int32)."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    if int(lengths.min()) < 1:
        raise ValueError("every prompt needs at least one token")
    width = int(lengths.max())
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    cache = target.new_cache(len(prompts), length)
    logits, features = target(ids, lengths, cache, torch.zeros_like(lengths),
                              logits_at=[len(p) - 1 for p in prompts])
    return logits[:, 0], features, cache, lengths


def _verify_drafts(target, anchor, drafts, draft_logits, num_verify, position, cache, cache_len,
                   temperature, seed, filters: dict):
    """One target forward over the ragged batch ``[x0, x_1..x_l]`` of every request and the
    verification of its drafts: ``verify``'s output, the forward's ragged features and each
    request's first row in them."""
    with _part("pack_verify_inputs"):
        packed = pack_verify_inputs(anchor, drafts, num_verify, position)
    with _part("target_forward"):
        logits, features = target.forward_ragged(packed.input_ids, packed.cu_seqlens, cache,
                                                 cache_len)
    starts = packed.cu_seqlens[:-1]
    with _part("verify"):
        out = verify(logits.float(), drafts, num_verify, temperature, seed, position,
                     draft_logits=draft_logits, target_start=starts,
                     draft_temperature=temperature, **filters)
    return out, features, starts


def _sample_from_target(logits: torch.Tensor, temperature, seed, position,
                        filters: Optional[dict] = None) -> torch.Tensor:
    """The token after ``position`` from target logits ``[B, V]``: ``verify`` with no drafts,
    i.e. a plain draw from the (filtered) ``softmax(logits / T)`` on the resampling stream of
    that position."""
    batch = logits.shape[0]
    no_drafts = torch.zeros(batch, 0, dtype=torch.long, device=logits.device)
    out = verify(logits.float()[:, None], no_drafts, torch.zeros(batch, dtype=torch.int32,
                 device=logits.device), temperature, seed, position, **(filters or {}))
    return out.tokens[:, 0]


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
    :func:`dspark_ops.verify` does."""
    device = target.device
    batch = len(prompts)
    length = max(len(p) for p in prompts) + max_new_tokens + 1
    temperature = as_per_request(temperature, batch, torch.float32, device)
    seed = _seeds(seed, batch, device, generator)
    filters = _filters(top_k, top_p, min_p, batch, device)
    last, _, cache, lengths = _prefill(target, prompts, length, device)
    position = lengths.long() - 1
    generated: List[List[int]] = [[] for _ in range(batch)]
    done = [max_new_tokens <= 0] * batch
    while not all(done):
        token = _sample_from_target(last, temperature, seed, position, filters)
        for b, t in enumerate(token.tolist()):
            if not done[b]:
                done[b] = _finish(generated[b], [t], _stop_ids(eos_token_id), max_new_tokens)
        if all(done):  # the last token needs no forward of its own
            break
        position = position + 1
        logits, _ = target(token[:, None], torch.ones_like(lengths), cache, position.int())
        last = logits[:, 0]
    return generated


class SpeculativeDecoder:
    """DSpark speculative decoding of a target model with a DSpark draft (see the module doc).

    Parameters
    ----------
    target : TinyTarget or dspark_ops.hf.HFTarget
        Anything with the interface of the module doc.
    draft : DSparkDraft or Eagle3Draft
        Its context features must be the target's ``feature_layers``. A DFlash draft
        (``markov_rank = 0``, no confidence head) runs with ``scheduler="fixed"``, and so does
        an Eagle3 draft (:class:`dspark_ops.models.eagle3.Eagle3Draft`: chain drafting, see
        :meth:`_generate_chain`).
    block_size : int, optional
        ``G``, drafts per round; default ``draft.config.block_size`` (an Eagle3 draft's
        ``ttt_length``).
    scheduler : str
        ``"confidence"``: :func:`schedule_verify` (Algorithm 1) on fresh confidences;
        ``"budget"``: :func:`plan_verify_budget` on the confidences of two rounds before, then
        :func:`allocate_verify` on fresh ones (the production variant); ``"fixed"``: verify all
        G drafts.
    step_rate : torch.Tensor, optional
        float32 ``[M]``, target steps per second for an ``n``-token verify batch (``M`` above the
        largest batch, ``B * (G + 1)``); default :func:`default_step_rate`.
    calib_temperature : torch.Tensor, optional
        float32 ``[G]``: the confidence head's calibration (see
        :func:`dspark_ops.fit_sequential_temperatures`).
    eos_token_id : int or sequence of int, optional
        Stop token(s): a request ends after emitting one (mid-block tokens after it are
        dropped).
    """

    def __init__(self, target: TinyTarget, draft: DSparkDraft, *, block_size: Optional[int] = None,
                 scheduler: str = "confidence", step_rate: Optional[torch.Tensor] = None,
                 calib_temperature: Optional[torch.Tensor] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if scheduler != "fixed" and draft.confidence_head is None:
            raise ValueError(f"scheduler {scheduler!r} needs the draft's confidence head "
                             "(this draft has none: use scheduler='fixed')")
        self.target, self.draft = target, draft
        self.block_size = block_size or draft.config.block_size
        self.scheduler = scheduler
        self.step_rate = step_rate
        self.calib_temperature = calib_temperature
        self.eos_token_id = eos_token_id
        self._stop = _stop_ids(eos_token_id)

    def _num_verify(self, confidence, stale, active, step_rate):
        batch, block = confidence.shape
        confidence = torch.where(active[:, None], confidence, 0.0)  # finished: verify nothing
        if self.scheduler == "fixed":
            return torch.where(active, block, 0).int()
        if self.scheduler == "confidence":
            return schedule_verify(confidence, step_rate)
        if stale is None:  # no confidences two rounds old yet: the full budget
            budget = torch.full((1,), batch * (block + 1), dtype=torch.int32,
                                device=confidence.device)
        else:
            budget = plan_verify_budget(torch.where(active[:, None], stale, 0.0), step_rate)
        return allocate_verify(confidence, budget)

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
        target, draft, block = self.target, self.draft, self.block_size
        device = draft.fc.weight.device
        dtype = draft.fc.weight.dtype
        batch = len(prompts)
        length = max(len(p) for p in prompts) + max_new_tokens + block + 2
        temperature = as_per_request(temperature, batch, torch.float32, device)
        seed = _seeds(seed, batch, device, generator)
        filters = _filters(top_k, top_p, min_p, batch, device)
        if isinstance(draft, Eagle3Draft):
            return self._generate_chain(prompts, max_new_tokens, length, temperature, seed,
                                        filters)
        step_rate = self.step_rate
        if step_rate is None:
            step_rate = default_step_rate(batch * (block + 1) + 1, batch)
        step_rate = step_rate.to(device)
        calib = None if self.calib_temperature is None else self.calib_temperature.to(device)

        # Prefill: the target reads the prompts, the draft's context gets their features, and
        # the first token (the first anchor, at position p0 = prompt length) is drawn.
        last, features, t_cache, target_len = _prefill(target, prompts, length, device)
        d_k, d_v = draft.new_caches(batch, length)
        draft_len = torch.zeros(batch, dtype=torch.int32, device=device)
        draft.append_context(features.to(dtype), positions=None, num_new=target_len, k_caches=d_k,
                             v_caches=d_v, cache_seqlens=draft_len)
        position = target_len.long()  # p0 of each anchor
        anchor = _sample_from_target(last, temperature, seed, position - 1, filters)

        generated, done = self._first_tokens(anchor, max_new_tokens)
        rounds: List[RoundStats] = []
        history: List[torch.Tensor] = []  # confidences of earlier rounds (the "budget" scheduler)
        rows = torch.arange(block + 1, device=device)
        while not all(done):
            active = torch.tensor([not d for d in done], device=device)
            started = time.perf_counter()
            # 1. Draft: one parallel pass over the block, then the sequential head. (The
            # labels name each part of a round in a torch.profiler trace; free otherwise.)
            with _part("draft_forward"):
                hidden = draft(draft.block_hidden(anchor, block), block_positions=None,
                               k_caches=d_k, v_caches=d_v, cache_seqlens=draft_len)
            with _part("draft_lm_head"):
                base_logits = draft.base_logits(hidden)
            with _part("markov_drafting"):
                drafts, draft_logits = draft.propose(base_logits, anchor, hidden, temperature,
                                                     seed, position, **filters)
            with _part("confidence"):
                if draft.confidence_head is not None:
                    prev = torch.cat([anchor[:, None], drafts[:, :-1]], 1)
                    confidence = draft.confidence(hidden, prev, calib)
                else:
                    confidence = torch.ones(batch, block, device=device)
            # 2. Schedule.
            with _part("schedule"):
                stale = history[-2] if len(history) >= 2 else None
                num_verify = self._num_verify(confidence, stale, active, step_rate)
                history = (history + [confidence])[-2:]
            drafted = time.perf_counter()

            # 3. Verify: one target forward over the ragged batch of [x0, x_1..x_l].
            out, features, starts = _verify_drafts(target, anchor, drafts, draft_logits,
                                                   num_verify, position, t_cache, target_len,
                                                   temperature, seed, filters)

            # 4. Commit the anchor and the accepted drafts; the emitted token is the next anchor.
            with _part("commit"):
                kept = torch.where(active, out.num_accepted + 1, 0).int()
                new_rows = (starts.long()[:, None] + rows).clamp_max(features.shape[0] - 1)
                draft.append_context(features[new_rows].to(dtype), positions=None,
                                     num_new=kept, k_caches=d_k, v_caches=d_v,
                                     cache_seqlens=draft_len)
                target_len = target_len + kept
                position = position + kept
                emitted = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0]
                anchor = torch.where(active, emitted, anchor)

            # The one host sync of the round: what was emitted, and who is done.
            with _part("host_sync"):
                tokens, accepted = out.tokens.tolist(), out.num_accepted.tolist()
                verified, confidences = num_verify.tolist(), confidence.tolist()
            rounds.append(self._record_round(
                drafted - started, time.perf_counter() - drafted, tokens, accepted, verified,
                confidences, generated, done, max_new_tokens))
        return GenerateOutput(generated, rounds)

    def _first_tokens(self, anchor: torch.Tensor, max_new_tokens: int):
        """Each request's output list and done flag after the prefill's token."""
        generated: List[List[int]] = [[] for _ in range(anchor.shape[0])]
        done = [max_new_tokens <= 0] * anchor.shape[0]
        for b, t in enumerate(anchor.tolist()):
            if not done[b]:
                done[b] = _finish(generated[b], [t], self._stop, max_new_tokens)
        return generated, done

    def _record_round(self, draft_seconds: float, verify_seconds: float, tokens, accepted,
                      verified, confidences, generated, done, max_new_tokens: int) -> RoundStats:
        """A round's statistics over the requests still generating, whose emitted tokens (the
        accepted drafts and the one after them) are appended; ``done`` is updated in place."""
        stats = RoundStats([], [], 0, draft_seconds, verify_seconds, [])
        for b in range(len(done)):
            if done[b]:
                continue
            stats.accepted.append(accepted[b])
            stats.num_verify.append(verified[b])
            stats.verify_tokens += 1 + verified[b]
            stats.confidence.append(confidences[b])
            done[b] = _finish(generated[b], tokens[b][: accepted[b] + 1], self._stop,
                              max_new_tokens)
        return stats

    def _generate_chain(self, prompts, max_new_tokens: int, length: int, temperature, seed,
                        filters: dict) -> GenerateOutput:
        """:meth:`generate` with an Eagle3 draft: chain drafting as DeepSpec's Eagle3 evaluator
        does, batched. The draft's own K/V cache covers the whole sequence (row ``i``: the
        target features of token ``i`` paired with token ``i + 1``); a round samples ``G``
        drafts, each from ``softmax(logits / T)`` of the previous step's output (one
        single-token draft step between two drafts, ``G - 1`` per round), verifies them all with
        ``verify`` (their logits and temperature handed over), then drops the speculative draft
        rows (the committed length does not move past them) and appends the target features of
        the anchor and the accepted drafts, paired with the committed tokens."""
        target, draft, block = self.target, self.draft, self.block_size
        device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
        batch = len(prompts)
        every = torch.arange(batch, device=device)
        last, features, t_cache, target_len = _prefill(target, prompts, length, device)
        position = target_len.long()
        anchor = _sample_from_target(last, temperature, seed, position - 1, filters)
        # Prefill of the draft: the prompt's features with the prompt shifted left by one and
        # the first token at the end, RoPE position i for row i.
        width = features.shape[1]
        ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, : len(p) - 1] = torch.as_tensor(p[1:], dtype=torch.long)
        ids[every, position - 1] = anchor
        cache = draft.new_cache(batch, length)
        draft_len = torch.zeros(batch, dtype=torch.int32, device=device)
        rows = draft.extend(features.to(dtype), ids,
                            torch.arange(width, device=device).expand(batch, -1), target_len,
                            cache, draft_len, project=True)
        hidden = rows[every, position - 1]  # [B, hidden]: the output at the last prompt row
        draft_len = target_len.clone()

        generated, done = self._first_tokens(anchor, max_new_tokens)
        rounds: List[RoundStats] = []
        offsets = torch.arange(block + 1, device=device)
        one = torch.ones(batch, dtype=torch.int32, device=device)
        while not all(done):
            active = torch.tensor([not d for d in done], device=device)
            started = time.perf_counter()
            with _part("draft_chain"):
                tokens, logits, h = [], [], hidden
                for j in range(block):
                    step = sample_base_logits(draft.compute_logits(h)[:, None], temperature,
                                              seed, position + j, **filters)
                    tokens.append(step.tokens[:, 0])
                    logits.append(step.draft_logits[:, 0])
                    if j + 1 < block:  # the last draft needs no step of its own
                        h = draft.extend(h[:, None], step.tokens, (position + j)[:, None], one,
                                         cache, draft_len + j, project=False)[:, 0]
                drafts, draft_logits = torch.stack(tokens, 1), torch.stack(logits, 1)
            num_verify = torch.where(active, block, 0).int()
            drafted = time.perf_counter()

            out, features, starts = _verify_drafts(target, anchor, drafts, draft_logits,
                                                   num_verify, position, t_cache, target_len,
                                                   temperature, seed, filters)
            with _part("commit"):
                kept = torch.where(active, out.num_accepted + 1, 0).int()
                new_rows = (starts.long()[:, None] + offsets).clamp_max(features.shape[0] - 1)
                committed = out.tokens.clamp_min(0)  # rows past the emitted one: unused
                outputs = draft.extend(features[new_rows].to(dtype), committed,
                                       position[:, None] + offsets, kept, cache, draft_len,
                                       project=True)
                last_kept = outputs[every, (kept.long() - 1).clamp_min(0)]
                hidden = torch.where(active[:, None], last_kept, hidden)
                draft_len = draft_len + kept
                target_len = target_len + kept
                position = position + kept
                emitted = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0]
                anchor = torch.where(active, emitted, anchor)
            with _part("host_sync"):
                tokens_l, accepted = out.tokens.tolist(), out.num_accepted.tolist()
            rounds.append(self._record_round(
                drafted - started, time.perf_counter() - drafted, tokens_l, accepted,
                [block] * batch, [[1.0] * block] * batch, generated, done, max_new_tokens))
        return GenerateOutput(generated, rounds)
