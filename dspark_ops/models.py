"""A DSpark draft model and a small causal target model, built from :mod:`dspark_ops.modules`.

:class:`DSparkDraft` is the whole draft of a DSpark round: the parallel backbone of
:mod:`dspark_ops.modules` plus the shared (frozen) token embedding and LM head, the Markov head
(``markov_head.markov_w1`` / ``markov_w2``, optionally the RNN head's ``joint_proj``) and the
confidence head (``confidence_head.proj``). With ``markov_rank = 0`` and no confidence head it is
a DFlash draft (the same backbone; the base logits are the proposal). Parameter names and shapes
are those of DeepSpec's Qwen3 DSpark and DFlash drafts, so such a checkpoint loads with
``load_state_dict(strict=True)``; :meth:`DSparkDraft.from_pretrained` reads a local directory
holding ``config.json`` and ``model.safetensors`` (sharded or not; or a ``.pt``/``.bin`` state
dict) without extra dependencies, and :meth:`DSparkDraft.save_pretrained` writes one that
DeepSpec's own loader reads. :class:`DSparkConfig` reads both the transformers 4.x and 5.x config
layouts and refuses, naming the field, whatever this library does not implement.

:class:`TinyTarget` is a Qwen3-style causal LM (embedding, decoder layers with per-head q/k
RMSNorm and RoPE, final norm, LM head) with a K/V cache, small enough to run offline on CPU, that
returns the raw outputs of chosen layers as the draft's context features. It takes the ragged
verify batch of :func:`dspark_ops.pack_verify_inputs` directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .modules import DraftAttention, DraftBackbone, DraftConfig, DraftMLP, RMSNorm
from .ops.attention import append_context_kv
from .ops.draft import DraftOutput, draft_confidence, markov_draft, rnn_draft
from .sampling import filter_logits
from .ops.random import philox_uniform

__all__ = [
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraft",
    "MarkovHead",
    "TargetConfig",
    "TinyTarget",
    "forward_ragged",
    "load_state_dict_file",
    "sample_base_logits",
    "save_safetensors",
]


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
    """A state dict from ``.safetensors`` (read natively), a sharded checkpoint's
    ``*.safetensors.index.json`` (every shard it names) or a ``torch.save`` file."""
    if path.endswith(".safetensors.index.json"):
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(_read_safetensors(os.path.join(os.path.dirname(path), shard)))
        return state
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def save_safetensors(tensors: dict, path: str) -> None:
    """Writes ``tensors`` (name -> tensor) as one ``.safetensors`` file, readable by the
    ``safetensors`` library and by :func:`load_state_dict_file`."""
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in names:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


# ------------------------------------------------------------------------------------------------
# The draft model


MARKOV_HEAD_TYPES = ("vanilla", "rnn")

# Fields of DeepSpec's draft configs (a copy of the target's transformers config plus its own)
# that do not change what the draft computes at inference: read and dropped.
_INFERENCE_NEUTRAL_FIELDS = frozenset({
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    "max_window_layers",  # only meaningful with use_sliding_window, which is refused
    "output_attentions", "output_hidden_states", "return_dict",
    # what every transformers config carries (task heads, encoder-decoder switches)
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",
})
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                    "target_layer_ids", "block_size", "mask_token_id", "markov_rank",
                    "enable_confidence_head")
_COPIED_FIELDS = _REQUIRED_FIELDS + ("attention_bias", "target_hidden_size", "num_anchors",
                                     "max_position_embeddings")


def _rope_theta(values: dict) -> float:
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

    @property
    def is_dflash(self) -> bool:
        """No sequential head: the block's base logits are the proposal."""
        return self.markov_rank == 0

    @classmethod
    def from_dict(cls, values: dict) -> "DSparkConfig":
        """Reads a DeepSpec draft ``config.json`` (transformers 4.x or 5.x layout).

        Raises ``ValueError`` naming the field for anything not implemented here (RoPE scaling,
        sliding-window layers, tied embeddings, an activation other than SiLU, a Markov head
        other than vanilla/rnn, a model other than Qwen3's) and for missing required fields;
        fields that do not affect inference (token ids, dtype, training-only settings) are
        dropped, and unknown fields are dropped with a warning.
        """
        values = dict(values)
        missing = [name for name in _REQUIRED_FIELDS if name not in values]
        if missing:
            raise ValueError(f"config is missing the field(s) {missing}")
        if values.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"config field 'model_type' is {values['model_type']!r}: only Qwen3 "
                             "drafts ('qwen3') are implemented")
        architectures = values.get("architectures") or ["Qwen3DSparkModel"]
        if list(architectures) != ["Qwen3DSparkModel"]:
            raise ValueError(f"config field 'architectures' is {architectures}: only "
                             "'Qwen3DSparkModel' drafts (DSpark or DFlash) are implemented")
        if values.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config field 'hidden_act' is {values['hidden_act']!r}: the draft "
                             "MLP implements 'silu'")
        if values.get("tie_word_embeddings", False):
            raise ValueError("config field 'tie_word_embeddings' is true: DeepSpec drafts keep "
                             "lm_head separate and this loader expects it in the checkpoint")
        layer_types = values.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config field 'layer_types' is {layer_types}: only "
                             "'full_attention' draft layers are implemented")
        if values.get("use_sliding_window", False):
            raise ValueError("config field 'use_sliding_window' is true: sliding-window draft "
                             "layers are not implemented")
        if values.get("sliding_window") is not None and "use_sliding_window" not in values:
            raise ValueError("config field 'sliding_window' is set: sliding-window draft layers "
                             "are not implemented")
        kwargs = {name: values[name] for name in _COPIED_FIELDS if values.get(name) is not None}
        kwargs["rope_theta"] = _rope_theta(values)
        if values.get("num_target_layers") is not None:
            kwargs["target_num_hidden_layers"] = int(values["num_target_layers"])
        head_dim = values.get("head_dim")
        kwargs["head_dim"] = (int(head_dim) if head_dim is not None
                              else values["hidden_size"] // values["num_attention_heads"])
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
        known = (set(_COPIED_FIELDS) | _INFERENCE_NEUTRAL_FIELDS
                 | {"model_type", "architectures", "hidden_act", "tie_word_embeddings",
                    "layer_types", "use_sliding_window", "sliding_window", "rope_theta",
                    "rope_parameters", "rope_scaling", "head_dim", "markov_head_type",
                    "confidence_head_with_markov", "num_target_layers"})
        unknown = sorted(set(values) - known)
        if unknown:
            warnings.warn(f"DSparkConfig: ignoring config field(s) this library does not read: "
                          f"{unknown}", stacklevel=2)
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

    def sample(self, base_logits, anchor, hidden, temperature, seed, position, **filters):
        """The block's tokens and draft logits: :func:`markov_draft` or :func:`rnn_draft`
        (``filters``: their ``top_k`` / ``top_p`` / ``min_p``)."""
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
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

    The same rule and random stream as :func:`dspark_ops.markov_draft` with a zero bias: slot
    ``j`` takes ``argmax_v z(v) / T - log(-log1p(-u_v))`` with the Philox uniforms of the draft
    stream of position ``p0 + 1 + j`` (greedy argmax when ``T <= 1e-5``), so the verifier's
    acceptance and resampling streams stay independent of the drafts. Sampling filters
    (per-request ``[B]``) apply as in :func:`dspark_ops.markov_draft`.

    Returns
    -------
    DraftOutput
        ``tokens`` int64 ``[B, G]`` and ``draft_logits``: ``base_logits`` as float32, -inf
        where a filter drops a token.
    """
    batch, block, vocab = base_logits.shape
    logits = base_logits.float()
    filters = {k: v[:, None].expand(batch, block) for k, v in
               (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)) if v is not None}
    if filters:
        logits = filter_logits(logits, temperature[:, None].expand(batch, block), **filters)
    slots = position.long()[:, None] + 1 + torch.arange(block, device=logits.device)
    uniforms = philox_uniform(seed.long().repeat_interleave(block), slots.reshape(-1), 0, vocab)
    noise = -torch.log(-torch.log1p(-uniforms.double())).reshape(batch, block, vocab)
    temp = temperature.double()[:, None, None]
    greedy = temp <= 1e-5
    scores = torch.where(greedy, logits.double(), logits.double() / temp.clamp_min(1e-5) + noise)
    return DraftOutput(scores.argmax(-1), logits)


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

        The weights are ``model.safetensors``, a sharded ``model.safetensors.index.json``,
        ``pytorch_model.bin`` or ``model.pt`` in ``path``. The config is read by
        :meth:`DSparkConfig.from_dict`, which refuses what this library does not implement.
        ``dtype`` defaults to float32 parameters (DeepSpec's drafts are stored in bfloat16).
        """
        with open(os.path.join(path, "config.json")) as f:
            config = DSparkConfig.from_dict(json.load(f))
        names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "model.pt")
        for name in names:
            weights = os.path.join(path, name)
            if os.path.exists(weights):
                break
        else:
            raise FileNotFoundError(f"none of {', '.join(names)} in {path}")
        model = cls(config)
        model.load_state_dict(load_state_dict_file(weights), strict=True)
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

    def propose(self, base_logits: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor,
                temperature: torch.Tensor, seed: torch.Tensor,
                position: torch.Tensor, **filters) -> DraftOutput:
        """The block's drafts and the logits they were sampled from: the Markov or RNN head, or
        for a DFlash draft (no head) the base logits themselves (:func:`sample_base_logits`);
        ``filters`` are the sampling filters (``top_k``, ``top_p``, ``min_p``) of both."""
        if self.markov_head is None:
            return sample_base_logits(base_logits, temperature, seed, position, **filters)
        return self.markov_head.sample(base_logits, anchor, hidden, temperature, seed, position,
                                       **filters)

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
                cache_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Padded forward: request ``b``'s ``num_valid[b]`` tokens ``input_ids[b]`` sit at
        positions ``cache_len[b] + i``; their K/V are written to the cache there. ``cache_len``
        is what the caller has committed: rows written past it by an earlier call (rejected
        drafts) are overwritten, so committing the accepted rows is advancing ``cache_len``.

        Returns ``logits [B, T, V]`` and ``features [B, T, n_layers * hidden]``.
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
