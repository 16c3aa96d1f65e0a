"""The ``config.json`` fields of the draft families, in one table: which each parser requires,
copies into its config as they are, reads itself (checks, converts, renames) and reads and drops;
and the refusals and the unknown-field warning the parsers share. Whatever a parser's table does
not name is dropped with a warning."""

from __future__ import annotations

import dataclasses
import warnings
from typing import FrozenSet, Tuple

__all__ = ["ConfigFields", "EAGLE3_GEMMA4", "EAGLE3_QWEN3", "GEMMA4_BLOCK", "QWEN3_BLOCK",
           "head_dim_of", "refuse_non_silu", "refuse_sliding_window", "refuse_tied_embeddings",
           "target_depth"]


@dataclasses.dataclass(frozen=True)
class ConfigFields:
    """The fields one parser knows.

    Attributes
    ----------
    required : tuple of str
        Refused when absent (named in this order).
    copied : tuple of str
        Copied into the config under the same name when set (not null).
    read : frozenset of str
        Read by the parser's own code: checked, converted or renamed.
    dropped : frozenset of str
        Read and dropped: they do not change what the draft computes.
    """

    required: Tuple[str, ...]
    copied: Tuple[str, ...]
    read: FrozenSet[str]
    dropped: FrozenSet[str]

    def refuse_missing(self, values: dict, null_is_missing: bool = True) -> None:
        """Raises ``ValueError`` listing the required fields ``values`` lacks (with
        ``null_is_missing=False``, a field set to null counts as present)."""
        missing = [name for name in self.required
                   if (values.get(name) is None if null_is_missing else name not in values)]
        if missing:
            raise ValueError(f"config is missing the field(s) {missing}")

    def copy(self, values: dict) -> dict:
        """The copied fields ``values`` sets (not null), as config keyword arguments."""
        return {name: values[name] for name in self.copied if values.get(name) is not None}

    def warn_unknown(self, values: dict, owner: str) -> None:
        """Warns, naming ``owner`` (the config class), about the fields of ``values`` this table
        does not name; the warning points at the caller of ``from_dict``."""
        unknown = sorted(set(values) - set(self.copied) - self.read - self.dropped)
        if unknown:
            warnings.warn(f"{owner}: ignoring config field(s) this library does not read: "
                          f"{unknown}", stacklevel=3)


# Read and dropped by every family: what DeepSpec copies from the target's transformers config
# that does not change what the draft computes at inference.
_NEUTRAL = frozenset({
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    "max_window_layers",  # only meaningful with use_sliding_window, which is refused
    "output_attentions", "output_hidden_states", "return_dict",
    # what every transformers config carries (task heads, encoder-decoder switches)
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",
})

# Read and dropped from a Gemma4 target's config: its sliding layers, per-layer inputs' table,
# MoE sizes and multimodal switches (the draft's layers are full attention, dense, text only).
_GEMMA4_NEUTRAL = _NEUTRAL | {
    "sliding_window", "vocab_size_per_layer_input", "num_experts", "top_k_experts",
    "moe_intermediate_size", "use_bidirectional_attention", "target_model_type",
    "target_text_model_type", "query_pre_attn_scalar", "per_layer_config",
}

# What a Gemma4 parser reads beside the Qwen3 one's fields: the refused switches (MoE, per-layer
# inputs, double-wide MLPs, attention-logit soft-capping), the activation and the global
# attention's shape.
_GEMMA4_READ = frozenset({
    "hidden_activation", "hidden_act", "enable_moe_block", "hidden_size_per_layer_input",
    "use_double_wide_mlp", "num_kv_shared_layers", "attn_logit_softcapping",
    "final_logit_softcapping", "attention_k_eq_v", "global_head_dim",
    "num_global_key_value_heads",
})

_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "target_layer_ids")
_BLOCK = ("block_size", "mask_token_id", "markov_rank", "enable_confidence_head")
_BLOCK_COPIED = _SHAPE + _BLOCK + ("attention_bias", "target_hidden_size", "num_anchors",
                                   "max_position_embeddings")
_BLOCK_READ = frozenset({"model_type", "architectures", "tie_word_embeddings", "layer_types",
                         "rope_theta", "rope_parameters", "head_dim", "markov_head_type",
                         "confidence_head_with_markov", "num_target_layers"})
_EAGLE3_COPIED = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "rms_norm_eps", "attention_bias", "target_layer_ids",
                  "ttt_length", "step_loss_decay", "max_position_embeddings")
_EAGLE3_READ = frozenset({"model_type", "architectures", "num_hidden_layers",
                          "draft_num_hidden_layers", "tie_word_embeddings", "num_target_layers",
                          "target_model_name_or_path", "layer_types", "rope_theta",
                          "rope_parameters", "rope_scaling", "head_dim"})

# DSpark and DFlash block drafts of Qwen3 (models/config.py).
QWEN3_BLOCK = ConfigFields(
    required=_SHAPE + _BLOCK,
    copied=_BLOCK_COPIED,
    read=_BLOCK_READ | {"hidden_act", "use_sliding_window", "sliding_window", "rope_scaling"},
    dropped=_NEUTRAL,
)
# DSpark and DFlash block drafts of Gemma4 (models/gemma4.py).
GEMMA4_BLOCK = ConfigFields(
    required=_SHAPE + _BLOCK + ("global_head_dim",),
    copied=_BLOCK_COPIED,
    read=_BLOCK_READ | _GEMMA4_READ,
    dropped=_GEMMA4_NEUTRAL,
)
# Eagle3 chain drafts (models/eagle3.py), of Qwen3 and of Gemma4.
EAGLE3_QWEN3 = ConfigFields(
    required=_SHAPE + ("ttt_length",),
    copied=_EAGLE3_COPIED,
    read=_EAGLE3_READ | {"hidden_act", "use_sliding_window"},
    dropped=_NEUTRAL | {"sliding_window"},
)
EAGLE3_GEMMA4 = ConfigFields(
    required=_SHAPE + ("ttt_length", "global_head_dim"),
    copied=_EAGLE3_COPIED,
    read=_EAGLE3_READ | _GEMMA4_READ,
    dropped=_GEMMA4_NEUTRAL,
)


# ------------------------------------------------------------------------------------------------
# What several parsers refuse or read alike


def refuse_tied_embeddings(values: dict) -> None:
    """Every family's drafts keep ``lm_head`` apart from the embedding."""
    if values.get("tie_word_embeddings", False):
        raise ValueError("config field 'tie_word_embeddings' is true: DeepSpec drafts keep "
                         "lm_head separate and this loader expects it in the checkpoint")


def refuse_non_silu(values: dict) -> None:
    """A Qwen3 draft's MLP is SwiGLU."""
    if values.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field 'hidden_act' is {values['hidden_act']!r}: the draft "
                         "MLP implements 'silu'")


def refuse_sliding_window(values: dict) -> None:
    """A Qwen3 draft's layers are all full attention."""
    if values.get("use_sliding_window", False):
        raise ValueError("config field 'use_sliding_window' is true: sliding-window draft "
                         "layers are not implemented")


def target_depth(values: dict) -> dict:
    """DeepSpec's ``num_target_layers`` as the config's ``target_num_hidden_layers`` (keyword
    arguments; none when unset)."""
    if values.get("num_target_layers") is None:
        return {}
    return {"target_num_hidden_layers": int(values["num_target_layers"])}


def head_dim_of(values: dict) -> int:
    """``head_dim``, or ``hidden_size / num_attention_heads`` when unset (transformers'
    default)."""
    head_dim = values.get("head_dim")
    return (int(head_dim) if head_dim is not None
            else values["hidden_size"] // values["num_attention_heads"])
