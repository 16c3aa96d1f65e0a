"""``python -m dspark_ops.release``: a trained draft as one small file to ship, without the
target's embedding and LM head it copies, in bfloat16 (:mod:`dspark_ops.models.release`).

    python -m dspark_ops.release DRAFT_DIR --target TARGET_DIR --out draft.safetensors

``DRAFT_DIR`` is a checkpoint directory (``config.json``, the weights, optionally
``draft_vocab.safetensors`` and ``calibration.json``, all carried over). The file is read back
and checked against the checkpoint before the command reports success. Every command that takes
``--draft`` (``generate``, ``eval``, ``profile``, ``serve``) takes the file in place of the
directory, with the same ``--target``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import torch

from .models import load_draft
from .models.release import COPIED, W2, save_release

__all__ = ["main"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _load_target(path: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise SystemExit("python -m dspark_ops.release needs transformers to read --target: "
                         "pip install --no-build-isolation '.[hf]'") from error
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("draft", help="the draft's checkpoint directory")
    parser.add_argument("--target", required=True,
                        help="local directory of the transformers target the draft was trained for")
    parser.add_argument("--out", required=True, help="the release file to write (.safetensors)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                        help="of the stored floating-point tensors")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.draft, "config.json")):
        parser.error(f"'draft': no config.json in {args.draft}")
    if not os.path.isdir(args.target):
        parser.error(f"'--target': no directory {args.target}")
    if not args.out.endswith(".safetensors"):
        parser.error(f"'--out' must end in .safetensors, got {args.out}")

    draft = load_draft(args.draft, dtype=torch.float32).eval()
    target = _load_target(args.target)
    calibration = None
    calibration_file = os.path.join(args.draft, "calibration.json")
    if os.path.isfile(calibration_file):
        with open(calibration_file) as f:
            calibration = json.load(f).get("calib_temperature")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    summary = save_release(draft, target, tmp, calibration=calibration, dtype=DTYPES[args.dtype])

    # Read it back: every stored tensor is the checkpoint's, rounded to --dtype.
    rebuilt = load_draft(tmp, target=target, dtype=torch.float32)
    original = draft.state_dict()
    vocabulary = getattr(draft, "draft_vocabulary", None)
    for name, tensor in rebuilt.state_dict().items():
        if name in summary["left_out"]:  # the target's own, not stored
            continue
        expected = original[name]
        if name == W2 and vocabulary is not None:  # only the vocabulary's rows are stored
            tensor, expected = tensor[vocabulary.d2t], expected[vocabulary.d2t]
        if expected.is_floating_point():
            expected = expected.to(DTYPES[args.dtype]).float()
        if not torch.equal(tensor, expected.to(tensor.dtype)):
            os.remove(tmp)
            raise SystemExit(f"the release does not read back: {name} differs")
    os.replace(tmp, args.out)
    taken = ", ".join(summary["left_out"]) or "nothing"
    kept = [name for name in COPIED if name not in summary["left_out"] and name in original]
    print(f"wrote {args.out}: {summary['bytes'] / 2**20:.1f} MiB, "
          f"{summary['parameters'] / 1e6:.2f} M parameters in {args.dtype}; from the target: "
          f"{taken}" + (f"; trained, so stored: {', '.join(kept)}" if kept else "")
          + (f"; W2 rows: {summary['w2_rows']} (the draft vocabulary)"
             if summary["w2_rows"] else "")
          + ("; calibration carried" if calibration is not None else ""))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
