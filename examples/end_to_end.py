"""The end-to-end decoder: ``dspark_ops.SpeculativeDecoder`` on a tiny target/draft pair.

``dspark_ops.demo.tiny_pair`` builds a small Qwen3-style target and a DSpark draft that drafts it
well without training (see its docstring); swap in ``DSparkDraft.from_pretrained(dir)`` and
``dspark_ops.hf.HFTarget(model, ...)`` for real models. Greedy decoding is checked token for
token against plain target decoding (``generate_target_only``) on the same seeds.

    python examples/end_to_end.py [--device cuda] [--temperature 0.7] [--top-p 0.9]
"""

import argparse

import torch

import dspark_ops
from dspark_ops.demo import tiny_pair


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus filter (both sides)")
    parser.add_argument("--scheduler", default="confidence",
                        choices=("confidence", "budget", "fixed"))
    args = parser.parse_args(argv)

    target, draft = tiny_pair(vocab=64, block_size=7, context=0.1, noise=0.3, device=args.device)
    decoder = dspark_ops.SpeculativeDecoder(target, draft, scheduler=args.scheduler,
                                            eos_token_id=None)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [42]]  # token ids; lengths may differ
    seeds = torch.tensor([0, 1, 2])

    for temperature in (0.0, args.temperature):
        out = decoder.generate(prompts, args.max_new_tokens, temperature=temperature, seed=seeds,
                               top_p=args.top_p)
        verified = [n for r in out.rounds for n in r.num_verify]
        print(f"T={temperature}: {len(out.rounds)} rounds, mean accepted length "
              f"{out.mean_accepted_length:.2f}, drafts verified per request-round "
              f"{sum(verified) / len(verified):.2f}")
        for b, tokens in enumerate(out.tokens):
            print(f"  request {b}: {tokens}")
        assert all(len(t) == args.max_new_tokens for t in out.tokens)
        if temperature <= 1e-5:
            plain = dspark_ops.generate_target_only(target, prompts, args.max_new_tokens,
                                                    temperature, seeds, top_p=args.top_p)
            assert out.tokens == plain, "greedy speculative output differs from plain decoding"
            print("  greedy output identical to plain target decoding")
    print("ok")


if __name__ == "__main__":
    main()
