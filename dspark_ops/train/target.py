"""The target in the training process (online training): its features for the draft, computed
on every micro-batch under ``torch.no_grad``, with :class:`dspark_ops.hf.HFTarget`'s hooks.

DeepSpec builds an offline cache of the same two tensors; here the target runs beside the draft
instead (as DeepSpec's pull request #23 proposes), so nothing is written to disk:

- ``target_features [B, L, n * H]``: the outputs of the ``target_layer_ids`` layers (``-1`` the
  embedding output), concatenated in that order, read by the hooks ``HFTarget`` registers;
- ``target_last_hidden [B, L, H]``: the backbone's ``last_hidden_state``, after the final norm,
  whose image by the LM head is the target's logits.

Only the backbone (``model.get_decoder()``) runs: the ``[B, L, V]`` logits are never made.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ..hf import HFTarget

__all__ = ["OnlineTarget"]


class OnlineTarget:
    """Feature extraction from a transformers causal LM for training.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The target, loaded with ``attn_implementation="sdpa"`` or ``"eager"``; frozen and put in
        eval mode.
    feature_layers : sequence of int
        The draft's ``target_layer_ids``.
    """

    def __init__(self, model, feature_layers: Sequence[int]):
        model.requires_grad_(False)
        self.hf = HFTarget(model, feature_layers)  # checks the layers and hooks them
        self.model = self.hf.model
        self.backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, valid: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Features of a right-padded batch.

        Parameters
        ----------
        input_ids : torch.Tensor
            int64 ``[B, L]``.
        valid : torch.Tensor
            bool ``[B, L]``: the real tokens (a prefix of each row).

        Returns
        -------
        target_features : torch.Tensor
            ``[B, L, n * H]``, zero on padding.
        target_last_hidden : torch.Tensor
            ``[B, L, H]``, zero on padding.
        """
        # The same hooks as decoding, around a plain causal forward of the backbone.
        out, features = self.hf.capture_features(
            lambda: self.backbone(input_ids=input_ids, attention_mask=valid.long(),
                                  use_cache=False))
        keep = valid[..., None]
        zero = features.new_zeros(())
        return torch.where(keep, features, zero), torch.where(keep, out.last_hidden_state, zero)

    def close(self) -> None:
        """Removes the hooks."""
        self.hf.close()
