"""The decoding loop an engine author writes: draft -> schedule -> verify, with the ops only.

The models are stand-ins so the script runs anywhere in seconds: the target is a bigram model
(its logits after token ``x`` are row ``x`` of a table ``M``, for every token of a ragged batch),
and the draft's Markov head is that table plus noise (``W1 = I``, ``W2 = (M + noise)^T``) on top
of zero base logits. In a real engine ``base_logits = lm_head(h)`` comes from the draft
backbone, ``hidden`` is that backbone's output, and ``target_forward`` is one forward of the
target over the ragged batch ``pack_verify_inputs`` builds. Everything between is what you see.

    python examples/decoding_loop.py [--device cuda] [--temperature 0] [--profile-step-rate]

With ``--temperature 0`` the output is checked token for token against plain greedy decoding of
the target.
"""

import argparse

import torch

import dspark_ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4, help="requests B")
    parser.add_argument("--block-size", type=int, default=6, help="drafts per round G")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary V (<= 1024 here: r = V)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--noise", type=float, default=0.5, help="error of the draft head")
    parser.add_argument("--profile-step-rate", action="store_true",
                        help="time the stand-in target with profile_step_rate instead of using "
                             "a synthetic step-rate table")
    args = parser.parse_args(argv)
    B, G, V, device = args.batch, args.block_size, args.vocab, torch.device(args.device)
    gen = torch.Generator().manual_seed(0)

    # --- stand-in models ------------------------------------------------------------------
    table = (2.5 * torch.randn(V, V, generator=gen)).to(device)  # target logits after token x

    def target_forward(input_ids, positions):
        """One target forward over a ragged batch: a row of logits per input token."""
        return table[input_ids]

    w1 = torch.eye(V, device=device)  # Markov head, rank r = V: W2 . W1[x] = W2[:, x]
    w2 = (table + args.noise * torch.randn(V, V, generator=gen).to(device)).T.contiguous()
    d = 16  # the draft backbone's hidden size
    conf_weight = torch.cat([0.1 * torch.randn(d, generator=gen),  # confidence head [d + r]
                             3.0 * table.softmax(-1).amax(-1).cpu()]).to(device)
    conf_bias = torch.tensor([0.5], device=device)

    # --- what the engine sets up once -----------------------------------------------------
    max_batch = B * (G + 1)  # the largest verify batch: every draft of every request
    if args.profile_step_rate:
        ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        step_rate = dspark_ops.profile_step_rate(
            lambda n: target_forward(ids[:n], ids[:n]), max_tokens=max_batch, device=device,
            warmup=1, repeats=3)
    else:  # each verified token costs a tenth of a step per request: a loaded server
        n = torch.arange(max_batch + 1, dtype=torch.float32)
        step_rate = (1.0 / (1.0 + 0.1 * n / B)).to(device)
    temperature = torch.full((B,), args.temperature, device=device)
    seed = torch.arange(B, device=device) + 1000  # one seed per request, for draft and verify

    # --- prefill: the first token is verify with no drafts on the prompts' last logits ----
    prompts = torch.randint(0, V, (B, 5), generator=gen).to(device)
    position = torch.full((B,), prompts.shape[1] - 1, dtype=torch.int64, device=device)
    first = dspark_ops.verify(target_forward(prompts[:, -1], position)[:, None],
                              torch.zeros(B, 0, dtype=torch.int64, device=device),
                              torch.zeros(B, dtype=torch.int32, device=device), temperature,
                              seed, position)
    anchor, position = first.tokens[:, 0], position + 1  # x0 at p0
    generated = [[t] for t in anchor.tolist()]

    rounds = accepted_total = verified_total = 0
    while min(len(g) for g in generated) < args.max_new_tokens:
        # 1. Draft: the backbone gives base logits and hidden states for the G block slots
        #    (stand-ins here); the Markov head walks the slots in one call.
        base_logits = torch.zeros(B, G, V, device=device)
        hidden = torch.randn(B, G, d, generator=gen).to(device)
        draft = dspark_ops.markov_draft(base_logits, anchor, w1, w2, temperature, seed, position)
        prev_tokens = torch.cat([anchor[:, None], draft.tokens[:, :-1]], 1)
        confidence = dspark_ops.draft_confidence(hidden, prev_tokens, w1, conf_weight, conf_bias)
        # 2. Schedule: how many drafts of each request are worth a target forward (lossless).
        num_verify = dspark_ops.schedule_verify(confidence, step_rate)
        # 3. Verify: one target forward over the ragged batch, one verify call.
        batch = dspark_ops.pack_verify_inputs(anchor, draft.tokens, num_verify, position)
        logits = target_forward(batch.input_ids, batch.positions)  # [B*(G+1), V]; tail = padding
        out = dspark_ops.verify(logits, draft.tokens, num_verify, temperature, seed, position,
                                draft_logits=draft.draft_logits, draft_temperature=temperature,
                                target_start=batch.cu_seqlens[:-1])
        # 4. Commit: the emitted token after the accepted drafts is the next anchor. A real
        #    engine also keeps the target's K/V of the accepted rows and appends their features
        #    to the draft's context (append_context_kv).
        anchor = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0]
        position = position + out.num_accepted.long() + 1
        # 5. The round's one host sync: read what was emitted.
        tokens, num_accepted = out.tokens.tolist(), out.num_accepted.tolist()
        for b in range(B):
            generated[b] += tokens[b][: num_accepted[b] + 1]
        rounds += 1
        accepted_total += sum(num_accepted)
        verified_total += int(num_verify.sum())

    print(f"device {device}, B={B}, G={G}, V={V}, T={args.temperature}: {rounds} rounds, "
          f"mean accepted length {(accepted_total + rounds * B) / (rounds * B):.2f}, "
          f"drafts verified per request-round {verified_total / (rounds * B):.2f}")
    for b in range(B):
        print(f"request {b}: {generated[b][:args.max_new_tokens]}")
    if args.temperature <= 1e-5:
        for b in range(B):  # plain greedy decoding of the target
            x, plain = int(prompts[b, -1]), []
            for _ in range(len(generated[b])):
                x = int(table[x].argmax())
                plain.append(x)
            assert generated[b] == plain, (b, generated[b], plain)
        print("greedy output identical to plain target decoding")
    print("ok")


if __name__ == "__main__":
    main()
