"""The training forward of a DSpark draft: teacher-forced and parallel over anchor blocks.

One call of :func:`training_forward` does what DeepSpec's ``Qwen3DSparkModel.forward`` does for a
batch of packed sequences ``[B, L]``:

1. **Anchors.** ``A`` anchor positions per sequence are drawn uniformly without replacement among
   the candidates ``p <= L - 2`` with ``loss_mask[p]`` and ``loss_mask[p + 1]`` set (the anchor's
   next token is trained), then sorted ascending (:func:`sample_anchor_positions`). A sequence
   with fewer than ``A`` candidates is padded with blocks that have ``block_keep_mask`` False,
   anchor 0 and only MASK tokens. Blocks may overlap in sequence positions.
2. **Blocks.** Block ``a`` is ``[x_{p0}, MASK, ..., MASK]`` (``G`` slots) at positions
   ``p0 .. p0 + G - 1``; all ``A`` blocks are embedded together, ``[B, A * G, d]``.
3. **Backbone.** The context ``hidden_norm(fc(target_features))`` of the whole sequence (positions
   ``0 .. L - 1``) is projected once; every draft layer applies its own ``k_proj``/``v_proj``
   (per-head ``k_norm``, RoPE at the context position) to it, the same as the inference path's
   context caches. The queries of a block see the context rows at positions ``< p0`` and the
   ``G`` rows of their own block (bidirectionally), nothing else (:func:`block_attention_mask`);
   a padding block sees nothing, and its attention output is exactly zero.
4. **Heads and labels.** Slot ``k`` is trained on the label ``input_ids[p0 + 1 + k]``; the Markov
   head is teacher-forced with the previous tokens ``[x_{p0}, labels[:-1]]``; the eval mask keeps
   the contiguous prefix of slots whose label is inside the sequence and trained
   (:func:`build_eval_mask`); the target's final-normed hidden state at ``p0 + k`` (whose logits
   predict that label) is gathered by flat row index.

Attention runs through ``torch.nn.attention.flex_attention`` with a block mask on CUDA (compiled),
or through ``scaled_dot_product_attention`` with a dense boolean mask (any device; the CPU path,
since flex has no CPU backward). The draft's layers run their own forward, the one inference
uses: they take what the block attends over, here the context under the block mask instead of
the inference K/V cache.

Example
-------
>>> import torch
>>> from dspark_ops.models import DSparkConfig, DSparkDraft
>>> from dspark_ops.train import position_weights, training_forward
>>> config = DSparkConfig(vocab_size=64, hidden_size=64, num_attention_heads=2,
...                       num_key_value_heads=1, head_dim=32, intermediate_size=128,
...                       num_hidden_layers=2, target_layer_ids=(0, 1), block_size=4,
...                       mask_token_id=63, markov_rank=8)
>>> draft = DSparkDraft(config)
>>> B, L = 2, 24
>>> input_ids = torch.randint(0, 63, (B, L))
>>> features = torch.randn(B, L, 2 * config.hidden_size)
>>> loss_mask = torch.ones(B, L)
>>> batch = training_forward(draft, input_ids, features, loss_mask, torch.randn(B, L, 64),
...                          num_anchors=8, generator=torch.Generator().manual_seed(0))
>>> batch.hidden.shape, batch.markov_latent.shape, batch.target_hidden.shape
(torch.Size([2, 8, 4, 64]), torch.Size([2, 8, 4, 8]), torch.Size([2, 8, 4, 64]))
>>> position_weights(batch.eval_mask).shape
torch.Size([2, 8, 4])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple

import torch
from torch import nn

__all__ = [
    "ATTENTION_BACKENDS",
    "TrainingBatch",
    "block_attention_mask",
    "build_eval_mask",
    "position_weights",
    "sample_anchor_positions",
    "training_forward",
]

ATTENTION_BACKENDS = ("sdpa", "flex")


@dataclasses.dataclass
class TrainingBatch:
    """What one training forward yields, per block slot (``A`` blocks of ``G`` slots per sequence).

    Attributes
    ----------
    hidden : torch.Tensor
        ``[B, A, G, d]``: the backbone's final-normed hidden states ``h``.
    markov_latent : torch.Tensor or None
        ``[B, A, G, r]``: ``u`` such that the Markov head's logit bias is ``u @ W2.T``
        (``W2 = markov_w2.weight``): ``W1[prev]`` for the vanilla head, ``tanh(o)`` of the
        teacher-forced recurrence for the RNN head; None for a DFlash draft.
    labels : torch.Tensor
        int64 ``[B, A, G]``: slot ``k`` predicts ``input_ids[p0 + 1 + k]``; out-of-sequence
        labels and those of padding blocks hold a valid id (masked by ``eval_mask``).
    eval_mask : torch.Tensor
        bool ``[B, A, G]``: the contiguous prefix of slots whose label is inside the sequence and
        has ``loss_mask`` set, in kept blocks only.
    confidence_logits : torch.Tensor or None
        float32 ``[B, A, G]``: the confidence head's logit; None without a confidence head.
    target_hidden : torch.Tensor or None
        ``[B, A, G, H]``: ``target_last_hidden[b, p0 + k]``, the target state whose logits predict
        slot ``k``'s label (a valid row, masked, where the label is outside the sequence); None
        when no ``target_last_hidden`` was given.
    anchor_positions : torch.Tensor
        int64 ``[B, A]``: ``p0`` of each block, ascending among kept blocks; 0 for padding blocks.
    block_keep_mask : torch.Tensor
        bool ``[B, A]``: False for padding blocks.
    prev_tokens : torch.Tensor
        int64 ``[B, A, G]``: the teacher-forced previous token of each slot, ``[x_{p0},
        labels[..., :-1]]`` (what the Markov and confidence heads read).
    """

    hidden: torch.Tensor
    markov_latent: Optional[torch.Tensor]
    labels: torch.Tensor
    eval_mask: torch.Tensor
    confidence_logits: Optional[torch.Tensor]
    target_hidden: Optional[torch.Tensor]
    anchor_positions: torch.Tensor
    block_keep_mask: torch.Tensor
    prev_tokens: torch.Tensor


# ------------------------------------------------------------------------------------------------
# Anchors, labels and masks


def _trained(loss_mask: torch.Tensor) -> torch.Tensor:
    """``loss_mask`` as booleans, with DeepSpec's threshold (``> 0.5``) for numeric masks."""
    if loss_mask.dtype == torch.bool:
        return loss_mask
    return loss_mask > 0.5


def sample_anchor_positions(loss_mask: torch.Tensor, num_anchors: int,
                            generator: Optional[torch.Generator] = None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples ``num_anchors`` anchor positions per sequence, as DeepSpec samples them.

    A candidate is a position ``p <= L - 2`` with ``loss_mask[p]`` and ``loss_mask[p + 1]`` set.
    Every candidate gets a uniform random key (non-candidates the key 2, above them all); the
    candidates with the ``num_anchors`` smallest keys (a uniform sample without replacement) are
    kept and sorted ascending. Sequences with fewer candidates are filled up with padding blocks.

    Parameters
    ----------
    loss_mask : torch.Tensor
        ``[B, L]``, bool or numeric (a position is trained where it is ``> 0.5``).
    num_anchors : int
        ``A``.
    generator : torch.Generator, optional
        Source of the keys (``torch.rand`` of shape ``[B, L - 1]``); drawn on the generator's
        device and moved to ``loss_mask``'s when they differ.

    Returns
    -------
    anchor_positions : torch.Tensor
        int64 ``[B, A]``: the kept anchors ascending, then 0 for each padding block.
    block_keep_mask : torch.Tensor
        bool ``[B, A]``: True for the first ``min(candidates, A)`` blocks of each sequence.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, L], got shape {tuple(loss_mask.shape)}")
    if num_anchors < 0:
        raise ValueError(f"num_anchors must be >= 0, got {num_anchors}")
    batch, length = loss_mask.shape
    device = loss_mask.device
    num_candidates = max(length - 1, 0)
    if num_candidates == 0:
        return (torch.zeros(batch, num_anchors, dtype=torch.long, device=device),
                torch.zeros(batch, num_anchors, dtype=torch.bool, device=device))
    trained = _trained(loss_mask)
    valid = trained[:, :num_candidates] & trained[:, 1:]
    rand_device = generator.device if generator is not None else device
    keys = torch.rand(batch, num_candidates, generator=generator, device=rand_device).to(device)
    keys = torch.where(valid, keys, 2.0)
    order = keys.argsort(dim=1)
    # Non-candidates sort last (key 2) and carry the index L + 1, above every candidate.
    picked = torch.where(valid.gather(1, order), order, length + 1)[:, :num_anchors]
    if picked.shape[1] < num_anchors:
        picked = torch.cat([picked, picked.new_full((batch, num_anchors - picked.shape[1]),
                                                    length + 1)], 1)
    anchors = picked.sort(dim=1).values
    counts = valid.sum(1, keepdim=True).clamp(max=num_anchors)
    keep = torch.arange(num_anchors, device=device)[None, :] < counts
    return torch.where(keep, anchors, 0), keep


def _label_indices(anchor_positions: torch.Tensor, block_keep_mask: torch.Tensor, length: int,
                   block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Label positions ``p0 + 1 + k``, ``[B, A, G]``, and the same clamped to ``L - 1`` (0 in
    padding blocks): indices safe to gather with."""
    offsets = torch.arange(1, block_size + 1, device=anchor_positions.device)
    label_pos = anchor_positions[..., None] + offsets
    safe = torch.where(block_keep_mask[..., None], label_pos.clamp(max=length - 1), 0)
    return label_pos, safe


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, ...]]`` for ``x [B, L, ...]`` and ``index [B, ...]`` by one flat index into
    the ``B * L`` rows: nothing is expanded per anchor."""
    batch, length = x.shape[:2]
    base = torch.arange(batch, device=index.device).view(-1, *([1] * (index.dim() - 1)))
    flat = (index + base * length).reshape(-1)
    rows = x.reshape(batch * length, *x.shape[2:]).index_select(0, flat)
    return rows.view(*index.shape, *x.shape[2:])


def build_eval_mask(loss_mask: torch.Tensor, anchor_positions: torch.Tensor,
                    block_keep_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which block slots are trained.

    Slot ``k`` of a block counts when its label position ``p0 + 1 + k`` is inside the sequence,
    that position has ``loss_mask`` set and the block is kept; a slot after one that does not
    count does not count either (cumulative product along the block).

    Parameters
    ----------
    loss_mask : torch.Tensor
        ``[B, L]``.
    anchor_positions : torch.Tensor
        int64 ``[B, A]``.
    block_keep_mask : torch.Tensor
        bool ``[B, A]``.
    block_size : int
        ``G``.

    Returns
    -------
    torch.Tensor
        bool ``[B, A, G]``.
    """
    length = loss_mask.shape[1]
    label_pos, safe = _label_indices(anchor_positions, block_keep_mask, length, block_size)
    trained = _gather_rows(_trained(loss_mask), safe)
    mask = (label_pos < length) & trained & block_keep_mask[..., None]
    return mask.to(torch.int32).cumprod(-1).bool()


def position_weights(eval_mask: torch.Tensor, loss_decay_gamma: float = 4.0) -> torch.Tensor:
    """The loss weights of the block slots: ``eval_mask * exp(-k / loss_decay_gamma)``.

    Parameters
    ----------
    eval_mask : torch.Tensor
        ``[..., G]`` (bool or numeric).
    loss_decay_gamma : float
        Decay length in slots (4 in DeepSpec's configs).

    Returns
    -------
    torch.Tensor
        float32 ``[..., G]``; slot ``k = 0`` (the anchor's slot) weighs 1.
    """
    if not loss_decay_gamma > 0:
        raise ValueError(f"loss_decay_gamma must be > 0, got {loss_decay_gamma}")
    slots = torch.arange(eval_mask.shape[-1], device=eval_mask.device, dtype=torch.float32)
    return eval_mask.to(torch.float32) * torch.exp(-slots / loss_decay_gamma)


def block_attention_mask(anchor_positions: torch.Tensor, block_keep_mask: torch.Tensor,
                         seq_len: int, block_size: int) -> torch.Tensor:
    """DeepSpec's training attention mask as a dense boolean tensor.

    Keys are the ``L`` context rows followed by the ``A * G`` block rows; query ``i`` belongs to
    block ``a = i // G``. It sees context row ``j`` when ``j < anchor_positions[b, a]``, and the
    block rows of block ``a``; a padding block sees nothing.

    Parameters
    ----------
    anchor_positions : torch.Tensor
        int64 ``[B, A]``.
    block_keep_mask : torch.Tensor
        bool ``[B, A]``.
    seq_len : int
        ``L``.
    block_size : int
        ``G``.

    Returns
    -------
    torch.Tensor
        bool ``[B, A * G, L + A * G]``, True where the query may attend.
    """
    return _dense_mask(anchor_positions, block_keep_mask, seq_len, block_size, pad_own_block=False)


def _dense_mask(anchor_positions, block_keep_mask, seq_len, block_size, pad_own_block):
    batch, blocks = anchor_positions.shape
    device = anchor_positions.device
    q_block = torch.arange(blocks * block_size, device=device) // block_size  # [Q]
    keep_q = block_keep_mask[:, q_block]  # [B, Q]
    context = torch.arange(seq_len, device=device) < anchor_positions[:, q_block, None]
    context = context & keep_q[..., None]
    own = (q_block[:, None] == q_block[None, :]).expand(batch, -1, -1)
    if not pad_own_block:
        own = own & keep_q[..., None]
    return torch.cat([context, own], -1)


# ------------------------------------------------------------------------------------------------
# Attention backends: (q [B, Hq, Q, D], k, v [B, Hkv, L + Q, D], scale) -> [B, Hq, Q, D]


def _sdpa_attention(anchor_positions, block_keep_mask, seq_len, block_size) -> Callable:
    """Dense masked ``scaled_dot_product_attention``. A padding block is given its own block's
    keys, so that no row is fully masked (a fully masked row is NaN, in the forward and in the
    gradients, in some SDPA backends and torch versions), and its output is then replaced by
    exact zeros, which is what flex attention returns for a row with no visible key."""
    mask = _dense_mask(anchor_positions, block_keep_mask, seq_len, block_size,
                       pad_own_block=True)[:, None]  # [B, 1, Q, KV], shared by all heads
    keep_q = block_keep_mask.repeat_interleave(block_size, dim=1)[:, None, :, None]

    def attend(q, k, v, scale):
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return torch.where(keep_q, out, out.new_zeros(()))

    return attend


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex_attention(anchor_positions, block_keep_mask, seq_len, block_size) -> Callable:
    """``flex_attention`` over a ``BlockMask`` of DeepSpec's mask_mod (rows with no visible key
    come out as zeros). Compiled on CUDA; on other devices the eager, unfused form runs (on CPU
    torch has no flex backward, so it serves inference-only checks there)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, blocks = anchor_positions.shape

    def mask_mod(b, h, q_idx, kv_idx):
        del h
        q_block = q_idx // block_size
        context = (kv_idx < seq_len) & (kv_idx < anchor_positions[b, q_block])
        own = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == q_block)
        return (context | own) & block_keep_mask[b, q_block]

    device = anchor_positions.device
    block_mask = create_block_mask(mask_mod, B=batch, H=None, Q_LEN=blocks * block_size,
                                   KV_LEN=seq_len + blocks * block_size, device=device)
    fn = _compiled_flex_attention() if device.type == "cuda" else flex_attention

    def attend(q, k, v, scale):
        return fn(q, k, v, block_mask=block_mask, scale=scale,
                  enable_gqa=q.shape[1] != k.shape[1])

    return attend


def _attention_backend(name: Optional[str], device: torch.device) -> str:
    if name is None:
        return "flex" if device.type == "cuda" else "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS} or None, got {name!r}")
    return name


# ------------------------------------------------------------------------------------------------
# What the blocks attend over in training


class _MaskedContext:
    """What every anchor block attends over in training: the whole sequence's context under
    DeepSpec's block mask (``attend``, one of the backends above). The draft layer runs its own
    forward (:meth:`~dspark_ops.models.backbone.DraftLayer.forward`, the inference arithmetic);
    only the keys and values differ: the layer's projections of the projected target features
    (not passed through ``input_layernorm``), followed by the blocks'."""

    def __init__(self, context: torch.Tensor, context_positions: torch.Tensor, attend: Callable):
        self.context, self.context_positions, self.mask_attend = context, context_positions, attend

    def attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        k_ctx, v_ctx = attn.key_value(self.context, self.context_positions)
        keys = torch.cat([k_ctx, k], 1).transpose(1, 2).to(q.dtype)
        values = torch.cat([v_ctx, v], 1).transpose(1, 2).to(q.dtype)
        return self.mask_attend(q.transpose(1, 2), keys, values, attn.scaling).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# Heads


def _markov_latent(head: nn.Module, prev_tokens: torch.Tensor,
                   hidden: torch.Tensor) -> torch.Tensor:
    """The teacher-forced latent ``u [B, A, G, r]`` whose image ``u @ W2.T`` is the head's bias.

    Vanilla head: ``W1[prev]``. RNN head: with ``s_0 = 0`` and, per slot ``k``,
    ``[g; c; o] = joint_proj([s_k; W1[prev_k]; h_k])``, the latent is ``tanh(o)`` and
    ``s_{k+1} = sigmoid(g) * s_k + (1 - sigmoid(g)) * tanh(c)``, the recurrence ``rnn_draft``
    runs at inference (here with the true previous tokens).
    """
    prev_embed = head.markov_w1(prev_tokens)
    if not head.is_rnn:
        return prev_embed
    rank = prev_embed.shape[-1]
    state = hidden.new_zeros(*hidden.shape[:-2], rank)
    latents = []
    for k in range(hidden.shape[-2]):
        joint = torch.cat([state, prev_embed[..., k, :].to(state.dtype), hidden[..., k, :]], -1)
        gate, candidate, output = head.joint_proj(joint).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        latents.append(torch.tanh(output))
    return torch.stack(latents, -2)


def _confidence_logits(draft: nn.Module, hidden: torch.Tensor,
                       prev_tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """The confidence head's logit, float32 ``[B, A, G]``: on ``[h; W1[prev]]`` (the Markov
    embedding, also for the RNN head) or on ``h``, as the config says."""
    if draft.confidence_head is None:
        return None
    features = hidden
    if draft.config.confidence_head_with_markov:
        prev_embed = draft.markov_head.markov_w1(prev_tokens).to(hidden.dtype)
        features = torch.cat([hidden, prev_embed], -1)
    return draft.confidence_head.proj(features).squeeze(-1).float()


# ------------------------------------------------------------------------------------------------
# The forward


def _check_inputs(draft, input_ids, target_features, loss_mask, target_last_hidden):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    shape = tuple(input_ids.shape)
    if tuple(loss_mask.shape) != shape:
        raise ValueError(f"loss_mask must have input_ids' shape {shape}, got "
                         f"{tuple(loss_mask.shape)}")
    width = draft.fc.in_features
    if target_features.dim() != 3 or tuple(target_features.shape) != (*shape, width):
        raise ValueError(f"target_features must be [B, L, {width}] (the draft's "
                         f"{len(draft.config.target_layer_ids)} target layers concatenated) with "
                         f"[B, L] = {list(shape)}, got shape {tuple(target_features.shape)}")
    if target_last_hidden is not None and (target_last_hidden.dim() != 3
                                           or tuple(target_last_hidden.shape[:2]) != shape):
        raise ValueError(f"target_last_hidden must be [B, L, H] with [B, L] = {list(shape)}, got "
                         f"shape {tuple(target_last_hidden.shape)}")
    if draft.config.sliding_window is not None:
        raise NotImplementedError("training_forward implements full attention over the context "
                                  "only (the draft's config has a sliding_window)")


def training_forward(draft: nn.Module, input_ids: torch.Tensor, target_features: torch.Tensor,
                     loss_mask: torch.Tensor, target_last_hidden: Optional[torch.Tensor] = None,
                     *, anchor_positions: Optional[torch.Tensor] = None,
                     block_keep_mask: Optional[torch.Tensor] = None,
                     eval_mask: Optional[torch.Tensor] = None,
                     num_anchors: Optional[int] = None,
                     generator: Optional[torch.Generator] = None,
                     attention: Optional[str] = None) -> TrainingBatch:
    """The teacher-forced training forward of a DSpark (or DFlash) draft over anchor blocks.

    The same computation as DeepSpec's ``Qwen3DSparkModel.forward`` up to the logits: anchors
    sampled (or given), blocks ``[x_{p0}, MASK, ...]`` run through the backbone in one pass with
    DeepSpec's block mask over ``[context of the whole sequence; all blocks]``, and the per-slot
    inputs of the DSpark loss. Differentiable in the draft's parameters.

    Parameters
    ----------
    draft : dspark_ops.models.DSparkDraft
        The draft; ``G = draft.config.block_size``.
    input_ids : torch.Tensor
        int64 ``[B, L]`` packed sequences.
    target_features : torch.Tensor
        ``[B, L, n_target_layers * H]``: the outputs of the target layers
        ``target_layer_ids`` at every position, concatenated in that order.
    loss_mask : torch.Tensor
        ``[B, L]``: which positions are trained (bool, or numeric with ``> 0.5`` trained).
    target_last_hidden : torch.Tensor, optional
        ``[B, L, H]``: the target's final-normed hidden states; their rows at ``p0 + k`` are
        gathered into :attr:`TrainingBatch.target_hidden`.
    anchor_positions : torch.Tensor, optional
        int64 ``[B, A]``, each in ``[0, L)``: the anchors to use instead of sampling. Positions of
        padding blocks are replaced by 0.
    block_keep_mask : torch.Tensor, optional
        bool ``[B, A]`` with ``anchor_positions`` (default: every block kept); only with it.
    eval_mask : torch.Tensor, optional
        bool ``[B, A, G]``: :func:`build_eval_mask` of these anchors, when the caller built it
        with them (the trainer's batch); only with ``anchor_positions``. Default: built here.
    num_anchors : int, optional
        ``A`` when sampling; default the draft config's ``num_anchors`` (512 in DeepSpec's
        configs), as DeepSpec's model samples its config's count.
    generator : torch.Generator, optional
        Random source of the anchor sampling (:func:`sample_anchor_positions`).
    attention : {"sdpa", "flex"} or None
        ``"flex"``: ``flex_attention`` with a block mask (compiled on CUDA; forward-only on CPU);
        ``"sdpa"``: ``scaled_dot_product_attention`` with a dense ``[B, A*G, L + A*G]`` mask;
        None: flex on CUDA, SDPA elsewhere.

    Returns
    -------
    TrainingBatch
    """
    _check_inputs(draft, input_ids, target_features, loss_mask, target_last_hidden)
    config = draft.config
    block = config.block_size
    batch, length = input_ids.shape
    device = input_ids.device
    input_ids = input_ids.long()

    if anchor_positions is None:
        for name, value in (("block_keep_mask", block_keep_mask), ("eval_mask", eval_mask)):
            if value is not None:
                raise ValueError(f"{name} is given without anchor_positions")
        if num_anchors is None:
            num_anchors = config.num_anchors
        anchor_positions, block_keep_mask = sample_anchor_positions(loss_mask, num_anchors,
                                                                    generator)
    else:
        if anchor_positions.dim() != 2 or anchor_positions.shape[0] != batch:
            raise ValueError(f"anchor_positions must be [B, A] with B = {batch}, got shape "
                             f"{tuple(anchor_positions.shape)}")
        if block_keep_mask is None:
            block_keep_mask = torch.ones(anchor_positions.shape, dtype=torch.bool, device=device)
        if tuple(block_keep_mask.shape) != tuple(anchor_positions.shape):
            raise ValueError(f"block_keep_mask must have anchor_positions' shape "
                             f"{tuple(anchor_positions.shape)}, got {tuple(block_keep_mask.shape)}")
        block_keep_mask = block_keep_mask.to(device=device, dtype=torch.bool)
        anchor_positions = torch.where(block_keep_mask, anchor_positions.to(device).long(), 0)
    blocks = anchor_positions.shape[1]

    # Blocks: [x_{p0}, MASK, ...]; a padding block is MASK throughout.
    anchor_tokens = input_ids.gather(1, anchor_positions)
    noise_ids = torch.full((batch, blocks, block), config.mask_token_id, dtype=torch.long,
                           device=device)
    noise_ids[..., 0] = torch.where(block_keep_mask, anchor_tokens, config.mask_token_id)
    hidden = draft.embed_tokens(noise_ids.view(batch, blocks * block))
    block_positions = (anchor_positions[..., None]
                       + torch.arange(block, device=device)).view(batch, blocks * block)
    context_positions = torch.arange(length, device=device).expand(batch, length)
    context = draft.project(target_features.to(draft.fc.weight.dtype))

    backend = _attention_backend(attention, device)
    make = _flex_attention if backend == "flex" else _sdpa_attention
    over = _MaskedContext(context, context_positions,
                          make(anchor_positions, block_keep_mask, length, block))
    for layer in draft.layers:
        hidden = layer(hidden, block_positions, over)
    hidden = draft.norm(hidden).view(batch, blocks, block, -1)

    # Labels, teacher-forced previous tokens, eval mask, aligned target states.
    _, safe = _label_indices(anchor_positions, block_keep_mask, length, block)
    labels = _gather_rows(input_ids, safe)
    prev_tokens = torch.cat([anchor_tokens[..., None], labels[..., :-1]], -1)
    if eval_mask is None:
        eval_mask = build_eval_mask(loss_mask, anchor_positions, block_keep_mask, block)
    elif tuple(eval_mask.shape) != (batch, blocks, block):
        raise ValueError(f"eval_mask must be [B, A, G] = {[batch, blocks, block]}, got shape "
                         f"{tuple(eval_mask.shape)}")
    target_hidden = None
    if target_last_hidden is not None:
        target_hidden = _gather_rows(target_last_hidden, (safe - 1).clamp(min=0))

    latent = None
    if draft.markov_head is not None:
        latent = _markov_latent(draft.markov_head, prev_tokens, hidden)
    return TrainingBatch(
        hidden=hidden,
        markov_latent=latent,
        labels=labels,
        eval_mask=eval_mask,
        confidence_logits=_confidence_logits(draft, hidden, prev_tokens),
        target_hidden=target_hidden,
        anchor_positions=anchor_positions,
        block_keep_mask=block_keep_mask,
        prev_tokens=prev_tokens,
    )
