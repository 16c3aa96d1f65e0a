"""What a draft family learns from, one class per training loss the registry names
(:attr:`dspark_ops.models.registry.DraftFamily.training_loss`): the forward and loss of one
micro-batch, its denominators, the per-step sums of its metrics, and how the run describes it.
The trainer's loop is the same for every family; it asks :data:`TRAINING_LOSSES`.

The step sums are ``[loss, ce, l1, confidence, accept_sum[G], accept_count[G], tau_sum,
block_count]`` (float64), the columns of ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse

import torch

from .eagle3 import eagle3_ttt_loss
from .forward import build_eval_mask, position_weights, training_forward
from .loss import block_metrics, draft_loss, loss_coefficients

__all__ = ["DSparkObjective", "TTTObjective", "TRAINING_LOSSES"]


class DSparkObjective:
    """Block drafts (DSpark, DFlash): the anchor-parallel forward and DeepSpec's DSpark loss
    (:func:`dspark_ops.train.draft_loss`), its denominators summed over ranks."""

    def __init__(self, draft, args: argparse.Namespace):
        self.coefficients = loss_coefficients(draft, args.ce_weight, args.l1_weight,
                                              args.confidence_weight)
        self.loss_decay_gamma = args.loss_decay_gamma
        self.loss_kwargs = {"loss_decay_gamma": args.loss_decay_gamma,
                            "ce_weight": self.coefficients[0], "l1_weight": self.coefficients[1],
                            "confidence_weight": self.coefficients[2]}
        if args.loss_impl == "reference":
            from .. import reference

            self.loss_kwargs["loss_fn"] = reference.dspark_loss

    def forward(self, draft, input_ids, features, loss_mask, last_hidden, anchors, keep,
                denominators, valid=None):
        """The loss output, eval mask, block keep mask and confidence logits of one batch."""
        batch = training_forward(draft, input_ids, features, loss_mask, last_hidden,
                                 anchor_positions=anchors, block_keep_mask=keep)
        out = draft_loss(draft, batch, denominators=denominators, **self.loss_kwargs)
        return out, batch.eval_mask, batch.block_keep_mask, batch.confidence_logits

    def denominators(self, data: dict, block_size: int, dist):
        """DeepSpec's denominators: sum(w) of this micro-step over all ranks (the weights are
        known before the forward: the eval mask follows from the anchors and the loss mask)."""
        weights = position_weights(build_eval_mask(data["loss_mask"], data["anchor_positions"],
                                                   data["block_keep_mask"], block_size),
                                   self.loss_decay_gamma).sum().double()
        return dist.all_reduce(weights.repeat(3)) + 1e-6

    @staticmethod
    def loss(result) -> torch.Tensor:
        return result[0].loss

    def sums(self, result, grad_accum: int) -> torch.Tensor:
        out, eval_mask, keep, _ = result
        batch = argparse.Namespace(eval_mask=eval_mask, block_keep_mask=keep)
        metrics = block_metrics(out.accept_rate, batch)
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
    def forward(draft, input_ids, features, loss_mask, last_hidden, anchors, keep, denominators,
                valid=None):
        return eagle3_ttt_loss(draft, input_ids, features, loss_mask, last_hidden, valid)

    @staticmethod
    def denominators(data: dict, block_size: int, dist):
        return None  # the TTT loss normalises by its own rows

    @staticmethod
    def loss(result) -> torch.Tensor:
        return result.loss

    @staticmethod
    def sums(result, grad_accum: int) -> torch.Tensor:
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
