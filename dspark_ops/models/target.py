"""A tiny Qwen3-style causal target model, built from :mod:`dspark_ops.models.backbone`.

:class:`TinyTarget` (embedding, decoder layers with per-head q/k RMSNorm and RoPE, final norm, LM
head) has a K/V cache, is small enough to run offline on CPU, and returns the raw outputs of
chosen layers as the draft's context features. It takes the ragged verify batch of
:func:`dspark_ops.pack_verify_inputs` directly (:func:`forward_ragged`, which also serves
:class:`dspark_ops.hf.HFTarget`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .backbone import DraftAttention, DraftMLP, RMSNorm
from ..ops.attention import append_context_kv

__all__ = ["TargetConfig", "TinyTarget", "forward_ragged"]


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

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_rows: int, length: int) -> Tuple[list, list]:
        """An empty cache: K and V lists, one ``[num_rows, length, Hkv, D]`` tensor per layer, in
        the parameters' dtype (float32 for a float64 model: the cache op stores 16/32-bit
        floats). Pass it back to :meth:`forward` as it is."""
        weight = self.embed_tokens.weight
        dtype = torch.float32 if weight.dtype == torch.float64 else weight.dtype
        shape = (num_rows, length, self.config.num_key_value_heads, self.config.head_dim)
        return ([weight.new_zeros(shape, dtype=dtype) for _ in self.layers],
                [weight.new_zeros(shape, dtype=dtype) for _ in self.layers])

    def forward(self, input_ids: torch.Tensor, num_valid: torch.Tensor, cache,
                cache_len: torch.Tensor, logits_at: Optional[Sequence[int]] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Padded forward: request ``b``'s ``num_valid[b]`` tokens ``input_ids[b]`` sit at
        positions ``cache_len[b] + i``; their K/V are written to the cache there. ``cache_len``
        is what the caller has committed: rows written past it by an earlier call (rejected
        drafts) are overwritten, so committing the accepted rows is advancing ``cache_len``.

        Returns ``logits [B, T, V]`` (``[B, 1, V]``, row ``logits_at[b]`` of request ``b``,
        when ``logits_at`` is given: a prefill needs only the last prompt token's) and
        ``features [B, T, n_layers * hidden]``.
        """
        k_caches, v_caches = cache
        positions = cache_len.long()[:, None] + torch.arange(input_ids.shape[1],
                                                             device=input_ids.device)
        h = self.embed_tokens(input_ids)
        outputs = {-1: h}
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            h = layer(h, positions, num_valid, k_cache, v_cache, cache_len)
            outputs[i] = h
        features = torch.cat([outputs[i] for i in self.feature_layers], -1)
        if logits_at is not None:
            rows = torch.arange(h.shape[0], device=h.device)
            h = h[rows, torch.as_tensor(list(logits_at), device=h.device)][:, None]
        return self.lm_head(self.norm(h)), features

    def forward_ragged(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache,
                       cache_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward over a ragged batch (``pack_verify_inputs``'s ``input_ids`` and
        ``cu_seqlens``): :func:`forward_ragged` over :meth:`forward`."""
        return forward_ragged(self, input_ids, cu_seqlens, cache, cache_len)


def forward_ragged(target, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache,
                   cache_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A ragged batch (``pack_verify_inputs``'s ``input_ids`` and ``cu_seqlens``, at most
    ``len(input_ids) // B`` tokens per request) through a target's padded ``forward``, without a
    host sync: the rows are gathered into a padded batch and back. Returns ragged ``logits
    [R, V]`` and ``features [R, n_layers * hidden]`` (the padding rows past ``cu_seqlens[B]``
    repeat real rows; ignore them)."""
    batch = cu_seqlens.shape[0] - 1
    width = input_ids.shape[0] // batch
    starts = cu_seqlens[:-1].long()
    slots = starts[:, None] + torch.arange(width, device=input_ids.device)
    padded = input_ids[slots.clamp_max(input_ids.shape[0] - 1)]  # rows past a request: unused
    num_valid = (cu_seqlens[1:] - cu_seqlens[:-1]).int()
    logits, features = target(padded, num_valid, cache, cache_len)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    request = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True).clamp_max(batch - 1)
    offset = (rows - starts[request]).clamp(0, width - 1)
    return logits[request, offset], features[request, offset]
