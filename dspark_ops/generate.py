"""``python -m dspark_ops.generate``: one prompt through a transformers target with a DSpark,
DFlash or Eagle3 draft (:func:`dspark_ops.load_draft`), against plain target decoding on the same
seed.

Prints the generated text, then the mean accepted length (tokens per round: accepted drafts + 1,
the paper's tau), the drafts verified per round, the target forwards of both decoders and their
tokens per second. Example::

    python -m dspark_ops.generate --target Qwen/Qwen3-8B-local --draft dspark-qwen3-8b \\
        --prompt "Why is the sky blue?" --max-new-tokens 256

Paths are local directories; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from . import _cli
from .prompts import chat_prompt


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_model_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--no-chat-template", action="store_true",
                        help="tokenize the prompt as it is instead of as a user turn")
    return parser.parse_args(argv)


@torch.no_grad()
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    models = _cli.load_models(args)
    tokenizer = models.tokenizer
    if args.no_chat_template or not getattr(tokenizer, "chat_template", None):
        prompt = tokenizer(args.prompt, add_special_tokens=False).input_ids
    else:
        prompt = chat_prompt(tokenizer, args.prompt)
    _cli.warm_up(models, args)
    result = _cli.compare(models, [prompt], args)
    out = result.speculative
    tokens = out.tokens[0]
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    print()
    rounds = len(out.rounds)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    spec_rate = len(tokens) / result.speculative_seconds
    plain_rate = len(result.plain_tokens[0]) / result.plain_seconds
    print(f"generated tokens       : {len(tokens)} speculative, {len(result.plain_tokens[0])} "
          "plain")
    print(f"mean accepted length   : {out.mean_accepted_length:.2f} tokens per round "
          f"({rounds} rounds)")
    print(f"verified drafts/round  : {verified / max(rounds, 1):.2f} of G = "
          f"{models.decoder.block_size}")
    print(f"target forwards        : {result.speculative_forwards} speculative, "
          f"{result.plain_forwards} plain")
    print(f"tokens/s               : {spec_rate:.1f} speculative, {plain_rate:.1f} plain "
          f"(speed-up x{_cli.speedup(result.plain_seconds, result.speculative_seconds):.2f})")
    if args.temperature == 0.0:
        print(f"greedy output identical to plain decoding: {tokens == result.plain_tokens[0]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
