"""Draft backbone modules that wire the attention ops into a DSpark draft (its parallel stage).

The DSpark draft backbone is a few Qwen3-style decoder layers run once per round over the block
``[x0, MASK, ..., MASK]`` (G slots at absolute positions ``p0 .. p0+G-1``). Its attention sees a
*context* built from the target model:

1. :class:`ContextProjection`: the hidden features of several target layers at one position are
   concatenated and projected, ``hidden_norm(fc(concat))``, once per new context position;
2. :meth:`DraftLayer.append_context`: every draft layer projects that context to its own keys
   (``k_proj``, per-head ``k_norm``, RoPE at the context position) and values (``v_proj``) and
   appends them to its cache with :func:`dspark_ops.append_context_kv`;
3. :meth:`DraftLayer.forward`: the block's queries, keys and values come from the block's hidden
   states; the block keys stay local, and :func:`dspark_ops.block_draft_attention` lets every slot
   see all G block keys (non-causal) and the cached context ``[0, p0)``.

:class:`DraftBackbone` stacks the layers and a final norm. Caches are one pair per layer, each
``[N, L, Hkv, D]`` (cache row ``cache_slot[b]`` holds request ``b``), with one shared
``cache_seqlens`` int32 ``[B]`` that equals ``p0`` of each request.

Parameter names follow the Qwen3 DSpark drafts of DeepSpec
(``deepspec/modeling/dspark/qwen3/modeling.py``), so their weights load with ``load_state_dict``:
``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight`` and
``norm.weight``. The names inside a layer are those of Hugging Face's Qwen3 decoder layer, which
DeepSpec's draft layer reuses. A checkpoint's ``embed_tokens``, ``lm_head``, ``markov_head`` and
``confidence_head`` belong to the full draft model (:class:`dspark_ops.models.DSparkDraft`), not
to these modules (load with ``strict=False`` or strip those keys).

Example
-------
>>> import torch
>>> from dspark_ops.models.backbone import DraftBackbone, DraftConfig
>>> config = DraftConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
...                      head_dim=64, intermediate_size=512, num_hidden_layers=2,
...                      target_layer_ids=(1, 3, 5))
>>> draft = DraftBackbone(config)
>>> B, G, L = 2, 4, 64
>>> k_caches, v_caches = draft.new_caches(B, L)
>>> seqlens = torch.zeros(B, dtype=torch.int32)
>>> # Prefill: target features of the prompt (3 target layers, concatenated), 10 and 7 tokens.
>>> features = torch.randn(B, 10, 3 * config.hidden_size)
>>> num_new = torch.tensor([10, 7], dtype=torch.int32)
>>> draft.append_context(features, positions=None, num_new=num_new, k_caches=k_caches,
...                      v_caches=v_caches, cache_seqlens=seqlens)
>>> seqlens.tolist()
[10, 7]
>>> block = torch.randn(B, G, config.hidden_size)  # embeddings of [x0, MASK, MASK, MASK]
>>> draft(block, block_positions=None, k_caches=k_caches, v_caches=v_caches,
...       cache_seqlens=seqlens).shape  # h_0 .. h_{G-1}, before lm_head
torch.Size([2, 4, 256])
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from ..ops.attention import append_context_kv, block_draft_attention

__all__ = [
    "KERNEL_HEAD_DIMS",
    "ContextCache",
    "ContextProjection",
    "DraftAttention",
    "DraftBackbone",
    "DraftConfig",
    "DraftLayer",
    "DraftMLP",
    "RMSNorm",
    "apply_rope",
    "block_attention_torch",
    "rotate_half",
]

#: Head dims the ``block_draft_attention`` kernels take; others attend through
#: :func:`block_attention_torch`, the same arithmetic in PyTorch.
KERNEL_HEAD_DIMS = (64, 128, 256, 512)


@dataclasses.dataclass
class DraftConfig:
    """Sizes of a Qwen3-style DSpark draft backbone.

    Field names are those of Hugging Face's ``Qwen3Config`` plus DeepSpec's
    ``target_layer_ids``, so a loaded model config can be read into it field by field.

    Attributes
    ----------
    hidden_size : int
        Draft hidden size ``d``.
    num_attention_heads, num_key_value_heads : int
        ``Hq`` and ``Hkv`` (``Hq % Hkv == 0``).
    head_dim : int
        ``D``; the attention op supports 64, 128 and 256.
    intermediate_size : int
        MLP width.
    num_hidden_layers : int
        Number of draft layers (5 in the DeepSpec Qwen3 drafts).
    target_layer_ids : tuple of int
        Target layers whose outputs feed the context (e.g. ``(1, 9, 17, 25, 33)`` for
        Qwen3-4B/8B); only their count matters here.
    target_hidden_size : int, optional
        Hidden size of the target's features; default ``hidden_size`` (DeepSpec clones the
        target's config, so the two agree in its checkpoints).
    rms_norm_eps : float
    rope_theta : float
        RoPE base (Qwen3: 1e6).
    attention_bias : bool
        Biases on q/k/v/o projections (False for Qwen3).
    sliding_window : int, optional
        Attention window over the context; None: full attention (the DeepSpec drafts).
    """

    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    target_layer_ids: Tuple[int, ...] = (1, 9, 17, 25, 33)
    target_hidden_size: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    sliding_window: Optional[int] = None

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)


# ------------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 (as Qwen3's).

    Parameters
    ----------
    dim : int
        Size of the last axis.
    eps : float
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last axis (the non-interleaved RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding at absolute positions, rotate-half layout.

    Parameters
    ----------
    x : torch.Tensor
        ``[B, S, H, D]``.
    positions : torch.Tensor
        Integer ``[B, S]``: the absolute position of each row.
    theta : float
        RoPE base.

    Returns
    -------
    torch.Tensor
        ``x`` rotated, in ``x``'s dtype (the rotation itself runs in float32).
    """
    dim = x.shape[-1]
    # Recomputed per call rather than kept as a buffer: a buffer would follow a module's
    # .to(bfloat16) and lose the low frequencies' precision.
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)[..., None, :]  # [B, S, 1, D], shared by heads
    xf = x.float()
    return (xf * angles.cos() + rotate_half(xf) * angles.sin()).to(x.dtype)


def _default_positions(cache_seqlens: torch.Tensor, count: int) -> torch.Tensor:
    """``cache_seqlens[b] + i`` for ``i < count``, int64 ``[B, count]``: where new rows land."""
    offsets = torch.arange(count, device=cache_seqlens.device)
    return cache_seqlens.long()[:, None] + offsets


class ContextProjection(nn.Module):
    """Target features -> draft context hidden states: ``hidden_norm(fc(concat))``.

    Parameters
    ----------
    config : DraftConfig

    Notes
    -----
    ``fc`` is ``Linear(n_target_layers * target_hidden_size -> hidden_size, bias=False)`` and
    ``hidden_norm`` an RMSNorm, named as in the DeepSpec checkpoints. The features of one position
    are the raw outputs of the target layers ``target_layer_ids``, concatenated in that order.
    """

    #: The norm class of ``hidden_norm`` (and of :class:`DraftBackbone`'s final ``norm``); a
    #: draft family with other norm arithmetic sets its own.
    norm_class = RMSNorm

    def __init__(self, config: DraftConfig):
        super().__init__()
        target_hidden = config.target_hidden_size or config.hidden_size
        self.fc = nn.Linear(config.num_target_layers * target_hidden, config.hidden_size,
                            bias=False)
        self.hidden_norm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """``[..., n_target_layers * target_hidden]`` -> ``[..., hidden]``."""
        return self.hidden_norm(self.fc(target_features))

    def forward(self, target_features: torch.Tensor) -> torch.Tensor:
        return self.project(target_features)


class DraftMLP(nn.Module):
    """Qwen3's gated MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------------------------
# Attention and the decoder layer


class DraftAttention(nn.Module):
    """Draft self-attention with context K/V injection (DeepSpec's ``Qwen3DSparkAttention``).

    Context rows and block rows share ``k_proj``/``v_proj`` and the per-head ``k_norm``; queries
    come from the block only. Order as in Qwen3: projection, per-head RMSNorm (q and k), then
    RoPE at the absolute position. Values get neither.

    Parameters
    ----------
    config : DraftConfig
    """

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.sliding_window = config.sliding_window
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], heads, self.head_dim)

    def key_value(self, hidden: torch.Tensor,
                  positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, ``[B, S, Hkv, D]``, of ``hidden [B, S, hidden]`` at ``positions``."""
        k = self.k_norm(self._heads(self.k_proj(hidden), self.num_kv_heads))
        v = self._heads(self.v_proj(hidden), self.num_kv_heads)
        return apply_rope(k, positions, self.rope_theta), v

    def query(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Queries of ``hidden [B, G, hidden]`` at ``positions [B, G]``: ``[B, G, Hq, D]``."""
        q = self.q_norm(self._heads(self.q_proj(hidden), self.num_heads))
        return apply_rope(q, positions, self.rope_theta)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, over) -> torch.Tensor:
        """Attention output of the block, after ``o_proj``: ``[B, G, hidden]``.

        ``hidden`` is the block's normed hidden states at ``positions``; ``over`` is what the
        block attends over besides itself: a :class:`ContextCache` at inference, the training
        forward's block mask over the whole sequence's context when training. Its
        ``attend(attn, q, k, v)`` gets this module and the block's queries ``[B, G, Hq, D]``,
        keys and values ``[B, G, Hkv, D]``, and returns ``[B, G, Hq, D]``.
        """
        batch, block = hidden.shape[:2]
        q = self.query(hidden, positions)
        k, v = self.key_value(hidden, positions)
        out = over.attend(self, q, k, v)
        return self.o_proj(out.reshape(batch, block, -1).to(hidden.dtype))


class ContextCache:
    """What a draft layer's block attends over at inference: its context K/V cache.

    The block sees all ``G`` block rows and the cached context rows ``[0, cache_seqlens[b])``
    of cache row ``cache_slot[b]`` (:func:`dspark_ops.block_draft_attention`; for a head dim the
    kernels do not take, :func:`block_attention_torch`). The cache is read, never written.

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        The layer's ``[N, L, Hkv, D]`` caches.
    cache_seqlens : torch.Tensor
        int32 ``[B]``: ``p0``, the context rows each request sees.
    cache_slot : torch.Tensor, optional
        int32 ``[B]``: cache row of each request; default ``b``.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                 cache_slot: Optional[torch.Tensor] = None):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.cache_seqlens, self.cache_slot = cache_seqlens, cache_slot

    def attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        dtype = self.k_cache.dtype  # the op wants q and the block K/V in the cache's dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if attn.head_dim not in KERNEL_HEAD_DIMS:
            if attn.sliding_window is not None:
                raise NotImplementedError(
                    f"head dim {attn.head_dim} attends through PyTorch, which has no "
                    f"sliding_window")
            return block_attention_torch(q, k, v, self.k_cache, self.v_cache,
                                         self.cache_seqlens, cache_slot=self.cache_slot,
                                         softmax_scale=attn.scaling)
        return block_draft_attention(q, k, v, self.k_cache, self.v_cache, self.cache_seqlens,
                                     cache_slot=self.cache_slot, softmax_scale=attn.scaling,
                                     window=attn.sliding_window)


def block_attention_torch(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cache_seqlens: torch.Tensor, *, cache_slot: Optional[torch.Tensor] = None,
                          softmax_scale: float) -> torch.Tensor:
    """What :func:`dspark_ops.block_draft_attention` computes (its output; no log-sum-exp), for
    any head dim, in float32 PyTorch: block slot ``g`` of request ``b`` attends to the cached
    context rows ``[0, cache_seqlens[b])`` of cache row ``cache_slot[b]`` and to all ``G`` block
    rows. Shapes as the op's: ``q [B, G, Hq, D]``, block K/V ``[B, G, Hkv, D]``, caches
    ``[N, L, Hkv, D]``; the result is ``[B, G, Hq, D]`` in ``q``'s dtype."""
    batch, block, heads, _ = q.shape
    kv_heads, length = k_block.shape[2], k_cache.shape[1]
    slots = cache_slot.long() if cache_slot is not None else torch.arange(batch, device=q.device)
    keys = torch.cat([k_cache[slots], k_block], 1).float()  # [B, L + G, Hkv, D]
    values = torch.cat([v_cache[slots], v_block], 1).float()
    keys = keys.repeat_interleave(heads // kv_heads, dim=2)  # query head h reads kv head h // r
    values = values.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bghd,bnhd->bhgn", q.float(), keys) * softmax_scale
    slot = torch.arange(length + block, device=q.device)
    visible = (slot < cache_seqlens.long()[:, None]) | (slot >= length)  # [B, L + G]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bnhd->bghd", torch.softmax(scores, -1), values)
    return out.to(q.dtype)


class DraftLayer(nn.Module):
    """One DSpark draft decoder layer (DeepSpec's ``Qwen3DSparkDecoderLayer``).

    ``h = h + self_attn(input_layernorm(h))``, then ``h = h + mlp(post_attention_layernorm(h))``.
    The context enters only through this layer's K/V cache, which :meth:`append_context` fills;
    unlike the block, the context is not passed through ``input_layernorm`` (it is already
    normalised by ``hidden_norm``).

    Parameters
    ----------
    config : DraftConfig
    """

    def __init__(self, config: DraftConfig, layer_index: int = 0):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def append_context(self, context_features: torch.Tensor, positions: Optional[torch.Tensor],
                       num_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cache_seqlens: torch.Tensor,
                       cache_slot: Optional[torch.Tensor] = None) -> None:
        """Projects new context rows to this layer's K/V and appends them to its cache.

        Parameters
        ----------
        context_features : torch.Tensor
            ``[B, n_max, hidden]``: the output of :class:`ContextProjection` for the new
            context positions of each request (after prefill: the prompt; after a round: the
            anchor and the accepted drafts).
        positions : torch.Tensor or None
            Integer ``[B, n_max]``: absolute positions for RoPE; None means
            ``cache_seqlens[b] + i``, the rows' positions in the cache.
        num_new : torch.Tensor
            int32 ``[B]``: rows of each request to append (the rest are padding).
        k_cache, v_cache : torch.Tensor
            This layer's ``[N, L, Hkv, D]`` caches, written in place.
        cache_seqlens : torch.Tensor
            int32 ``[B]``, advanced in place by ``num_new`` (capped at ``L``). When several
            layers share one length tensor, give every layer but the last a copy (see
            :meth:`DraftBackbone.append_context`).
        cache_slot : torch.Tensor, optional
            int32 ``[B]``: cache row of each request; default ``b``.
        """
        if positions is None:
            positions = _default_positions(cache_seqlens, context_features.shape[1])
        k, v = self.self_attn.key_value(context_features, positions)
        append_context_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), num_new,
                          cache_seqlens, cache_slot=cache_slot)

    def forward(self, block_hidden: torch.Tensor, block_positions: torch.Tensor,
                over) -> torch.Tensor:
        """Runs the layer over the block: the one arithmetic of the layer, for inference and
        for training alike.

        Parameters
        ----------
        block_hidden : torch.Tensor
            ``[B, G, hidden]``: hidden states of the G block slots (in training, of all
            anchor blocks, ``[B, A * G, hidden]``).
        block_positions : torch.Tensor
            Integer ``[B, G]``: absolute positions ``p0 .. p0+G-1``.
        over
            What the block attends over besides itself (:meth:`DraftAttention.forward`): this
            layer's :class:`ContextCache` at inference.

        Returns
        -------
        torch.Tensor
            ``[B, G, hidden]``.
        """
        attended = self.self_attn(self.input_layernorm(block_hidden), block_positions, over)
        return self.after_attention(block_hidden, attended)

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer once the attention output (after ``o_proj``) is known:
        ``h = hidden + attended``, then ``h + mlp(post_attention_layernorm(h))``; a family with
        other norms around its attention and MLP overrides it."""
        h = hidden + attended
        return h + self.mlp(self.post_attention_layernorm(h))


# ------------------------------------------------------------------------------------------------
# The backbone


class DraftBackbone(ContextProjection):
    """Context projection, draft layers and the final norm: the DSpark parallel stage.

    It subclasses :class:`ContextProjection` so that ``fc`` and ``hidden_norm`` sit at the top
    level next to ``layers`` and ``norm``, as in the checkpoints. Token embedding, ``lm_head``
    and the Markov and confidence heads are outside: the input is the embedded block, the output
    the final-normed ``h_0 .. h_{G-1}``.

    Parameters
    ----------
    config : DraftConfig
    """

    #: The decoder-layer class, built as ``layer_class(config, layer_index)``; a draft family
    #: with another layer sets its own.
    layer_class = DraftLayer

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.config = config
        self.layers = nn.ModuleList(self.layer_class(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def new_caches(self, num_rows: int, length: int, *, dtype: Optional[torch.dtype] = None,
                   device=None) -> Tuple[list, list]:
        """Empty K and V caches, one ``[num_rows, length, Hkv, D]`` pair per layer.

        dtype and device default to those of the parameters.
        """
        weight = self.fc.weight
        shape = (num_rows, length, self.config.num_key_value_heads, self.config.head_dim)
        kw = dict(dtype=dtype or weight.dtype, device=device or weight.device)
        return ([torch.zeros(shape, **kw) for _ in self.layers],
                [torch.zeros(shape, **kw) for _ in self.layers])

    def append_context(self, target_features: torch.Tensor, positions: Optional[torch.Tensor],
                       num_new: torch.Tensor, k_caches: Sequence[torch.Tensor],
                       v_caches: Sequence[torch.Tensor], cache_seqlens: torch.Tensor,
                       cache_slot: Optional[torch.Tensor] = None) -> None:
        """Projects target features once and appends every layer's K/V.

        Parameters
        ----------
        target_features : torch.Tensor
            ``[B, n_max, n_target_layers * target_hidden]``: concatenated target-layer outputs
            of the new context positions.
        positions, num_new, cache_slot
            As in :meth:`DraftLayer.append_context`.
        k_caches, v_caches : sequence of torch.Tensor
            One ``[N, L, Hkv, D]`` cache per layer.
        cache_seqlens : torch.Tensor
            int32 ``[B]``, shared by all layers, advanced once (in place).
        """
        if positions is None:
            positions = _default_positions(cache_seqlens, target_features.shape[1])
        context = self.project(target_features)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # Every layer writes at the same offsets; only the last one advances the lengths.
            seqlens = cache_seqlens if i == last else cache_seqlens.clone()
            layer.append_context(context, positions, num_new, k_caches[i], v_caches[i], seqlens,
                                 cache_slot)

    def forward(self, block_hidden: torch.Tensor, block_positions: Optional[torch.Tensor],
                k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                cache_seqlens: torch.Tensor,
                cache_slot: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Runs all layers over the block and returns ``norm(h)``, ``[B, G, hidden]``.

        Arguments as in :meth:`DraftLayer.forward`, with one cache pair per layer.
        """
        if block_positions is None:
            block_positions = _default_positions(cache_seqlens, block_hidden.shape[1])
        h = block_hidden
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            h = layer(h, block_positions, ContextCache(k_cache, v_cache, cache_seqlens,
                                                       cache_slot))
        return self.norm(h)

