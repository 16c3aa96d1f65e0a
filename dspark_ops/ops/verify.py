"""verify: fused, lossless verification of a block of draft tokens (docs/semantics.md §3.1)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..outputs import VerifyOutput
from .._per_request import draw_seeds, per_request_args
from .._fake_checks import checked_fake

__all__ = ["VerifyOutput", "verify"]


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    temperature: Union[torch.Tensor, float],
    seed: Optional[torch.Tensor],
    position: torch.Tensor,
    *,
    draft_logits: Optional[torch.Tensor] = None,
    target_start: Optional[torch.Tensor] = None,
    draft_temperature: Union[torch.Tensor, float, None] = None,
    top_k: Union[torch.Tensor, int, None] = None,
    top_p: Union[torch.Tensor, float, None] = None,
    min_p: Union[torch.Tensor, float, None] = None,
    allowed_token_mask: Optional[torch.Tensor] = None,
    return_logprobs: bool = False,
    generator: Optional[torch.Generator] = None,
) -> VerifyOutput:
    """Accepts the longest valid prefix of each request's drafts and emits one more token.

    Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) against the processed target
    distribution (``allowed_token_mask``, temperature, then top-k, top-p and min-p): the
    emitted tokens are distributed exactly as sampling that distribution alone. Greedy requests
    (``temperature <= 1e-5``) accept iff the draft is the target argmax. The rule:
    docs/semantics.md §3.1; the filters and their order: §3.1b; why it is lossless: §5.1.

    Parameters
    ----------
    target_logits : torch.Tensor
        float32/bfloat16/float16, padded ``[B, G+1, V]`` or ragged ``[R, V]``. Row
        ``target_start[b] + j`` holds the target's logits for the token after position
        ``position[b] + j``, for ``j = 0..num_draft[b]``.
    draft_tokens : torch.Tensor
        int64 or int32 ``[B, G]``; entries past ``num_draft[b]`` are ignored.
    num_draft : torch.Tensor
        int32 ``[B]``, each in ``[0, G]``.
    temperature : torch.Tensor or float
        float32 ``[B]``: target sampling temperature, finite and ``>= 0``; ``<= 1e-5`` is greedy.
        A Python number is shared by every request (as for ``draft_temperature``, ``top_k``,
        ``top_p`` and ``min_p``).
    seed : torch.Tensor or None
        int64 ``[B]``: per-request seeds. ``None`` draws them from ``generator`` (or torch's
        default generator for the device).
    position : torch.Tensor
        int64 ``[B]``: absolute position ``p0`` (in ``[0, 2**62]``) of each request's anchor
        token. Row ``j`` draws
        its random numbers from the streams of position ``p0 + 1 + j`` only, so a request's
        output never depends on the rest of the batch.
    draft_logits : torch.Tensor, optional
        float32/bfloat16/float16 ``[B, G, V]``: the pre-temperature logits the drafts were
        sampled from (``markov_draft``'s ``draft_logits``); ``q_j = softmax(draft_logits/T_d)``.
        ``None`` means deterministic (one-hot) proposals.
    target_start : torch.Tensor, optional
        int32 ``[B]``: first row of each request in a ragged ``target_logits``; default
        ``b * (G + 1)`` (then ``target_logits`` must have ``B * (G + 1)`` rows).
    draft_temperature : torch.Tensor or float, optional
        float32 ``[B]``: the temperature ``T_d`` the drafts were sampled at; default
        ``temperature``.
    top_k : torch.Tensor or int, optional
        int32 ``[B]``, ``>= 0``: keep the tokens with fewer than ``k`` larger logits (ties at the
        boundary are kept); 0 (or ``>= V``) is off.
    top_p : torch.Tensor or float, optional
        float32 ``[B]`` in ``(0, 1]``: keep a token iff the probability of the (top-k kept)
        tokens with a larger logit is ``< top_p`` (ties at the boundary kept); 1 is off. Sums
        are taken in float64.
    min_p : torch.Tensor or float, optional
        float32 ``[B]`` in ``[0, 1]``: keep a token iff ``p >= min_p * max p``; 0 is off.
    allowed_token_mask : torch.Tensor, optional
        int32 ``[R, ceil(V / 32)]``, one row per ``target_logits`` row (the layout grammar engines
        such as xgrammar produce): bit ``v % 32`` of word ``v // 32`` set = token ``v`` allowed.
        A row with no allowed finite logit emits 0 with ``valid = False``.
    return_logprobs : bool
        Also return ``logprobs`` float32 ``[B, G+1]``: the log of each emitted token's processed
        probability (greedy requests: of the processed distribution at ``T = 1``), ``-inf`` past
        the ``num_accepted + 1`` emitted tokens and where the row had no allowed finite logit.
    generator : torch.Generator, optional
        Only used to draw ``seed`` when it is ``None``.

    Returns
    -------
    VerifyOutput
        ``tokens`` int64 ``[B, G+1]`` (the ``num_accepted[b] + 1`` emitted tokens, then -1),
        ``num_accepted`` int32 ``[B]``, ``valid`` bool ``[B]`` (False where a row the op needed
        had no finite logit, in which case the token there is 0, or a draft id was outside
        ``[0, V)``, which is rejected without being used as an index), and ``logprobs`` (None
        unless ``return_logprobs``). Non-finite logits (NaN, +-inf) count as -inf.

    Notes
    -----
    No host synchronisation and no data-dependent shapes on CUDA, so the call can be captured
    in a CUDA graph. Value checks (ids in range, lengths <= G, temperatures) always run on CPU
    and on CUDA only with ``DSPARK_OPS_DEBUG=1``, because they need a sync.
    """
    batch, device = draft_tokens.shape[0], draft_tokens.device
    temperature, draft_temperature, top_k, top_p, min_p = per_request_args(
        "verify", batch, device, temperature=temperature, draft_temperature=draft_temperature,
        top_k=top_k, top_p=top_p, min_p=min_p)
    if seed is None:
        seed = draw_seeds(batch, generator, device)
    tokens, num_accepted, valid, logprobs = torch.ops.dspark_ops.verify(
        target_logits, draft_tokens, num_draft, temperature, seed, position,
        draft_logits, target_start, draft_temperature, top_k, top_p, min_p, allowed_token_mask,
        return_logprobs,
    )
    return VerifyOutput(tokens, num_accepted, valid, logprobs if return_logprobs else None)


@torch.library.register_fake("dspark_ops::verify")
@checked_fake("verify")
def _verify_fake(target_logits, draft_tokens, num_draft, temperature, seed, position,
                 draft_logits=None, target_start=None, draft_temperature=None, top_k=None,
                 top_p=None, min_p=None, allowed_token_mask=None, return_logprobs=False):
    torch._check(draft_tokens.dim() == 2, lambda: "verify(): 'draft_tokens' must be 2-D [B, G]")
    batch, block = draft_tokens.shape
    return (
        draft_tokens.new_empty((batch, block + 1), dtype=torch.int64),
        draft_tokens.new_empty((batch,), dtype=torch.int32),
        draft_tokens.new_empty((batch,), dtype=torch.bool),
        draft_tokens.new_empty((batch, block + 1 if return_logprobs else 0), dtype=torch.float32),
    )
