"""``python -m dspark_ops.train``: trains a DSpark (or DFlash) draft for a transformers target,
with the target's features computed online, DeepSpec's recipe and checkpoint layout.

The recipe (DeepSpec's defaults, every one a flag):

- the draft config is the target's (a copy with ``num_hidden_layers`` draft layers, untied
  embeddings, the target layer ids and the mask token), as DeepSpec's ``build_draft_config``;
  the embedding and LM head are copied from the target and frozen;
- per sequence, 512 anchors, blocks of 7, Markov rank 256 (vanilla head), a confidence head on
  ``[h; W1[x]]``; DFlash (``--arch dflash``): no Markov or confidence head; Eagle3 (``--arch
  eagle3``): DeepSpec's one-layer Eagle3 draft, trained with its training-time test over
  ``--block-size`` steps, each step's soft cross-entropy against the target's next-token
  distribution weighted by ``--step-loss-decay ** k`` (:mod:`.eagle3`; ``ce`` in the metrics);
- the loss is :func:`dspark_ops.train.draft_loss` (fused): ``0.1 CE + 0.9 L1 + 1.0 BCE`` over
  the slots' weights ``exp(-k/4)``, CE alone for DFlash; the three denominators are summed over
  ranks and the loss multiplied by the world size, then divided by the gradient accumulation
  steps, as DeepSpec;
- AdamW (lr 6e-4, weight decay 0), linear warm-up over 4 % of the steps then cosine to 0,
  gradient clipping at 1.0, bfloat16 autocast on CUDA (float32 master weights);
- the target runs in the process under ``torch.no_grad`` (:class:`~.target.OnlineTarget`), or
  its features come from DeepSpec's offline cache (``--cache DIR``, written once with
  ``--write-cache``; :mod:`~.cache`).

Checkpoints: ``OUT/step_N/`` holds ``config.json`` + ``model.safetensors`` (what
:meth:`dspark_ops.models.DSparkDraft.from_pretrained` and DeepSpec's ``from_pretrained`` load),
``training_state.pt`` (optimiser, scheduler, random states, next step, the data schedule's
fingerprint) and ``train_args.json``; ``OUT/step_latest`` links to the newest. ``--resume``
continues from it exactly. At the end, the confidence head's sequential temperatures are fitted
on held-out samples (:func:`dspark_ops.fit_sequential_temperatures`) and written to the final
checkpoint's ``calibration.json``, which ``generate``/``eval`` read. Per step, ``OUT/metrics.jsonl``
gets the loss, its terms, DeepSpec's ``accept_rate@k`` and ``tau_probabilistic``, the learning
rate, gradient norm and throughput.

Data-parallel: run under ``torchrun --nproc-per-node N -m dspark_ops.train ...``
(DistributedDataParallel; gloo on CPU, NCCL on CUDA); rank 0 writes checkpoints and logs.

Example::

    python -m dspark_ops.prepare_data --target qwen3-4b --prompts prompts.jsonl --out train.jsonl
    python -m dspark_ops.train --target qwen3-4b --data train.jsonl --out runs/dspark \\
        --target-layers 1 9 17 25 33 --epochs 10 --grad-accum 64
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from typing import List, Optional, Sequence

import torch
from torch import nn

from ..models import (DSparkConfig, DSparkDraft, Eagle3Config, Eagle3Draft, Gemma4DSparkConfig,
                      load_draft)
from ..models.config import GEMMA4_MODEL_TYPES
from .eagle3 import eagle3_ttt_loss
from .data import Schedule, collate, read_training_data
from .forward import build_eval_mask, position_weights, sample_anchor_positions, training_forward
from .loss import block_metrics, draft_loss, loss_coefficients

__all__ = ["build_draft_config", "default_target_layers", "main", "parse_args", "Trainer"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}
STATE_FILE = "training_state.pt"
CALIBRATION_FILE = "calibration.json"


# ------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    io = parser.add_argument_group("input and output")
    io.add_argument("--target", required=True,
                    help="local directory of the transformers target (model and tokenizer)")
    io.add_argument("--data", required=True,
                    help="JSONL rows with 'input_ids' and 'loss_mask' (python -m "
                         "dspark_ops.prepare_data)")
    io.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl")
    io.add_argument("--resume", nargs="?", const="latest", default=None, metavar="STEP_DIR",
                    help="continue a run: from OUT/step_latest, or the checkpoint given")
    io.add_argument("--checkpoint-every", type=int, default=3000, help="optimiser steps")
    io.add_argument("--cache", default=None, metavar="DIR",
                    help="read the target's features from DeepSpec's offline cache in DIR "
                         "instead of running the target (a resumed run then never loads it)")
    io.add_argument("--write-cache", action="store_true",
                    help="write --cache DIR first (once: skipped when DIR already holds every "
                         "sample of --data for these target layers)")
    io.add_argument("--cache-dtype", choices=("bfloat16", "float16", "float32"),
                    default="bfloat16", help="of the cached hidden states (DeepSpec: bfloat16)")
    io.add_argument("--no-progress", action="store_true", help="no progress bar")

    model = parser.add_argument_group("draft")
    model.add_argument("--arch", choices=("dspark", "dflash", "eagle3"), default="dspark",
                       help="eagle3: DeepSpec's Eagle3 draft (one layer), trained with its "
                            "training-time test over --block-size steps (its ttt_length)")
    model.add_argument("--config", default=None,
                       help="a draft config.json (DeepSpec's fields) instead of the flags below")
    model.add_argument("--num-layers", type=int, default=5)
    model.add_argument("--block-size", type=int, default=7)
    model.add_argument("--markov-rank", type=int, default=None,
                       help="default 256 (dspark), 0 (dflash)")
    model.add_argument("--markov-head", choices=("vanilla", "rnn"), default="vanilla")
    model.add_argument("--target-layers", type=int, nargs="+", default=None,
                       help="target layer ids of the context features (-1: embedding output); "
                            "default 5 spread from layer 1 to the third-to-last, as DeepSpec's "
                            "Qwen3 configs ([1, 9, 17, 25, 33] of 36)")
    model.add_argument("--mask-token-id", type=int, default=None,
                       help="default: the tokenizer's mask token, else the first id past the "
                            "tokenizer (Qwen3: 151669)")
    model.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    model.add_argument("--step-loss-decay", type=float, default=0.8,
                       help="eagle3: weight decay**k of the k-th training-time-test step")

    loss = parser.add_argument_group("loss")
    loss.add_argument("--loss-decay-gamma", type=float, default=4.0)
    loss.add_argument("--ce-weight", type=float, default=None, help="dspark 0.1, dflash 1")
    loss.add_argument("--l1-weight", type=float, default=None, help="dspark 0.9, dflash 0")
    loss.add_argument("--confidence-weight", type=float, default=None,
                      help="dspark 1.0, dflash 0")
    loss.add_argument("--loss-impl", choices=("fused", "reference"), default="fused",
                      help="'reference': the eager formula (dspark_ops.reference.dspark_loss), "
                           "for comparisons")

    train = parser.add_argument_group("optimisation")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--max-steps", type=int, default=None,
                       help="optimiser steps (overrides --epochs)")
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--warmup-ratio", type=float, default=0.04)
    train.add_argument("--grad-clip", type=float, default=1.0)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--batch-tokens", type=int, default=4096,
                       help="padded tokens per rank and micro-step (sequences are packed into "
                            "micro-batches up to it)")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    train.add_argument("--max-length", type=int, default=4096, help="tokens per sequence")
    train.add_argument("--min-loss-tokens", type=int, default=None,
                       help="drop sequences with fewer trained tokens (default 2 x block size)")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--calibration-samples", type=int, default=None,
                       help="held-out samples for the confidence calibration (default 2 %% of "
                            "the data, at least 1 and at most 256; 0: none)")

    system = parser.add_argument_group("system")
    system.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    system.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the target's dtype and the autocast dtype (default: bfloat16 on "
                             "CUDA, float32 on CPU); the draft keeps float32 weights")
    return parser.parse_args(argv)


def _check_args(args: argparse.Namespace) -> None:
    positive = ("num_layers", "block_size", "anchors", "epochs", "batch_tokens", "grad_accum",
                "max_length", "checkpoint_every")
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 1:
        raise SystemExit(f"--max-steps must be >= 1, got {args.max_steps}")
    if not 0 <= args.warmup_ratio < 1:
        raise SystemExit(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    if not args.lr > 0:
        raise SystemExit(f"--lr must be > 0, got {args.lr}")
    if not args.loss_decay_gamma > 0:
        raise SystemExit(f"--loss-decay-gamma must be > 0, got {args.loss_decay_gamma}")
    if args.markov_rank is not None and args.markov_rank < 0:
        raise SystemExit(f"--markov-rank must be >= 0, got {args.markov_rank}")
    if args.write_cache and not args.cache:
        raise SystemExit("--write-cache needs --cache DIR (where to write it)")


# ------------------------------------------------------------------------------------------------
# The draft's config from the target's


def _text_config(config):
    return getattr(config, "text_config", None) or config


def default_target_layers(num_layers: int, count: int = 5) -> List[int]:
    """``count`` layer ids spread evenly from 1 to ``num_layers - 3`` (DeepSpec's Qwen3 drafts:
    ``[1, 9, 17, 25, 33]`` of 36 layers), fewer on a shallow target; never the last layer."""
    last = max(num_layers - 3, 1)
    if num_layers < 3:
        return [-1] if num_layers < 2 else [0]
    ids = sorted({round(1 + (last - 1) * i / (count - 1)) for i in range(count)})
    return [i for i in ids if i < num_layers - 1] or [0]


def _check_target_layers(ids: Sequence[int], depth: int) -> List[int]:
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


def _rope_theta(config) -> float:
    spec = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind != "default":
        raise SystemExit(f"the target uses RoPE scaling {kind!r}: the draft implements plain "
                         "RoPE only")
    theta = spec.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise SystemExit("the target's config has no rope_theta")
    return float(theta)


def _mask_token_id(tokenizer, vocab_size: int) -> int:
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


def build_draft_config(target_config, args: argparse.Namespace, tokenizer=None) -> DSparkConfig:
    """The draft's config, as DeepSpec's ``build_draft_config``: the target's sizes (attention,
    MLP, norms, RoPE, vocabulary) with ``num_hidden_layers`` draft layers, untied embeddings, the
    target layer ids, the block size, the mask token and the heads; or ``--config`` checked
    against the target.

    Raises
    ------
    SystemExit
        Target layers out of range or naming the final layer; a ``--config`` whose hidden size,
        vocabulary or target depth does not match the target.
    """
    text = _text_config(target_config)
    depth = int(text.num_hidden_layers)
    if getattr(args, "arch", "dspark") == "eagle3":
        return _eagle3_config(text, args)
    if args.config:
        try:
            with open(args.config) as f:
                config = DSparkConfig.from_dict(json.load(f))
        except (OSError, ValueError) as error:
            raise SystemExit(f"--config {args.config}: {error}") from None
        width = config.target_hidden_size or config.hidden_size
        if width != text.hidden_size:
            raise SystemExit(f"--config {args.config}: the draft reads {width}-wide target "
                             f"features; the target's hidden size is {text.hidden_size}")
        if config.hidden_size != text.hidden_size:
            raise SystemExit(f"--config {args.config}: hidden_size {config.hidden_size} differs "
                             f"from the target's {text.hidden_size} (the embedding and LM head "
                             "are copied from the target)")
        if config.vocab_size != text.vocab_size:
            raise SystemExit(f"--config {args.config}: vocab_size {config.vocab_size} differs "
                             f"from the target's {text.vocab_size}")
        if config.target_num_hidden_layers not in (None, depth):
            raise SystemExit(f"--config {args.config}: made for a "
                             f"{config.target_num_hidden_layers}-layer target; this one has "
                             f"{depth}")
        _check_target_layers(config.target_layer_ids, depth)
        config.target_num_hidden_layers = depth
        return config
    dflash = args.arch == "dflash"
    rank = args.markov_rank if args.markov_rank is not None else (0 if dflash else 256)
    layers = _check_target_layers(args.target_layers if args.target_layers is not None
                                  else default_target_layers(depth), depth)
    confidence = not dflash and rank > 0 and args.confidence_weight != 0
    mask = (args.mask_token_id if args.mask_token_id is not None
            else _mask_token_id(tokenizer, int(text.vocab_size)))
    if not 0 <= mask < text.vocab_size:
        raise SystemExit(f"--mask-token-id {mask} is outside the vocabulary [0, "
                         f"{text.vocab_size})")
    if getattr(text, "model_type", None) in GEMMA4_MODEL_TYPES:
        return _gemma4_config(text, args, layers, mask, rank, confidence, depth)
    heads = int(text.num_attention_heads)
    return DSparkConfig(
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(text.intermediate_size),
        num_hidden_layers=int(args.num_layers),
        target_layer_ids=tuple(layers),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(text),
        attention_bias=bool(getattr(text, "attention_bias", False)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 40960)),
        block_size=int(args.block_size),
        mask_token_id=int(mask),
        markov_rank=int(rank),
        markov_head_type=args.markov_head,
        enable_confidence_head=confidence,
        confidence_head_with_markov=confidence,
        num_anchors=int(args.anchors),
        target_num_hidden_layers=depth,
    )


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


def _gemma4_config(text, args, layers, mask, rank, confidence, depth) -> DSparkConfig:
    """A Gemma4 DSpark/DFlash draft's config, as DeepSpec's Gemma4 ``build_draft_config``: a copy
    of the target's text config (with ``global_head_dim`` and ``num_global_key_value_heads``
    read back from the full-attention layers' view where transformers moved them) and the
    draft's fields, read by :meth:`Gemma4DSparkConfig.from_dict` (which refuses what it does not
    implement)."""
    values = _gemma4_text_values(text)
    values.update(architectures=["Gemma4DSparkModel"], num_hidden_layers=int(args.num_layers),
                  layer_types=["full_attention"] * int(args.num_layers),
                  tie_word_embeddings=False, target_layer_ids=list(layers),
                  block_size=int(args.block_size), mask_token_id=int(mask),
                  markov_rank=int(rank), markov_head_type=args.markov_head,
                  enable_confidence_head=confidence, confidence_head_with_markov=confidence,
                  num_anchors=int(args.anchors), num_target_layers=depth)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fields of the copied transformers config
            return Gemma4DSparkConfig.from_dict(values)
    except ValueError as error:
        raise SystemExit(f"--target: {error}") from None


def _eagle3_config(text, args: argparse.Namespace) -> Eagle3Config:
    """An Eagle3 draft's config from the target's (DeepSpec's Eagle3 ``build_draft_config``):
    its sizes with one draft layer, the target layers (no ``-1``), ``ttt_length`` = the block
    size; or ``--config`` (an Eagle3 ``config.json``) checked against the target."""
    depth = int(text.num_hidden_layers)
    if args.config:
        try:
            with open(args.config) as f:
                config = Eagle3Config.from_dict(json.load(f))
        except (OSError, ValueError) as error:
            raise SystemExit(f"--config {args.config}: {error}") from None
        if (config.hidden_size, config.vocab_size) != (text.hidden_size, text.vocab_size):
            raise SystemExit(f"--config {args.config}: hidden size / vocabulary "
                             f"{config.hidden_size} / {config.vocab_size} differ from the "
                             f"target's {text.hidden_size} / {text.vocab_size}")
    elif getattr(text, "model_type", None) in GEMMA4_MODEL_TYPES:
        layers = _check_target_layers(args.target_layers if args.target_layers is not None
                                      else default_target_layers(depth), depth)
        values = _gemma4_text_values(text)
        values.update(architectures=["Gemma4Eagle3Model"], num_hidden_layers=1,
                      draft_num_hidden_layers=1, layer_types=["full_attention"],
                      tie_word_embeddings=False, target_layer_ids=list(layers),
                      ttt_length=int(args.block_size),
                      step_loss_decay=float(args.step_loss_decay))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fields of the copied transformers config
                config = Eagle3Config.from_dict(values)
        except ValueError as error:
            raise SystemExit(f"--arch eagle3: {error}") from None
    else:
        layers = _check_target_layers(args.target_layers if args.target_layers is not None
                                      else default_target_layers(depth), depth)
        heads = int(text.num_attention_heads)
        try:
            config = Eagle3Config(
                family="qwen3", vocab_size=int(text.vocab_size),
                hidden_size=int(text.hidden_size), num_attention_heads=heads,
                num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                intermediate_size=int(text.intermediate_size),
                rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(text),
                attention_bias=bool(getattr(text, "attention_bias", False)),
                max_position_embeddings=int(getattr(text, "max_position_embeddings", 40960)),
                target_layer_ids=tuple(layers), ttt_length=int(args.block_size),
                step_loss_decay=float(args.step_loss_decay))
        except ValueError as error:
            raise SystemExit(f"--arch eagle3: {error}") from None
    _check_target_layers(config.target_layer_ids, depth)
    config.target_num_hidden_layers = depth
    return config


def init_draft(config, target_model, initializer_range: float = 0.02):
    """A new draft (:class:`DSparkDraft`, or :class:`Eagle3Draft` for an Eagle3 config): linear
    and embedding weights ``N(0, initializer_range)``, biases 0, norms 1 (transformers'
    initialisation, which DeepSpec's drafts get), then the target's embedding and LM head copied
    in and frozen."""
    draft = (Eagle3Draft if isinstance(config, Eagle3Config) else config.draft_class())(config)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, initializer_range)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        draft.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(target_model.get_output_embeddings().weight)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    return draft


# ------------------------------------------------------------------------------------------------
# Schedule of the learning rate


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """DeepSpec's schedule: ``(step + 1) / warmup`` for the first ``warmup`` steps, then a cosine
    from 1 to 0 over the rest (``step`` is 0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))


# ------------------------------------------------------------------------------------------------
# Distributed helpers


@dataclasses.dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()


def _init_distributed(device_arg: Optional[str]) -> tuple:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        device = torch.device(device_arg or ("cuda" if torch.cuda.is_available() else "cpu"))
        return _Dist(), device
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(device_arg or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend)
    return _Dist(rank, world, local), device


class _DraftStep(nn.Module):
    """The draft's training forward and loss as one module, so that DistributedDataParallel sees
    one forward per micro-step."""

    def __init__(self, draft: DSparkDraft, loss_kwargs: dict):
        super().__init__()
        self.draft = draft
        self.loss_kwargs = loss_kwargs

    def forward(self, input_ids, features, loss_mask, last_hidden, anchors, keep, denominators,
                valid=None):
        if isinstance(self.draft, Eagle3Draft):
            return eagle3_ttt_loss(self.draft, input_ids, features, loss_mask, last_hidden,
                                   valid)
        batch = training_forward(self.draft, input_ids, features, loss_mask, last_hidden,
                                 anchor_positions=anchors, block_keep_mask=keep)
        out = draft_loss(self.draft, batch, denominators=denominators, **self.loss_kwargs)
        return out, batch.eval_mask, batch.block_keep_mask, batch.confidence_logits


# ------------------------------------------------------------------------------------------------
# Checkpoints


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _link_latest(out: str, name: str) -> None:
    link = os.path.join(out, "step_latest")
    tmp = os.path.join(out, f".step_latest.{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, link)


def load_checkpoint(path: str) -> dict:
    """The training state of a checkpoint directory, after checking it is whole.

    Raises
    ------
    SystemExit
        Naming what is missing or unreadable.
    """
    if not os.path.isdir(path):
        raise SystemExit(f"--resume: {path} is not a checkpoint directory")
    for name in ("config.json", "model.safetensors", STATE_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise SystemExit(f"--resume: corrupt checkpoint {path}: {name} is missing")
    try:
        state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu",
                           weights_only=False)
    except Exception as error:  # a truncated or foreign file: say which
        raise SystemExit(f"--resume: corrupt checkpoint {path}: {STATE_FILE} does not load "
                         f"({type(error).__name__}: {error})") from None
    keys = {"next_step", "optimizer", "scheduler", "rng", "schedule"}
    if not isinstance(state, dict) or not keys <= set(state):
        raise SystemExit(f"--resume: corrupt checkpoint {path}: {STATE_FILE} lacks "
                         f"{sorted(keys - set(state) if isinstance(state, dict) else keys)}")
    try:
        state["draft"] = load_draft(path)
    except Exception as error:
        raise SystemExit(f"--resume: corrupt checkpoint {path}: the draft does not load "
                         f"({type(error).__name__}: {error})") from None
    return state


# ------------------------------------------------------------------------------------------------
# The trainer


def _progress(total: int, initial: int, enabled: bool, desc: str = "train", unit: str = "step"):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


def _peak_memory(device: torch.device) -> float:
    """Peak memory in MiB: the CUDA allocator's high-water mark, or the process's peak resident
    set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:
        return float("nan")


class Trainer:
    """Everything of one training run; :meth:`train` runs it. Built from the parsed flags
    (:func:`parse_args`); checks everything it can before loading the target's weights."""

    def __init__(self, args: argparse.Namespace):
        _check_args(args)
        self.args = args
        self.dist, self.device = _init_distributed(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        self.dtype = DTYPES[args.dtype] if args.dtype else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.autocast = self.device.type == "cuda" and self.dtype in (torch.bfloat16,
                                                                      torch.float16)
        try:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        except ImportError as error:
            raise SystemExit("training needs transformers: pip install --no-build-isolation "
                             "'.[hf]'") from error

        # Everything cheap first: flags, target config, data, checkpoint.
        try:
            target_config = AutoConfig.from_pretrained(args.target)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--target {args.target}: {error}") from None
        text = _text_config(target_config)
        tokenizer = None
        if args.mask_token_id is None and not args.config:
            try:
                tokenizer = AutoTokenizer.from_pretrained(args.target)
            except (OSError, ValueError):
                tokenizer = None
        self.resume_state = None
        if args.resume is not None:
            path = (os.path.join(args.out, "step_latest") if args.resume == "latest"
                    else args.resume)
            if args.resume == "latest" and not os.path.lexists(path):
                raise SystemExit(f"--resume: no {path} (no checkpoint in --out yet)")
            self.resume_state = load_checkpoint(os.path.realpath(path))
            self.resume_path = os.path.realpath(path)
            config = self.resume_state["draft"].config
            width = config.target_hidden_size or config.hidden_size
            if (width != text.hidden_size or config.vocab_size != text.vocab_size
                    or config.target_num_hidden_layers not in (None, text.num_hidden_layers)):
                raise SystemExit(f"--resume: the checkpoint's draft ({config.hidden_size} "
                                 f"hidden, vocabulary {config.vocab_size}) does not fit the "
                                 f"target {args.target}")
            _check_target_layers(config.target_layer_ids, int(text.num_hidden_layers))
        else:
            config = build_draft_config(target_config, args, tokenizer)
        self.config = config
        block = config.block_size
        min_tokens = args.min_loss_tokens if args.min_loss_tokens is not None else 2 * block
        samples, dropped = read_training_data(args.data, vocab_size=int(text.vocab_size),
                                              max_length=args.max_length,
                                              min_loss_tokens=min_tokens)
        self.dropped = dropped
        holdout = args.calibration_samples
        if holdout is None:
            holdout = min(256, max(1, len(samples) // 50)) if len(samples) >= 10 else 0
        if not config.enable_confidence_head:
            holdout = 0
        if holdout >= len(samples):
            raise SystemExit(f"--calibration-samples {holdout}: only {len(samples)} samples")
        order = torch.randperm(len(samples),
                               generator=torch.Generator().manual_seed(args.seed)).tolist()
        held = sorted(order[len(samples) - holdout:]) if holdout else []
        held_set = set(held)
        self.calibration_samples = [samples[i] for i in held]
        self.train_samples = [s for i, s in enumerate(samples) if i not in held_set]
        self.schedule = Schedule(self.train_samples, batch_tokens=args.batch_tokens,
                                 world_size=self.dist.world_size, grad_accum=args.grad_accum,
                                 seed=args.seed, epochs=args.epochs, max_steps=args.max_steps)
        self.total_steps = self.schedule.total_steps
        if self.resume_state is not None:
            saved = self.resume_state["schedule"]
            now = self.schedule.fingerprint()
            if saved != now:
                diff = {k: (saved.get(k), now.get(k)) for k in set(saved) | set(now)
                        if saved.get(k) != now.get(k)}
                raise SystemExit(f"--resume: the checkpoint was made with another data schedule "
                                 f"(checkpoint, now): {diff}; resume with the same --data, "
                                 "--seed, --batch-tokens, --grad-accum, --epochs/--max-steps "
                                 "and number of processes")

        # The offline cache, when asked for: checked before the target loads.
        from .cache import TargetCache

        self.cache = None
        write = False
        if args.cache:
            everything = self.train_samples + self.calibration_samples
            if args.write_cache:
                try:
                    existing = TargetCache(args.cache, config.target_layer_ids,
                                           int(text.hidden_size))
                    write = not all(s.index in existing for s in everything)
                except SystemExit:
                    write = True
            else:
                self.cache = TargetCache(args.cache, config.target_layer_ids,
                                         int(text.hidden_size))
                missing = [s.index for s in everything if s.index not in self.cache]
                if missing:
                    raise SystemExit(f"--cache {args.cache}: no features for {len(missing)} "
                                     f"samples of --data (first: row {missing[0]}); write them "
                                     "with --write-cache")

        # The target (the long part; not needed when a resumed run reads a cache), the draft.
        self.target = None
        model = None
        if self.cache is None or self.resume_state is None:
            try:
                model = AutoModelForCausalLM.from_pretrained(args.target, dtype=self.dtype,
                                                             attn_implementation="sdpa")
            except (OSError, ValueError) as error:
                raise SystemExit(f"--target {args.target}: {error}") from None
            model = model.to(self.device).eval()
            from .target import OnlineTarget

            self.target = OnlineTarget(model, config.target_layer_ids)
        if write:
            self._write_cache(args, config, int(text.hidden_size))
        if args.cache and self.cache is None:
            self.cache = TargetCache(args.cache, config.target_layer_ids, int(text.hidden_size))
        torch.manual_seed(args.seed)
        if self.resume_state is not None:
            draft = self.resume_state.pop("draft")
            draft.embed_tokens.requires_grad_(False)
            draft.lm_head.requires_grad_(False)
        else:
            draft = init_draft(config, model, float(getattr(text, "initializer_range", 0.02)))
        if self.cache is not None and self.target is not None:  # the cache replaces it
            self.target.close()
            self.target = None
        del model
        self.draft = draft.to(device=self.device, dtype=torch.float32)
        self.eagle3 = isinstance(self.draft, Eagle3Draft)
        if self.eagle3:  # the TTT loss is a soft cross-entropy alone
            if args.loss_impl != "fused" or args.l1_weight or args.confidence_weight:
                raise SystemExit("--arch eagle3 trains with its own loss: no --loss-impl, "
                                 "--l1-weight or --confidence-weight")
            self.coefficients = (1.0, 0.0, 0.0)
        else:
            self.coefficients = loss_coefficients(self.draft, args.ce_weight, args.l1_weight,
                                                  args.confidence_weight)
        loss_kwargs = {"loss_decay_gamma": args.loss_decay_gamma,
                       "ce_weight": self.coefficients[0], "l1_weight": self.coefficients[1],
                       "confidence_weight": self.coefficients[2]}
        if args.loss_impl == "reference":
            from .. import reference

            loss_kwargs["loss_fn"] = reference.dspark_loss
        self.step_module = _DraftStep(self.draft, loss_kwargs)
        self.model = self.step_module
        if self.dist.enabled:
            unused = self.draft.confidence_head is not None and self.coefficients[2] == 0
            self.model = nn.parallel.DistributedDataParallel(
                self.step_module, device_ids=[self.device.index] if self.device.type == "cuda"
                else None, find_unused_parameters=unused)
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr,
                                           weight_decay=args.weight_decay)
        warmup = int(args.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, self.total_steps, warmup))
        self.next_step = 0
        if self.resume_state is not None:
            state = self.resume_state
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.next_step = int(state["next_step"])
            _set_rng_state(state["rng"])
            self.resume_state = None

    # -- the target's features ---------------------------------------------------------------

    def _features(self, samples, data: dict):
        """The micro-batch's target features and final hidden states: from the cache, or a
        target forward."""
        if self.cache is not None:
            return self.cache.batch(samples, self.dtype, self.device)
        return self.target(data["input_ids"], data["valid"])

    def _write_cache(self, args, config, hidden_size: int) -> None:
        samples = self.train_samples + self.calibration_samples
        if self.dist.main:
            from .cache import write_cache

            bar = _progress(len(samples), 0, not args.no_progress, "cache", "sample")
            device = self.device

            def features_of(ids, valid):
                return self.target(ids.to(device), valid.to(device))

            write_cache(args.cache, samples, features_of,
                        target_layer_ids=config.target_layer_ids, hidden_size=hidden_size,
                        target_name=args.target, data_path=args.data,
                        dtype=DTYPES[args.cache_dtype], batch_tokens=args.batch_tokens,
                        progress=bar.update if bar is not None else None)
            if bar is not None:
                bar.close()
            print(f"cache: {len(samples)} samples written to {args.cache}", flush=True)
        self.dist.barrier()

    # -- one step ----------------------------------------------------------------------------

    def _micro_step(self, step: int, micro: int, sums: torch.Tensor) -> None:
        args, dist = self.args, self.dist
        epoch, samples = self.schedule.micro_batch(step, micro, dist.rank)
        data = collate(samples, epoch, args.seed, getattr(self.config, "num_anchors", 1),
                       self.device, sample_anchor_positions)
        features, last_hidden = self._features(samples, data)
        if self.eagle3:
            return self._eagle3_micro_step(data, features, last_hidden, micro, sums)
        # DeepSpec's denominators: sum(w) of this micro-step over all ranks (the weights are
        # known before the forward: the eval mask follows from the anchors and the loss mask).
        weights = position_weights(build_eval_mask(data["loss_mask"], data["anchor_positions"],
                                                   data["block_keep_mask"],
                                                   self.config.block_size),
                                   args.loss_decay_gamma).sum().double()
        denominators = dist.all_reduce(weights.repeat(3)) + 1e-6
        last = micro == args.grad_accum - 1
        sync = self.model.no_sync() if dist.enabled and not last else contextlib.nullcontext()
        autocast = (torch.autocast(self.device.type, dtype=self.dtype) if self.autocast
                    else contextlib.nullcontext())
        with sync:
            with autocast:
                out, eval_mask, keep, _ = self.model(
                    data["input_ids"], features, data["loss_mask"], last_hidden,
                    data["anchor_positions"], data["block_keep_mask"], denominators)
            loss = out.loss * dist.world_size / args.grad_accum
            loss.backward()
        batch = argparse.Namespace(eval_mask=eval_mask, block_keep_mask=keep)
        metrics = block_metrics(out.accept_rate, batch)
        alpha, beta, gamma = self.coefficients
        local_loss = alpha * out.ce + beta * out.l1 + gamma * out.confidence
        sums += torch.cat([torch.stack([local_loss.double(), out.ce.double(), out.l1.double(),
                                        out.confidence.double()]) / args.grad_accum,
                           metrics["accept_sum"].cpu(), metrics["accept_count"].cpu(),
                           metrics["tau_sum"].reshape(1).cpu(),
                           metrics["block_count"].reshape(1).cpu()]).to(sums)

    def _eagle3_micro_step(self, data, features, last_hidden, micro: int,
                           sums: torch.Tensor) -> None:
        """One micro-step of an Eagle3 draft: the TTT loss (:func:`.eagle3.eagle3_ttt_loss`),
        its metrics in the slots of the DSpark ones (``ce`` is the soft cross-entropy,
        ``accept_rate@k`` the TTT step's)."""
        args, dist = self.args, self.dist
        last = micro == args.grad_accum - 1
        sync = self.model.no_sync() if dist.enabled and not last else contextlib.nullcontext()
        autocast = (torch.autocast(self.device.type, dtype=self.dtype) if self.autocast
                    else contextlib.nullcontext())
        with sync:
            with autocast:
                out = self.model(data["input_ids"], features, data["loss_mask"], last_hidden,
                                 None, None, None, data["valid"])
            (out.loss * dist.world_size / args.grad_accum).backward()
        loss = out.loss.detach().double() / args.grad_accum
        zero = loss.new_zeros(())
        sums += torch.cat([torch.stack([loss, loss, zero, zero]).cpu(), out.accept_sum.cpu(),
                           out.accept_count.cpu(), out.tau_sum.reshape(1).cpu(),
                           out.row_count.reshape(1).cpu()]).to(sums)

    def _step(self, step: int) -> dict:
        block = self.config.block_size
        sums = torch.zeros(4 + 2 * block + 2, dtype=torch.float64, device=self.device)
        for micro in range(self.args.grad_accum):
            self._micro_step(step, micro, sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.dist.all_reduce(sums).cpu()
        accept, count = sums[4:4 + block], sums[4 + block:4 + 2 * block]
        row = {"step": step + 1, "loss": float(sums[0]), "ce": float(sums[1]),
               "l1": float(sums[2]), "confidence": float(sums[3]), "lr": lr,
               "grad_norm": float(grad_norm)}
        for k in range(block):
            row[f"accept_rate@{k}"] = float(accept[k] / count[k]) if count[k] else None
        blocks = float(sums[-1])
        row["tau_probabilistic"] = float(sums[-2]) / blocks if blocks else None
        return row

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, calibration: Optional[dict] = None) -> Optional[str]:
        """Writes ``OUT/step_N`` (rank 0) and points ``step_latest`` at it."""
        path = None
        if self.dist.main:
            name = f"step_{self.next_step}"
            path = os.path.join(self.args.out, name)
            tmp = os.path.join(self.args.out, f".{name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self.draft.save_pretrained(tmp)
            state = {"format": 1, "next_step": self.next_step,
                     "total_steps": self.total_steps,
                     "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "rng": _rng_state(),
                     "schedule": self.schedule.fingerprint(),
                     "world_size": self.dist.world_size}
            torch.save(state, os.path.join(tmp, STATE_FILE))
            with open(os.path.join(tmp, "train_args.json"), "w") as f:
                json.dump({k: v for k, v in vars(self.args).items()}, f, indent=2)
            if calibration is not None:
                with open(os.path.join(tmp, CALIBRATION_FILE), "w") as f:
                    json.dump(calibration, f, indent=2)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            _link_latest(self.args.out, name)
        self.dist.barrier()
        return path

    # -- calibration -------------------------------------------------------------------------

    @torch.no_grad()
    def calibrate(self) -> Optional[dict]:
        """Sequential temperature scaling of the confidence head on the held-out samples.

        The outcome of slot ``k`` is drawn from its expected acceptance ``c* = 1 - TV(p, q)``
        (the probability that the verifier accepts a draft sampled from the draft's
        distribution), slot by slot until the first rejection; slots past the eval mask are
        not verified.
        """
        if not self.calibration_samples or self.draft.confidence_head is None:
            return None
        from ..calibration import fit_sequential_temperatures

        args = self.args
        self.draft.eval()
        logits, accepted, verified = [], [], []
        g = torch.Generator().manual_seed(args.seed + 1)
        samples = self.calibration_samples
        per_batch = max(1, args.batch_tokens // max(len(s.input_ids) for s in samples))
        for start in range(0, len(samples), per_batch):
            chunk = samples[start:start + per_batch]
            data = collate(chunk, -1, args.seed, self.config.num_anchors, self.device,
                           sample_anchor_positions)
            features, last_hidden = self._features(chunk, data)
            autocast = (torch.autocast(self.device.type, dtype=self.dtype) if self.autocast
                        else contextlib.nullcontext())
            with autocast:
                out, eval_mask, keep, conf = self.step_module(
                    data["input_ids"], features, data["loss_mask"], last_hidden,
                    data["anchor_positions"], data["block_keep_mask"], None)
            rows = (keep & eval_mask[..., 0]).reshape(-1)
            c = out.accept_rate.reshape(eval_mask.shape).reshape(-1, eval_mask.shape[-1])[rows]
            n_verified = eval_mask.reshape(-1, eval_mask.shape[-1])[rows].sum(-1)
            draws = torch.rand(c.shape, generator=g, dtype=torch.float64).to(c.device)
            success = (draws < c.double()).int().cumprod(-1).sum(-1)
            logits.append(conf.reshape(-1, eval_mask.shape[-1])[rows].float().cpu())
            accepted.append(torch.minimum(success, n_verified).cpu())
            verified.append(n_verified.cpu())
        self.draft.train()
        logits, accepted, verified = torch.cat(logits), torch.cat(accepted), torch.cat(verified)
        if logits.shape[0] == 0:
            return None
        temps = fit_sequential_temperatures(logits, accepted, num_verified=verified)
        return {"calib_temperature": [float(t) for t in temps],
                "num_blocks": int(logits.shape[0]), "num_samples": len(samples),
                "mean_accepted": float(accepted.double().mean()),
                "method": "sequential temperature scaling (fit_sequential_temperatures) on "
                          "held-out anchor blocks, outcomes drawn from c* = 1 - TV(p, q)"}

    # -- the loop ----------------------------------------------------------------------------

    def train(self) -> Optional[str]:
        """Runs the remaining steps; returns the final checkpoint's path (rank 0)."""
        args, dist = self.args, self.dist
        if dist.main:
            os.makedirs(args.out, exist_ok=True)
            metrics_path = os.path.join(args.out, "metrics.jsonl")
            if self.next_step > 0 and os.path.exists(metrics_path):
                with open(metrics_path) as f:  # drop lines past the resumed step
                    kept = [ln for ln in f if ln.strip()
                            and json.loads(ln).get("step", 0) <= self.next_step]
                with open(metrics_path, "w") as f:
                    f.writelines(kept)
            elif self.next_step == 0 and os.path.exists(metrics_path):
                os.remove(metrics_path)
            self._print_header()
        dist.barrier()
        self.draft.train()
        bar = _progress(self.total_steps, self.next_step, dist.main and not args.no_progress)
        started = time.perf_counter()
        tokens_done = 0
        row = None
        while self.next_step < self.total_steps:
            step = self.next_step
            t0 = time.perf_counter()
            row = self._step(step)
            self.next_step += 1
            elapsed = time.perf_counter() - t0
            tokens = self.schedule.tokens(step)
            tokens_done += tokens
            row.update(tokens=tokens, tokens_per_second=tokens / elapsed,
                       peak_memory_mib=_peak_memory(self.device), seconds=elapsed)
            if dist.main:
                with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                self._show(bar, row)
            if self.next_step % args.checkpoint_every == 0 and self.next_step < self.total_steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        total = time.perf_counter() - started
        calibration = self.calibrate() if dist.main else None
        path = self.save_checkpoint(calibration)
        if dist.main:
            rate = tokens_done / total if total > 0 and tokens_done else float("nan")
            print(f"done: {self.total_steps} steps, {tokens_done} tokens in {total:.1f} s "
                  f"({rate:.0f} tokens/s), peak memory {_peak_memory(self.device):.0f} MiB",
                  flush=True)
            if calibration is not None:
                temps = ", ".join(f"{t:.2f}" for t in calibration["calib_temperature"])
                print(f"calibration: temperatures [{temps}] from {calibration['num_blocks']} "
                      "held-out blocks", flush=True)
            print(f"checkpoint: {path}", flush=True)
        return path

    def _print_header(self) -> None:
        c, a = self.config, self.args
        trainable = sum(p.numel() for p in self.params)
        if self.eagle3:
            print(f"draft: eagle3, 1 layer, ttt_length {c.ttt_length}, step loss decay "
                  f"{c.step_loss_decay:g}, target layers {list(c.target_layer_ids)}, "
                  f"{trainable:,} trainable parameters", flush=True)
        else:
            kind = "dflash" if c.markov_rank == 0 else f"dspark ({c.markov_head_type} head)"
            print(f"draft: {kind}, {c.num_hidden_layers} layers, block {c.block_size}, markov "
                  f"rank {c.markov_rank}, target layers {list(c.target_layer_ids)}, mask token "
                  f"{c.mask_token_id}, {trainable:,} trainable parameters", flush=True)
        loss = ("the training-time test's soft cross-entropy" if self.eagle3 else
                f"{self.coefficients[0]:g} ce + {self.coefficients[1]:g} l1 + "
                f"{self.coefficients[2]:g} confidence ({a.loss_impl})")
        print(f"data: {len(self.train_samples)} training samples ({self.dropped} dropped), "
              f"{len(self.calibration_samples)} held out; {self.total_steps} steps of "
              f"{a.grad_accum} micro-step(s) x {self.dist.world_size} rank(s); loss {loss}; "
              f"device {self.device}", flush=True)
        if self.next_step:
            print(f"resumed from {self.resume_path} at step {self.next_step}", flush=True)

    def _show(self, bar, row: dict) -> None:
        text = {"loss": f"{row['loss']:.3f}", "ce": f"{row['ce']:.3f}", "l1": f"{row['l1']:.3f}",
                "conf": f"{row['confidence']:.3f}"}
        if row["tau_probabilistic"] is not None:
            text["tau"] = f"{row['tau_probabilistic']:.2f}"
        if row.get("accept_rate@0") is not None:
            text["acc@0"] = f"{row['accept_rate@0']:.2f}"
        text["tok/s"] = f"{row['tokens_per_second']:.0f}"
        if bar is not None:
            bar.set_postfix(text, refresh=False)
            bar.update(1)
        elif not self.args.no_progress:
            print(f"step {row['step']}/{self.total_steps} "
                  + " ".join(f"{k} {v}" for k, v in text.items()), flush=True)

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
        if self.dist.enabled:
            torch.distributed.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> Optional[str]:
    """Entry point of ``python -m dspark_ops.train``; returns the final checkpoint (rank 0)."""
    args = parse_args(argv)
    trainer = Trainer(args)
    try:
        return trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
