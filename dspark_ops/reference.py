"""Pure-PyTorch references: the semantics of record for every op.

Each function here spells out, in eager float32 PyTorch, exactly what the matching CPU and CUDA
kernels compute, including the random numbers they draw, so tests can demand identical tokens.
They are written for clarity and run on any device; they assume inputs that pass the ops'
argument checks.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

from .outputs import DraftOutput, LossOutput, VerifyBatch, VerifyOutput
from .sampling import (
    GREEDY_TEMPERATURE,
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_RESAMPLE,
    allowed_tokens,
    filter_logits,
)

__all__ = [
    "PURPOSE_DRAFT",
    "PURPOSE_ACCEPT",
    "PURPOSE_RESAMPLE",
    "GREEDY_TEMPERATURE",
    "MIN_RESIDUAL_MASS",
    "philox4x32_10",
    "philox_uniform",
    "uniform_from_bits",
    "VerifyOutput",
    "filter_logits",
    "allowed_tokens",
    "verify",
    "DraftOutput",
    "draft_sample",
    "markov_draft",
    "rnn_draft",
    "draft_confidence",
    "survivals",
    "schedule_verify",
    "plan_verify_budget",
    "allocate_verify",
    "VerifyBatch",
    "pack_verify_inputs",
    "LossOutput",
    "dspark_loss",
]

MIN_RESIDUAL_MASS = 1e-12

_MASK32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, multiplier: int):
    """(hi, lo) 32-bit halves of a * multiplier for 0 <= a < 2**32, in int64 without overflow."""
    low16 = a * (multiplier & 0xFFFF)  # < 2**48
    high16 = a * (multiplier >> 16)  # < 2**48
    z = low16 + ((high16 & 0xFFFF) << 16)  # < 2**49
    return (high16 >> 16) + (z >> 32), z & _MASK32


def philox4x32_10(counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor]):
    """Philox4x32-10 on int64 tensors holding 32-bit words; returns the four output words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(
    seed: torch.Tensor,
    position: torch.Tensor,
    purpose: int,
    elements: Union[int, torch.Tensor],
) -> torch.Tensor:
    """Uniforms in (0, 1) of the streams (seed, position, purpose).

    ``seed`` and ``position`` (int64) broadcast to a shape S; the result is float32 ``[*S, K]``
    whose last axis holds elements ``elements`` (or ``0..elements-1`` for an int) of each stream,
    exactly as the kernels draw them.
    """
    seed, position = torch.broadcast_tensors(
        torch.as_tensor(seed, dtype=torch.int64), torch.as_tensor(position, dtype=torch.int64)
    )
    count = elements if isinstance(elements, int) else None
    if count is not None:  # whole Philox blocks: each block yields four consecutive elements
        elements = torch.arange((count + 3) // 4 * 4, device=seed.device)
    elements = elements.to(device=seed.device, dtype=torch.int64)
    seed, position = seed[..., None], position[..., None]
    group = elements[::4] >> 2 if count is not None else elements >> 2
    words = philox4x32_10(
        (group, torch.full_like(group, purpose), position & _MASK32, (position >> 32) & _MASK32),
        (seed & _MASK32, (seed >> 32) & _MASK32),
    )
    words = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    if count is not None:
        bits = words.flatten(-2)[..., :count]
    else:
        lane = (elements & 3).expand(words.shape[:-1])
        bits = words.gather(-1, lane[..., None])[..., 0]
    return uniform_from_bits(bits)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32-bit words to uniforms in (0, 1), finest near 0 (csrc/common/philox.h)."""
    return (bits.to(torch.float32) * 2.0**-32 + 2.0**-33).clamp_max(1.0 - 2.0**-24)




def _softmax_parts(logits: torch.Tensor, inv_temperature: torch.Tensor):
    """Row max, normalised probabilities and first argmax, with non-finite logits as -inf."""
    logits = torch.where(torch.isfinite(logits), logits, float("-inf"))
    row_max = logits.amax(-1)
    invalid = row_max == float("-inf")
    shifted = torch.where(invalid[..., None], float("-inf"), logits - row_max[..., None])
    weight = torch.exp(shifted * inv_temperature[..., None])
    prob = weight * (1.0 / weight.sum(-1))[..., None]
    return prob, logits.argmax(-1), invalid


def _exponential_race(weights: torch.Tensor, seed, position) -> torch.Tensor:
    """argmax_x weights[x] / E(x), E = -log1p(-u_x) from the resampling stream; ties to the lower id."""
    u = philox_uniform(seed, position, PURPOSE_RESAMPLE, weights.shape[-1])
    key = weights / -torch.log1p(-u)
    return torch.where(weights > 0, key, float("-inf")).argmax(-1)


class _TargetRows(NamedTuple):
    """Each row's processed target distribution ``p [B, G + 1, V]``, its first argmax and
    whether the row has no finite logit."""

    p: torch.Tensor
    argmax: torch.Tensor
    invalid: torch.Tensor


class _DraftRows(NamedTuple):
    """Each row's draft token ``x [B, G + 1]`` (-1 on the bonus row), whether it is in the
    vocabulary (``x_safe``: 0 where not), the proposal ``q`` it came from (None: one-hot on
    ``x``), ``q(x)``, and whether the row's proposal has no finite logit."""

    x: torch.Tensor
    in_range: torch.Tensor
    x_safe: torch.Tensor
    q: Optional[torch.Tensor]
    q_x: torch.Tensor
    invalid: torch.Tensor


def _target_rows(target_logits, draft_tokens, target_start, temperature, greedy, top_k, top_p,
                 min_p, allowed_token_mask) -> _TargetRows:
    """The target distribution of the ``G + 1`` rows of each request (``draft_tokens [B, G]``):
    its logits rows from ``target_start`` (packed ``G + 1`` apart by default), disallowed tokens
    dropped, :func:`filter_logits`, softmax at the request's temperature (1 if greedy)."""
    device = draft_tokens.device
    batch, block = draft_tokens.shape
    vocab = target_logits.shape[-1]
    target = target_logits.reshape(-1, vocab).float()
    j = torch.arange(block + 1, device=device)
    start = (
        target_start.long()
        if target_start is not None
        else torch.arange(batch, device=device) * (block + 1)
    )
    rows = (start[:, None] + j).clamp(0, target.shape[0] - 1)  # rows past n are never used

    inv_t = torch.where(greedy, 1.0, 1.0 / temperature)
    row_logits = target[rows]
    if allowed_token_mask is not None:
        row_logits = torch.where(allowed_tokens(allowed_token_mask, vocab)[rows], row_logits,
                                 float("-inf"))
    if top_k is not None or top_p is not None or min_p is not None:
        per_row = lambda t: None if t is None else t[:, None].expand(batch, block + 1)  # noqa: E731
        row_logits = filter_logits(row_logits, per_row(temperature), top_k=per_row(top_k),
                                   top_p=per_row(top_p), min_p=per_row(min_p))
    return _TargetRows(*_softmax_parts(row_logits, inv_t[:, None]))


def _draft_rows(draft_tokens, vocab, draft_logits, temperature, draft_temperature,
                greedy) -> _DraftRows:
    """Per-row views of the drafts, padded with the bonus row (no draft token there): the
    token and the distribution ``q`` it was proposed from (without draft logits, one-hot on
    the token; a greedy draft's ``q`` is one-hot on its argmax)."""
    batch = draft_tokens.shape[0]
    x = torch.cat([draft_tokens.long(),
                   torch.full((batch, 1), -1, dtype=torch.long, device=draft_tokens.device)], 1)
    in_range = (x >= 0) & (x < vocab)
    x_safe = torch.where(in_range, x, 0)
    if draft_logits is None:
        return _DraftRows(x, in_range, x_safe, None, in_range.float(), torch.zeros_like(in_range))
    t_d = temperature if draft_temperature is None else draft_temperature
    draft_greedy = ~(t_d > GREEDY_TEMPERATURE)
    inv_td = torch.where(draft_greedy, 1.0, 1.0 / t_d)
    q, draft_argmax, draft_invalid = _softmax_parts(draft_logits.float(), inv_td[:, None])
    q = torch.where(
        draft_greedy[:, None, None],
        torch.nn.functional.one_hot(draft_argmax, vocab).float(),
        q,
    )
    q = torch.where(draft_invalid[..., None], 0.0, q)
    q = torch.cat([q, q.new_zeros(batch, 1, vocab)], 1)
    q_x = torch.where(in_range, q.gather(-1, x_safe[..., None])[..., 0], 0.0)
    no_row = torch.zeros_like(in_range[:, :1])
    draft_invalid = torch.cat([draft_invalid & ~greedy[:, None], no_row], 1)
    return _DraftRows(x, in_range, x_safe, q, q_x, draft_invalid)


def _accept(target: _TargetRows, draft: _DraftRows, greedy, num_draft, seed,
            position) -> torch.Tensor:
    """``num_accepted [B]``: row ``j`` accepts its draft when ``u * q(x) < p(x)`` with ``u``
    from the accept stream (greedy: when ``x`` is the target's argmax), unless a row is invalid
    or past ``num_draft``; the count stops at the first rejection."""
    j = torch.arange(draft.x.shape[1], device=draft.x.device)
    p_x = torch.where(draft.in_range,
                      target.p.gather(-1, draft.x_safe[..., None])[..., 0], 0.0)
    u = philox_uniform(seed[:, None], position[:, None] + 1 + j, PURPOSE_ACCEPT, 1)[..., 0]
    sampled_accept = (draft.q_x > 0) & (u * draft.q_x < p_x)
    greedy_accept = draft.x == target.argmax
    accept = torch.where(greedy[:, None], greedy_accept, sampled_accept)
    accept &= (draft.in_range & ~target.invalid & ~draft.invalid
               & (j < num_draft.long()[:, None]))
    return accept.int().cumprod(1).sum(1)  # first rejection, or n after a full accept


def _emit(target: _TargetRows, draft: _DraftRows, num_accepted, greedy, num_draft, seed,
          position, return_logprobs) -> VerifyOutput:
    """The accepted drafts and, at row ``j* = num_accepted``, the token drawn from
    ``r = max(p - q, 0)`` with ``q`` the rejected proposal's distribution (nothing for the bonus
    row), or from ``p`` when ``r`` has no mass; validity and, if asked, the log-probabilities."""
    p, x, in_range = target.p, draft.x, draft.in_range
    batch, rows, vocab = p.shape
    b = torch.arange(batch, device=x.device)
    j = torch.arange(rows, device=x.device)
    j_star = num_accepted.long()
    is_bonus = j_star == num_draft.long()
    p_star = p[b, j_star]
    if draft.q is None:
        q_star = (torch.nn.functional.one_hot(draft.x_safe[b, j_star], vocab)
                  * in_range[b, j_star, None])
    else:
        q_star = draft.q[b, j_star]
    q_star = torch.where(is_bonus[:, None], 0.0, q_star)
    residual = (p_star - q_star).clamp_min(0.0)
    residual = torch.where((residual.sum(-1) <= MIN_RESIDUAL_MASS)[:, None], p_star, residual)
    sampled_token = _exponential_race(residual, seed, position + 1 + j_star)

    invalid = target.invalid[b, j_star]
    token = torch.where(greedy, target.argmax[b, j_star], sampled_token)
    token = torch.where(invalid, 0, token)
    invalid |= ~is_bonus & (~in_range[b, j_star] | draft.invalid[b, j_star])

    tokens = torch.where(j < j_star[:, None], x, -1)
    tokens[b, j_star] = token
    logprobs = None
    if return_logprobs:
        # log p of each emitted token under the processed distribution (greedy rows: at T = 1).
        emitted = torch.where(j[None, :] <= j_star[:, None], tokens, 0).clamp(0, vocab - 1)
        logprobs = torch.log(p.gather(-1, emitted[..., None])[..., 0])
        logprobs = torch.where(j[None, :] <= j_star[:, None], logprobs, float("-inf"))
        logprobs[b, j_star] = torch.where(target.invalid[b, j_star], float("-inf"),
                                          logprobs[b, j_star])
    return VerifyOutput(tokens, num_accepted.int(), ~invalid, logprobs)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    draft_logits: Optional[torch.Tensor] = None,
    target_start: Optional[torch.Tensor] = None,
    draft_temperature: Optional[torch.Tensor] = None,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
    allowed_token_mask: Optional[torch.Tensor] = None,
    return_logprobs: bool = False,
) -> VerifyOutput:
    """Lossless speculative verification (README "verify"), vectorised over the whole batch.

    Row ``j`` of request ``b`` decides the token at absolute position ``position[b] + 1 + j`` and
    draws from the streams keyed by that position. The target distribution of a row is the
    processed one: disallowed tokens dropped, then :func:`filter_logits`.
    """
    greedy = ~(temperature > GREEDY_TEMPERATURE)
    target = _target_rows(target_logits, draft_tokens, target_start, temperature, greedy, top_k,
                          top_p, min_p, allowed_token_mask)
    draft = _draft_rows(draft_tokens, target_logits.shape[-1], draft_logits, temperature,
                        draft_temperature, greedy)
    num_accepted = _accept(target, draft, greedy, num_draft, seed, position)
    return _emit(target, draft, num_accepted, greedy, num_draft, seed, position, return_logprobs)


# ------------------------------------------------------------------------------------------------
# Sequential drafting (docs/semantics.md §1 step 3, §3.2, §3.3).
#
# Slot j drafts x_{j+1} from z_j = base_logits[:, j] + W2 . bias_input_j, where bias_input_j is
# W1[x_j] (Markov head) or tanh(o_j) (RNN head), x_0 the anchor. The head's arithmetic runs in
# float64 (every product of two float32 numbers is exact there) and z_j is rounded to float32 once
# (then to bfloat16, nearest even, with draft_logits_dtype=torch.bfloat16); the stored z_j is the
# proposal: x_{j+1} ~ softmax(z_j / T), drawn by the Gumbel-max rule
#   x = argmax_v  z_j(v) * (1/T) - log(E(v)),   E(v) = -log1p(-u_v),
# u_v element v of the draft stream at position p0 + 1 + j (greedy, T <= 1e-5: argmax z_j, ties to
# the lowest id). Non-finite z never wins; a row without a finite z yields token 0. An id outside
# [0, V) (only on CUDA without value checks) embeds as a zero row.


def _embed(w1: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """W1[ids] in float64; ids outside [0, V) give zero rows."""
    in_range = (ids >= 0) & (ids < w1.shape[0])
    rows = w1[ids.long().clamp(0, w1.shape[0] - 1)].double()
    return torch.where(in_range[..., None], rows, 0.0)


def draft_sample(
    z: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """One token per row of float32 ``z [B, V]`` from softmax(z / T), drawn at ``position``."""
    greedy = ~(temperature > GREEDY_TEMPERATURE)
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature)[:, None]
    u = philox_uniform(seed, position, PURPOSE_DRAFT, z.shape[-1])
    log_e = torch.log(-torch.log1p(-u))
    key = torch.where(greedy[:, None], z, z * inv_t - log_e)
    return torch.where(torch.isfinite(z), key, float("-inf")).argmax(-1)


def _logits_dtype(dtype):
    if dtype is None:
        return torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"'draft_logits_dtype' must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"'draft_logits_dtype' must be torch.float32 or torch.bfloat16, got {dtype}")
    return dtype


def _draft_block(base_logits, anchor, temperature, seed, position, bias_input, w2, filters,
                 logits_dtype=None):
    """The sequential walk shared by both heads; bias_input(j, prev) gives the [B, r] float64
    vector that W2 maps to the logit bias of slot j; `filters` (top_k, top_p, min_p) are applied
    to each slot's z before it is sampled and stored. With bfloat16 `logits_dtype` the float32
    z is rounded to bfloat16 (nearest even) first, and the filters, the draw and the stored
    logits all use the rounded values."""
    logits_dtype = _logits_dtype(logits_dtype)
    w2 = w2.double()
    prev = anchor.long()
    tokens, logits = [], []
    for j in range(base_logits.shape[1]):
        bias = bias_input(j, prev) @ w2.T
        z = (bias + base_logits[:, j].double()).float()
        if logits_dtype == torch.bfloat16:
            z = z.to(torch.bfloat16).float()
        if any(f is not None for f in filters.values()):
            z = filter_logits(z, temperature, **filters)
        prev = draft_sample(z, temperature, seed, position + 1 + j)
        tokens.append(prev)
        logits.append(z.to(logits_dtype))
    batch, block, vocab = base_logits.shape
    if block == 0:
        return DraftOutput(anchor.new_empty((batch, 0), dtype=torch.int64),
                           base_logits.new_empty((batch, 0, vocab), dtype=logits_dtype))
    return DraftOutput(torch.stack(tokens, 1), torch.stack(logits, 1))


def markov_draft(base_logits, anchor, w1, w2, temperature, seed, position, *, top_k=None,
                 top_p=None, min_p=None, draft_logits_dtype=None) -> DraftOutput:
    """Markov head (README "Drafting"): z_j = base_logits[:, j] + W2 . W1[x_j], one slot at a
    time, filtered by :func:`filter_logits` when filters are given."""
    return _draft_block(base_logits, anchor, temperature, seed, position,
                        lambda j, prev: _embed(w1, prev), w2,
                        dict(top_k=top_k, top_p=top_p, min_p=min_p), draft_logits_dtype)


def rnn_draft(base_logits, anchor, hidden, w1, w2, joint_weight, joint_bias, temperature, seed,
              position, *, top_k=None, top_p=None, min_p=None,
              draft_logits_dtype=None) -> DraftOutput:
    """RNN head (docs/semantics.md §1 step 3): [g; c; o] = J [s_j; W1[x_j]; h_j] + b, bias
    W2 . tanh(o), then s_{j+1} = sigmoid(g) * s_j + (1 - sigmoid(g)) * tanh(c), s_0 = 0."""
    rank = w1.shape[1]
    weight, bias = joint_weight.double(), joint_bias.double()
    state = torch.zeros(base_logits.shape[0], rank, dtype=torch.float64, device=w1.device)

    def bias_input(j, prev):
        nonlocal state
        u = torch.cat([state, _embed(w1, prev), hidden[:, j].double()], -1)
        gate, candidate, output = (u @ weight.T + bias).split(rank, -1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)  # after this slot's bias input
        return torch.tanh(output)

    return _draft_block(base_logits, anchor, temperature, seed, position, bias_input, w2,
                        dict(top_k=top_k, top_p=top_p, min_p=min_p), draft_logits_dtype)


def draft_confidence(hidden, prev_tokens, w1, weight, bias=None, calib_temperature=None):
    """c_j = sigmoid(logit_j / tau_j), logit_j = w . [h_j; W1[x_j]] + b in float64 rounded to
    float32 (docs/semantics.md §3.3); float32 [B, G]."""
    features = torch.cat([hidden.double(), _embed(w1, prev_tokens)], -1)
    logit = features @ weight.double()
    if bias is not None:
        logit = logit + bias.double().reshape(())
    logit = logit.float()
    if calib_temperature is not None:
        logit = logit / calib_temperature.float()
    return torch.sigmoid(logit)


# ------------------------------------------------------------------------------------------------
# Scheduling (docs/semantics.md §3.4): which draft tokens of each request are worth verifying.
#
# Survivals a[r, j] = c[r, 0] * ... * c[r, j] (multiplied left to right in float32) rank the
# (request, position) pairs: survival descending, then position, then request ascending. A pair
# is eligible when a > 0 and j < max_verify[r]; admitting (r, j) verifies draft x_{j+1}, so it
# sets num_verify[r] = j + 1 and adds one token to the verify batch. Expected emitted tokens are
# tau = B + sum of admitted survivals, accumulated exactly in fixed point (survival * 2^32,
# rounded half to even, as an integer) so every backend makes the same comparisons; the objective
# is Theta(N) = float64(tau) * float64(step_rate[N]) for a batch of N tokens (N < M).

SURVIVAL_SCALE = 2**32


def survivals(confidence: torch.Tensor) -> torch.Tensor:
    """a[r, j] = prod_{i<=j} c[r, i], multiplied left to right in float32."""
    a = confidence.float().clone()
    for j in range(1, a.shape[1]):
        a[:, j] = a[:, j - 1] * a[:, j]
    return a


def _ranked_pairs(confidence: torch.Tensor, max_verify: Optional[torch.Tensor]):
    """Eligible (r, j) pairs in admission order and their fixed-point survivals, on the CPU."""
    a = survivals(confidence).cpu()
    batch, block = a.shape
    j = torch.arange(block)
    eligible = a > 0
    if max_verify is not None:
        eligible &= j < max_verify.cpu().long()[:, None]
    r_idx, j_idx = eligible.nonzero(as_tuple=True)
    values = a[r_idx, j_idx]
    # Stable sort by survival descending after ordering the pairs by (j, r).
    by_position = torch.argsort(j_idx * batch + r_idx)
    r_idx, j_idx, values = r_idx[by_position], j_idx[by_position], values[by_position]
    order = torch.sort(values, descending=True, stable=True).indices
    r_idx, j_idx, values = r_idx[order], j_idx[order], values[order]
    fixed = torch.round(values.double() * SURVIVAL_SCALE).long()
    return r_idx.tolist(), j_idx.tolist(), fixed.tolist()


def _theta(tau_fixed: int, step_rate: list, tokens: int) -> float:
    return float(tau_fixed) * step_rate[tokens]


def schedule_verify(
    confidence: torch.Tensor, step_rate: torch.Tensor, *, max_verify: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Algorithm 1 (docs/semantics.md §3.4): admit pairs in rank order while Theta strictly
    improves, and stop at the first admission that does not (or that would need M tokens)."""
    batch = confidence.shape[0]
    rates = step_rate.double().cpu().tolist()
    num_verify = [0] * batch
    tokens, tau = batch, batch * SURVIVAL_SCALE
    best = _theta(tau, rates, tokens)
    for r, j, a in zip(*_ranked_pairs(confidence, max_verify)):
        if tokens + 1 >= len(rates):
            break
        theta = _theta(tau + a, rates, tokens + 1)
        if not theta > best:
            break  # the early stop: later (smaller) survivals must not decide earlier pairs
        tokens, tau, best = tokens + 1, tau + a, theta
        num_verify[r] = j + 1
    return torch.tensor(num_verify, dtype=torch.int32, device=confidence.device)


def plan_verify_budget(confidence: torch.Tensor, step_rate: torch.Tensor) -> torch.Tensor:
    """Global search over the token budget K in [B, M): argmax of Theta(K) with the top K - B
    survivals admitted (ties to the smaller K). Returns int32 [1]."""
    batch = confidence.shape[0]
    rates = step_rate.double().cpu().tolist()
    _, _, fixed = _ranked_pairs(confidence, None)
    tau = batch * SURVIVAL_SCALE
    best_k, best = batch, _theta(tau, rates, batch)
    for k, a in enumerate(fixed, start=batch + 1):
        if k >= len(rates):
            break
        tau += a
        theta = _theta(tau, rates, k)
        if theta > best:
            best_k, best = k, theta
    return torch.tensor([best_k], dtype=torch.int32, device=confidence.device)


def allocate_verify(
    confidence: torch.Tensor, budget: torch.Tensor, *, max_verify: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Admits the top budget - B eligible pairs (same order as schedule_verify)."""
    batch = confidence.shape[0]
    admit = max(int(budget.reshape(-1)[0]) - batch, 0)
    num_verify = [0] * batch
    for r, j, _ in list(zip(*_ranked_pairs(confidence, max_verify)))[:admit]:
        num_verify[r] = j + 1
    return torch.tensor(num_verify, dtype=torch.int32, device=confidence.device)


def pack_verify_inputs(
    anchor: torch.Tensor, draft_tokens: torch.Tensor, num_verify: torch.Tensor, position: torch.Tensor
) -> VerifyBatch:
    """Flattens [x0, x_1..x_l] of every request into one ragged target batch."""
    batch, block = draft_tokens.shape
    lengths = num_verify.long() + 1
    cu = torch.zeros(batch + 1, dtype=torch.long, device=anchor.device)
    cu[1:] = lengths.cumsum(0)
    ids = torch.zeros(batch * (block + 1), dtype=torch.int64, device=anchor.device)
    positions = torch.zeros_like(ids)
    for b in range(batch):
        start, n = int(cu[b]), int(lengths[b])
        ids[start] = anchor[b]
        ids[start + 1 : start + n] = draft_tokens[b, : n - 1]
        positions[start : start + n] = position[b] + torch.arange(n, device=anchor.device)
    return VerifyBatch(ids, positions, cu.int())


# ------------------------------------------------------------------------------------------------
# Block drafting attention (docs/semantics.md §3.5): the G block slots attend, non-causally, to all
# G block keys and to their request's context cache rows [max(0, p0 - window), p0).


def block_draft_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    cache_slot: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    window: Optional[int] = None,
):
    """Returns (out [B, G, Hq, D] in q's dtype, lse [B, G, Hq] float32), with an explicit float32
    softmax over each request's visible keys (context rows first, then the block)."""
    batch, block, heads, dim = q.shape
    kv_heads = k_block.shape[2]
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    lse = torch.empty(batch, block, heads, dtype=torch.float32, device=q.device)
    for b in range(batch):
        slot = int(cache_slot[b]) if cache_slot is not None else b
        end = int(cache_seqlens[b])
        begin = 0 if window is None else max(0, end - window)
        keys = torch.cat([k_cache[slot, begin:end], k_block[b]]).float()  # [n, Hkv, D]
        values = torch.cat([v_cache[slot, begin:end], v_block[b]]).float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # query head h reads kv head h // ratio
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("ghd,nhd->hgn", q[b].float(), keys) * scale
        lse[b] = torch.logsumexp(scores, -1).t()
        out[b] = torch.einsum("hgn,nhd->ghd", torch.softmax(scores, -1), values).to(q.dtype)
    return out, lse


def block_draft_attention_sdpa(
    q, k_block, v_block, k_cache, v_cache, cache_seqlens, *, cache_slot=None, softmax_scale=None,
    window=None,
) -> torch.Tensor:
    """The same attention through PyTorch SDPA with a boolean mask over [cache row ; block], the
    way an engine without a block-draft kernel computes it (it copies the cache rows it reads)."""
    batch, block, heads, dim = q.shape
    kv_heads, length = k_block.shape[2], k_cache.shape[1]
    slots = cache_slot.long() if cache_slot is not None else torch.arange(batch, device=q.device)
    keys = torch.cat([k_cache[slots], k_block], 1).transpose(1, 2)  # [B, Hkv, L + G, D]
    values = torch.cat([v_cache[slots], v_block], 1).transpose(1, 2)
    position = torch.arange(length + block, device=q.device)
    end = cache_seqlens.long()[:, None]
    begin = end - window if window is not None else torch.zeros_like(end)
    visible = ((position >= begin) & (position < end)) | (position >= length)  # [B, L + G]
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=visible[:, None, None, :],
        scale=softmax_scale, enable_gqa=heads != kv_heads,
    ).transpose(1, 2)


def append_context_kv(k_cache, v_cache, k_new, v_new, num_new, cache_seqlens, *, cache_slot=None):
    """Writes num_new[b] rows at cache_seqlens[b] of each request's cache row, dropping rows that
    would land at or past L, and advances cache_seqlens (capped at L) in place."""
    length = k_cache.shape[1]
    for b in range(k_new.shape[0]):
        slot = int(cache_slot[b]) if cache_slot is not None else b
        start = int(cache_seqlens[b])
        kept = max(0, min(int(num_new[b]), length - start))
        k_cache[slot, start : start + kept] = k_new[b, :kept]
        v_cache[slot, start : start + kept] = v_new[b, :kept]
        cache_seqlens[b] = min(start + int(num_new[b]), length)


def dspark_loss(hidden, lm_head_weight, labels, weights, *, target_hidden=None, markov_latent=None,
                markov_w2=None, confidence_logits=None, ce_weight=0.1, l1_weight=0.9,
                confidence_weight=1.0, denominators=None, logit_softcap=None) -> LossOutput:
    """DSpark's training loss, eagerly: the formula :func:`dspark_ops.dspark_loss` fuses.

    Computed in float32 (float64 for float64 inputs) from the inputs as given, with autograd
    through every path the formula has (``z`` and ``t``, so a trainable LM head gets both), except
    that ``c*`` is detached and nothing reaches ``target_hidden``. It holds several ``[N, V]``
    tensors at once, as DeepSpec's eager loss does. ``logit_softcap`` ``s`` (Gemma4) caps the LM
    head's products before the Markov bias: ``z = s tanh(W h / s) + W2 u``,
    ``t = s tanh(W g / s)``; autograd of ``torch.tanh`` gives the gradients through the cap.
    """
    if logit_softcap is None:
        logits_of = lambda product: product  # noqa: E731
    else:
        cap = float(logit_softcap)
        logits_of = lambda product: cap * torch.tanh(product / cap)  # noqa: E731
    return dspark_loss_of_logits(
        hidden, lm_head_weight, labels, weights, logits_of,
        target_hidden=target_hidden, markov_latent=markov_latent, markov_w2=markov_w2,
        confidence_logits=confidence_logits, ce_weight=ce_weight, l1_weight=l1_weight,
        confidence_weight=confidence_weight, denominators=denominators)


def dspark_loss_of_logits(hidden, lm_head_weight, labels, weights, logits_of, *,
                          target_hidden=None, markov_latent=None, markov_w2=None,
                          confidence_logits=None, ce_weight=0.1, l1_weight=0.9,
                          confidence_weight=1.0, denominators=None) -> LossOutput:
    """:func:`dspark_loss` with the LM head's products ``W h`` (draft and target alike) turned
    into logits by ``logits_of`` before the Markov bias is added: the identity for DSpark's
    drafts, a soft cap for Gemma4's."""
    from .ops.loss import loss_denominators

    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    weight = lm_head_weight.to(dtype)
    z = logits_of(hidden.to(dtype) @ weight.T)
    if markov_latent is not None:
        z = z + markov_latent.to(dtype) @ markov_w2.to(dtype).T
    w = weights.to(dtype)
    s_ce, s_l1, s_conf = (s.to(dtype) for s in loss_denominators(weights, denominators))
    ce = torch.logsumexp(z, dim=-1) - z.gather(-1, labels.long()[:, None]).squeeze(-1)
    loss = ce_weight * (w * ce).sum() / s_ce
    zero = loss.new_zeros(())
    l1_mean, confidence, accept_rate = zero, zero, None
    if target_hidden is not None:
        t = logits_of(target_hidden.detach().to(dtype) @ weight.T)
        l1 = (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)
        l1_mean = (w * l1).sum() / s_l1
        loss = loss + l1_weight * l1_mean
        accept_rate = (1 - 0.5 * l1).clamp(0, 1).detach()
        if confidence_logits is not None:
            bce = torch.nn.functional.binary_cross_entropy_with_logits(
                confidence_logits.to(dtype), accept_rate, reduction="none")
            confidence = (w * bce).sum() / s_conf
            loss = loss + confidence_weight * confidence
    return LossOutput(loss, ((w * ce).sum() / s_ce).detach(), l1_mean.detach(),
                      confidence.detach(), accept_rate)
