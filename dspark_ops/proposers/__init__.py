"""What drafts tokens for :class:`dspark_ops.SpeculativeDecoder`: one interface
(:class:`Proposer`), one decoding loop, one goodput rule and one lossless verify for all.

- :class:`BlockDraftProposer`: DSpark and DFlash drafts (Gemma4's too), one parallel block pass;
- :class:`ChainProposer`: Eagle3 drafts, one step per slot;
- :class:`PromptLookupProposer`: n-gram matching over the request's own tokens, no model;
- :class:`OracleProposer`: the target's own continuation with wrong tokens at a set rate, for
  measurement.
"""

import copy

from .base import Proposal, Proposer
from .block import BlockDraftProposer
from .chain import ChainProposer
from .lookup import OracleProposer, PromptLookupProposer, find_continuation

__all__ = ["BlockDraftProposer", "ChainProposer", "OracleProposer", "PromptLookupProposer",
           "Proposal", "Proposer", "find_continuation", "make_proposer"]


def make_proposer(draft, *, block_size=None, calib_temperature=None) -> Proposer:
    """A draft model as a proposer: a chain for a family that drafts one token per step
    (Eagle3, :mod:`dspark_ops.models.registry`), else a block. A :class:`Proposer` is returned
    as it is, or, when ``block_size`` is below its ``max_drafts``, as a shallow copy drafting at
    most ``block_size`` (the caller's proposer is never changed: decoders of several block sizes
    may share one)."""
    if isinstance(draft, Proposer):
        if block_size is None or int(block_size) >= draft.max_drafts:
            return draft
        limited = copy.copy(draft)
        limited.max_drafts = int(block_size)
        return limited
    from ..models.registry import family_of

    if family_of(draft).drafting == "chain":
        return ChainProposer(draft, block_size)
    return BlockDraftProposer(draft, block_size, calib_temperature)
