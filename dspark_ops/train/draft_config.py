"""The draft's config from the target's, as DeepSpec's ``build_draft_config``: the target layers
the draft reads, the RoPE base, the mask token, and one builder per draft family (the family is
the registry's choice, :func:`dspark_ops.models.registry.family_to_train`); a new draft from it.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import List, Sequence

import torch
from torch import nn

from ..models import DSparkConfig, Eagle3Config, Gemma4DSparkConfig
from ..models.config import rope_theta_of
from ..models.registry import GEMMA4_MODEL_TYPES, family_of, family_of_config, family_to_train

__all__ = ["build_draft_config", "check_draft_fits_target", "check_target_layers",
           "copy_target_layers", "default_target_layers", "init_draft", "mask_token_id",
           "text_config"]


def text_config(config):
    """The text model's config of a transformers config (a multimodal one keeps it apart)."""
    return getattr(config, "text_config", None) or config


def default_target_layers(num_layers: int, count: int = 5) -> List[int]:
    """``count`` layer ids spread evenly from 1 to ``num_layers - 3`` (DeepSpec's Qwen3 drafts:
    ``[1, 9, 17, 25, 33]`` of 36 layers), fewer on a shallow target; never the last layer."""
    last = max(num_layers - 3, 1)
    if num_layers < 3:
        return [-1] if num_layers < 2 else [0]
    ids = sorted({round(1 + (last - 1) * i / (count - 1)) for i in range(count)})
    return [i for i in ids if i < num_layers - 1] or [0]


def check_target_layers(ids: Sequence[int], depth: int) -> List[int]:
    """``ids`` as a list, after checking them against a ``depth``-layer target."""
    ids = [int(i) for i in ids]
    if not ids:
        raise SystemExit("--target-layers: at least one layer id")
    for i in ids:
        if i == depth - 1:
            raise SystemExit(f"--target-layers {ids}: {i} is the target's final layer; its "
                             "output is what the draft predicts from, DeepSpec forbids it as a "
                             f"feature (use ids in {{-1}} U [0, {depth - 2}])")
        if not -1 <= i < depth - 1:
            raise SystemExit(f"--target-layers {ids}: {i} is out of range for a {depth}-layer "
                             f"target (ids in {{-1}} U [0, {depth - 2}]; -1: the embedding "
                             "output)")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise SystemExit(f"--target-layers {ids}: must be strictly increasing")
    return ids


def _rope_theta(text) -> float:
    """The target's RoPE base, by the rule every draft config reads it with
    (:func:`dspark_ops.models.config.rope_theta_of`: either transformers layout, plain RoPE
    only)."""
    values = {name: getattr(text, name, None)
              for name in ("rope_theta", "rope_parameters", "rope_scaling")}
    try:
        return rope_theta_of(values)
    except ValueError as error:
        raise SystemExit(f"--target: {error}") from None


def mask_token_id(tokenizer, vocab_size: int) -> int:
    """The id the draft embeds in a block's masked slots: the tokenizer's mask token, else a row
    no text maps to, else a spare added token."""
    mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mask is not None:
        return int(mask)
    if tokenizer is not None and len(tokenizer) < vocab_size:
        return len(tokenizer)  # an embedding row no text maps to (Qwen3: 151669)
    # Every row is a token (SmolLM2): borrow the last added token that plain text, the chat
    # template and generation never produce (SmolLM2: 16, ``<empty_output>``).
    if tokenizer is not None:
        used = {getattr(tokenizer, f"{kind}_token_id", None)
                for kind in ("bos", "eos", "pad", "unk", "sep", "cls")}
        template = getattr(tokenizer, "chat_template", None) or ""
        template = template if isinstance(template, str) else json.dumps(template)
        spare = [i for text, i in tokenizer.get_added_vocab().items()
                 if i not in used and text not in template and i < vocab_size]
        if spare:
            return max(spare)
    raise SystemExit("no mask token: the tokenizer has none, uses every embedding row and has "
                     "no spare added token; pass --mask-token-id")


def build_draft_config(target_config, args: argparse.Namespace, tokenizer=None):
    """The draft's config, as DeepSpec's ``build_draft_config``: the target's sizes (attention,
    MLP, norms, RoPE, vocabulary) with ``num_hidden_layers`` draft layers, untied embeddings, the
    target layer ids, the block size, the mask token and the heads (an Eagle3 draft: one layer,
    ``ttt_length`` = the block size); or ``--config`` checked against the target. The family is
    the registry's for ``--arch`` and the target's ``model_type``.

    Raises
    ------
    SystemExit
        Target layers out of range or naming the final layer; a ``--config`` whose hidden size,
        vocabulary or target depth does not match the target.
    """
    text = text_config(target_config)
    depth = int(text.num_hidden_layers)
    family = family_to_train(getattr(args, "arch", "dspark"), getattr(text, "model_type", None))
    if args.config:
        config = _read_config_file(args.config, family.drafting)
        check_draft_fits_target(config, text, f"--config {args.config}")
    else:
        config = _BUILDERS[family.name](text, args, tokenizer)
    check_target_layers(config.target_layer_ids, depth)
    config.target_num_hidden_layers = depth
    return config


def _read_config_file(path: str, drafting: str):
    """A draft ``config.json`` read by the config class of its family among those that draft
    as ``--arch`` asks (a block's config by its ``model_type``, an Eagle3 chain's as such)."""
    try:
        with open(path) as f:
            values = json.load(f)
        return family_of_config(values, drafting=drafting).config_class.from_dict(values)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--config {path}: {error}") from None


def check_draft_fits_target(config, text, what: str) -> None:
    """Refuses a draft config (``what`` names where it came from) whose target features, hidden
    size, vocabulary or target depth differ from the target's (the embedding and LM head are
    copied from the target)."""
    width = config.target_hidden_size or config.hidden_size
    if width != text.hidden_size:
        raise SystemExit(f"{what}: the draft reads {width}-wide target features; the target's "
                         f"hidden size is {text.hidden_size}")
    if config.hidden_size != text.hidden_size:
        raise SystemExit(f"{what}: hidden_size {config.hidden_size} differs from the target's "
                         f"{text.hidden_size} (the embedding and LM head are copied from the "
                         "target)")
    if config.vocab_size != text.vocab_size:
        raise SystemExit(f"{what}: vocab_size {config.vocab_size} differs from the target's "
                         f"{text.vocab_size}")
    depth = int(text.num_hidden_layers)
    if config.target_num_hidden_layers not in (None, depth):
        raise SystemExit(f"{what}: made for a {config.target_num_hidden_layers}-layer target; "
                         f"this one has {depth}")
    check_target_layers(config.target_layer_ids, depth)


def _target_layers(text, args) -> List[int]:
    depth = int(text.num_hidden_layers)
    return check_target_layers(args.target_layers if args.target_layers is not None
                               else default_target_layers(depth), depth)


def _block_fields(text, args, tokenizer) -> dict:
    """The fields every block draft (DSpark, DFlash; Qwen3 or Gemma4) takes from the flags:
    target layers, block, mask token, heads, anchors."""
    dflash = args.arch == "dflash"
    rank = args.markov_rank if args.markov_rank is not None else (0 if dflash else 256)
    layers = _target_layers(text, args)
    confidence = not dflash and rank > 0 and args.confidence_weight != 0
    mask = (args.mask_token_id if args.mask_token_id is not None
            else mask_token_id(tokenizer, int(text.vocab_size)))
    if not 0 <= mask < text.vocab_size:
        raise SystemExit(f"--mask-token-id {mask} is outside the vocabulary [0, "
                         f"{text.vocab_size})")
    return dict(target_layer_ids=list(layers), block_size=int(args.block_size),
                mask_token_id=int(mask), markov_rank=int(rank), markov_head_type=args.markov_head,
                enable_confidence_head=confidence, confidence_head_with_markov=confidence,
                num_anchors=int(args.anchors))


def _qwen3_sizes(text) -> dict:
    """A Qwen3-style draft layer's sizes, norm and RoPE from the target's config."""
    heads = int(text.num_attention_heads)
    return dict(
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(text.intermediate_size),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(text),
        attention_bias=bool(getattr(text, "attention_bias", False)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 40960)),
    )


def _qwen3_config(text, args, tokenizer) -> DSparkConfig:
    """A Qwen3 DSpark/DFlash draft's config (any target that is not Gemma4's)."""
    fields = _block_fields(text, args, tokenizer)
    fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
    return DSparkConfig(num_hidden_layers=int(args.num_layers),
                        target_num_hidden_layers=int(text.num_hidden_layers),
                        **_qwen3_sizes(text), **fields)


def _gemma4_text_values(text) -> dict:
    """A Gemma4 text config as a dict with ``global_head_dim`` and ``num_global_key_value_heads``
    at the top level, where DeepSpec's draft configs keep them (transformers 5.17 and later move
    them into the full-attention layers' ``per_layer_config`` view)."""
    values = text.to_dict()
    if values.get("global_head_dim") is None:
        full = [i for i, t in enumerate(text.layer_types) if t == "full_attention"]
        view = text.per_layer_config[full[0]] if hasattr(text, "per_layer_config") else text
        values["global_head_dim"] = int(view.head_dim)
        values["num_global_key_value_heads"] = int(view.num_key_value_heads)
    values.pop("per_layer_config", None)
    values["num_target_layers"] = int(text.num_hidden_layers)
    return values


def _from_copied_target(config_class, values: dict, flag: str):
    """``config_class.from_dict`` of a copy of the target's config plus the draft's fields (its
    refusals named after ``flag``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fields of the copied transformers config
            return config_class.from_dict(values)
    except ValueError as error:
        raise SystemExit(f"{flag}: {error}") from None


def _gemma4_config(text, args, tokenizer) -> Gemma4DSparkConfig:
    """A Gemma4 DSpark/DFlash draft's config, as DeepSpec's Gemma4 ``build_draft_config``: a copy
    of the target's text config (with ``global_head_dim`` and ``num_global_key_value_heads``
    read back from the full-attention layers' view where transformers moved them) and the
    draft's fields, read by :meth:`Gemma4DSparkConfig.from_dict` (which refuses what it does not
    implement)."""
    fields = _block_fields(text, args, tokenizer)
    values = _gemma4_text_values(text)
    values.update(architectures=["Gemma4DSparkModel"], num_hidden_layers=int(args.num_layers),
                  layer_types=["full_attention"] * int(args.num_layers),
                  tie_word_embeddings=False, num_target_layers=int(text.num_hidden_layers),
                  **fields)
    return _from_copied_target(Gemma4DSparkConfig, values, "--target")


def _eagle3_config(text, args, tokenizer=None) -> Eagle3Config:
    """An Eagle3 draft's config from the target's (DeepSpec's Eagle3 ``build_draft_config``):
    its sizes with one draft layer (Gemma4's layer arithmetic for a Gemma4 target), the target
    layers (no ``-1``), ``ttt_length`` = the block size."""
    layers = _target_layers(text, args)
    fields = dict(target_layer_ids=list(layers), ttt_length=int(args.block_size),
                  step_loss_decay=float(args.step_loss_decay))
    if getattr(text, "model_type", None) in GEMMA4_MODEL_TYPES:
        values = _gemma4_text_values(text)
        values.update(architectures=["Gemma4Eagle3Model"], num_hidden_layers=1,
                      draft_num_hidden_layers=1, layer_types=["full_attention"],
                      tie_word_embeddings=False, **fields)
        return _from_copied_target(Eagle3Config, values, "--arch eagle3")
    try:
        return Eagle3Config(family="qwen3", **_qwen3_sizes(text), **fields)
    except ValueError as error:
        raise SystemExit(f"--arch eagle3: {error}") from None


# Each registry family's builder (dspark_ops.models.registry.FAMILIES, by name).
_BUILDERS = {"qwen3": _qwen3_config, "gemma4": _gemma4_config, "eagle3": _eagle3_config}


def init_draft(config, target_model, initializer_range: float = 0.02,
               layers_from_target: bool = False):
    """A new draft of the config's family (:func:`~dspark_ops.models.registry.family_of`): linear
    and embedding weights ``N(0, initializer_range)``, biases 0, norms 1 (transformers'
    initialisation, which DeepSpec's drafts get), then the target's embedding and LM head copied
    in and frozen.

    ``layers_from_target``: draft layer ``i`` of ``n`` then starts from the target's layer
    ``L - n + i`` (its top layers, which already map hidden states toward the next token), every
    weight whose name and shape match, and the final norm from the target's; what the target
    has no counterpart for (the context projection, the heads, a Qwen3-style q/k norm over a
    Llama target) keeps the initialisation above. Trainable, unlike the embedding and LM head.
    """
    draft = family_of(config).draft_class(config)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, initializer_range)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        draft.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(target_model.get_output_embeddings().weight)
        if layers_from_target:
            copy_target_layers(draft, target_model)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    return draft


def copy_target_layers(draft: nn.Module, target_model) -> List[str]:
    """Copies the target's top layers (and final norm) into ``draft``'s layers, tensor by tensor
    where the names and shapes match (:func:`init_draft`); returns the draft tensors copied.
    Raises when the draft has no layer list, or when no tensor of a layer matches (another
    architecture: a silent no-op would train from scratch under the flag's name)."""
    from ..hf import _decoder_layers

    layers = getattr(draft, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(draft).__name__}: no 'layers' to start from the target's")
    source = _decoder_layers(target_model)
    if len(layers) > len(source):
        raise ValueError(f"the draft has {len(layers)} layers, the target only {len(source)}")
    copied: List[str] = []
    for i, layer in enumerate(layers):
        theirs = source[len(source) - len(layers) + i].state_dict()
        mine = layer.state_dict()
        names = [name for name, tensor in mine.items()
                 if name in theirs and theirs[name].shape == tensor.shape]
        if not names:
            raise ValueError(f"draft layer {i} ({type(layer).__name__}) shares no weight name "
                             f"and shape with the target's {type(source[0]).__name__}")
        for name in names:
            mine[name].copy_(theirs[name])
        copied += [f"layers.{i}.{name}" for name in names]
    norm = getattr(target_model.get_decoder(), "norm", None)
    if norm is not None and getattr(draft, "norm", None) is not None \
            and norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(norm.weight)
        copied.append("norm.weight")
    return copied
