"""A Hugging Face transformers causal LM as the target of :class:`dspark_ops.SpeculativeDecoder`.

:class:`HFTarget` wraps any ``AutoModelForCausalLM`` whose decoder layers sit in
``model.get_decoder().layers`` (Qwen3, Llama, Qwen2, Gemma3, Gemma4, ...) behind
the target interface the decoder uses (see :mod:`dspark_ops.decoder`): a batched prefill of
prompts of different lengths, the ragged verify forward, the commit of each request's accepted
rows, and the draft's context features, exactly as DeepSpec's training cache defines them:

- id ``-1`` is the embedding output, i.e. the input of decoder layer 0 (``hidden_states[0]``;
  for Gemma models the *scaled* embedding);
- id ``l >= 0`` is the raw output of decoder layer ``l`` (``hidden_states[l + 1]``; for Gemma4
  after its ``layer_scalar``), including the last layer, whose raw output transformers does
  *not* return (its ``hidden_states[-1]`` is the final-normed state); forward hooks on the
  layers read them directly.

``transformers`` is an optional dependency (``pip install --no-build-isolation ".[hf]"``); only
this module imports it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .models.cpu_linear import CpuLinears
from .models.target import forward_ragged

__all__ = ["HFTarget"]

_SUPPORTED_ATTENTION = ("sdpa", "eager")


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _decoder_layers(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found at "
                         "model.get_decoder().layers")
    return layers


def _sliding_window(config):
    """The window of the model's sliding-window layers, or None when every layer is full
    attention. Layers are told apart by ``config.layer_types`` (``"full_attention"`` or
    ``"sliding_attention"``, as Gemma3/Gemma4 and recent Qwen/Mistral configs list them); a
    window without per-layer types (every layer sliding, applied by the model itself) and other
    layer types (chunked, linear, ...) are refused."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"target layer_types {other} are not supported (only 'full_attention' "
                         "and 'sliding_attention')")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("target config 'use_bidirectional_attention' is 'all': a causal LM is "
                         "needed")
    if "sliding_attention" in layer_types:
        if window is None:
            raise ValueError("target config lists 'sliding_attention' layers but no "
                             "'sliding_window'")
        return int(window)
    if window is not None and not layer_types:
        raise ValueError(f"target config 'sliding_window' is {window} without 'layer_types': "
                         "which layers slide is not known")
    return None


class _Cache:
    """The HF key/value cache of a batch plus which of its slots each request may attend to.

    Every forward appends its ``T`` rows to every request; rows a request did not keep (padding,
    rejected drafts) stay in the cache as holes that the attention mask hides. ``commit`` turns
    the rows of the last forward into kept or hidden ones from the committed lengths.
    """

    def __init__(self, hf_cache, batch: int, device):
        self.hf_cache = hf_cache
        self.visible = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        # The sequence position of every slot (for sliding windows; holes keep theirs, unused).
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self._pending = None  # (first slot, rows, committed lengths before the forward)

    def commit(self, cache_len: torch.Tensor) -> None:
        if self._pending is None:
            return
        start, rows, before = self._pending
        kept = (cache_len.long() - before).clamp(0, rows)
        self.visible[:, start:] = torch.arange(rows, device=kept.device) < kept[:, None]
        self._pending = None

    def append(self, rows: int, cache_len: torch.Tensor) -> None:
        start = self.visible.shape[1]
        self.visible = torch.cat([self.visible, self.visible.new_zeros(self.visible.shape[0], rows)],
                                 1)
        new = cache_len.long()[:, None] + torch.arange(rows, device=cache_len.device)
        self.positions = torch.cat([self.positions, new], 1)
        self._pending = (start, rows, cache_len.long().clone())


class HFTarget:
    """A transformers causal LM served to :class:`dspark_ops.SpeculativeDecoder`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (``AutoModelForCausalLM``) loaded with ``attn_implementation="sdpa"`` or
        ``"eager"`` (the adapter passes explicit 4-D attention masks). Sliding-window layers
        are told apart by ``config.layer_types``; each kind of layer gets its own mask over the
        cache (a mapping ``{"full_attention": ..., "sliding_attention": ...}``, which
        transformers' Gemma3/Gemma4 and Qwen models take), the sliding one limited to the
        keys of the last ``sliding_window`` positions. It is put in eval mode.
    feature_layers : sequence of int
        The draft's ``target_layer_ids``: ``-1`` the embedding output, ``l`` the raw output of
        decoder layer ``l`` (the last layer allowed), concatenated in this order.
    few_row_linears : bool
        Run the model's linear layers through
        :class:`dspark_ops.models.cpu_linear.CpuLinears` during this adapter's forwards
        (float32 on the CPU with MKL; elsewhere it changes nothing):
        a verify forward of a few tokens then costs about what a plain step does. Outside the
        adapter's calls the model is unchanged.

    Notes
    -----
    What this costs compared with a serving engine: the K/V cache is transformers' contiguous
    ``DynamicCache`` of the whole batch, not a paged one. Every forward appends its padded
    width to every request (a verify round appends ``max_b(1 + num_verify[b])`` slots, a
    prefill the longest prompt), and the rows a request does not keep (padding, rejected
    drafts) stay in memory as holes hidden by a dense ``[B, 1, T, S]`` additive attention mask
    (one per kind of layer) rebuilt every forward; nothing is compacted, so the cache grows by
    the verify width per round rather than by the accepted length, and attention reads the
    holes too (sliding layers included: their window is a mask, not an eviction). The ragged
    verify batch is run padded, one model forward per round for the whole batch, through
    transformers' eager/SDPA attention (no FlashAttention varlen kernel, no CUDA graphs).
    Correct, batched and simple; for speed-ups that carry over to production, wire the ops into
    an engine.
    """

    def __init__(self, model, feature_layers: Sequence[int], few_row_linears: bool = True):
        config = _text_config(model.config)
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in _SUPPORTED_ATTENTION:
            raise ValueError(f"attn_implementation {attention!r} is not supported: load the model "
                             f"with attn_implementation in {_SUPPORTED_ATTENTION}")
        self.sliding_window = _sliding_window(config)
        self.model = model.eval()
        self.config = config
        self.layers = _decoder_layers(model)
        self.linears = CpuLinears(model) if few_row_linears else contextlib.nullcontext()
        depth = len(self.layers)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        ids = self.feature_layers
        if (not ids or not all(-1 <= i < depth for i in ids)
                or any(a >= b for a, b in zip(ids, ids[1:]))):
            raise ValueError(f"feature_layers {list(ids)}: strictly increasing ids, each -1 "
                             f"(embedding output) or a decoder layer in [0, {depth})")
        parameters = inspect.signature(model.forward).parameters
        # transformers >= 5.2x names the cache argument ``cache``; earlier versions
        # ``past_key_values``.
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in parameters
        self._captured: dict = {}
        self._capturing = False
        self._hooks = []
        if -1 in self.feature_layers:
            self._hooks.append(self.layers[0].register_forward_pre_hook(
                self._capture_input, with_kwargs=True))
        for layer_id in sorted(set(self.feature_layers) - {-1}):
            self._hooks.append(self.layers[layer_id].register_forward_hook(
                self._capture_output(layer_id)))

    # -- feature capture ---------------------------------------------------------------------

    def _capture_input(self, module, args, kwargs):
        if self._capturing:
            self._captured[-1] = args[0] if args else kwargs["hidden_states"]

    def _capture_output(self, layer_id: int):
        def hook(module, args, output):
            if self._capturing:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def close(self) -> None:
        """Removes the feature hooks from the model."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- the target interface ----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def new_cache(self, num_rows: int, length: int) -> _Cache:
        """An empty cache for ``num_rows`` requests (``length`` is not preallocated: the
        transformers cache grows)."""
        from transformers import DynamicCache

        return _Cache(DynamicCache(), num_rows, self.device)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, num_valid: torch.Tensor, cache: _Cache,
                 cache_len: torch.Tensor, logits_at: Optional[Sequence[int]] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Padded forward: request ``b``'s first ``num_valid[b]`` tokens of ``input_ids[b]`` at
        positions ``cache_len[b] + i``, attending to its committed rows and causally to each
        other. Rows of the previous forward past ``cache_len[b]`` are dropped (hidden) first.

        Returns ``logits [B, T, V]`` (``[B, 1, V]``, row ``logits_at[b]`` of request ``b``,
        when ``logits_at`` is given: the LM head then runs on those rows only, as
        ``model.generate``'s prefill) and ``features [B, T, n_layers * hidden]``.
        """
        batch, width = input_ids.shape
        device = input_ids.device
        with torch.profiler.record_function("dspark_ops.hf_mask_and_cache"):
            cache.commit(cache_len)
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            visible = torch.cat([cache.visible[:, None, :].expand(batch, width, -1),
                                 causal.expand(batch, width, width)], -1)
            positions = cache_len.long()[:, None] + torch.arange(width, device=device)
            mask = self._additive(visible)
            if self.sliding_window is not None:
                # Sliding layers see the keys of the last `window` positions (query included),
                # transformers' sliding overlay: key position > query position - window.
                keys = torch.cat([cache.positions, positions], 1)  # [B, S + T]
                near = keys[:, None, :] > positions[:, :, None] - self.sliding_window
                mask = {"full_attention": mask,
                        "sliding_attention": self._additive(visible & near)}
        extra = {}
        if logits_at is not None and self._logits_to_keep:
            keep = sorted(set(int(i) for i in logits_at))
            extra["logits_to_keep"] = torch.tensor(keep, device=device)
        with torch.profiler.record_function("dspark_ops.hf_model"):
            with self.linears:
                out, features = self.capture_features(lambda: self.model(
                    input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    use_cache=True, **{self._cache_argument: cache.hf_cache}, **extra))
        with torch.profiler.record_function("dspark_ops.hf_mask_and_cache"):
            cache.append(width, cache_len)
        logits = out.logits
        if logits_at is not None:
            columns = ([keep.index(int(i)) for i in logits_at] if extra
                       else [int(i) for i in logits_at])
            logits = logits[torch.arange(batch, device=device),
                            torch.tensor(columns, device=device)][:, None]
        return logits, features

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """A boolean ``[B, T, S]`` visibility as the additive ``[B, 1, T, S]`` mask."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
        return mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None]

    def capture_features(self, run: Callable[[], Any]) -> Tuple[Any, torch.Tensor]:
        """Calls ``run()`` (a forward of this model or its backbone) with the feature hooks on.

        Returns ``run()``'s result and the hooked layers' outputs concatenated along the last
        dimension (``[..., n_layers * hidden]``, the layout of :meth:`forward`'s features)."""
        self._captured.clear()
        self._capturing = True
        try:
            out = run()
        finally:
            self._capturing = False
        features = torch.cat([self._captured.pop(i) for i in self.feature_layers], -1)
        self._captured.clear()
        return out, features

    def forward_ragged(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache: _Cache,
                       cache_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The ragged verify batch of :func:`dspark_ops.pack_verify_inputs`, run padded."""
        return forward_ragged(self, input_ids, cu_seqlens, cache, cache_len)
