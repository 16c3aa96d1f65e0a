""":class:`DSparkConfig`: the configuration of a DSpark or DFlash draft, read from and written to
DeepSpec's ``config.json`` (transformers 4.x and 5.x layouts). Whatever this library does not
implement is refused with an error naming the field."""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import registry
from .backbone import DraftConfig
from .config_fields import (
    QWEN3_BLOCK, head_dim_of, refuse_non_silu, refuse_sliding_window, refuse_tied_embeddings,
    target_depth,
)
from .registry import GEMMA4_MODEL_TYPES

__all__ = ["DSparkConfig", "MARKOV_HEAD_TYPES", "rope_theta_of"]


MARKOV_HEAD_TYPES = ("vanilla", "rnn")


def rope_theta_of(values: dict) -> float:
    """The RoPE base from either layout: transformers 5.x ``rope_parameters`` or 4.x
    ``rope_theta`` (+ ``rope_scaling``). Only plain (``"default"``) RoPE is implemented."""
    theta = values.get("rope_theta")
    for field in ("rope_parameters", "rope_scaling"):
        spec = values.get(field)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ValueError(f"config field {field!r} must be a mapping, got {spec!r}")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(f"config field '{field}.rope_type' is {kind!r}: only 'default' RoPE "
                             "is implemented (no RoPE scaling)")
        for key in sorted(set(spec) - {"rope_type", "type", "rope_theta"}):
            raise ValueError(f"config field '{field}.{key}' is not supported (only plain RoPE "
                             "with a base 'rope_theta' is implemented)")
        if "rope_theta" in spec:
            if theta is not None and float(theta) != float(spec["rope_theta"]):
                raise ValueError(f"config fields 'rope_theta' ({theta}) and "
                                 f"'{field}.rope_theta' ({spec['rope_theta']}) disagree")
            theta = spec["rope_theta"]
    if theta is None:
        raise ValueError("config has no RoPE base: neither 'rope_parameters.rope_theta' "
                         "(transformers 5.x) nor 'rope_theta' (4.x)")
    return float(theta)


@dataclasses.dataclass
class DSparkConfig(DraftConfig):
    """:class:`DraftConfig` plus the fields of DeepSpec's DSpark and DFlash draft configs.

    Attributes
    ----------
    vocab_size : int
    block_size : int
        ``G``: block slots per round (7 in the paper's drafts).
    mask_token_id : int
        Id embedded in slots ``1 .. G-1`` (151669 for Qwen3).
    markov_rank : int
        ``r`` (256 in every released DSpark draft); 0 for a DFlash draft (no sequential head:
        the base logits are the proposal).
    markov_head_type : str
        ``"vanilla"`` (the Markov head) or ``"rnn"``; ignored when ``markov_rank = 0``.
    enable_confidence_head : bool
    confidence_head_with_markov : bool
        The confidence head reads ``[h; W1[x]]`` (True) or ``h`` only.
    num_anchors : int
        Training only (anchors per sequence); kept so a saved config round-trips.
    target_num_hidden_layers : int, optional
        Layers of the target the draft was trained on, DeepSpec's ``num_target_layers``
        (``target_layer_ids`` must be below it).
    max_position_embeddings : int
        Informational (RoPE has no table); kept so a saved config round-trips.
    """

    vocab_size: int = 151936
    block_size: int = 7
    mask_token_id: int = 151669
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512
    target_num_hidden_layers: Optional[int] = None
    max_position_embeddings: int = 40960

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        ids = self.target_layer_ids
        if not ids or any(i < -1 for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(f"config field 'target_layer_ids' must be a non-empty, strictly "
                             f"increasing list of ids >= -1 (-1: the embedding output), got {ids}")
        depth = self.target_num_hidden_layers
        if depth is not None and ids[-1] >= depth:
            raise ValueError(f"config field 'target_layer_ids' {ids} names a layer past "
                             f"num_target_layers = {depth}")
        if self.block_size < 1:
            raise ValueError(f"config field 'block_size' must be >= 1, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"config field 'markov_rank' must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"config field 'markov_head_type' is {self.markov_head_type!r}: "
                             f"this library implements {MARKOV_HEAD_TYPES}")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("config field 'confidence_head_with_markov' needs a Markov head "
                             "(markov_rank > 0)")

    def draft_class(self):
        """The draft model class of this config's family (:class:`DSparkDraft` for Qwen3), from
        :mod:`.registry`."""
        return registry.family_of(self).draft_class

    @property
    def is_dflash(self) -> bool:
        """No sequential head: the block's base logits are the proposal."""
        return self.markov_rank == 0

    @classmethod
    def from_dict(cls, values: dict) -> "DSparkConfig":
        """Reads a DeepSpec draft ``config.json`` (transformers 4.x or 5.x layout).

        Raises ``ValueError`` naming the field for anything not implemented here (RoPE scaling,
        sliding-window layers, tied embeddings, an activation other than SiLU, a Markov head
        other than vanilla/rnn, a model other than Qwen3's or Gemma4's) and for missing required
        fields; called on this class, a config of another block family (:mod:`.registry`: a
        Gemma4 ``model_type``) is read by that family's config class;
        fields that do not affect inference (token ids, dtype, training-only settings) are
        dropped, and unknown fields are dropped with a warning.
        """
        values = dict(values)
        if cls is DSparkConfig:
            family_class = registry.family_of_config(values, drafting="block").config_class
            if family_class is not cls:
                return family_class.from_dict(values)
        QWEN3_BLOCK.refuse_missing(values, null_is_missing=False)
        if values.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"config field 'model_type' is {values['model_type']!r}: only Qwen3 "
                             f"('qwen3') and Gemma4 {GEMMA4_MODEL_TYPES} drafts are "
                             "implemented")
        architectures = values.get("architectures") or ["Qwen3DSparkModel"]
        if list(architectures) != ["Qwen3DSparkModel"]:
            raise ValueError(f"config field 'architectures' is {architectures}: only "
                             "'Qwen3DSparkModel' drafts (DSpark or DFlash) are implemented")
        refuse_non_silu(values)
        refuse_tied_embeddings(values)
        layer_types = values.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config field 'layer_types' is {layer_types}: only "
                             "'full_attention' draft layers are implemented")
        refuse_sliding_window(values)
        if values.get("sliding_window") is not None and "use_sliding_window" not in values:
            raise ValueError("config field 'sliding_window' is set: sliding-window draft layers "
                             "are not implemented")
        kwargs = QWEN3_BLOCK.copy(values)
        kwargs["rope_theta"] = rope_theta_of(values)
        kwargs.update(target_depth(values))
        kwargs["head_dim"] = head_dim_of(values)
        kwargs.update(DSparkConfig._head_fields(values))
        QWEN3_BLOCK.warn_unknown(values, "DSparkConfig")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The config as DeepSpec writes it: a transformers 5.x ``Qwen3Config`` plus the draft's
        fields (``markov_head_type`` only with a Markov head, ``confidence_head_with_markov``
        only with a confidence head, as DeepSpec's ``build_draft_config``)."""
        if self.sliding_window is not None:
            raise ValueError("sliding_window has no equivalent in DeepSpec's draft config")
        values = {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "tie_word_embeddings": False,
            "use_cache": True,
        }
        values.update(self._draft_fields())
        return values

    @staticmethod
    def _head_fields(values: dict) -> dict:
        """The Markov and confidence heads' fields of ``config.json``, each required when its
        head is on (every draft family reads them alike)."""
        kwargs = {}
        if int(values["markov_rank"]) > 0:
            if "markov_head_type" not in values:
                raise ValueError("config field 'markov_head_type' is required when "
                                 "markov_rank > 0")
            kwargs["markov_head_type"] = values["markov_head_type"]
        if values["enable_confidence_head"]:
            if "confidence_head_with_markov" not in values:
                raise ValueError("config field 'confidence_head_with_markov' is required when "
                                 "enable_confidence_head is true")
            kwargs["confidence_head_with_markov"] = bool(values["confidence_head_with_markov"])
        return kwargs

    def _draft_fields(self) -> dict:
        """The DSpark fields of ``config.json`` every draft family writes after its own."""
        values = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "num_anchors": self.num_anchors,
            "enable_confidence_head": self.enable_confidence_head,
            "markov_rank": self.markov_rank,
        }
        if self.target_num_hidden_layers is not None:
            values["num_target_layers"] = self.target_num_hidden_layers
        if self.target_hidden_size not in (None, self.hidden_size):
            values["target_hidden_size"] = self.target_hidden_size  # not a DeepSpec field
        if self.markov_rank > 0:
            values["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            values["confidence_head_with_markov"] = self.confidence_head_with_markov
        return values

