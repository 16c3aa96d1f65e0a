"""A draft vocabulary: the subset of the target's token ids a draft proposes from.

A draft's LM head over the whole vocabulary is the largest part of its cost (SmolLM2: 49,152
rows of 576, about a fifth of a target token per drafted slot). With a vocabulary of the ``N``
most frequent response tokens the draft computes ``N`` rows instead, and the Markov head's
``W2`` likewise. The draft then has probability zero outside the subset, which speculative
sampling handles exactly: verification sees ``q = 0`` there, so a target token outside is only
ever emitted by the residual draw (docs/semantics.md "Draft vocabulary").

:class:`DraftVocabulary` is the subset (``d2t``: draft index -> target id, sorted), saved next to a
checkpoint as ``draft_vocab.safetensors`` (absent: the full vocabulary, so checkpoints without
one load as before). :class:`VocabularyHeads` holds a draft's LM head and Markov rows sliced to
it and drafts a block in it:

- the base logits are ``[B, k, N + B]``: the ``N`` sliced rows, then one column per request held
  at ``-inf``. Those ``B`` rows of ``W1`` hold each request's anchor row, so the Markov / RNN
  head reads the anchor's own ``W1`` row whether or not the anchor is in the subset, and the
  ``-inf`` columns are never drawn;
- the drafts map back to target ids, and the draft logits are scattered into ``[B, k, V]`` at
  ``-inf`` elsewhere for ``verify``: ``B k V`` floats written, the bytes a full-vocabulary draft
  writes anyway, for ``N / V`` of its LM-head multiply-adds.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

import torch

from .checkpoint import load_state_dict_file, save_safetensors
from .cpu_linear import few_row_linear

__all__ = ["DRAFT_VOCAB_FILE", "DraftVocabulary", "VocabularyHeads", "count_response_tokens"]

#: The file a checkpoint directory keeps its draft vocabulary in.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class DraftVocabulary:
    """A sorted subset of the target's token ids.

    Parameters
    ----------
    d2t : torch.Tensor
        int64 ``[N]``, strictly increasing target ids: draft index ``i`` proposes token
        ``d2t[i]``.
    vocab_size : int
        ``V``, the target's vocabulary.
    """

    def __init__(self, d2t: torch.Tensor, vocab_size: int):
        d2t = torch.as_tensor(d2t)
        if d2t.dim() != 1 or d2t.dtype not in (torch.int64, torch.int32) or d2t.numel() < 1:
            raise ValueError(f"DraftVocabulary: 'd2t' must be a non-empty 1-D integer tensor, got "
                             f"{tuple(d2t.shape)} {d2t.dtype}")
        d2t = d2t.to(device="cpu", dtype=torch.int64)
        if int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size:
            raise ValueError(f"DraftVocabulary: 'd2t' must hold ids in [0, {vocab_size}), got "
                             f"[{int(d2t.min())}, {int(d2t.max())}]")
        if d2t.numel() > 1 and not bool((d2t[1:] > d2t[:-1]).all()):
            raise ValueError("DraftVocabulary: 'd2t' must be strictly increasing")
        self.d2t, self.vocab_size = d2t, int(vocab_size)

    @property
    def size(self) -> int:
        return self.d2t.numel()

    def __repr__(self) -> str:
        return f"DraftVocabulary({self.size} of {self.vocab_size} ids)"

    @classmethod
    def most_frequent(cls, counts: torch.Tensor, size: int,
                      always: Iterable[int] = ()) -> "DraftVocabulary":
        """The ``size`` ids of the largest ``counts [V]``, ``always`` included (EOS and the
        special tokens: a draft that cannot propose EOS cannot end an answer). Ties go to the
        lower id: a BPE vocabulary numbers its tokens in merge order, so a lower id is the more
        frequent token in the tokenizer's own corpus."""
        vocab = counts.numel()
        always = sorted({int(t) for t in always})
        if not 1 <= size <= vocab:
            raise ValueError(f"DraftVocabulary.most_frequent: 'size' must be in [1, {vocab}], "
                             f"got {size}")
        if any(not 0 <= t < vocab for t in always):
            raise ValueError(f"DraftVocabulary.most_frequent: 'always' ids must be in "
                             f"[0, {vocab}), got {always}")
        if len(always) > size:
            raise ValueError(f"DraftVocabulary.most_frequent: {len(always)} ids in 'always' do "
                             f"not fit in 'size' {size}")
        score = counts.double().clone()
        score[always] = float("inf")
        # a stable sort of -score keeps equal scores in id order
        order = torch.sort(-score, stable=True).indices[:size]
        return cls(torch.sort(order).values, vocab)

    def inside(self, device=None) -> torch.Tensor:
        """bool ``[V]``: which target ids are in the vocabulary."""
        inside = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
        inside[self.d2t.to(inside.device)] = True
        return inside

    def coverage(self, tokens: torch.Tensor) -> float:
        """The share of ``tokens`` (target ids, any shape) inside the vocabulary."""
        tokens = tokens.reshape(-1).to("cpu", torch.int64)
        if tokens.numel() == 0:
            return float("nan")
        return float(self.inside()[tokens].double().mean())

    def save(self, directory: str) -> str:
        """Writes ``directory/draft_vocab.safetensors``; returns its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, DRAFT_VOCAB_FILE)
        save_safetensors({"d2t": self.d2t,
                          "vocab_size": torch.tensor([self.vocab_size], dtype=torch.int64)},
                         path)
        return path

    @classmethod
    def load(cls, directory: str) -> Optional["DraftVocabulary"]:
        """The vocabulary saved in ``directory``, or None when it has none."""
        path = os.path.join(directory, DRAFT_VOCAB_FILE)
        if not os.path.exists(path):
            return None
        tensors = load_state_dict_file(path)
        if "d2t" not in tensors or "vocab_size" not in tensors:
            raise ValueError(f"{path}: a draft vocabulary holds 'd2t' and 'vocab_size', got "
                             f"{sorted(tensors)}")
        return cls(tensors["d2t"], int(tensors["vocab_size"][0]))


def count_response_tokens(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Token counts ``[V]`` over the response tokens (``loss_mask`` 1) of training rows with
    ``input_ids`` and ``loss_mask`` (the rows ``prepare_data`` writes)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i, row in enumerate(rows):
        if "input_ids" not in row or "loss_mask" not in row:
            raise ValueError(f"row {i}: needs 'input_ids' and 'loss_mask', has {sorted(row)}")
        ids = torch.tensor(row["input_ids"], dtype=torch.int64)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        if ids.shape != mask.shape:
            raise ValueError(f"row {i}: 'input_ids' and 'loss_mask' differ in length "
                             f"({ids.numel()} and {mask.numel()})")
        ids = ids[mask]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"row {i}: token ids outside [0, {vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


class VocabularyHeads:
    """A draft's LM head and Markov / RNN rows sliced to a :class:`DraftVocabulary`, drafting a
    block in it (module docstring). Built once per draft; the per-request rows are rewritten
    each round.

    Parameters
    ----------
    draft : DSparkDraft
        Any block draft family: its ``lm_head``, ``transform_logits``, ``markov_head`` and
        ``propose`` are used.
    vocabulary : DraftVocabulary
    """

    def __init__(self, draft, vocabulary: DraftVocabulary):
        vocab = draft.config.vocab_size
        if vocabulary.vocab_size != vocab:
            raise ValueError(f"the draft vocabulary is over {vocabulary.vocab_size} ids, the "
                             f"draft's over {vocab}")
        self.draft, self.vocabulary = draft, vocabulary
        weight = draft.lm_head.weight
        self.d2t = vocabulary.d2t.to(weight.device)
        with torch.no_grad():
            self.lm_rows = weight[self.d2t].contiguous()
            head = draft.markov_head
            self.w1_rows = None if head is None else head.markov_w1.weight[self.d2t]
            self.w2_rows = None if head is None else head.markov_w2.weight[self.d2t]
        self._batch = -1

    @property
    def size(self) -> int:
        return self.vocabulary.size

    def _for_batch(self, batch: int) -> None:
        """``W1``/``W2`` with one row per request after the subset's (W2's zero), and the
        ``d2t`` the drafts map through."""
        if batch == self._batch:
            return
        n = self.size
        if self.w1_rows is not None:
            rank = self.w1_rows.shape[1]
            self.w1 = torch.cat([self.w1_rows, self.w1_rows.new_zeros(batch, rank)])
            self.w2 = torch.cat([self.w2_rows, self.w2_rows.new_zeros(batch, rank)])
        self.local_anchor = torch.arange(n, n + batch, device=self.d2t.device)
        self._batch = batch

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, k, N + B]``: the family's logits over the subset, then ``-inf`` columns."""
        batch = hidden.shape[0]
        logits = self.draft.transform_logits(few_row_linear(hidden, self.lm_rows))
        tail = logits.new_full((batch, hidden.shape[1], batch), float("-inf"))
        return torch.cat([logits, tail], -1)

    def propose(self, base_logits: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor,
                temperature, seed, position, **filters):
        """The block's drafts as target ids and their logits over the target's vocabulary
        (``-inf`` outside the subset): a :class:`~dspark_ops.ops.draft.DraftOutput`."""
        from ..ops.draft import DraftOutput

        batch = anchor.shape[0]
        self._for_batch(batch)
        draft = self.draft
        if draft.markov_head is None:
            out = draft.propose(base_logits, anchor, hidden, temperature, seed, position,
                                **filters)
        else:
            with torch.no_grad():
                self.w1[self.size:] = draft.markov_head.markov_w1.weight[anchor]
            out = draft.propose(base_logits, self.local_anchor, hidden, temperature, seed,
                                position, w1=self.w1, w2=self.w2, **filters)
        tokens = self.d2t[out.tokens]  # never a -inf column: an index past N would raise
        logits = out.draft_logits
        full = logits.new_full((*logits.shape[:-1], self.vocabulary.vocab_size), float("-inf"))
        full.index_copy_(-1, self.d2t, logits[..., :self.size])
        return DraftOutput(tokens, full)
