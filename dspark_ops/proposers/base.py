"""The proposer interface: what the decoding loop of :class:`dspark_ops.SpeculativeDecoder`
asks of anything that drafts tokens.

One round of the loop: the goodput rule picks ``k`` (0: the plain path, the proposer is not
called), :meth:`Proposer.propose` drafts ``k`` slots, the scheduler picks how many to verify, the
target verifies them, and :meth:`Proposer.commit` hands back what was kept. After a plain round
``commit`` is called with ``plain=True`` and a proposer defers its own bookkeeping (a draft
model appends the target's features to its context at its next ``propose``), so the plain path
costs what plain decoding costs.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

__all__ = ["Proposal", "Proposer"]


@dataclasses.dataclass
class Proposal:
    """``k`` drafted slots per request.

    Attributes
    ----------
    tokens : torch.Tensor
        int64 ``[B, k]``.
    logits : torch.Tensor or None
        ``[B, k, V]``, the pre-temperature logits each draft was sampled from (``verify``'s
        ``draft_logits``); None for deterministic drafts (one-hot proposals).
    confidence : torch.Tensor or None
        float32 ``[B, k]``: conditional survival probabilities from a confidence head (slot
        ``j``'s depends only on drafts before it); None: the decoder uses its running
        estimates.
    available : torch.Tensor or None
        int32 ``[B]``: real drafts per request (a lookup may find fewer than ``k``); None: all
        ``k``.
    """

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None
    available: Optional[torch.Tensor] = None


class Proposer:
    """Base class: drafts for the requests of one :meth:`dspark_ops.SpeculativeDecoder.generate`.

    Attributes
    ----------
    max_drafts : int
        ``K``: the most slots one call drafts.
    """

    max_drafts: int = 0

    def identity(self) -> str:
        """What the proposer's cost depends on (its kind and configuration): part of a cost
        table's key."""
        raise NotImplementedError

    def start(self, prompts: Sequence[Sequence[int]], features: torch.Tensor,
              prompt_len: torch.Tensor, anchor: torch.Tensor, length: int) -> None:
        """New requests after the target's prefill: their ``prompts``, the prompts' target
        ``features [B, T, F]``, their lengths (int32 ``[B]``), the first emitted token
        ``anchor [B]`` (at position ``prompt_len``), and ``length``, the longest sequence any
        request can reach."""
        raise NotImplementedError

    def propose(self, k: int, anchor: torch.Tensor, position: torch.Tensor,
                temperature: torch.Tensor, seed: torch.Tensor, filters: dict,
                history: List[List[int]]) -> Proposal:
        """``k >= 1`` drafts after each ``anchor`` (at ``position``, int64 ``[B]``), sampled
        at ``temperature`` with ``filters`` on the draft streams of ``seed``; ``history`` holds
        each request's tokens so far (prompt, then every emitted token, the anchor last)."""
        raise NotImplementedError

    def commit(self, features: torch.Tensor, kept: torch.Tensor, emitted: torch.Tensor,
               position: torch.Tensor, plain: bool) -> None:
        """The round's outcome: request ``b`` kept ``kept[b]`` rows (the anchor and its
        accepted drafts; 0 when finished), whose target features are ``features[b, :kept[b]]``
        and whose next tokens are ``emitted[b, :kept[b]]``; ``position`` is the anchor's
        position before the round. ``plain``: the round ran the plain path."""
        raise NotImplementedError
