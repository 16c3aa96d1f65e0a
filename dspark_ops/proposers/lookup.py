"""Drafts without a draft model: prompt lookup (n-gram matching over the request's own tokens)
and an oracle for measurement.

Both propose deterministic tokens (one-hot proposals: ``verify`` accepts a draft iff the target
would have drawn it) and cost almost nothing to draft, so the goodput rule decides how many to
verify from the running acceptance estimates and from how many a lookup found (0 when nothing
matches: the round is the plain path).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .base import Proposal, Proposer

__all__ = ["OracleProposer", "PromptLookupProposer", "find_continuation"]


def find_continuation(tokens: Sequence[int], max_ngram: int, min_ngram: int,
                      count: int) -> List[int]:
    """Up to ``count`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of ``tokens`` (``max_ngram`` down to ``min_ngram`` tokens); [] if none."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tokens - n:])
        # Latest start first: recent context predicts best; the suffix itself is excluded.
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + count])
    return []


class PromptLookupProposer(Proposer):
    """Prompt lookup decoding: the tokens that followed the latest earlier occurrence of the
    request's last n-gram (its prompt and everything generated so far), as transformers'
    ``prompt_lookup_num_tokens`` drafts, under the goodput rule.

    Parameters
    ----------
    max_drafts : int
        The most tokens a round proposes (transformers' usual 10).
    max_ngram, min_ngram : int
        The n-gram sizes tried, longest first.
    """

    kind = "prompt-lookup"

    def __init__(self, max_drafts: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if max_drafts < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"PromptLookupProposer: need max_drafts >= 1 and 1 <= min_ngram <= "
                             f"max_ngram, got {max_drafts}, {min_ngram} and {max_ngram}")
        self.max_drafts, self.max_ngram, self.min_ngram = max_drafts, max_ngram, min_ngram

    def identity(self) -> str:
        return f"prompt-lookup/K={self.max_drafts}/n={self.min_ngram}..{self.max_ngram}"

    def start(self, prompts, features, prompt_len, anchor, length) -> None:
        self.device = anchor.device

    def propose(self, k, anchor, position, temperature, seed, filters, history) -> Proposal:
        found = [find_continuation(h, self.max_ngram, self.min_ngram, k) for h in history]
        return _deterministic(found, k, self.device)

    def commit(self, features, kept, emitted, position, plain) -> None:
        pass  # the decoder's history is the lookup's whole state


def _deterministic(found: Sequence[Sequence[int]], k: int, device) -> Proposal:
    """Proposals of ``len(found[b]) <= k`` tokens each, padded with 0 (never verified)."""
    tokens = torch.zeros(len(found), k, dtype=torch.long)
    for b, row in enumerate(found):
        tokens[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    available = torch.tensor([len(row) for row in found], dtype=torch.int32)
    return Proposal(tokens.to(device), available=available.to(device))


class OracleProposer(Proposer):
    """For measurement: the target's own greedy continuation (from a plain run), each token
    replaced by a wrong one with probability ``1 - alpha``, so that every draft is accepted
    independently with probability ``alpha`` under greedy decoding. It shows where speculation
    starts paying on a machine, for a draft of a given acceptance and cost.

    Parameters
    ----------
    continuations : sequence of sequences of int
        Per request, plain greedy decoding's output (its first token is the prefill's).
    alpha : float
        Per-draft acceptance.
    vocab_size : int
        Wrong tokens are drawn from ``[0, vocab_size)``.
    max_drafts : int
    seed : int
        Which tokens are wrong is fixed per continuation index, so every ``k`` and scheduler
        sees the same wrong tokens.
    draft_seconds : (float, float)
        A cost to spend per call, fixed and per slot (``time.sleep``), to stand in for a draft
        model's; (0, 0) by default.
    """

    kind = "oracle"

    def __init__(self, continuations: Sequence[Sequence[int]], alpha: float, vocab_size: int,
                 max_drafts: int = 7, seed: int = 0, draft_seconds=(0.0, 0.0)):
        if not 0 <= alpha <= 1:
            raise ValueError(f"OracleProposer: 'alpha' must be in [0, 1], got {alpha}")
        if max_drafts < 1 or vocab_size < 2:
            raise ValueError(f"OracleProposer: need max_drafts >= 1 and vocab_size >= 2, got "
                             f"{max_drafts} and {vocab_size}")
        self.alpha, self.max_drafts, self.draft_seconds = alpha, max_drafts, tuple(draft_seconds)
        generator = torch.Generator().manual_seed(seed)
        self.proposals = []
        for row in continuations:
            row = torch.as_tensor(list(row), dtype=torch.long)
            wrong = torch.rand(len(row), generator=generator) >= alpha
            shift = torch.randint(1, vocab_size, (len(row),), generator=generator)
            self.proposals.append(torch.where(wrong, (row + shift) % vocab_size, row).tolist())

    def identity(self) -> str:
        return f"oracle/K={self.max_drafts}/cost={self.draft_seconds}"

    def start(self, prompts, features, prompt_len, anchor, length) -> None:
        if len(prompts) > len(self.proposals):
            raise ValueError(f"OracleProposer has {len(self.proposals)} continuations, the "
                             f"batch {len(prompts)} requests")
        self.prompt_len = [len(p) for p in prompts]
        self.device = anchor.device

    def propose(self, k, anchor, position, temperature, seed, filters, history) -> Proposal:
        import time

        fixed, per_slot = self.draft_seconds
        if fixed or per_slot:
            time.sleep(fixed + per_slot * k)
        found = []
        for b, h in enumerate(history):
            done = len(h) - self.prompt_len[b]  # continuation tokens emitted, the anchor last
            found.append(self.proposals[b][done:done + k])
        return _deterministic(found, k, self.device)

    def commit(self, features, kept, emitted, position, plain) -> None:
        pass
