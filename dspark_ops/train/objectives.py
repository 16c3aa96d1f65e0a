"""What a draft family learns from, one class per training loss the registry names
(:attr:`dspark_ops.models.registry.DraftFamily.training_loss`): how a micro-batch is built, its
forward and loss, its denominators, the per-step sums of its metrics, and how the run describes
it. The trainer's loop is the same for every family; it asks :data:`TRAINING_LOSSES`.

The step sums are ``[loss, ce, l1, confidence, accept_sum[G], accept_count[G], tau_sum,
block_count]`` (float64), the columns of ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse

import torch

from .data import collate, collate_blocks
from .eagle3 import eagle3_ttt_loss
from .forward import training_forward
from .loss import block_metrics, draft_loss, loss_coefficients

__all__ = ["DSparkObjective", "TTTObjective", "TRAINING_LOSSES"]


class DSparkObjective:
    """Block drafts (DSpark, DFlash): the anchor-parallel forward and DeepSpec's DSpark loss
    (:func:`dspark_ops.train.draft_loss`), its denominators summed over ranks. The anchors,
    the eval mask and the slots' weights are built once per micro-batch, by :meth:`collate`."""

    def __init__(self, draft, args: argparse.Namespace):
        self.num_anchors = draft.config.num_anchors
        self.block_size = draft.config.block_size
        self.coefficients = loss_coefficients(draft, args.ce_weight, args.l1_weight,
                                              args.confidence_weight)
        self.loss_decay_gamma = args.loss_decay_gamma
        self.vocabulary = getattr(draft, "draft_vocabulary", None)
        self.loss_kwargs = {"loss_decay_gamma": args.loss_decay_gamma,
                            "ce_weight": self.coefficients[0], "l1_weight": self.coefficients[1],
                            "confidence_weight": self.coefficients[2]}
        if args.loss_impl == "reference":
            from .. import reference

            self.loss_kwargs["loss_fn"] = reference.dspark_loss

    def collate(self, samples, epoch: int, seed: int, device) -> dict:
        """The micro-batch with its anchor blocks, eval mask and weights
        (:func:`~.data.collate_blocks`)."""
        return collate_blocks(samples, epoch, seed, device, num_anchors=self.num_anchors,
                              block_size=self.block_size, loss_decay_gamma=self.loss_decay_gamma,
                              vocabulary=self.vocabulary)

    def forward(self, draft, data: dict, features, last_hidden, denominators):
        """The loss output and the confidence logits of one micro-batch."""
        batch = training_forward(draft, data["input_ids"], features, data["loss_mask"],
                                 last_hidden, anchor_positions=data["anchor_positions"],
                                 block_keep_mask=data["block_keep_mask"],
                                 eval_mask=data["eval_mask"])
        out = draft_loss(draft, batch, weights=data["weights"], denominators=denominators,
                         **self.loss_kwargs)
        return out, batch.confidence_logits

    @staticmethod
    def denominators(data: dict, dist):
        """DeepSpec's denominators: sum(w) of this micro-step over all ranks."""
        return dist.all_reduce(data["weights"].sum().double().repeat(3)) + 1e-6

    @staticmethod
    def loss(result) -> torch.Tensor:
        return result[0].loss

    def sums(self, result, data: dict, grad_accum: int) -> torch.Tensor:
        out = result[0]
        metrics = block_metrics(out.accept_rate, data["eval_mask"], data["block_keep_mask"])
        alpha, beta, gamma = self.coefficients
        local_loss = alpha * out.ce + beta * out.l1 + gamma * out.confidence
        return torch.cat([torch.stack([local_loss.double(), out.ce.double(), out.l1.double(),
                                       out.confidence.double()]) / grad_accum,
                          metrics["accept_sum"].cpu(), metrics["accept_count"].cpu(),
                          metrics["tau_sum"].reshape(1).cpu(),
                          metrics["block_count"].reshape(1).cpu()])

    @staticmethod
    def describe_draft(config, trainable: int) -> str:
        kind = ("dflash" if config.markov_rank == 0
                else f"dspark ({config.markov_head_type} head)")
        return (f"draft: {kind}, {config.num_hidden_layers} layers, block {config.block_size}, "
                f"markov rank {config.markov_rank}, target layers "
                f"{list(config.target_layer_ids)}, mask token {config.mask_token_id}, "
                f"{trainable:,} trainable parameters")

    def describe_loss(self, args: argparse.Namespace) -> str:
        a, b, c = self.coefficients
        return f"{a:g} ce + {b:g} l1 + {c:g} confidence ({args.loss_impl})"


class TTTObjective:
    """Chain drafts (Eagle3): DeepSpec's training-time test (:func:`.eagle3.eagle3_ttt_loss`), a
    soft cross-entropy alone; its metrics in the slots of the DSpark ones (``ce`` is the soft
    cross-entropy, ``accept_rate@k`` the TTT step's)."""

    coefficients = (1.0, 0.0, 0.0)

    def __init__(self, draft, args: argparse.Namespace):
        if args.loss_impl != "fused" or args.l1_weight or args.confidence_weight:
            raise SystemExit(f"--arch {args.arch} trains with its own loss: no --loss-impl, "
                             "--l1-weight or --confidence-weight")

    @staticmethod
    def collate(samples, epoch: int, seed: int, device) -> dict:
        return collate(samples, device)

    @staticmethod
    def forward(draft, data: dict, features, last_hidden, denominators):
        return eagle3_ttt_loss(draft, data["input_ids"], features, data["loss_mask"],
                               last_hidden, data["valid"])

    @staticmethod
    def denominators(data: dict, dist):
        return None  # the TTT loss normalises by its own rows

    @staticmethod
    def loss(result) -> torch.Tensor:
        return result.loss

    @staticmethod
    def sums(result, data: dict, grad_accum: int) -> torch.Tensor:
        loss = result.loss.detach().double() / grad_accum
        zero = loss.new_zeros(())
        return torch.cat([torch.stack([loss, loss, zero, zero]).cpu(), result.accept_sum.cpu(),
                          result.accept_count.cpu(), result.tau_sum.reshape(1).cpu(),
                          result.row_count.reshape(1).cpu()])

    @staticmethod
    def describe_draft(config, trainable: int) -> str:
        return (f"draft: eagle3, 1 layer, ttt_length {config.ttt_length}, step loss decay "
                f"{config.step_loss_decay:g}, target layers {list(config.target_layer_ids)}, "
                f"{trainable:,} trainable parameters")

    @staticmethod
    def describe_loss(args: argparse.Namespace) -> str:
        return "the training-time test's soft cross-entropy"


#: The registry's training-loss names and what implements each.
TRAINING_LOSSES = {"dspark": DSparkObjective, "ttt": TTTObjective}
