"""Training side of a DSpark draft: the teacher-forced training forward, its loss and the trainer.

:func:`training_forward` runs a :class:`~dspark_ops.models.DSparkDraft` over many anchor blocks of
a packed sequence at once, as DeepSpec's ``Qwen3DSparkModel.forward`` does, and returns a
:class:`TrainingBatch`: the per-slot hidden states, Markov latents, labels, eval mask, confidence
logits and aligned target hidden states that the DSpark loss consumes.
:func:`position_weights` turns the eval mask into the loss's per-slot weights, and
:func:`draft_loss` computes DeepSpec's loss on a batch with the fused
:func:`dspark_ops.dspark_loss`. :func:`eagle3_ttt_loss` is an Eagle3 draft's forward and loss
(DeepSpec's training-time test). ``python -m dspark_ops.train`` is the trainer
(:mod:`dspark_ops.train.trainer`).
"""

from .forward import (
    ATTENTION_BACKENDS,
    TrainingBatch,
    block_attention_mask,
    build_eval_mask,
    position_weights,
    sample_anchor_positions,
    training_forward,
)
from .eagle3 import Eagle3Batch, eagle3_ttt_loss
from .loss import block_metrics, draft_loss, flatten_batch, loss_coefficients, loss_weights

__all__ = [
    "ATTENTION_BACKENDS",
    "Eagle3Batch",
    "TrainingBatch",
    "block_attention_mask",
    "block_metrics",
    "build_eval_mask",
    "draft_loss",
    "eagle3_ttt_loss",
    "flatten_batch",
    "loss_coefficients",
    "loss_weights",
    "position_weights",
    "sample_anchor_positions",
    "training_forward",
]
