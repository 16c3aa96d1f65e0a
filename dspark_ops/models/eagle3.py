"""Eagle3 drafts as DeepSpec trains them (``Qwen3Eagle3Model``, ``Gemma4Eagle3Model``), read from
its ``config.json`` and weights exactly, and run as a chain of single-token steps.

The draft is **one** decoder layer over ``[input_layernorm(embed(token)) ; hidden_norm(h)]``
(width ``2 * hidden``), where ``h`` is either ``fc`` of the target's features (the
concatenated outputs of the configured target layers, ``-1`` not allowed) or the draft's own
previous output:

- attention: ``q/k/v_proj`` from the ``2 * hidden`` input, per-head ``q_norm``/``k_norm``, RoPE,
  causal over the draft's own K/V cache of the whole sequence (not only a block);
- residual: the *un-normed* ``h``; then ``post_attention_layernorm``, the MLP and its residual
  (Gemma4: the sandwich norms, ``layer_scalar``, GeGLU, scale 1, shared K/V through the
  weightless ``v_norm``, proportional RoPE and the scaled embedding of
  :mod:`dspark_ops.models.gemma4`);
- logits: ``lm_head(norm(h))`` over the full vocabulary (Gemma4: soft-capped). The layer returns
  the pre-norm ``h``, which the next step takes as its hidden input.

Positions pair as DeepSpec's training does: the cache row at position ``i`` is built from the
target features of token ``i`` and the token ``i + 1``, with RoPE at ``i``. A round drafts a
chain: from the last committed row's output, ``logits -> sample d_1``, one single-token step at
the anchor's position with ``(h, d_1)``, ``logits -> d_2``, ... (``G - 1`` steps for ``G``
drafts); after verification the speculative rows are dropped (the committed length is not
advanced past them) and the target features of the anchor and the accepted drafts are appended,
paired with the committed tokens (:meth:`Eagle3Draft.extend`).

Attention reads and writes the cache with :func:`dspark_ops.append_context_kv` and a float32
PyTorch attention over it (:func:`cache_attention`); ``block_draft_attention`` does not fit a
causal chain step over a growing cache of its own rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Optional, Tuple

import torch
from torch import nn

from .backbone import DraftMLP, RMSNorm, apply_rope
from ..ops.attention import append_context_kv
from .checkpoint import load_state_dict_file, save_safetensors, weights_file
from .config import rope_theta_of
from .config_fields import (
    EAGLE3_GEMMA4, EAGLE3_QWEN3, head_dim_of, refuse_non_silu, refuse_sliding_window,
    refuse_tied_embeddings, target_depth,
)
from .registry import GEMMA4_MODEL_TYPES
from .gemma4 import Gemma4DraftMLP, GemmaRMSNorm, ScaledEmbedding, _rope, gemma4_rope, soft_cap

__all__ = ["ChainCache", "Eagle3Config", "Eagle3Draft", "cache_attention"]

ARCHITECTURES = {"qwen3": "Qwen3Eagle3Model", "gemma4": "Gemma4Eagle3Model"}


@dataclasses.dataclass
class Eagle3Config:
    """An Eagle3 draft's configuration (DeepSpec's fields; one decoder layer).

    Attributes
    ----------
    family : str
        ``"qwen3"`` or ``"gemma4"`` (the layer arithmetic of that model family).
    target_layer_ids : tuple of int
        Target layers (>= 0) whose outputs, concatenated, ``fc`` projects (5 in DeepSpec).
    ttt_length : int
        Training-time-test steps, the default drafts per round (7 in DeepSpec).
    step_loss_decay : float
        Training only (0.8 in DeepSpec); kept so a saved config round-trips.
    head_dim, num_key_value_heads : int
        Of the draft layer (Gemma4: the global ones; with ``attention_k_eq_v`` the global K/V
        heads).
    attention_k_eq_v, final_logit_softcapping, rope_type, partial_rotary_factor
        Gemma4 only, as in :class:`~dspark_ops.models.gemma4.Gemma4DSparkConfig`.
    """

    family: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    target_layer_ids: Tuple[int, ...] = (1, 9, 17, 25, 33)
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    target_num_hidden_layers: Optional[int] = None
    max_position_embeddings: int = 40960
    attention_k_eq_v: bool = False
    final_logit_softcapping: Optional[float] = None
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    sliding_head_dim: Optional[int] = None
    sliding_num_key_value_heads: Optional[int] = None

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        ids = self.target_layer_ids
        if self.family not in ARCHITECTURES:
            raise ValueError(f"Eagle3 family {self.family!r}: one of {tuple(ARCHITECTURES)}")
        if not ids or any(i < 0 for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(f"config field 'target_layer_ids' must be a non-empty, strictly "
                             f"increasing list of ids >= 0 (Eagle3 takes no embedding), got "
                             f"{list(ids)}")
        if self.target_num_hidden_layers is not None and ids[-1] >= self.target_num_hidden_layers:
            raise ValueError(f"config field 'target_layer_ids' {list(ids)} names a layer past "
                             f"num_target_layers = {self.target_num_hidden_layers}")
        if self.ttt_length < 1:
            raise ValueError(f"config field 'ttt_length' must be >= 1, got {self.ttt_length}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")

    @property
    def block_size(self) -> int:
        """Drafts per round by default: ``ttt_length``."""
        return self.ttt_length

    # What an Eagle3 draft does not have, under the names DSpark configs use for them.
    num_hidden_layers = 1
    enable_confidence_head = False
    target_hidden_size = None

    @classmethod
    def from_dict(cls, values: dict) -> "Eagle3Config":
        """Reads DeepSpec's Eagle3 draft ``config.json`` (a copy of the target's config plus
        ``target_layer_ids``, ``ttt_length``, ``step_loss_decay``, ``draft_num_hidden_layers``).
        Refused, naming the field: more than one draft layer (DeepSpec's evaluator refuses it
        too), what the Qwen3 or Gemma4 DSpark configs refuse (RoPE scaling, other activations,
        MoE blocks, per-layer inputs, tied embeddings)."""
        values = dict(values)
        model_type = values.get("model_type", "qwen3")
        family = "gemma4" if model_type in GEMMA4_MODEL_TYPES else model_type
        if family not in ARCHITECTURES:
            raise ValueError(f"config field 'model_type' is {model_type!r}: Eagle3 drafts of "
                             f"Qwen3 ('qwen3') and Gemma4 {GEMMA4_MODEL_TYPES} are implemented")
        architectures = values.get("architectures") or [ARCHITECTURES[family]]
        if list(architectures) != [ARCHITECTURES[family]]:
            raise ValueError(f"config field 'architectures' is {architectures}: a {family} "
                             f"Eagle3 draft is a {ARCHITECTURES[family]!r}")
        fields = EAGLE3_GEMMA4 if family == "gemma4" else EAGLE3_QWEN3
        fields.refuse_missing(values)
        for name in ("num_hidden_layers", "draft_num_hidden_layers"):
            if int(values.get(name, 1)) != 1:
                raise ValueError(f"config field '{name}' is {values[name]}: the Eagle3 chain "
                                 "drafter runs one draft layer (as DeepSpec's evaluator)")
        refuse_tied_embeddings(values)
        kwargs = dict(family=family, **fields.copy(values), **target_depth(values))
        if family == "qwen3":
            refuse_non_silu(values)
            refuse_sliding_window(values)
            kwargs["rope_theta"] = rope_theta_of(values)
            kwargs["head_dim"] = head_dim_of(values)
        else:
            from .gemma4 import Gemma4DSparkConfig

            # The Gemma4 refusals (MoE, per-layer inputs, activation, rope) are the DSpark
            # draft's: check them on a copy shaped like a DSpark config.
            probe = dict(values, architectures=["Gemma4DSparkModel"], block_size=1,
                         mask_token_id=0, markov_rank=0, enable_confidence_head=False,
                         layer_types=None, target_layer_ids=[0])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gemma = Gemma4DSparkConfig.from_dict(probe)
            kind, theta, fraction = _rope(values)
            kwargs.update(rope_theta=theta, rope_type=kind, partial_rotary_factor=fraction,
                          head_dim=gemma.head_dim, num_key_value_heads=gemma.num_key_value_heads,
                          attention_k_eq_v=gemma.attention_k_eq_v,
                          final_logit_softcapping=gemma.final_logit_softcapping,
                          sliding_head_dim=gemma.sliding_head_dim,
                          sliding_num_key_value_heads=gemma.sliding_num_key_value_heads)
        fields.warn_unknown(values, "Eagle3Config")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The config as DeepSpec writes an Eagle3 draft's."""
        values = {
            "architectures": [ARCHITECTURES[self.family]],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "draft_num_hidden_layers": 1, "num_attention_heads": self.num_attention_heads,
            "rms_norm_eps": self.rms_norm_eps, "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "target_layer_ids": list(self.target_layer_ids), "ttt_length": self.ttt_length,
            "step_loss_decay": self.step_loss_decay, "tie_word_embeddings": False,
            "layer_types": ["full_attention"],
        }
        if self.target_num_hidden_layers is not None:
            values["num_target_layers"] = self.target_num_hidden_layers
        if self.family == "qwen3":
            values.update(model_type="qwen3", hidden_act="silu", head_dim=self.head_dim,
                          num_key_value_heads=self.num_key_value_heads,
                          rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        else:
            rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
            if self.rope_type == "proportional":
                rope["partial_rotary_factor"] = self.partial_rotary_factor
            values.update(
                model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh",
                head_dim=self.sliding_head_dim or self.head_dim, global_head_dim=self.head_dim,
                num_key_value_heads=(self.sliding_num_key_value_heads
                                     if self.sliding_num_key_value_heads is not None
                                     else self.num_key_value_heads),
                num_global_key_value_heads=self.num_key_value_heads,
                attention_k_eq_v=self.attention_k_eq_v,
                final_logit_softcapping=self.final_logit_softcapping,
                rope_parameters={"full_attention": rope}, enable_moe_block=False,
                hidden_size_per_layer_input=0)
        return values


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    visible_end: torch.Tensor, scale: float) -> torch.Tensor:
    """Query row ``t`` of request ``b`` attends to cache rows ``[0, visible_end[b, t])``, in
    float32. ``q [B, T, Hq, D]``, caches ``[B, L, Hkv, D]``, integer ``visible_end [B, T]``;
    returns ``[B, T, Hq, D]`` in ``q``'s dtype."""
    heads, kv_heads = q.shape[2], k_cache.shape[2]
    keys = k_cache.float().repeat_interleave(heads // kv_heads, dim=2)
    values = v_cache.float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), keys) * scale
    slot = torch.arange(k_cache.shape[1], device=q.device)
    visible = slot[None, None, :] < visible_end[:, :, None]  # [B, T, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhtl,blhd->bthd", torch.softmax(scores, -1), values).to(q.dtype)


class Eagle3Attention(nn.Module):
    """The Eagle3 layer's attention over its ``2 * hidden`` input (names as DeepSpec's)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        gemma = config.family == "gemma4"
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.config = config
        self.scaling = 1.0 if gemma else d**-0.5
        bias, width = config.attention_bias, 2 * config.hidden_size
        norm = GemmaRMSNorm if gemma else RMSNorm
        self.q_proj = nn.Linear(width, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * d, bias=bias)
        self.v_proj = (None if gemma and config.attention_k_eq_v
                       else nn.Linear(width, self.num_kv_heads * d, bias=bias))
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=bias)
        self.q_norm = norm(d, config.rms_norm_eps)
        self.k_norm = norm(d, config.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(d, config.rms_norm_eps, with_scale=False) if gemma else None

    def _rope(self, x, positions):
        c = self.config
        if c.family == "gemma4":
            return gemma4_rope(x, positions, c.rope_theta, c.partial_rotary_factor)
        return apply_rope(x, positions, c.rope_theta)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """``q [B, T, Hq, D]``, ``k``, ``v [B, T, Hkv, D]`` of rows ``x [B, T, 2 * hidden]`` at
        ``positions [B, T]`` (norms and RoPE applied)."""
        batch, length = x.shape[:2]
        q = self._rope(self.q_norm(self.q_proj(x).view(batch, length, -1, self.head_dim)),
                       positions)
        raw = self.k_proj(x).view(batch, length, -1, self.head_dim)
        v = raw if self.v_proj is None else self.v_proj(x).view(batch, length, -1, self.head_dim)
        if self.v_norm is not None:
            v = self.v_norm(v)
        return q, self._rope(self.k_norm(raw), positions), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, over) -> torch.Tensor:
        """Rows ``x [B, T, 2 * hidden]`` at ``positions [B, T]`` attending over ``over`` (a
        :class:`ChainCache` at inference; the training-time test's keys in training), after
        ``o_proj``: ``[B, T, hidden]``. ``over.attend(attn, q, k, v)`` gets this module, the
        rows' queries ``[B, T, Hq, D]``, keys and values ``[B, T, Hkv, D]``."""
        batch, length = x.shape[:2]
        q, k, v = self.project(x, positions)
        out = over.attend(self, q, k, v)
        return self.o_proj(out.reshape(batch, length, -1).to(x.dtype))


class ChainCache:
    """What Eagle3's rows attend over at inference: the draft's own K/V cache. The rows' K/V
    are written at ``cache_len[b] + t`` (the first ``num_new[b]``), and each row attends to
    the rows before it and itself (``cache_len`` is not advanced: the caller commits)."""

    def __init__(self, num_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_len: torch.Tensor, cache_slot: Optional[torch.Tensor] = None):
        self.num_new, self.k_cache, self.v_cache = num_new, k_cache, v_cache
        self.cache_len, self.cache_slot = cache_len, cache_slot

    def attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_cache, self.v_cache
        append_context_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype),
                          self.num_new, self.cache_len.clone(), cache_slot=self.cache_slot)
        batch, length = q.shape[:2]
        slots = (self.cache_slot.long() if self.cache_slot is not None
                 else torch.arange(batch, device=q.device))
        end = self.cache_len.long()[:, None] + torch.arange(1, length + 1, device=q.device)
        return cache_attention(q, k_cache[slots], v_cache[slots], end, attn.scaling)


class Eagle3Layer(nn.Module):
    """The single Eagle3 decoder layer (``layers.0`` in the checkpoints)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        gemma = config.family == "gemma4"
        norm = GemmaRMSNorm if gemma else RMSNorm
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.gemma = gemma
        self.self_attn = Eagle3Attention(config)
        self.mlp = Gemma4DraftMLP(config) if gemma else DraftMLP(config)
        self.hidden_norm = norm(hidden, eps)
        self.input_layernorm = norm(hidden, eps)
        self.post_attention_layernorm = norm(hidden, eps)
        if gemma:
            self.pre_feedforward_layernorm = norm(hidden, eps)
            self.post_feedforward_layernorm = norm(hidden, eps)
            self.register_buffer("layer_scalar", torch.ones(1))

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[input_layernorm(embeds) ; hidden_norm(hidden)]``, ``[B, T, 2 * hidden]``."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                over) -> torch.Tensor:
        """The layer over rows ``embeds``/``hidden [B, T, hidden]`` at ``positions``, attending
        over ``over`` (:meth:`Eagle3Attention.forward`): the one arithmetic of the layer, for
        inference and the training-time test alike."""
        attended = self.self_attn(self.attention_input(embeds, hidden), positions, over)
        return self.after_attention(hidden, attended)

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual (the un-normed ``hidden``) and the MLP, once the attention output
        (after ``o_proj``) is known."""
        if not self.gemma:
            h = hidden + attended
            return h + self.mlp(self.post_attention_layernorm(h))
        h = hidden + self.post_attention_layernorm(attended)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar.to(h.dtype)


class Eagle3Draft(nn.Module):
    """DeepSpec's Eagle3 draft: ``embed_tokens``, ``fc``, ``layers.0``, ``norm``, ``lm_head``
    (full vocabulary; no Markov or confidence head), parameter names as its checkpoints."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        gemma = config.family == "gemma4"
        self.embed_tokens = (ScaledEmbedding if gemma else nn.Embedding)(config.vocab_size,
                                                                         hidden)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = (GemmaRMSNorm if gemma else RMSNorm)(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.confidence_head = None  # no confidence head: the decoder verifies every draft

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: Optional[torch.dtype] = None,
                        device=None) -> "Eagle3Draft":
        """Loads a local DeepSpec Eagle3 checkpoint directory strictly (weights file names as
        :meth:`dspark_ops.models.DSparkDraft.from_pretrained`)."""
        with open(os.path.join(path, "config.json")) as f:
            config = Eagle3Config.from_dict(json.load(f))
        model = cls(config)
        model.load_state_dict(load_state_dict_file(weights_file(path)), strict=True)
        return model.to(device=device, dtype=dtype)

    def save_pretrained(self, path: str) -> None:
        """Writes ``config.json`` and ``model.safetensors`` (DeepSpec's layout)."""
        os.makedirs(path, exist_ok=True)
        config = self.config.to_dict()
        config["dtype"] = str(self.fc.weight.dtype).replace("torch.", "")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_safetensors(self.state_dict(), os.path.join(path, "model.safetensors"))

    def new_cache(self, num_rows: int, length: int, *, dtype=None, device=None):
        """An empty ``(k, v)`` cache pair, ``[num_rows, length, Hkv, D]`` each."""
        weight = self.fc.weight
        shape = (num_rows, length, self.config.num_key_value_heads, self.config.head_dim)
        kw = dict(dtype=dtype or weight.dtype, device=device or weight.device)
        return torch.zeros(shape, **kw), torch.zeros(shape, **kw)

    def extend(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               num_new: torch.Tensor, cache: Tuple[torch.Tensor, torch.Tensor],
               cache_len: torch.Tensor, *, project: bool,
               cache_slot: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Appends rows to the draft's cache and returns their outputs (pre-norm ``h``).

        Parameters
        ----------
        hidden : torch.Tensor
            ``[B, T, n_layers * hidden]`` target features (``project=True``: through ``fc``)
            or ``[B, T, hidden]`` the draft's own outputs (``project=False``).
        input_ids : torch.Tensor
            ``[B, T]``: the token *after* each row's position (DeepSpec's pairing).
        positions : torch.Tensor
            ``[B, T]``: RoPE positions, ``cache_len[b] + t`` in the chain.
        num_new : torch.Tensor
            int32 ``[B]``: rows of each request that are real (written to the cache).
        cache_len : torch.Tensor
            int32 ``[B]``: committed rows; the new ones land at ``cache_len[b] + t`` and each
            attends to the rows before it and itself. Not advanced here (the caller commits).
        """
        if project:
            hidden = self.fc(hidden)
        k_cache, v_cache = cache
        return self.layers[0](self.embed_tokens(input_ids), hidden, positions,
                              ChainCache(num_new, k_cache, v_cache, cache_len, cache_slot))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(h))``, soft-capped for a Gemma4 draft."""
        return soft_cap(self.lm_head(self.norm(hidden)), self.config.final_logit_softcapping)
