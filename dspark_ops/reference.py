"""Pure-PyTorch references: the semantics of record for every op.

Each function here spells out, in eager float32 PyTorch, exactly what the matching CPU and CUDA
kernels compute, including the random numbers they draw, so tests can demand identical tokens.
They are written for clarity and run on any device; they assume inputs that pass the ops'
argument checks.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

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
    "verify",
]

# Random streams (csrc/common/philox.h): a token's proposal, acceptance test and resampling never
# share random numbers.
PURPOSE_DRAFT = 0
PURPOSE_ACCEPT = 1
PURPOSE_RESAMPLE = 2

GREEDY_TEMPERATURE = 1e-5
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


class VerifyOutput(NamedTuple):
    tokens: torch.Tensor  # int64 [B, G+1]: emitted tokens, then -1
    num_accepted: torch.Tensor  # int32 [B]: accepted draft tokens (one more token is emitted)
    valid: torch.Tensor  # bool [B]: False where a needed row had no finite logit or a draft id was out of range


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
) -> VerifyOutput:
    """Lossless speculative verification (SPEC §3.1), vectorised over the whole batch.

    Row ``j`` of request ``b`` decides the token at absolute position ``position[b] + 1 + j`` and
    draws from the streams keyed by that position.
    """
    device = draft_tokens.device
    batch, block = draft_tokens.shape
    vocab = target_logits.shape[-1]
    target = target_logits.reshape(-1, vocab).float()
    j = torch.arange(block + 1, device=device)
    n = num_draft.long()
    start = (
        target_start.long()
        if target_start is not None
        else torch.arange(batch, device=device) * (block + 1)
    )
    rows = (start[:, None] + j).clamp(0, target.shape[0] - 1)  # rows past n are never used

    greedy = ~(temperature > GREEDY_TEMPERATURE)
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature)
    p, target_argmax, target_invalid = _softmax_parts(target[rows], inv_t[:, None])

    # Per-row views padded with the bonus row (no draft token there).
    x = torch.cat([draft_tokens.long(), torch.full_like(n[:, None], -1)], 1)
    in_range = (x >= 0) & (x < vocab)
    x_safe = torch.where(in_range, x, 0)
    p_x = torch.where(in_range, p.gather(-1, x_safe[..., None])[..., 0], 0.0)

    # q: the distribution each draft token was proposed from; without draft logits, one-hot on
    # the draft token.
    no_row = torch.zeros_like(in_range[:, :1])
    if draft_logits is None:
        q = None
        q_x = in_range.float()
        draft_invalid = torch.zeros_like(in_range)
    else:
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
        draft_invalid = torch.cat([draft_invalid & ~greedy[:, None], no_row], 1)

    u = philox_uniform(seed[:, None], position[:, None] + 1 + j, PURPOSE_ACCEPT, 1)[..., 0]
    sampled_accept = (q_x > 0) & (u * q_x < p_x)
    greedy_accept = x == target_argmax
    accept = torch.where(greedy[:, None], greedy_accept, sampled_accept)
    accept &= in_range & ~target_invalid & ~draft_invalid & (j < n[:, None])
    num_accepted = accept.int().cumprod(1).sum(1)  # first rejection, or n after a full accept

    # The emitted token, drawn at row j* = num_accepted from r = max(p - q, 0) with q the rejected
    # proposal's distribution (nothing for the bonus row), or from p when r has no mass.
    b = torch.arange(batch, device=device)
    j_star = num_accepted.long()
    is_bonus = j_star == n
    p_star = p[b, j_star]
    if q is None:
        q_star = torch.nn.functional.one_hot(x_safe[b, j_star], vocab) * in_range[b, j_star, None]
    else:
        q_star = q[b, j_star]
    q_star = torch.where(is_bonus[:, None], 0.0, q_star)
    residual = (p_star - q_star).clamp_min(0.0)
    residual = torch.where((residual.sum(-1) <= MIN_RESIDUAL_MASS)[:, None], p_star, residual)
    sampled_token = _exponential_race(residual, seed, position + 1 + j_star)

    invalid = target_invalid[b, j_star]
    token = torch.where(greedy, target_argmax[b, j_star], sampled_token)
    token = torch.where(invalid, 0, token)
    invalid |= ~is_bonus & (~in_range[b, j_star] | draft_invalid[b, j_star])

    tokens = torch.where(j < j_star[:, None], x, -1)
    tokens[b, j_star] = token
    return VerifyOutput(tokens, num_accepted.int(), ~invalid)
