"""Verify a block of drafts against the target's logits with ``dspark_ops.verify``.

The smallest complete use of the library: random target and draft logits stand in for two
models, the drafts are sampled from the draft distribution, and one ``verify`` call accepts the
longest valid prefix of each request's drafts and emits one more token. Request 2 is greedy.

    python examples/verify_only.py [--device cuda] [--vocab 151936]
"""

import argparse

import torch

import dspark_ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4, help="requests B (at least 3)")
    parser.add_argument("--block-size", type=int, default=8, help="drafts per request G")
    parser.add_argument("--vocab", type=int, default=32_000, help="vocabulary size V")
    args = parser.parse_args(argv)
    B, G, V, device = args.batch, args.block_size, args.vocab, args.device
    torch.manual_seed(0)

    # What the draft proposed from (pre-temperature logits) and what the target says, row j of
    # request b being the target's logits for the token after position position[b] + j.
    draft_logits = torch.randn(B, G, V, device=device)
    target_logits = torch.randn(B, G + 1, V, device=device)
    target_logits[:, :G] = draft_logits + 0.3 * target_logits[:, :G]  # roughly agrees
    target_logits = target_logits.to(torch.bfloat16)

    temperature = torch.ones(B, device=device)
    temperature[2] = 0.0  # request 2 is greedy; greedy and sampled requests mix in one call
    draft_tokens = torch.distributions.Categorical(logits=draft_logits).sample()  # at T = 1
    # The greedy request: its first 3 drafts are the target's argmax, the 4th is not.
    target_argmax = target_logits[2].float().argmax(-1)
    draft_tokens[2] = target_argmax[:G]
    draft_tokens[2, 3] = (target_argmax[3] + 1) % V
    seed = torch.arange(B, device=device)  # per request: a request's tokens never depend on others
    position = torch.tensor([17, 230, 5, 1024] * (B // 4 + 1), device=device)[:B]

    out = dspark_ops.verify(
        target_logits, draft_tokens,
        num_draft=torch.full((B,), G, dtype=torch.int32, device=device),
        temperature=temperature, seed=seed, position=position,
        draft_logits=draft_logits, return_logprobs=True,
    )
    for b in range(B):
        n = int(out.num_accepted[b])
        emitted = out.tokens[b, : n + 1].tolist()
        print(f"request {b}: accepted {n} of {G} drafts, emitted {emitted} "
              f"(log p of the last {float(out.logprobs[b, n]):.2f}, valid {bool(out.valid[b])})")
    assert bool(out.valid.all())
    # Accepted tokens are the drafts themselves; the rest of each row is -1.
    for b in range(B):
        n = int(out.num_accepted[b])
        assert torch.equal(out.tokens[b, :n], draft_tokens[b, :n])
        assert bool((out.tokens[b, n + 1 :] == -1).all())
    # Greedy: 3 accepted, then the target's argmax instead of the wrong 4th draft.
    assert int(out.num_accepted[2]) == 3 and int(out.tokens[2, 3]) == int(target_argmax[3])
    # The same call again gives the same tokens: the random streams are keyed by (seed, position).
    again = dspark_ops.verify(target_logits, draft_tokens,
                              torch.full((B,), G, dtype=torch.int32, device=device), temperature,
                              seed, position, draft_logits=draft_logits)
    assert torch.equal(again.tokens, out.tokens)
    print("ok")


if __name__ == "__main__":
    main()
