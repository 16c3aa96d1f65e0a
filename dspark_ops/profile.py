"""``python -m dspark_ops.profile``: measures what a decoding round costs on this machine (the
target's step by width, the draft's cost by drafted slots) and writes the cost table the goodput
scheduler reads (:mod:`dspark_ops.costs`).

    python -m dspark_ops.profile --target SmolLM2-dir --draft runs/smollm2/dspark/step_latest

By default the table goes to the cache that ``generate``, ``eval`` and ``bench.e2e`` look in
(keyed by the target, the draft, the device, the dtype, the threads and the library version),
so they find it instead of profiling on first use; ``--out`` writes it elsewhere, for
``--cost-table``. Paths are local directories; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from . import _cli
from .costs import cost_key, default_cost_dir, digest, profile_costs


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_model_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's); part of the table's key")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=128,
                        help="tokens of context behind every measured step")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed repetitions (each prices every width and slot count once)")
    parser.add_argument("--out", default=None, help="where to write the table (default: the "
                        "cache, " + default_cost_dir() + ")")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    args.scheduler = "fixed"  # the table is measured here, not loaded
    models = _cli.load_models(args)
    proposer = models.decoder.proposer
    target = models.target
    try:
        table = profile_costs(target, proposer, batch_sizes=args.batch_sizes,
                              context=args.context, repeats=args.repeats)
    except ValueError as error:
        raise SystemExit(str(error)) from error
    key = cost_key(target, proposer, device=target.device, dtype=target.dtype,
                   batch_sizes=args.batch_sizes)
    path = args.out or os.path.join(default_cost_dir(), digest(key) + ".json")
    table.save(path)
    for batch in args.batch_sizes:
        print(table.summary(batch))
    print(f"cost table: {path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
