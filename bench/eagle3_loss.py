"""Peak memory and time of one Eagle3 training-time-test step (forward + backward): the chunked
soft cross-entropy (``eagle3_ttt_loss(fused=True)``, docs/semantics.md §3.7b) against the eager
formula (``fused=False``), which keeps every step's ``[B, L, V]`` logits for the backward.

The case is SmolLM2-135M's shape: an Eagle3 draft of width 576 (9 heads of 64, 3 K/V heads, MLP
1536) over a 49,152-token vocabulary, random weights in float32, the embedding and LM head frozen
as in training; a batch of ``--batch`` sequences of ``--length`` tokens (the second one 20 %
shorter), the first quarter of each a prompt (loss mask 0), ``--ttt-length`` steps. Each variant
runs in a process of its own, so that the process's peak resident set is that variant's alone.

Columns: ``step s`` (the median over ``--repeats`` steps, after one warm-up step), ``peak MiB``
(the most memory the step's tensors held at once beyond what was held before it, from the CPU
allocator's events, ``bench.memory.peak_memory_bytes``; CUDA: ``max_memory_allocated``),
``maxrss MiB`` (the process's peak resident set, ``resource.getrusage``, CPU only; ``(before)``:
the same before the first step, i.e. the library, the model and the inputs) and the loss.

Run from the repository root: ``python -m bench.eagle3_loss [--device cpu] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.eagle3_loss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="rows per chunk of the fused loss (default: its own, 2**24 / V)")
    parser.add_argument("--variant", choices=("fused", "eager"), default=None,
                        help="run one variant in this process (default: both, one process each)")
    return parser.parse_args(argv)


def _case(args):
    import torch

    from dspark_ops.models.eagle3 import Eagle3Config, Eagle3Draft

    torch.manual_seed(0)
    hidden, vocab = 576, 49152
    config = Eagle3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=1536,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          target_layer_ids=(1, 7, 13, 19, 25), target_num_hidden_layers=30,
                          ttt_length=args.ttt_length, rope_theta=1e5)
    device = torch.device(args.device)
    draft = Eagle3Draft(config).to(device)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    batch, length = args.batch, args.length
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    features = torch.randn(batch, length, 5 * hidden, generator=g)
    last = torch.randn(batch, length, hidden, generator=g)
    lengths = torch.tensor([length - (length // 5) * (b % 2) for b in range(batch)])
    valid = torch.arange(length)[None] < lengths[:, None]
    loss_mask = (torch.arange(length)[None] >= length // 4).float() * valid
    inputs = [t.to(device) for t in (ids, features, loss_mask, last, valid)]
    return draft, inputs


def _run_variant(args) -> dict:
    import resource

    import torch

    from bench.memory import peak_memory_bytes
    from dspark_ops.train.eagle3 import eagle3_ttt_loss

    torch.set_num_threads(args.threads)
    draft, inputs = _case(args)
    fused = args.variant == "fused"
    device = torch.device(args.device)

    def step():
        draft.zero_grad(set_to_none=True)
        out = eagle3_ttt_loss(draft, *inputs, fused=fused, chunk_rows=args.chunk_rows)
        out.loss.backward()
        return float(out.loss.detach())

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loss = step()  # warm-up; the gradients' buffers exist from here on
    peak = peak_memory_bytes(step, device) / 2**20
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": args.variant, "step_s": statistics.median(times), "step_s_all": times,
            "peak_mib": peak, "maxrss_mib": maxrss if device.type == "cpu" else None,
            "rss_before_mib": rss_before, "loss": loss, "threads": args.threads,
            "batch": args.batch, "length": args.length, "ttt_length": args.ttt_length,
            "device": str(device)}


def main(argv=None) -> int:
    args = _parse(argv)
    if args.variant is not None:
        print(json.dumps(_run_variant(args)))
        return 0
    rows = []
    for variant in ("eager", "fused"):
        command = [sys.executable, "-m", "bench.eagle3_loss", "--variant", variant,
                   "--batch", str(args.batch), "--length", str(args.length),
                   "--ttt-length", str(args.ttt_length), "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--device", args.device]
        if args.chunk_rows is not None:
            command += ["--chunk-rows", str(args.chunk_rows)]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode:
            sys.stderr.write(done.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"Eagle3 TTT step, B={args.batch} L={args.length} K={args.ttt_length} V=49152 d=576, "
          f"{args.device}, {args.threads} thread(s)")
    print(f"{'variant':8} {'step s':>8} {'peak MiB':>9} {'maxrss MiB':>11} {'(before)':>9} "
          f"{'loss':>10}")
    for row in rows:
        rss = f"{row['maxrss_mib']:.0f}" if row["maxrss_mib"] is not None else "-"
        print(f"{row['variant']:8} {row['step_s']:8.2f} {row['peak_mib']:9.0f} {rss:>11} "
              f"{row['rss_before_mib']:9.0f} {row['loss']:10.5f}")
    eager, fused = rows
    print(f"fused / eager: peak {fused['peak_mib'] / eager['peak_mib']:.3f}, step time "
          f"{fused['step_s'] / eager['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
