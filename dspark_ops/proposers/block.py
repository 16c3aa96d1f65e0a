"""Block drafts (DSpark, DFlash; Gemma4's too): one parallel pass over ``[x0, MASK, ...]``, then
the sequential head, over only the slots the round drafts.

The backbone always reads the whole block of ``G`` slots (its attention is non-causal inside the
block, so a shorter block would change every slot), but the LM head, the Markov / RNN head and
the confidence head run over the first ``k`` slots only: no logits are computed for a slot that
cannot be verified. A slot's draft does not depend on later slots, so the first ``k`` drafts are
those a full block would have drawn, on the same random streams.

A draft with a draft vocabulary (``draft.draft_vocabulary``) computes its LM head and Markov rows
over that subset only (:class:`~dspark_ops.models.vocab.VocabularyHeads`).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..costs import digest
from ..models.cpu_linear import CpuLinears
from ..models.vocab import VocabularyHeads
from ..steps import part
from .base import Proposal, Proposer

__all__ = ["BlockDraftProposer"]


class BlockDraftProposer(Proposer):
    """A :class:`~dspark_ops.models.DSparkDraft` (or DFlash / Gemma4 draft) as a proposer.

    Parameters
    ----------
    draft : DSparkDraft
        Its context features must be the target's ``feature_layers``.
    block_size : int, optional
        ``G``, the block the backbone reads and the most slots a round drafts; default
        ``draft.config.block_size``.
    calib_temperature : torch.Tensor, optional
        float32 ``[G]``, the confidence head's calibration.
    """

    def __init__(self, draft, block_size: Optional[int] = None,
                 calib_temperature: Optional[torch.Tensor] = None):
        self.draft = draft
        self.linears = CpuLinears(draft)  # the heads' few rows on the CPU
        self.block_size = int(block_size or draft.config.block_size)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.max_drafts = self.block_size
        self.has_confidence = draft.confidence_head is not None
        self.calib = calib_temperature
        vocabulary = getattr(draft, "draft_vocabulary", None)
        self.vocab_heads = None if vocabulary is None else VocabularyHeads(draft, vocabulary)
        if calib_temperature is not None and calib_temperature.numel() < self.block_size:
            raise ValueError(f"calib_temperature has {calib_temperature.numel()} temperatures, "
                             f"the block {self.block_size} slots")

    @property
    def kind(self) -> str:
        return "dflash" if self.draft.config.is_dflash else "dspark"

    def identity(self) -> str:
        dtype = str(self.draft.fc.weight.dtype).replace("torch.", "")
        vocab = ""
        if self.vocab_heads is not None:  # the draft's cost depends on its vocabulary
            vocab = f"/vocab={self.vocab_heads.size}:{digest(self.vocab_heads.d2t.tolist())}"
        return (f"{type(self.draft).__name__}/{self.kind}/G={self.block_size}/{dtype}/"
                f"{digest(self.draft.config.to_dict())}{vocab}")

    def start(self, prompts, features, prompt_len, anchor, length) -> None:
        draft = self.draft
        weight = draft.fc.weight
        self.k_caches, self.v_caches = draft.new_caches(len(prompts), length)
        self.cache_len = torch.zeros(len(prompts), dtype=torch.int32, device=weight.device)
        self._pending: List[torch.Tensor] = []
        self._pending_kept: Optional[torch.Tensor] = None
        with part("draft_context"):
            draft.append_context(features.to(weight.dtype), positions=None, num_new=prompt_len,
                                 k_caches=self.k_caches, v_caches=self.v_caches,
                                 cache_seqlens=self.cache_len)
        if self.calib is not None:
            self.calib = self.calib.to(weight.device)

    def _append(self, features: torch.Tensor, kept: torch.Tensor) -> None:
        self.draft.append_context(features.to(self.draft.fc.weight.dtype), positions=None,
                                  num_new=kept, k_caches=self.k_caches, v_caches=self.v_caches,
                                  cache_seqlens=self.cache_len)

    def _flush(self) -> None:
        """The plain rounds' features since the last draft, appended in one call (a request
        keeps a row in every plain round until it finishes, so its rows come first)."""
        if self._pending:
            with part("draft_context"):
                self._append(torch.cat(self._pending, 1), self._pending_kept)
            self._pending, self._pending_kept = [], None

    def propose(self, k, anchor, position, temperature, seed, filters, history) -> Proposal:
        if not 1 <= k <= self.block_size:
            raise ValueError(f"propose(): k must be in [1, {self.block_size}], got {k}")
        with self.linears:
            draft = self.draft
            self._flush()
            with part("draft_forward"):
                hidden = draft(draft.block_hidden(anchor, self.block_size), block_positions=None,
                               k_caches=self.k_caches, v_caches=self.v_caches,
                               cache_seqlens=self.cache_len)[:, :k]
            heads = self.vocab_heads or draft
            with part("draft_lm_head"):
                base_logits = heads.base_logits(hidden)
            with part("markov_drafting"):
                drafts, draft_logits = heads.propose(base_logits, anchor, hidden, temperature, seed,
                                                     position, **filters)
            confidence = None
            if self.has_confidence:
                with part("confidence"):
                    prev = torch.cat([anchor[:, None], drafts[:, :-1]], 1)
                    calib = None if self.calib is None else self.calib[:k]
                    confidence = draft.confidence(hidden, prev, calib)
            return Proposal(drafts, draft_logits, confidence)

    def commit(self, features, kept, emitted, position, plain) -> None:
        if plain:
            self._pending.append(features)
            self._pending_kept = kept if self._pending_kept is None else self._pending_kept + kept
            return
        with self.linears:
            self._flush()
            with part("draft_context"):
                self._append(features, kept)
