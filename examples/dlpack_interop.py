"""Arrays from CuPy (on CUDA) or NumPy (on CPU) into the ops and back, without a copy (DLPack).

The ops take PyTorch tensors; any DLPack producer converts with ``torch.from_dlpack`` sharing
its memory, and results go back the same way (``cupy.from_dlpack`` / ``numpy.from_dlpack``).
On CUDA this needs CuPy; without it the script says so and exits 0.

    python examples/dlpack_interop.py [--device cuda]
"""

import argparse
import sys

import torch

import dspark_ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=1000)
    args = parser.parse_args(argv)
    B, G, V = 3, 4, args.vocab
    if torch.device(args.device).type == "cuda":
        try:
            import cupy as xp
        except ImportError:
            print("CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x); skipping")
            return 0
        name = "CuPy"
    else:
        import numpy as xp
        name = "NumPy"

    # The engine's arrays: ragged target logits [B*(G+1), V], drafts, lengths, sampling state.
    rng = xp.random.default_rng(0)
    logits_xp = rng.standard_normal((B * (G + 1), V), dtype=xp.float32)
    drafts_xp = rng.integers(0, V, (B, G)).astype(xp.int64)
    num_draft_xp = xp.asarray([G, 2, 0], dtype=xp.int32)
    temperature_xp = xp.asarray([1.0, 0.7, 0.0], dtype=xp.float32)
    seed_xp = xp.arange(B, dtype=xp.int64)
    position_xp = xp.asarray([10, 200, 3000], dtype=xp.int64)

    logits = torch.from_dlpack(logits_xp)  # zero-copy views on the same memory
    assert logits.data_ptr() == (logits_xp.data.ptr if name == "CuPy"
                                 else logits_xp.__array_interface__["data"][0])
    out = dspark_ops.verify(logits, torch.from_dlpack(drafts_xp), torch.from_dlpack(num_draft_xp),
                            torch.from_dlpack(temperature_xp), torch.from_dlpack(seed_xp),
                            torch.from_dlpack(position_xp))
    tokens_xp = xp.from_dlpack(out.tokens)  # and back, still without a copy
    accepted_xp = xp.from_dlpack(out.num_accepted)
    print(f"{name} on {args.device}: tokens {type(tokens_xp).__module__}.{type(tokens_xp).__name__}"
          f" {tokens_xp.shape}, accepted {accepted_xp.tolist()}")
    for b in range(B):
        n = int(accepted_xp[b])
        print(f"  request {b}: emitted {tokens_xp[b, : n + 1].tolist()}")
    assert tokens_xp.shape == (B, G + 1) and int(accepted_xp[2]) == 0
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
