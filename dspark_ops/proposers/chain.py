"""Chain drafts (Eagle3): one single-token draft step per slot, as DeepSpec's Eagle3 evaluator
drafts, batched.

The draft's own K/V cache covers the whole sequence (row ``i``: the target features of token
``i`` paired with token ``i + 1``). A round of ``k`` slots samples ``d_1`` from the last
committed row's output, then runs ``k - 1`` single-token steps (the last draft needs no step of
its own); the speculative rows are not committed (the cache length does not move past them).
The commit appends the target features of the anchor and the accepted drafts, paired with the
tokens emitted after them; after plain rounds those rows wait and are appended, in one call,
before the next draft.
"""

from __future__ import annotations

from typing import List

import torch

from ..costs import digest
from ..models.cpu_linear import CpuLinears
from ..models.draft import sample_base_logits
from ..steps import part
from .base import Proposal, Proposer

__all__ = ["ChainProposer"]


class ChainProposer(Proposer):
    """An :class:`~dspark_ops.models.Eagle3Draft` as a proposer.

    Parameters
    ----------
    draft : Eagle3Draft
    max_drafts : int, optional
        The most slots a round drafts; default the draft's ``ttt_length``.
    """

    kind = "eagle3"

    def __init__(self, draft, max_drafts=None):
        self.draft = draft
        self.linears = CpuLinears(draft)  # the chain's one row per step on the CPU
        self.max_drafts = int(max_drafts or draft.config.block_size)
        if self.max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {self.max_drafts}")

    def identity(self) -> str:
        dtype = str(self.draft.fc.weight.dtype).replace("torch.", "")
        return (f"{type(self.draft).__name__}/eagle3/K={self.max_drafts}/{dtype}/"
                f"{digest(self.draft.config.to_dict())}")

    def start(self, prompts, features, prompt_len, anchor, length) -> None:
        draft = self.draft
        device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
        batch = len(prompts)
        self.rows = torch.arange(batch, device=device)
        position = prompt_len.long()
        # The prompt's features with the prompt shifted left by one and the first token at the
        # end, RoPE position i for row i.
        width = features.shape[1]
        ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, : len(p) - 1] = torch.as_tensor(p[1:], dtype=torch.long)
        ids[self.rows, position - 1] = anchor
        self.cache = draft.new_cache(batch, length)
        self.cache_len = torch.zeros(batch, dtype=torch.int32, device=device)
        with part("draft_context"):
            outputs = draft.extend(features.to(dtype), ids,
                                   torch.arange(width, device=device).expand(batch, -1),
                                   prompt_len, self.cache, self.cache_len, project=True)
        self.hidden = outputs[self.rows, position - 1]  # the output at the last prompt row
        self.cache_len = prompt_len.clone()
        self._pending: List[tuple] = []

    def _append(self, features, emitted, position, kept) -> None:
        """Appends the kept rows and moves the chain's start to the last one's output."""
        offsets = torch.arange(features.shape[1], device=features.device)
        outputs = self.draft.extend(features.to(self.draft.fc.weight.dtype),
                                    emitted.clamp_min(0), position[:, None] + offsets, kept,
                                    self.cache, self.cache_len, project=True)
        last = outputs[self.rows, (kept.long() - 1).clamp_min(0)]
        self.hidden = torch.where((kept > 0)[:, None], last, self.hidden)
        self.cache_len = self.cache_len + kept

    def _flush(self) -> None:
        if self._pending:
            features = torch.cat([p[0] for p in self._pending], 1)
            emitted = torch.cat([p[1] for p in self._pending], 1)
            kept = sum(p[3] for p in self._pending)
            with part("draft_context"):
                self._append(features, emitted, self._pending[0][2], kept)
            self._pending = []

    def propose(self, k, anchor, position, temperature, seed, filters, history) -> Proposal:
        if not 1 <= k <= self.max_drafts:
            raise ValueError(f"propose(): k must be in [1, {self.max_drafts}], got {k}")
        with self.linears:
            draft = self.draft
            self._flush()
            one = torch.ones_like(self.cache_len)
            with part("draft_chain"):
                tokens, logits, h = [], [], self.hidden
                for j in range(k):
                    step = sample_base_logits(draft.compute_logits(h)[:, None], temperature, seed,
                                              position + j, **filters)
                    tokens.append(step.tokens[:, 0])
                    logits.append(step.draft_logits[:, 0])
                    if j + 1 < k:  # the last draft needs no step of its own
                        h = draft.extend(h[:, None], step.tokens, (position + j)[:, None], one,
                                         self.cache, self.cache_len + j, project=False)[:, 0]
            return Proposal(torch.stack(tokens, 1), torch.stack(logits, 1))

    def commit(self, features, kept, emitted, position, plain) -> None:
        if plain:
            self._pending.append((features, emitted, position, kept))
            return
        with self.linears:
            self._flush()
            with part("draft_context"):
                self._append(features, emitted, position, kept)
