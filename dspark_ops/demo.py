"""``python -m dspark_ops.demo``: DSpark speculative decoding of a tiny target, with statistics.

The tiny pair is built so the draft is good without training. The target's first layer has its
attention output scaled by ``context`` (0 makes the target a bigram model: the next-token logits
depend only on the current token); the draft's Markov head is that bigram table, exactly
(``W1 = I``, ``W2 = M^T`` with ``M[x]`` the target's logits after token ``x`` alone), plus
``noise``; its backbone output is zeroed so the base logits are 0. With ``context = noise = 0``
the draft distribution is the target's and every draft is accepted; raising either lowers the
acceptance, and the confidence head (here a per-token logit growing with the bigram's top
probability, calibrated on a few rounds by :func:`fit_sequential_temperatures`) tells the
scheduler which drafts are worth verifying.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Tuple

import torch

from .calibration import fit_sequential_temperatures
from .decoder import SpeculativeDecoder, generate_target_only
from .models import DSparkConfig, DSparkDraft, TargetConfig, TinyTarget

__all__ = ["tiny_pair", "main"]


def tiny_pair(vocab: int = 64, block_size: int = 7, *, context: float = 0.0, noise: float = 0.0,
              num_layers: int = 2, seed: int = 0, target_dtype: torch.dtype = torch.float32,
              draft_dtype: Optional[torch.dtype] = None, device="cpu",
              markov_head_type: str = "vanilla") -> Tuple[TinyTarget, DSparkDraft]:
    """A target (in ``target_dtype``) and a matching draft (see the module doc) in
    ``draft_dtype`` (default float32 on CPU, bfloat16 on CUDA, where the attention op wants 16-bit);
    ``vocab <= 1024`` (``r = V``). The RNN head variant drafts from the same table: its output
    activation is ``tanh(3 W1[x])`` (state and ``h`` do not reach it) and ``W2`` is rescaled."""
    gen = torch.Generator().manual_seed(seed)
    target_config = TargetConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=num_layers,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                 intermediate_size=128)
    target = TinyTarget(target_config, feature_layers=(-1, num_layers - 1))
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() == 1:  # norm scales
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # unit-variance activations; the LM head a little sharper
                scale = 1.0 if "embed" in name else (2.5 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        for layer in target.layers:  # the attention's share of the residual stream
            layer.self_attn.o_proj.weight.mul_(context)
    target = target.to(device=device, dtype=target_dtype)

    draft_config = DSparkConfig(
        vocab_size=vocab, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, intermediate_size=128, num_hidden_layers=1,
        target_layer_ids=(-1, num_layers - 1), target_hidden_size=64, block_size=block_size,
        mask_token_id=vocab - 1, markov_rank=vocab, markov_head_type=markov_head_type)
    draft = DSparkDraft(draft_config)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        draft.share_target_embeddings(target)
        draft.norm.weight.zero_()  # h = 0: base logits 0, the Markov head carries everything
        # M[x]: the target's logits after token x on its own.
        ids = torch.arange(vocab, device=device)[:, None]
        zeros = torch.zeros(vocab, dtype=torch.int32, device=device)
        bigram = target(ids, zeros + 1, target.new_cache(vocab, 1), zeros)[0][:, 0].float().cpu()
        draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        if markov_head_type == "rnn":  # o = 3 W1[x]: tanh(o) = tanh(3) one-hot(x)
            joint = draft.markov_head.joint_proj
            joint.weight[2 * vocab :] = 0.0
            joint.weight[2 * vocab :, vocab : 2 * vocab] = 3.0 * torch.eye(vocab)
            joint.bias[2 * vocab :] = 0.0
            bigram = bigram / torch.tanh(torch.tensor(3.0))
        draft.markov_head.markov_w2.weight.copy_(
            bigram.T + noise * torch.randn(vocab, vocab, generator=gen))
        # Confidence: a per-token logit that grows with the bigram's top probability; its scale
        # is left to calibration (fit_sequential_temperatures), as for a trained head.
        top = bigram.softmax(-1).max(-1).values
        proj = draft.confidence_head.proj
        proj.weight.zero_()
        proj.weight[0, 64:] = 4.0 * top
        proj.bias.fill_(1.0)
    if draft_dtype is None:
        draft_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return target, draft.to(device=device, dtype=draft_dtype)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dspark_ops.demo",
        description="DSpark speculative decoding of a tiny target with a matching draft (built "
                    "without training, see dspark_ops.demo.tiny_pair): calibrates the confidence "
                    "head, decodes a few prompts, prints every round and compares with plain "
                    "target decoding on the same seeds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the models and ops run (cpu or cuda)")
    parser.add_argument("--batch", type=int, default=4, help="requests decoded together")
    parser.add_argument("--block-size", type=int, default=7,
                        help="G, drafts proposed per request and round (1..32)")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="tokens generated per request")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of target and draft; 0 is greedy, and then "
                             "the output is checked for identity with plain decoding")
    parser.add_argument("--context", type=float, default=0.1,
                        help="attention share of the target (0: a bigram target, drafted exactly)")
    parser.add_argument("--noise", type=float, default=0.3,
                        help="error added to the draft's Markov head (0: the exact bigram table)")
    parser.add_argument("--scheduler", default="confidence",
                        choices=("confidence", "budget", "fixed"),
                        help="how many drafts to verify: confidence = schedule_verify (Algorithm "
                             "1), budget = plan_verify_budget on older confidences + "
                             "allocate_verify, fixed = all G")
    args = parser.parse_args(argv)

    target, draft = tiny_pair(block_size=args.block_size, context=args.context, noise=args.noise,
                              device=args.device)
    prompts = [[(7 * b + i) % 60 for i in range(3 + 2 * b)] for b in range(args.batch)]
    # Calibrate the confidence head on other prompts (sequential temperature scaling): verify
    # every draft, record the raw confidences and how many drafts were accepted.
    calibration_prompts = [[(11 * b + 5 * i + 3) % 60 for i in range(4)] for b in range(16)]
    calibration = SpeculativeDecoder(target, draft, scheduler="fixed").generate(
        calibration_prompts, 64, args.temperature, torch.arange(100, 116))
    raw = torch.tensor([c for r in calibration.rounds for c in r.confidence], dtype=torch.float64)
    accepted = torch.tensor([a for r in calibration.rounds for a in r.accepted])
    calib = fit_sequential_temperatures(torch.logit(raw.clamp(1e-9, 1 - 1e-9)), accepted)
    decoder = SpeculativeDecoder(target, draft, scheduler=args.scheduler, calib_temperature=calib)
    seeds = torch.arange(args.batch)
    started = time.perf_counter()
    out = decoder.generate(prompts, args.max_new_tokens, args.temperature, seeds)
    spec_seconds = time.perf_counter() - started
    started = time.perf_counter()
    plain = generate_target_only(target, prompts, args.max_new_tokens, args.temperature, seeds)
    plain_seconds = time.perf_counter() - started

    print(f"device {args.device}, B={args.batch}, G={args.block_size}, T={args.temperature}, "
          f"scheduler {args.scheduler}, target context {args.context}, draft noise {args.noise}")
    print("calibration temperatures per slot:", [round(t, 2) for t in calib.tolist()])
    print(f"{'round':>5} {'accepted per request':>28} {'verified':>22} {'tokens':>6} "
          f"{'draft ms':>8} {'verify ms':>9}")
    for i, r in enumerate(out.rounds):
        print(f"{i:>5} {str(r.accepted):>28} {str(r.num_verify):>22} {r.verify_tokens:>6} "
              f"{1e3 * r.draft_seconds:>8.2f} {1e3 * r.verify_seconds:>9.2f}")
    verified = [n for r in out.rounds for n in r.num_verify]
    accepted = [a for r in out.rounds for a in r.accepted]
    print(f"rounds {len(out.rounds)}; mean accepted length (accepted + 1) "
          f"{out.mean_accepted_length:.2f}; drafts verified per round {sum(verified) / len(verified):.2f}, "
          f"of which accepted {sum(accepted) / max(sum(verified), 1):.0%}")
    print(f"target forwards: speculative {len(out.rounds) + 1}, plain "
          f"{args.max_new_tokens}; wall time {spec_seconds:.2f} s vs {plain_seconds:.2f} s")
    if args.temperature <= 1e-5:
        print("greedy output identical to plain target decoding:", out.tokens == plain)
    for b, tokens in enumerate(out.tokens):
        print(f"request {b}: {tokens}")


if __name__ == "__main__":
    main()
