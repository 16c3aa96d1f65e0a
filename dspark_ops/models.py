"""A DSpark draft model and a small causal target model, built from :mod:`dspark_ops.modules`.

:class:`DSparkDraft` is the whole draft of SPEC §1 steps 2-4: the parallel backbone of
:mod:`dspark_ops.modules` plus the shared (frozen) token embedding and LM head, the Markov head
(``markov_head.markov_w1`` / ``markov_w2``, optionally the RNN head's ``joint_proj``) and the
confidence head (``confidence_head.proj``). Parameter names and shapes are those of DeepSpec's
Qwen3 DSpark drafts, so such a checkpoint loads with ``load_state_dict(strict=True)``;
:meth:`DSparkDraft.from_pretrained` reads a local directory holding ``config.json`` and
``model.safetensors`` (or a ``.pt``/``.bin`` state dict) without extra dependencies.

:class:`TinyTarget` is a Qwen3-style causal LM (embedding, decoder layers with per-head q/k
RMSNorm and RoPE, final norm, LM head) with a K/V cache, small enough to run offline on CPU, that
returns the raw outputs of chosen layers as the draft's context features. It takes the ragged
verify batch of :func:`dspark_ops.pack_verify_inputs` directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .modules import DraftAttention, DraftBackbone, DraftConfig, DraftMLP, RMSNorm
from .ops.attention import append_context_kv
from .ops.draft import draft_confidence, markov_draft, rnn_draft

__all__ = [
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraft",
    "MarkovHead",
    "TargetConfig",
    "TinyTarget",
    "load_state_dict_file",
]


def _from_dict(cls, values: dict):
    """A dataclass from a config dict, ignoring keys it does not have (as HF configs carry)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in values.items() if k in names}
    if "target_layer_ids" in kwargs:
        kwargs["target_layer_ids"] = tuple(kwargs["target_layer_ids"])
    return cls(**kwargs)


# ------------------------------------------------------------------------------------------------
# Checkpoint files


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _read_safetensors(path: str) -> dict:
    """The tensors of a ``.safetensors`` file (8-byte header size, JSON header, raw data)."""
    with open(path, "rb") as f:
        data = f.read()
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size])
    base = 8 + header_size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        raw = bytearray(data[base + begin : base + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def load_state_dict_file(path: str) -> dict:
    """A state dict from ``.safetensors`` (read natively) or a ``torch.save`` file."""
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    return torch.load(path, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------------------
# The draft model


@dataclasses.dataclass
class DSparkConfig(DraftConfig):
    """:class:`DraftConfig` plus the fields of DeepSpec's DSpark draft configs.

    Attributes
    ----------
    vocab_size : int
    block_size : int
        ``G``: block slots per round (7 in the paper's drafts).
    mask_token_id : int
        Id embedded in slots ``1 .. G-1`` (151669 for Qwen3).
    markov_rank : int
        ``r`` (256 in every released draft).
    markov_head_type : str
        ``"vanilla"`` (the Markov head) or ``"rnn"``.
    enable_confidence_head : bool
    confidence_head_with_markov : bool
        The confidence head reads ``[h; W1[x]]`` (True) or ``h`` only.
    """

    vocab_size: int = 151936
    block_size: int = 7
    mask_token_id: int = 151669
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    @classmethod
    def from_dict(cls, values: dict) -> "DSparkConfig":
        return _from_dict(cls, values)


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

    def sample(self, base_logits, anchor, hidden, temperature, seed, position):
        """The block's tokens and draft logits: :func:`markov_draft` or :func:`rnn_draft`."""
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
        if self.is_rnn:
            return rnn_draft(base_logits, anchor, hidden.to(w1.dtype), w1, w2,
                             self.joint_proj.weight, self.joint_proj.bias, temperature, seed,
                             position)
        return markov_draft(base_logits, anchor, w1, w2, temperature, seed, position)


class ConfidenceHead(nn.Module):
    """DeepSpec's ``AcceptRatePredictor``: ``proj = Linear(d [+ r], 1)``, a logit per slot."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


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

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
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

        The weights are ``model.safetensors``, ``pytorch_model.bin`` or ``model.pt`` in
        ``path``. The config's fields are those of :class:`DSparkConfig` (unknown keys ignored).
        """
        with open(os.path.join(path, "config.json")) as f:
            config = DSparkConfig.from_dict(json.load(f))
        for name in ("model.safetensors", "pytorch_model.bin", "model.pt"):
            weights = os.path.join(path, name)
            if os.path.exists(weights):
                break
        else:
            raise FileNotFoundError(f"no model.safetensors, pytorch_model.bin or model.pt in {path}")
        model = cls(config)
        model.load_state_dict(load_state_dict_file(weights), strict=True)
        return model.to(device=device, dtype=dtype)

    def share_target_embeddings(self, target: "TinyTarget") -> None:
        """Copies the target's token embedding and LM head (frozen, as DSpark trains them)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens.weight)
            self.lm_head.weight.copy_(target.lm_head.weight)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def block_hidden(self, anchor: torch.Tensor, block_size: int) -> torch.Tensor:
        """Embeddings of the block ``[x0, MASK, ..., MASK]``, ``[B, G, hidden]``."""
        ids = torch.full((anchor.shape[0], block_size), self.config.mask_token_id,
                         dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        return self.embed_tokens(ids)

    def confidence(self, hidden: torch.Tensor, prev_tokens: torch.Tensor,
                   calib_temperature: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`draft_confidence` with this model's heads, float32 ``[B, G]``."""
        proj = self.confidence_head.proj
        weight = proj.weight.reshape(-1)
        w1 = self.markov_head.markov_w1.weight
        if not self.config.confidence_head_with_markov:  # no W1 features: zero their weights
            weight = torch.cat([weight, weight.new_zeros(w1.shape[1])])
        return draft_confidence(hidden, prev_tokens, w1, weight, proj.bias, calib_temperature)


# ------------------------------------------------------------------------------------------------
# The target model


@dataclasses.dataclass
class TargetConfig:
    """Sizes of :class:`TinyTarget` (field names as in Hugging Face's ``Qwen3Config``)."""

    vocab_size: int = 256
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    attention_bias: bool = False
    sliding_window: Optional[int] = None


class TargetAttention(DraftAttention):
    """Causal self-attention over a K/V cache (same projections and norms as the draft's)."""

    def forward(self, hidden, positions, num_valid, k_cache, v_cache, cache_len):
        """``hidden [B, T, hidden]`` at ``positions = cache_len + i``; writes the K/V of the
        ``num_valid[b]`` valid rows at ``cache_len[b] + i`` and attends causally."""
        batch, length = hidden.shape[:2]
        q = self.query(hidden, positions)
        k, v = self.key_value(hidden, positions)
        append_context_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), num_valid,
                          cache_len.clone())
        slots = torch.arange(k_cache.shape[1], device=hidden.device)
        visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, L]: causal over the cache
        keys = k_cache[:batch].transpose(1, 2).repeat_interleave(self.num_heads // self.num_kv_heads, 1)
        values = v_cache[:batch].transpose(1, 2).repeat_interleave(self.num_heads // self.num_kv_heads, 1)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=visible[:, None],
            scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class TargetLayer(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.self_attn = TargetAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, positions, num_valid, k_cache, v_cache, cache_len):
        h = h + self.self_attn(self.input_layernorm(h), positions, num_valid, k_cache, v_cache,
                               cache_len)
        return h + self.mlp(self.post_attention_layernorm(h))


class TinyTarget(nn.Module):
    """A small Qwen3-style causal LM with a K/V cache that exposes chosen layers' outputs.

    Parameters
    ----------
    config : TargetConfig
    feature_layers : sequence of int
        Layers whose raw outputs, concatenated, are the draft's context features (``-1`` is the
        embedding output, ``l`` the output of decoder layer ``l``), as DeepSpec's
        ``target_layer_ids``.
    """

    def __init__(self, config: TargetConfig, feature_layers: Sequence[int] = (-1,)):
        super().__init__()
        self.config = config
        self.feature_layers = tuple(feature_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_cache(self, num_rows: int, length: int) -> Tuple[list, list]:
        """Empty K and V caches, one ``[num_rows, length, Hkv, D]`` pair per layer, in the
        parameters' dtype (float32 for a float64 model: the cache op stores 16/32-bit floats)."""
        weight = self.embed_tokens.weight
        dtype = torch.float32 if weight.dtype == torch.float64 else weight.dtype
        shape = (num_rows, length, self.config.num_key_value_heads, self.config.head_dim)
        return ([weight.new_zeros(shape, dtype=dtype) for _ in self.layers],
                [weight.new_zeros(shape, dtype=dtype) for _ in self.layers])

    def forward(self, input_ids: torch.Tensor, num_valid: torch.Tensor, k_caches, v_caches,
                cache_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Padded forward: request ``b``'s ``num_valid[b]`` tokens ``input_ids[b]`` sit at
        positions ``cache_len[b] + i``; their K/V are written to the cache there (``cache_len``
        itself is not advanced: the caller commits what was accepted).

        Returns ``logits [B, T, V]`` and ``features [B, T, n_layers * hidden]``.
        """
        positions = cache_len.long()[:, None] + torch.arange(input_ids.shape[1],
                                                             device=input_ids.device)
        h = self.embed_tokens(input_ids)
        outputs = {-1: h}
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            h = layer(h, positions, num_valid, k_cache, v_cache, cache_len)
            outputs[i] = h
        features = torch.cat([outputs[i] for i in self.feature_layers], -1)
        return self.lm_head(self.norm(h)), features

    def forward_ragged(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, k_caches,
                       v_caches, cache_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward over a ragged batch (``pack_verify_inputs``'s ``input_ids`` and
        ``cu_seqlens``, at most ``len(input_ids) // B`` tokens per request), without a host
        sync: the rows are gathered into a padded batch and back. Returns ragged ``logits
        [R, V]`` and ``features [R, n_layers * hidden]`` (the padding rows past
        ``cu_seqlens[B]`` repeat real rows; ignore them)."""
        batch = cu_seqlens.shape[0] - 1
        width = input_ids.shape[0] // batch
        starts = cu_seqlens[:-1].long()
        slots = starts[:, None] + torch.arange(width, device=input_ids.device)
        padded = input_ids[slots.clamp_max(input_ids.shape[0] - 1)]  # rows past a request: unused
        num_valid = (cu_seqlens[1:] - cu_seqlens[:-1]).int()
        logits, features = self(padded, num_valid, k_caches, v_caches, cache_len)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        request = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True).clamp_max(batch - 1)
        offset = (rows - starts[request]).clamp(0, width - 1)
        return logits[request, offset], features[request, offset]
