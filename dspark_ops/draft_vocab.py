"""Give a trained draft a draft vocabulary, without retraining: the ``--size`` most frequent
response tokens of its training data, the target's special tokens always in.

    python -m dspark_ops.draft_vocab DRAFT_DIR --data train_data.jsonl --size 16384
        [--tokenizer TARGET_DIR] [--always 0 2 ...] [--heldout heldout.jsonl] [--out DIR]

``--data`` (and ``--heldout``) are JSON lines with ``input_ids`` and ``loss_mask`` (what
``python -m dspark_ops.prepare_data`` writes); only the response tokens (``loss_mask`` 1) are
counted. ``--tokenizer`` adds every special token of the target's tokenizer (EOS among them) to
the ``--always`` ids, and the draft's mask token is always in. Writes
``draft_vocab.safetensors`` into ``--out`` (default: the draft's own directory), which
``DSparkDraft.from_pretrained`` then reads; deleting the file restores the full vocabulary.
Prints the coverage of the data (and of ``--heldout``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, Optional, Sequence

from .models.config import DSparkConfig
from .models.vocab import DraftVocabulary, count_response_tokens


def _rows(path: str) -> Iterator[dict]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def main(argv: Optional[Sequence[str]] = None) -> DraftVocabulary:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.draft_vocab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("draft", help="the draft's checkpoint directory (its config.json)")
    parser.add_argument("--data", required=True, help="training rows (JSON lines)")
    parser.add_argument("--size", type=int, required=True, help="ids in the vocabulary")
    parser.add_argument("--tokenizer", help="the target's directory: its special tokens are in")
    parser.add_argument("--always", type=int, nargs="*", default=[], help="ids always in")
    parser.add_argument("--heldout", help="held-out rows to report the coverage of")
    parser.add_argument("--out", help="where to write draft_vocab.safetensors (default: draft)")
    args = parser.parse_args(argv)

    config_path = os.path.join(args.draft, "config.json")
    if not os.path.isfile(config_path):
        parser.error(f"'draft': no config.json in {args.draft}")
    for name in ("data", "heldout"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            parser.error(f"'--{name}': no file {path}")
    with open(config_path) as f:
        config = DSparkConfig.from_dict(json.load(f))
    vocab_size = config.vocab_size
    if not 1 <= args.size <= vocab_size:
        parser.error(f"'--size' must be in [1, {vocab_size}], got {args.size}")
    always = set(args.always) | {config.mask_token_id}
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        always |= set(tokenizer.all_special_ids)
        if tokenizer.eos_token_id is not None:
            always.add(tokenizer.eos_token_id)
    elif not args.always:
        print("note: no --tokenizer or --always, so EOS is in only if the answers use it")

    counts = count_response_tokens(_rows(args.data), vocab_size)
    vocabulary = DraftVocabulary.most_frequent(counts, args.size, sorted(always))
    path = vocabulary.save(args.out or args.draft)
    inside = int(counts[vocabulary.d2t].sum())
    print(f"draft vocabulary: {vocabulary.size} of {vocab_size} ids; {int((counts > 0).sum())} "
          f"ids occur in {int(counts.sum())} response tokens, {inside / max(int(counts.sum()), 1):.2%}"
          f" of them inside")
    if args.heldout:
        held = count_response_tokens(_rows(args.heldout), vocab_size)
        share = int(held[vocabulary.d2t].sum()) / max(int(held.sum()), 1)
        print(f"held out: {share:.2%} of {int(held.sum())} response tokens inside")
    print(f"wrote {path}")
    return vocabulary


if __name__ == "__main__":
    main()
