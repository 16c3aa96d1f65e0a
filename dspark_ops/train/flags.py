"""The trainer's flags (``python -m dspark_ops.train --help``) and the checks on them that need
nothing loaded."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from ..models.registry import family_to_train, trainer_archs

__all__ = ["DTYPES", "check_args", "parse_args"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}


def parse_args(argv: Optional[Sequence[str]] = None, description: Optional[str] = None
               ) -> argparse.Namespace:
    """The trainer's flags (``description``: the ``--help`` text above them)."""
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.train", description=description,
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
    model.add_argument("--arch", choices=trainer_archs(), default="dspark",
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
    model.add_argument("--init-from-target", action="store_true",
                       help="the draft's layers start from the target's top layers (every "
                            "weight of matching name and shape) instead of at random (on "
                            "SmolLM2 it trained worse than a random start: "
                            "releases/smollm2-135m-instruct/README.md)")
    model.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    model.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                       help="draft from the N ids most frequent among the training data's "
                            "response tokens (special tokens and the mask token always in); "
                            "saved with the checkpoints (draft_vocab.safetensors)")
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
    train.add_argument("--min-lr-ratio", type=float, default=0.0,
                       help="the cosine ends at this fraction of --lr instead of 0 (DeepSpec: 0; "
                            "a short budget learns in its last steps with e.g. 0.1)")
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


def check_args(args: argparse.Namespace) -> None:
    """Refuses flag values no run can use, before anything loads."""
    positive = ("num_layers", "block_size", "anchors", "epochs", "batch_tokens", "grad_accum",
                "max_length", "checkpoint_every")
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 1:
        raise SystemExit(f"--max-steps must be >= 1, got {args.max_steps}")
    if not 0 <= args.warmup_ratio < 1:
        raise SystemExit(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise SystemExit(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    if not args.lr > 0:
        raise SystemExit(f"--lr must be > 0, got {args.lr}")
    if not args.loss_decay_gamma > 0:
        raise SystemExit(f"--loss-decay-gamma must be > 0, got {args.loss_decay_gamma}")
    if args.markov_rank is not None and args.markov_rank < 0:
        raise SystemExit(f"--markov-rank must be >= 0, got {args.markov_rank}")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise SystemExit(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
    if args.draft_vocab is not None and family_to_train(args.arch, None).drafting != "block":
        raise SystemExit(f"--draft-vocab: implemented for block drafts, not --arch {args.arch}")
    if args.write_cache and not args.cache:
        raise SystemExit("--write-cache needs --cache DIR (where to write it)")
