"""Gemma4 DSpark and DFlash drafts (DeepSpec's ``Gemma4DSparkModel``), read from its
``config.json`` and weights exactly.

A Gemma4 draft is the Qwen3 draft of :mod:`dspark_ops.models.draft` (the same context
projection, block layout, Markov and confidence heads, the same ops) with these differences,
each following DeepSpec's ``deepspec/modeling/dspark/gemma4`` and the Gemma4 classes of
transformers it builds on:

- **head dim** ``global_head_dim`` (512 in the released 12B draft) for every layer, and
  ``num_global_key_value_heads`` K/V heads when ``attention_k_eq_v``;
- **shared K/V** (``attention_k_eq_v``): there is no ``v_proj``; V is the raw ``k_proj`` output
  (before ``k_norm`` and RoPE) through ``v_norm``, an RMS norm *without* a weight;
- **attention scale 1** (not ``D ** -0.5``): ``q_norm``/``k_norm`` already fix the scale;
- **norms**: :class:`GemmaRMSNorm` multiplies by the weight in float32 and casts afterwards (the
  Qwen3 norm casts first), and each layer has four: ``input_layernorm`` before attention,
  ``post_attention_layernorm`` on the attention output, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` around the MLP; the layer output is multiplied by
  ``layer_scalar``, a persistent buffer of the checkpoint;
- **MLP**: GeGLU with the tanh approximation of GELU (``gelu_pytorch_tanh``);
- **embedding** scaled by ``sqrt(hidden_size)`` cast to the weight's dtype (in bfloat16
  ``sqrt(3840) = 61.97`` becomes 62.0), for the anchor and the mask tokens alike;
- **proportional RoPE** of Gemma4's full-attention layers: ``inv_freq[i] = theta ** (-2i / D)``
  for the first ``int(partial_rotary_factor * D // 2)`` frequency pairs and 0 for the rest,
  the exponent over the *full* head dim (transformers' ``proportional`` rope type);
- **soft-capped logits** ``cap * tanh(lm_head(h) / cap)`` (``final_logit_softcapping``), with
  the Markov bias added *after* the cap (:meth:`Gemma4DSparkDraft.base_logits` returns the
  capped logits, which ``markov_draft`` biases).

The block attention runs through :func:`dspark_ops.block_draft_attention` at every head dim its
kernels take (64, 128, 256 and the released draft's 512), reading the caches in place through
:class:`~dspark_ops.models.backbone.ContextCache`; the context K/V are written by
:func:`dspark_ops.append_context_kv`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import nn

from .backbone import DraftAttention, DraftLayer, DraftMLP
from .config import DSparkConfig
from .config_fields import GEMMA4_BLOCK, refuse_tied_embeddings, target_depth
from .draft import DSparkDraft
from .registry import GEMMA4_MODEL_TYPES

__all__ = [
    "Gemma4DSparkConfig",
    "Gemma4DSparkDraft",
    "Gemma4DraftAttention",
    "Gemma4DraftLayer",
    "GemmaRMSNorm",
    "ScaledEmbedding",
    "gemma4_rope",
    "proportional_inv_freq",
    "soft_cap",
]

ROPE_TYPES = ("proportional", "default")


# ------------------------------------------------------------------------------------------------
# Building blocks


class GemmaRMSNorm(nn.Module):
    """Gemma4's RMS norm: ``x * (mean(x**2) + eps) ** -0.5`` in float32, times the weight in
    float32, then cast to the input dtype (transformers' ``Gemma4RMSNorm``; the weight is used as
    it is, not as ``1 + w``). ``with_scale=False``: no weight (Gemma4's ``v_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            out = out * self.weight.float()
        return out.to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Gemma4's token embedding: ``E[ids] * sqrt(hidden_size)``, the scale cast to the weight's
    dtype first (transformers' ``Gemma4TextScaledWordEmbedding``: 62.0 in bfloat16 for 3840)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim**0.5, dtype=torch.float32)
        return super().forward(ids) * scale.to(self.weight.dtype)


def soft_cap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in the logits' dtype; ``cap=None``: the logits unchanged."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def proportional_inv_freq(head_dim: int, theta: float, rotary_fraction: float = 1.0,
                          device=None) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies of transformers' ``proportional`` RoPE:
    ``1 / theta ** (2i / head_dim)`` for ``i < int(rotary_fraction * head_dim // 2)``, zero
    after (those pairs pass through unrotated). The exponent's denominator is the full head dim;
    ``rotary_fraction = 1`` is plain RoPE."""
    angles = int(rotary_fraction * head_dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, device=device,
                                            dtype=torch.int64).float() / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, device=device)])


def gemma4_rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
                rotary_fraction: float) -> torch.Tensor:
    """RoPE with :func:`proportional_inv_freq` at absolute positions, rotate-half layout: dim
    ``i`` pairs with dim ``i + D/2``. ``x [B, S, H, D]``, integer ``positions [B, S]``; the
    rotation runs in float32 and the result has ``x``'s dtype."""
    dim = x.shape[-1]
    inv_freq = proportional_inv_freq(dim, theta, rotary_fraction, device=x.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)[..., None, :]  # [B, S, 1, D]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * angles.cos() + torch.cat([-x2, x1], -1) * angles.sin()).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# The config


def _rope(values: dict) -> Tuple[str, float, float]:
    """(rope type, theta, rotary fraction) of the full-attention layers, from a Gemma4
    ``rope_parameters`` (per layer type, possibly with stray top-level keys) or a flat one."""
    spec = values.get("rope_parameters")
    if spec is None:
        if values.get("rope_theta") is None:
            raise ValueError("config has no 'rope_parameters' (and no 'rope_theta')")
        spec = {"rope_type": "default", "rope_theta": values["rope_theta"]}
    if not isinstance(spec, dict):
        raise ValueError(f"config field 'rope_parameters' must be a mapping, got {spec!r}")
    name = "rope_parameters"
    if "full_attention" in spec:
        # DeepSpec's saved configs may carry stray top-level 'rope_type' / 'rope_theta' keys
        # beside the per-layer-type entries; transformers reads only the entry of the layer
        # type, and so does this.
        spec, name = spec["full_attention"], "rope_parameters.full_attention"
        if not isinstance(spec, dict):
            raise ValueError(f"config field '{name}' must be a mapping, got {spec!r}")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config field '{name}.rope_type' is {kind!r}: the Gemma4 draft "
                         f"implements {ROPE_TYPES}")
    for key in sorted(set(spec) - {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                                    "factor"}):
        raise ValueError(f"config field '{name}.{key}' is not supported")
    if float(spec.get("factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"config field '{name}.factor' is {spec['factor']}: only 1.0 is "
                         "implemented")
    theta = spec.get("rope_theta")
    if theta is None:
        raise ValueError(f"config field '{name}.rope_theta' is missing")
    fraction = float(spec.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    if kind == "default" and "partial_rotary_factor" in spec:
        raise ValueError(f"config field '{name}.partial_rotary_factor' needs rope_type "
                         "'proportional'")
    return kind, float(theta), fraction


@dataclasses.dataclass
class Gemma4DSparkConfig(DSparkConfig):
    """:class:`DSparkConfig` of a Gemma4 draft. ``head_dim`` and ``num_key_value_heads`` are the
    values the draft layers use (DeepSpec's ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads``).

    Attributes
    ----------
    attention_k_eq_v : bool
        No ``v_proj``: V is the raw ``k_proj`` output through the weightless ``v_norm``.
    final_logit_softcapping : float, optional
        ``cap`` of ``cap * tanh(z / cap)`` on the base logits (30 in Gemma4); None: no cap.
    rope_type : str
        ``"proportional"`` (Gemma4's full-attention layers) or ``"default"``.
    partial_rotary_factor : float
        Fraction of the frequency pairs that rotate (0.25 in Gemma4); 1 for ``"default"``.
    sliding_head_dim, sliding_num_key_value_heads : int, optional
        The target's sliding-layer ``head_dim`` / ``num_key_value_heads`` the config also
        carries (unused by the draft, whose layers are all full attention); kept so a saved
        config round-trips.
    """

    vocab_size: int = 262144
    mask_token_id: int = 4
    head_dim: int = 512
    rms_norm_eps: float = 1e-6
    attention_k_eq_v: bool = True
    final_logit_softcapping: Optional[float] = 30.0
    rope_type: str = "proportional"
    partial_rotary_factor: float = 0.25
    sliding_head_dim: Optional[int] = None
    sliding_num_key_value_heads: Optional[int] = None
    max_position_embeddings: int = 131072

    def __post_init__(self):
        super().__post_init__()
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"config field 'rope_type' is {self.rope_type!r}: the Gemma4 draft "
                             f"implements {ROPE_TYPES}")
        if not 0.0 <= self.partial_rotary_factor <= 1.0:
            raise ValueError("config field 'partial_rotary_factor' must be in [0, 1], got "
                             f"{self.partial_rotary_factor}")
        if self.sliding_window is not None:
            raise ValueError("Gemma4 draft layers are all full attention: sliding_window must be "
                             "None")

    @classmethod
    def from_dict(cls, values: dict) -> "Gemma4DSparkConfig":
        """Reads DeepSpec's Gemma4 draft ``config.json`` (a copy of the target's Gemma4 text
        config plus the draft's fields), directly from the JSON: transformers 5.17 and later
        move ``global_head_dim`` and ``num_global_key_value_heads`` out of the top level.

        Untidy keys DeepSpec saves are tolerated: a ``head_dim`` beside ``global_head_dim`` (the
        target's sliding-layer dim), a ``sliding_window`` although every draft layer is full
        attention, stray ``rope_type`` / ``rope_theta: null`` keys beside the per-layer-type
        entries of ``rope_parameters``. Refused, naming the field, is what would change the
        math: a draft layer that is not full attention, MoE blocks (``enable_moe_block``),
        per-layer inputs (``hidden_size_per_layer_input``), double-wide MLPs of KV-shared layers,
        an activation other than ``gelu_pytorch_tanh``, a rope type other than ``proportional``
        or ``default``, tied embeddings, attention-logit soft-capping, an architecture other
        than ``Gemma4DSparkModel``.
        """
        values = dict(values)
        GEMMA4_BLOCK.refuse_missing(values)
        model_type = values.get("model_type")
        if model_type not in GEMMA4_MODEL_TYPES:
            raise ValueError(f"config field 'model_type' is {model_type!r}: a Gemma4 draft has "
                             f"one of {GEMMA4_MODEL_TYPES}")
        architectures = values.get("architectures") or ["Gemma4DSparkModel"]
        if list(architectures) != ["Gemma4DSparkModel"]:
            raise ValueError(f"config field 'architectures' is {architectures}: a Gemma4 draft "
                             "is a 'Gemma4DSparkModel' (DSpark or DFlash)")
        activation = values.get("hidden_activation", values.get("hidden_act",
                                                                 "gelu_pytorch_tanh"))
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"config field 'hidden_activation' is {activation!r}: the Gemma4 "
                             "draft MLP implements 'gelu_pytorch_tanh'")
        if values.get("enable_moe_block"):
            raise ValueError("config field 'enable_moe_block' is true: MoE draft layers are not "
                             "implemented (DeepSpec's Gemma4 draft refuses them too)")
        if values.get("hidden_size_per_layer_input"):
            raise ValueError("config field 'hidden_size_per_layer_input' is "
                             f"{values['hidden_size_per_layer_input']}: per-layer inputs are "
                             "not implemented (DeepSpec's Gemma4 draft refuses them too)")
        if values.get("use_double_wide_mlp") and values.get("num_kv_shared_layers"):
            raise ValueError("config field 'use_double_wide_mlp' is true with "
                             "num_kv_shared_layers > 0: double-wide MLPs are not implemented")
        if values.get("attn_logit_softcapping") is not None:
            raise ValueError("config field 'attn_logit_softcapping' is set: attention-logit "
                             "soft-capping is not implemented")
        refuse_tied_embeddings(values)
        layers = int(values["num_hidden_layers"])
        layer_types = values.get("layer_types") or ["full_attention"] * layers
        if list(layer_types) != ["full_attention"] * layers:
            raise ValueError(f"config field 'layer_types' is {layer_types}: Gemma4 draft layers "
                             "are all 'full_attention'")
        kwargs = GEMMA4_BLOCK.copy(values)
        kind, theta, fraction = _rope(values)
        kwargs.update(rope_theta=theta, rope_type=kind, partial_rotary_factor=fraction)
        k_eq_v = bool(values.get("attention_k_eq_v", False))
        kwargs["attention_k_eq_v"] = k_eq_v
        kwargs["head_dim"] = int(values["global_head_dim"])
        if k_eq_v:
            if values.get("num_global_key_value_heads") is None:
                raise ValueError("config field 'num_global_key_value_heads' is required when "
                                 "attention_k_eq_v is true")
            kwargs["num_key_value_heads"] = int(values["num_global_key_value_heads"])
        kwargs["sliding_head_dim"] = values.get("head_dim")
        kwargs["sliding_num_key_value_heads"] = values["num_key_value_heads"]
        kwargs["final_logit_softcapping"] = values.get("final_logit_softcapping")
        kwargs.update(target_depth(values))
        kwargs.update(DSparkConfig._head_fields(values))
        GEMMA4_BLOCK.warn_unknown(values, "Gemma4DSparkConfig")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The config as DeepSpec writes a Gemma4 draft's: a Gemma4 text config (``head_dim``
        the sliding layers', ``global_head_dim`` the draft's) plus the draft's fields."""
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "proportional":
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        values = {
            "architectures": ["Gemma4DSparkModel"],
            "model_type": "gemma4_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": (self.sliding_num_key_value_heads
                                    if self.sliding_num_key_value_heads is not None
                                    else self.num_key_value_heads),
            "num_global_key_value_heads": self.num_key_value_heads,
            "head_dim": self.sliding_head_dim or self.head_dim,
            "global_head_dim": self.head_dim,
            "attention_k_eq_v": self.attention_k_eq_v,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"full_attention": rope},
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "final_logit_softcapping": self.final_logit_softcapping,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "enable_moe_block": False,
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "use_double_wide_mlp": False,
            "tie_word_embeddings": False,
            "use_cache": True,
        }
        values.update(self._draft_fields())
        return values


# ------------------------------------------------------------------------------------------------
# The draft


class Gemma4DraftAttention(DraftAttention):
    """Gemma4 draft attention (DeepSpec's Gemma4 DSpark attention): head dim and K/V heads of
    the config (the global ones), per-head ``q_norm``/``k_norm`` with weights and a weightless
    ``v_norm``, no ``v_proj`` with ``attention_k_eq_v`` (V is the raw ``k_proj`` output), RoPE
    of :func:`gemma4_rope` on q and k only, scale 1."""

    def __init__(self, config: Gemma4DSparkConfig):
        nn.Module.__init__(self)
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.rope_theta = config.rope_theta
        self.rotary_fraction = config.partial_rotary_factor
        self.sliding_window = None
        self.scaling = 1.0
        bias, hidden = config.attention_bias, config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = (None if config.attention_k_eq_v
                       else nn.Linear(hidden, self.num_kv_heads * d, bias=bias))
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(d, config.rms_norm_eps, with_scale=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return gemma4_rope(x, positions, self.rope_theta, self.rotary_fraction)

    def key_value(self, hidden: torch.Tensor,
                  positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        raw = self._heads(self.k_proj(hidden), self.num_kv_heads)
        v_raw = raw if self.v_proj is None else self._heads(self.v_proj(hidden),
                                                            self.num_kv_heads)
        return self._rope(self.k_norm(raw), positions), self.v_norm(v_raw)

    def query(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._rope(self.q_norm(self._heads(self.q_proj(hidden), self.num_heads)),
                          positions)


class Gemma4DraftMLP(DraftMLP):
    """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = nn.functional.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class Gemma4DraftLayer(DraftLayer):
    """A Gemma4 draft decoder layer: ``h += post_attention_layernorm(attn(input_layernorm(h)))``,
    ``h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``, ``h *= layer_scalar``.
    The context enters through the K/V cache as in :class:`~dspark_ops.models.backbone.DraftLayer`."""

    def __init__(self, config: Gemma4DSparkConfig, layer_index: int = 0):
        nn.Module.__init__(self)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4DraftAttention(config)
        self.mlp = Gemma4DraftMLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # persistent: in the checkpoint

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = hidden + self.post_attention_layernorm(attended)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar.to(h.dtype)


class Gemma4DSparkDraft(DSparkDraft):
    """DeepSpec's Gemma4 DSpark draft (``Gemma4DSparkModel``), or its DFlash twin (the same model
    with ``markov_rank = 0`` and no confidence head).

    Parameter names and shapes are DeepSpec's: those of :class:`DSparkDraft` without
    ``self_attn.v_proj`` when ``attention_k_eq_v``, with four norms and a ``layer_scalar``
    buffer per layer. Build it from a :class:`Gemma4DSparkConfig`, or load a checkpoint with
    :meth:`DSparkDraft.from_pretrained` (which picks this class from the config).
    """

    norm_class = GemmaRMSNorm
    layer_class = Gemma4DraftLayer
    embedding_class = ScaledEmbedding

    def __init__(self, config: Gemma4DSparkConfig):
        if not isinstance(config, Gemma4DSparkConfig):
            raise TypeError(f"config must be a Gemma4DSparkConfig, got {type(config).__name__}")
        super().__init__(config)

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` (``final_logit_softcapping``); the Markov bias is added
        to this, after the cap, as DeepSpec does."""
        return soft_cap(logits, self.config.final_logit_softcapping)
