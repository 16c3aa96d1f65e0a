"""What exact Philox pruning could skip in the drafting slot kernel, on a real model's logits.

    python -m bench.philox_pruning --data runs/x2/train_data.jsonl [--target DIR]
        [--samples 24] [--every 5] [--temperatures 1.0 0.7] [--json ...]

A sampled slot draws ``argmax_v z_v / T - log(-log1p(-u_v))`` with one Philox uniform ``u_v`` per
token (docs/semantics.md §2.1). Every uniform is at least ``2^-33``, so a token's Gumbel offset is
at most ``33 ln 2`` (22.87): a token whose ``z / T + 33 ln 2`` is below the best key known cannot
win whatever its uniform, and its random number need not be drawn. The slot kernel
(``kernels/draft_slot.cuh``) already skips the logarithms of such tokens warp by warp; skipping
the Philox block too is exact, but only where the whole warp agrees. A warp's epilogue covers a
tile of 16 vocabulary rows by 8 requests, and each lane's Philox block feeds four lanes through
the quad's transposes, so a tile's Philox work can be skipped only when all 128 of its tokens
are ruled out, each against its own request's best key.

This measures that share on the target's own logits at the positions of its answers (the
sharpest logits a draft could hope to match: a trained draft is less confident, so it rules out
fewer tokens). Each request's best key is drawn as the slot would draw it (Gumbel keys over the
whole row), which is the best key known to the last tile of the walk: an upper bound of what
any tile could skip. Requests are grouped eight at a time at random, as the rows of a batch are.
Per temperature it reports the share of tokens, of 16-token blocks of one request and of 16 x 8
tiles that are ruled out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, Optional, Sequence

import torch

from bench.common import write_json

#: The largest Gumbel offset a uniform of at least 2^-33 gives: -log(-log1p(-u)) <= 33 ln 2.
MAX_GUMBEL_OFFSET = 33 * math.log(2)

#: A warp's epilogue tile in the slot kernel: 16 vocabulary rows by 8 requests.
TILE_ROWS, TILE_REQUESTS = 16, 8


def ruled_out(logits: torch.Tensor, temperature: float, best_key: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` bool: tokens whose key cannot reach their row's ``best_key [N]`` whatever
    their uniform (``z / T + 33 ln 2 < best``)."""
    return logits / temperature + MAX_GUMBEL_OFFSET < best_key[:, None]


def sampled_best_keys(logits: torch.Tensor, temperature: float,
                      generator: torch.Generator) -> torch.Tensor:
    """``[N]``: each row's best Gumbel key ``max_v z_v / T + g_v``, drawn."""
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp_min(2.0 ** -33)
    return (logits.double() / temperature - torch.log(-torch.log1p(-u))).max(-1).values


def skip_shares(logits: torch.Tensor, temperature: float, *, generator: torch.Generator,
                best_key: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """Shares of the ``[N, V]`` rows' tokens, 16-token blocks and 16 x 8 tiles (rows grouped
    eight at a time in a random order; a remainder under eight is left out) that are ruled out.
    A vocabulary tail short of 16 rows counts as ruled out, as the kernel's rows past the
    vocabulary are. ``best_key`` defaults to :func:`sampled_best_keys`."""
    if logits.dim() != 2 or logits.shape[0] < TILE_REQUESTS:
        raise ValueError(f"skip_shares: 'logits' must be [N >= {TILE_REQUESTS}, V], got "
                         f"{tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"skip_shares: 'temperature' must be > 0, got {temperature}")
    if best_key is None:
        best_key = sampled_best_keys(logits, temperature, generator)
    out = ruled_out(logits.double(), temperature, best_key.double())
    rows, vocab = out.shape
    pad = -vocab % TILE_ROWS
    padded = torch.cat([out, out.new_ones(rows, pad)], 1) if pad else out
    blocks = padded.reshape(rows, -1, TILE_ROWS).all(-1)  # [N, V / 16]
    order = torch.randperm(rows, generator=generator)[:rows // TILE_REQUESTS * TILE_REQUESTS]
    tiles = blocks[order].reshape(-1, TILE_REQUESTS, blocks.shape[1]).all(1)
    return {"tokens": out.double().mean().item(), "blocks_of_16": blocks.double().mean().item(),
            "tiles_16x8": tiles.double().mean().item()}


def answer_logits(model, rows: Sequence[dict], every: int, max_length: int) -> torch.Tensor:
    """The target's logits at every ``every``-th answer position (``loss_mask`` 1) of each
    training row, float32 ``[N, V]``."""
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor(row["input_ids"][:max_length])[None]
            mask = torch.tensor(row["loss_mask"][:max_length], dtype=torch.bool)
            logits = model(ids).logits[0].float()[mask]
            out.append(logits[::every])
    return torch.cat(out)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.philox_pruning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True,
                        help="training JSONL (python -m dspark_ops.prepare_data's output)")
    parser.add_argument("--target", default=None,
                        help="transformers directory of the target (default: SmolLM2-135M-Instruct "
                             "through dspark_ops.smollm2)")
    parser.add_argument("--samples", type=int, default=24, help="training rows read")
    parser.add_argument("--every", type=int, default=5, help="every n-th answer position")
    parser.add_argument("--max-length", type=int, default=320, help="tokens of a row read")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="bench/results/philox_pruning_smollm2.json")
    args = parser.parse_args(argv)
    for name in ("samples", "every", "max_length", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(not t > 0 for t in args.temperatures):
        parser.error(f"--temperatures must be > 0, got {args.temperatures}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    target = args.target
    if target is None:
        from dspark_ops.smollm2 import ensure_hf_dir
        target = ensure_hf_dir()
    with open(args.data) as f:
        rows = [json.loads(line) for _, line in zip(range(args.samples), f)]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    logits = answer_logits(model, rows, args.every, args.max_length)
    generator = torch.Generator().manual_seed(args.seed)
    results = {
        "what": "share of the drafting slot kernel's work that exact Philox pruning could skip: "
                "tokens, 16-token blocks of one request and 16 x 8 tiles (a warp's epilogue) "
                "ruled out (z / T + 33 ln 2 below the request's best key), on the target's own "
                "logits at answer positions",
        "command": "python -m bench.philox_pruning " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:]),
        "positions": logits.shape[0], "vocab": logits.shape[1],
        "temperatures": {},
    }
    print(f"{logits.shape[0]} answer positions, vocabulary {logits.shape[1]}")
    print(f"{'T':>5} {'tokens':>8} {'blocks of 16':>13} {'16x8 tiles':>11}")
    for temperature in args.temperatures:
        shares = skip_shares(logits, temperature, generator=generator)
        results["temperatures"][str(temperature)] = shares
        print(f"{temperature:>5} {shares['tokens']:>8.3f} {shares['blocks_of_16']:>13.3f} "
              f"{shares['tiles_16x8']:>11.3f}")
    write_json(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
