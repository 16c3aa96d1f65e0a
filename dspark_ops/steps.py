"""The target's side of a decoding round, shared by the decoder (:mod:`dspark_ops.decoder`) and
the cost profile (:mod:`dspark_ops.costs`), so that what is timed is what runs:

- :func:`prefill`: the prompts through the target;
- :func:`plain_step`: one token per request, the plain decoding path (one target forward over
  the anchor, one draw from its logits);
- :func:`verify_step`: one target forward over the ragged batch ``[x0, x_1..x_l]`` of every
  request and :func:`dspark_ops.verify` of its drafts.

The target is anything with the interface of :mod:`dspark_ops.decoder`'s module doc.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .ops.schedule import pack_verify_inputs
from .ops.verify import verify

__all__ = ["part", "plain_step", "prefill", "sample_from_target", "verify_step"]


def part(name: str):
    """A ``torch.profiler`` label for one part of a decoding round (``dspark_ops.<name>``)."""
    return torch.profiler.record_function("dspark_ops." + name)


def prefill(target, prompts: Sequence[Sequence[int]], length: int, device):
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


def sample_from_target(logits: torch.Tensor, temperature, seed, position,
                       filters: Optional[dict] = None) -> torch.Tensor:
    """The token after ``position`` from target logits ``[B, V]``: ``verify`` with no drafts,
    i.e. a plain draw from the (filtered) ``softmax(logits / T)`` on the resampling stream of
    that position."""
    batch = logits.shape[0]
    no_drafts = torch.zeros(batch, 0, dtype=torch.long, device=logits.device)
    out = verify(logits.float()[:, None], no_drafts, torch.zeros(batch, dtype=torch.int32,
                 device=logits.device), temperature, seed, position, **(filters or {}))
    return out.tokens[:, 0]


def plain_step(target, anchor, cache, cache_len, temperature, seed, position, filters):
    """The plain decoding path: the anchor (the last emitted token, at ``position``) through
    the target, and the next token drawn from its logits. Returns the token ``[B]`` and the
    anchor's features ``[B, 1, F]``."""
    with part("target_forward"):
        logits, features = target(anchor[:, None], torch.ones_like(cache_len), cache, cache_len)
    with part("sample"):
        token = sample_from_target(logits[:, 0], temperature, seed, position, filters)
    return token, features


def verify_step(target, anchor, drafts, draft_logits, num_verify, position, cache, cache_len,
                temperature, seed, filters: dict):
    """One target forward over the ragged batch ``[x0, x_1..x_l]`` of every request and the
    verification of its drafts: ``verify``'s output, the forward's ragged features and each
    request's first row in them. ``draft_logits`` None: deterministic (one-hot) drafts."""
    with part("pack_verify_inputs"):
        packed = pack_verify_inputs(anchor, drafts, num_verify, position)
    with part("target_forward"):
        logits, features = target.forward_ragged(packed.input_ids, packed.cu_seqlens, cache,
                                                 cache_len)
    starts = packed.cu_seqlens[:-1]
    with part("verify"):
        out = verify(logits.float(), drafts, num_verify, temperature, seed, position,
                     draft_logits=draft_logits, target_start=starts,
                     draft_temperature=temperature, **filters)
    return out, features, starts
