"""Training data: reading the JSONL of ``input_ids`` / ``loss_mask`` rows, and a deterministic,
resumable schedule of micro-batches that splits the same way over any number of ranks.

A row is one conversation tokenised with the target's chat template, ``loss_mask`` 1 on the
response tokens (``python -m dspark_ops.prepare_data`` writes such rows). The schedule shuffles
the samples with a seeded permutation per epoch and groups them, in that order, into *global
micro-batches*: as many sequences as fit ``world_size * batch_tokens`` padded tokens (count times
the longest length), at least one per rank. Rank ``r`` of ``W`` takes the sequences
``r, r + W, ...`` of each group, so one process with ``W`` times the token budget sees exactly
the union of what ``W`` ranks see. Anchors are drawn per sequence from a generator seeded by
``(seed, epoch, sample)``, so they do not depend on how sequences are batched either.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional, Sequence, Tuple

import torch

from .forward import build_eval_mask, position_weights, sample_anchor_positions

__all__ = ["Sample", "Schedule", "anchor_generator", "collate", "collate_blocks",
           "read_training_data"]


@dataclasses.dataclass
class Sample:
    """One training sequence: ``index`` (its row in the data file, 0-based), ``input_ids`` and
    ``loss_mask`` (1 on the trained response tokens)."""

    index: int
    input_ids: List[int]
    loss_mask: List[int]

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)


def read_training_data(path: str, *, vocab_size: Optional[int] = None, max_length: int = 4096,
                       min_loss_tokens: int = 14) -> Tuple[List[Sample], int]:
    """Reads and checks the training JSONL.

    Every row needs ``input_ids`` (token ids, each below ``vocab_size``) and ``loss_mask`` (0/1,
    as long). Sequences are truncated to ``max_length`` tokens; those left with fewer than
    ``min_loss_tokens`` trained tokens are dropped, as DeepSpec drops them.

    Returns
    -------
    samples : list of Sample
    dropped : int
        How many rows were dropped for too few trained tokens.

    Raises
    ------
    SystemExit
        With the file and line for anything malformed, and when no row is left.
    """
    if not os.path.isfile(path):
        raise SystemExit(f"--data {path}: no such file")
    samples, dropped, rows, trained_total = [], 0, 0, 0
    hint = ("rows need 'input_ids' and 'loss_mask' (1 on response tokens); make them from "
            "prompts with: python -m dspark_ops.prepare_data --target DIR --prompts FILE --out "
            "FILE")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SystemExit(f"{where}: not JSON ({error.msg})") from None
            if not isinstance(row, dict) or "input_ids" not in row or "loss_mask" not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise SystemExit(f"{where}: no 'input_ids'/'loss_mask' (found {keys}); {hint}")
            ids, mask = row["input_ids"], row["loss_mask"]
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
                raise SystemExit(f"{where}: 'input_ids' must be a non-empty list of token ids")
            if not (isinstance(mask, list) and all(m in (0, 1) for m in mask)):
                raise SystemExit(f"{where}: 'loss_mask' must be a list of 0/1")
            if len(mask) != len(ids):
                raise SystemExit(f"{where}: 'loss_mask' has {len(mask)} entries for "
                                 f"{len(ids)} input_ids")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
                bad = next(t for t in ids if not 0 <= t < vocab_size)
                raise SystemExit(f"{where}: token id {bad} is outside the target's vocabulary "
                                 f"[0, {vocab_size})")
            ids, mask = ids[:max_length], [int(m) for m in mask[:max_length]]
            rows += 1
            trained_total += sum(mask)
            if sum(mask) < max(min_loss_tokens, 2):
                dropped += 1
                continue
            samples.append(Sample(rows - 1, ids, mask))
    if rows == 0:
        raise SystemExit(f"{path}: no rows")
    if trained_total == 0:
        raise SystemExit(f"{path}: no row has a response token (every loss_mask is 0): there is "
                         f"nothing to train on; {hint}")
    if not samples:
        raise SystemExit(f"{path}: all {rows} rows have fewer than {min_loss_tokens} trained "
                         "tokens (--min-loss-tokens)")
    return samples, dropped


def _group(lengths: Sequence[int], order: Sequence[int], budget: int,
           min_sequences: int) -> List[List[int]]:
    """Greedy groups of ``order`` whose ``count * max length`` stays within ``budget`` (a group
    always takes at least ``min_sequences``); a trailing group smaller than that is dropped."""
    groups, current, longest = [], [], 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and len(current) >= min_sequences and (len(current) + 1) * grown > budget:
            groups.append(current)
            current, longest = [], 0
            grown = lengths[i]
        current.append(i)
        longest = grown
    if len(current) >= min_sequences:
        groups.append(current)
    return groups


class Schedule:
    """Which samples each rank trains on at every micro-step, fixed by the data and the flags.

    Parameters
    ----------
    samples : list of Sample
    batch_tokens : int
        Padded tokens per rank and micro-step (a longer sequence gets a micro-batch alone).
    world_size : int
    grad_accum : int
        Micro-steps per optimiser step.
    seed : int
    epochs : int
        Passes over the data, unless ``max_steps`` is given.
    max_steps : int, optional
        Optimiser steps; as many epochs as it takes.
    """

    def __init__(self, samples: List[Sample], *, batch_tokens: int, world_size: int,
                 grad_accum: int, seed: int, epochs: int = 1, max_steps: Optional[int] = None):
        self.samples = samples
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.batch_tokens = batch_tokens
        lengths = [len(s.input_ids) for s in samples]
        budget = batch_tokens * world_size
        self.micro: List[Tuple[int, List[int]]] = []  # (epoch, sample positions), per micro-step
        epoch = 0
        while True:
            if max_steps is None and epoch >= epochs:
                break
            if max_steps is not None and len(self.micro) >= max_steps * grad_accum:
                break
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            order = torch.randperm(len(samples), generator=g).tolist()
            groups = _group(lengths, order, budget, world_size)
            usable = len(groups) // grad_accum * grad_accum  # whole optimiser steps per epoch
            if usable == 0:
                raise SystemExit(
                    f"{len(samples)} training samples make {len(groups)} micro-batch(es) per "
                    f"epoch at --batch-tokens {batch_tokens} x {world_size} rank(s): fewer than "
                    f"one optimiser step (--grad-accum {grad_accum}); lower --grad-accum or "
                    "--batch-tokens, or add data")
            self.micro.extend((epoch, grp) for grp in groups[:usable])
            epoch += 1
        if max_steps is not None:
            self.micro = self.micro[: max_steps * grad_accum]
        self.total_steps = len(self.micro) // grad_accum
        self.steps_per_epoch = sum(1 for e, _ in self.micro if e == 0) // grad_accum

    def fingerprint(self) -> dict:
        """What a resumed run must agree on for the schedule to continue exactly."""
        return {"num_samples": len(self.samples), "sample_indices_sum": sum(
            s.index for s in self.samples), "batch_tokens": self.batch_tokens,
            "world_size": self.world_size, "grad_accum": self.grad_accum, "seed": self.seed,
            "total_steps": self.total_steps}

    def micro_batch(self, step: int, micro: int, rank: int) -> Tuple[int, List[Sample]]:
        """``(epoch, samples)`` of rank ``rank`` at micro-step ``micro`` of optimiser step
        ``step``."""
        epoch, group = self.micro[step * self.grad_accum + micro]
        return epoch, [self.samples[i] for i in group[rank::self.world_size]]

    def tokens(self, step: int) -> int:
        """Tokens (unpadded, all ranks) of optimiser step ``step``."""
        return sum(len(self.samples[i].input_ids)
                   for _, group in self.micro[step * self.grad_accum:(step + 1) * self.grad_accum]
                   for i in group)


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """The CPU generator of one sequence's anchors in one epoch."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 10_000_019 + sample_index)


def collate(samples: Sequence[Sample], device) -> dict:
    """Right-padded tensors of a micro-batch: ``input_ids`` int64 ``[B, L]`` (padding: 0),
    ``loss_mask`` float32 (padding: 0) and ``valid`` bool (real tokens)."""
    length = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length)
    valid = torch.zeros(len(samples), length, dtype=torch.bool)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n] = torch.tensor(s.input_ids)
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        valid[row, :n] = True
    return {"input_ids": ids.to(device), "loss_mask": mask.to(device), "valid": valid.to(device)}


def collate_blocks(samples: Sequence[Sample], epoch: int, seed: int, device, *, num_anchors: int,
                   block_size: int, loss_decay_gamma: float, vocabulary=None) -> dict:
    """A micro-batch of block drafts: :func:`collate`'s tensors, its anchor blocks and their
    trained slots, each built once for the forward, the loss and the denominators.

    Adds ``anchor_positions`` int64 ``[B, A]`` and ``block_keep_mask`` bool ``[B, A]``, the
    anchors drawn per sequence by DeepSpec's sampler (:func:`~.forward.sample_anchor_positions`)
    on that sequence alone with :func:`anchor_generator`, ``A`` cut to the most blocks any
    sequence keeps (at least 1; at most ``num_anchors``); ``eval_mask`` bool ``[B, A, G]``
    (:func:`~.forward.build_eval_mask`) and ``weights`` float32 ``[B, A, G]``
    (:func:`~.forward.position_weights`).

    With a draft ``vocabulary`` (:class:`~dspark_ops.models.vocab.DraftVocabulary`), a slot whose
    label is outside it is not trained, nor are the slots after it: the draft cannot propose the
    token, so a round never accepts past it.
    """
    data = collate(samples, "cpu")
    anchors, keep = [], []
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        a, k = sample_anchor_positions(data["loss_mask"][row:row + 1, :n], num_anchors,
                                       anchor_generator(seed, epoch, s.index))
        anchors.append(a)
        keep.append(k)
    anchors, keep = torch.cat(anchors), torch.cat(keep)
    # Kept blocks come first in every row, so the columns past the longest kept run are padding
    # blocks in every row: zero weight, zero gradient. Dropping them changes no number and spares
    # the attention and the loss their rows (a short sequence has far fewer than 512 anchors).
    used = max(int(keep.sum(1).max()), 1) if keep.numel() else 0
    data["anchor_positions"], data["block_keep_mask"] = anchors[:, :used], keep[:, :used]
    trained = data["loss_mask"]
    if vocabulary is not None:
        trained = trained * vocabulary.inside()[data["input_ids"]]
    data["eval_mask"] = build_eval_mask(trained, data["anchor_positions"],
                                        data["block_keep_mask"], block_size)
    data["weights"] = position_weights(data["eval_mask"], loss_decay_gamma)
    return {name: value.to(device) for name, value in data.items()}
