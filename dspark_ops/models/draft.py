"""The DSpark draft model: the parallel backbone of :mod:`dspark_ops.models.backbone` plus the shared
(frozen) token embedding and LM head, the Markov head and the confidence head.

:class:`DSparkDraft` holds the Markov head (``markov_head.markov_w1`` / ``markov_w2``, optionally
the RNN head's ``joint_proj``) and the confidence head (``confidence_head.proj``). With
``markov_rank = 0`` and no confidence head it is a DFlash draft (the same backbone; the base
logits are the proposal, sampled by :func:`sample_base_logits`). Parameter names and shapes are
those of DeepSpec's Qwen3 DSpark and DFlash drafts, so such a checkpoint loads with
``load_state_dict(strict=True)``; :meth:`DSparkDraft.from_pretrained` reads a local directory
holding ``config.json`` (:class:`~dspark_ops.models.config.DSparkConfig`) and the weights
(:mod:`~dspark_ops.models.checkpoint`), and :meth:`DSparkDraft.save_pretrained` writes one that
DeepSpec's own loader reads.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .backbone import DraftBackbone
from ..ops.draft import DraftOutput, draft_confidence, markov_draft, rnn_draft
from .checkpoint import load_state_dict_file, save_safetensors, weights_file
from .config import DSparkConfig
from .vocab import DraftVocabulary

if TYPE_CHECKING:
    from .target import TinyTarget

__all__ = ["ConfidenceHead", "DSparkDraft", "MarkovHead", "sample_base_logits"]


class MarkovHead(nn.Module):
    """``markov_w1`` (``Embedding(V, r)``), ``markov_w2`` (``Linear(r, V)``) and, for the RNN
    head, ``joint_proj`` (``Linear(2r + d, 3r)``)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.vocab_size, bias=False)
        self.is_rnn = config.markov_head_type == "rnn"
        if self.is_rnn:
            self.joint_proj = nn.Linear(2 * rank + config.hidden_size, 3 * rank)
        elif config.markov_head_type != "vanilla":
            raise ValueError(f"unsupported markov_head_type {config.markov_head_type!r}; "
                             "this library implements 'vanilla' and 'rnn'")

    def sample(self, base_logits, anchor, hidden, temperature, seed, position, *, w1=None,
               w2=None, **filters):
        """The block's tokens and draft logits: :func:`markov_draft` or :func:`rnn_draft`
        (``filters``: their ``top_k`` / ``top_p`` / ``min_p``). ``w1`` / ``w2`` replace the
        head's own rows (a draft vocabulary's, :mod:`~dspark_ops.models.vocab`)."""
        w1 = self.markov_w1.weight if w1 is None else w1
        w2 = self.markov_w2.weight if w2 is None else w2
        if self.is_rnn:
            return rnn_draft(base_logits, anchor, hidden.to(w1.dtype), w1, w2,
                             self.joint_proj.weight, self.joint_proj.bias, temperature, seed,
                             position, **filters)
        return markov_draft(base_logits, anchor, w1, w2, temperature, seed, position, **filters)


class ConfidenceHead(nn.Module):
    """DeepSpec's ``AcceptRatePredictor``: ``proj = Linear(d [+ r], 1)``, a logit per slot."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


def sample_base_logits(base_logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                       position: torch.Tensor, top_k: Optional[torch.Tensor] = None,
                       top_p: Optional[torch.Tensor] = None,
                       min_p: Optional[torch.Tensor] = None) -> DraftOutput:
    """Drafts sampled from the base logits alone (a DFlash draft: no sequential head).

    :func:`dspark_ops.markov_draft` with a zero head (``W1 = W2 = 0``, rank 1): its bias is an
    exact zero, so ``z_j`` is the base logits and the drafts follow markov_draft's rule and
    random stream (the draft stream of position ``p0 + 1 + j``), its sampling filters and its
    handling of non-finite logits.

    Returns
    -------
    DraftOutput
        ``tokens`` int64 ``[B, G]`` and ``draft_logits``: ``base_logits`` as float32, -inf
        where a filter drops a token.
    """
    batch, _, vocab = base_logits.shape
    zero_head = base_logits.new_zeros((vocab, 1), dtype=torch.float32)
    anchor = torch.zeros(batch, dtype=torch.int64, device=base_logits.device)  # W1[0] = 0
    return markov_draft(base_logits, anchor, zero_head, zero_head, temperature, seed, position,
                        top_k=top_k, top_p=top_p, min_p=min_p)


class DSparkDraft(DraftBackbone):
    """The DSpark draft model: backbone, shared embedding and LM head, Markov and confidence heads.

    Parameters
    ----------
    config : DSparkConfig

    Notes
    -----
    ``embed_tokens`` and ``lm_head`` are the target's (DSpark trains with them frozen); copy them
    in with :meth:`share_target_embeddings` or load them from the checkpoint.
    """

    #: The token-embedding class, built as ``embedding_class(vocab_size, hidden_size)``.
    embedding_class = nn.Embedding

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.embed_tokens = self.embedding_class(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
        #: The :class:`~dspark_ops.models.vocab.DraftVocabulary` decoding drafts from (None: the
        #: whole vocabulary); :meth:`from_pretrained` reads a checkpoint's.
        self.draft_vocabulary = None
        self.confidence_head = None
        if config.enable_confidence_head:
            width = config.hidden_size
            if config.confidence_head_with_markov:
                width += config.markov_rank
            self.confidence_head = ConfidenceHead(width)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: Optional[torch.dtype] = None,
                        device=None) -> "DSparkDraft":
        """Loads a local checkpoint directory (``config.json`` + weights), strictly.

        The weights are ``model.safetensors``, a sharded ``model.safetensors.index.json``,
        ``pytorch_model.bin`` or ``model.pt`` in ``path``. The config is read by
        :meth:`DSparkConfig.from_dict`, which refuses what this library does not implement;
        called on :class:`DSparkDraft` it returns the config's family (a
        :class:`~dspark_ops.models.gemma4.Gemma4DSparkDraft` for a Gemma4 config).
        ``dtype`` defaults to float32 parameters (DeepSpec's drafts are stored in bfloat16).
        """
        with open(os.path.join(path, "config.json")) as f:
            config = DSparkConfig.from_dict(json.load(f))
        if cls is DSparkDraft:  # the family's class: a Gemma4 config builds a Gemma4 draft
            cls = config.draft_class()
        model = cls(config)
        model.load_state_dict(load_state_dict_file(weights_file(path)), strict=True)
        model.draft_vocabulary = DraftVocabulary.load(path)
        return model.to(device=device, dtype=dtype)

    def save_pretrained(self, path: str) -> None:
        """Writes ``config.json`` (:meth:`DSparkConfig.to_dict`, with the parameters' dtype) and
        ``model.safetensors`` to the directory ``path`` (created if needed): the layout
        DeepSpec's ``Qwen3DSparkModel.from_pretrained`` and :meth:`from_pretrained` read. DeepSpec
        reads it only when ``target_hidden_size`` is unset or equals ``hidden_size``."""
        os.makedirs(path, exist_ok=True)
        config = self.config.to_dict()
        config["dtype"] = str(self.fc.weight.dtype).replace("torch.", "")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_safetensors(self.state_dict(), os.path.join(path, "model.safetensors"))
        if self.draft_vocabulary is not None:
            self.draft_vocabulary.save(path)

    def share_target_embeddings(self, target: "TinyTarget") -> None:
        """Copies the target's token embedding and LM head (frozen, as DSpark trains them)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens.weight)
            self.lm_head.weight.copy_(target.lm_head.weight)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block's base logits from its final-normed hidden states:
        ``transform_logits(lm_head(hidden))`` (the sequential head's bias is added to this
        result)."""
        return self.transform_logits(self.lm_head(hidden))

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What a family does to the LM head's logits, elementwise (Gemma4: a soft cap);
        the identity here."""
        return logits

    def block_hidden(self, anchor: torch.Tensor, block_size: int) -> torch.Tensor:
        """Embeddings of the block ``[x0, MASK, ..., MASK]``, ``[B, G, hidden]``."""
        ids = torch.full((anchor.shape[0], block_size), self.config.mask_token_id,
                         dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        return self.embed_tokens(ids)

    def propose(self, base_logits: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor,
                temperature: torch.Tensor, seed: torch.Tensor,
                position: torch.Tensor, *, w1=None, w2=None, **filters) -> DraftOutput:
        """The block's drafts and the logits they were sampled from: the Markov or RNN head, or
        for a DFlash draft (no head) the base logits themselves (:func:`sample_base_logits`);
        ``filters`` are the sampling filters (``top_k``, ``top_p``, ``min_p``) of both, ``w1`` /
        ``w2`` the Markov rows to use instead of the head's (:meth:`MarkovHead.sample`)."""
        if self.markov_head is None:
            return sample_base_logits(base_logits, temperature, seed, position, **filters)
        return self.markov_head.sample(base_logits, anchor, hidden, temperature, seed, position,
                                       w1=w1, w2=w2, **filters)

    def confidence(self, hidden: torch.Tensor, prev_tokens: torch.Tensor,
                   calib_temperature: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`draft_confidence` with this model's heads, float32 ``[B, G]``."""
        proj = self.confidence_head.proj
        weight = proj.weight.reshape(-1)
        if self.markov_head is None:  # a head on h alone, without W1 features to read
            logit = (hidden.double() @ weight.double() + proj.bias.double()).float()
            if calib_temperature is not None:
                logit = logit / calib_temperature
            return torch.sigmoid(logit)
        w1 = self.markov_head.markov_w1.weight
        if not self.config.confidence_head_with_markov:  # no W1 features: zero their weights
            weight = torch.cat([weight, weight.new_zeros(w1.shape[1])])
        return draft_confidence(hidden, prev_tokens, w1, weight, proj.bias, calib_temperature)

