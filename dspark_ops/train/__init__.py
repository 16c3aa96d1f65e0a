"""Training side of a DSpark draft: the teacher-forced, anchor-parallel training forward.

:func:`training_forward` runs a :class:`~dspark_ops.models.DSparkDraft` over many anchor blocks of
a packed sequence at once, as DeepSpec's ``Qwen3DSparkModel.forward`` does, and returns a
:class:`TrainingBatch`: the per-slot hidden states, Markov latents, labels, eval mask, confidence
logits and aligned target hidden states that the DSpark loss consumes.
:func:`position_weights` turns the eval mask into the loss's per-slot weights.
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

__all__ = [
    "ATTENTION_BACKENDS",
    "TrainingBatch",
    "block_attention_mask",
    "build_eval_mask",
    "position_weights",
    "sample_anchor_positions",
    "training_forward",
]
