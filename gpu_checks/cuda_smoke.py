"""Short CUDA run of every kernel over edge cases, compared with the reference.

Small enough to run under compute-sanitizer (memcheck, racecheck) in gpu_checks/gpu_check.sh:
odd and tiny vocabularies, misaligned rows, ragged layouts, rows with no finite logit,
out-of-range draft ids (not value-checked on CUDA), int32 ids, greedy drafts, G = 0; the
scheduling ops over ties, caps, capacity limits and both sort paths (shared and global memory);
block_draft_attention and append_context_kv over GQA ratios, head dims, windows, slots and rows
that land past L; markov_draft, rnn_draft and draft_confidence over every weight dtype, ranks
1..1024, vocabularies that are not multiples of 16, batches of 1 and of more than 64 (several
batch groups), G = 0, 1, 5, greedy, sampled and mixed temperatures, misaligned and non-finite
base-logit rows and (on CUDA) out-of-range ids.
Run as `python -m gpu_checks.cuda_smoke [--device cpu]`. Exits non-zero on any disagreement with dspark_ops.reference beyond 1% of requests (float-rounding
near-ties are the only allowed differences; for the drafting ops, 1% of all drafted requests,
and draft logits and confidences must match wherever the drafted prefix does).
"""

from __future__ import annotations

import sys

import torch

import dspark_ops
from dspark_ops import reference
from bench.bench_draft import max_logit_difference, same_prefix


def make_case(batch, block, vocab, dtype, *, draft, ragged, nan_rows, bad_ids, seed):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, block + 1, (batch,), generator=g, dtype=torch.int32)
    target = torch.randn(batch * (block + 1) + 3, vocab, generator=g) * 3
    draft_logits = torch.randn(batch, block, vocab, generator=g) * 3 if draft else None
    tokens = torch.randint(0, vocab, (batch, block), generator=g)
    if bad_ids and block:
        tokens[::2, 0] = vocab + 5
        tokens[1::3, -1] = -7
    if nan_rows:
        target[1] = float("nan")
        target[4, : vocab // 2] = float("-inf")
        if draft_logits is not None and block:
            draft_logits[2, 0] = float("nan")
    temperature = torch.rand(batch, generator=g) + 0.3
    temperature[::4] = 0.0
    kwargs = {}
    if ragged:
        start = torch.cat([torch.zeros(1, dtype=torch.int64), (n + 1).cumsum(0)[:-1].long()])
        kwargs["target_start"] = (start + 1).int()
    else:
        target = target[: batch * (block + 1)]
    if draft_logits is not None:
        kwargs["draft_logits"] = draft_logits.to(dtype)
        kwargs["draft_temperature"] = torch.where(torch.arange(batch) % 5 == 1, 0.0, temperature)
    # A row stride of vocab + 1 elements misaligns the rows for vector loads.
    padded = torch.empty(target.shape[0], vocab + 1, dtype=dtype)[:, :vocab]
    padded.copy_(target.to(dtype))
    args = (
        padded,
        tokens.int() if seed % 2 else tokens,
        n,
        temperature,
        torch.randint(0, 2**62, (batch,), generator=g),
        torch.randint(0, 2**20, (batch,), generator=g),
    )
    return args, kwargs


# Drafting: (B, G, V, r, weight dtype, base-logit dtype, temperatures, W rows padded). V = 1, odd
# and larger vocabularies; r from 1 to the maximum 1024; B = 70 spans two 64-request batch groups
# (more at r = 1024, where the groups shrink to fit shared memory); padded W1/W2 rows (row
# stride r + 1) are misaligned for vector loads.
DRAFT_CASES = [
    (1, 1, 100, 8, torch.float32, torch.float32, "greedy", False),
    (1, 5, 4099, 256, torch.bfloat16, torch.bfloat16, "sampled", False),
    (70, 5, 4099, 8, torch.float16, torch.float16, "mixed", True),
    (70, 1, 1000, 256, torch.bfloat16, torch.float32, "sampled", False),
    (70, 5, 20011, 256, torch.bfloat16, torch.bfloat16, "mixed", False),
    (70, 5, 20011, 256, torch.bfloat16, torch.bfloat16, "sampled", True),
    (3, 5, 1, 8, torch.float32, torch.bfloat16, "sampled", False),
    (4, 0, 100, 8, torch.float32, torch.float32, "sampled", False),
    (70, 3, 257, 1024, torch.float16, torch.float32, "mixed", False),
    (70, 2, 257, 1024, torch.float32, torch.bfloat16, "sampled", True),
    (5, 2, 333, 1, torch.bfloat16, torch.float16, "greedy", True),
    (9, 5, 4099, 37, torch.float16, torch.float32, "sampled", False),
    (9, 5, 4099, 100, torch.float32, torch.float32, "sampled", True),
]
# rnn_draft: (B, G, V, r, d, dtype); draft_confidence: (B, G, V, r, d, dtype, bias and tau).
RNN_CASES = [
    (70, 3, 4099, 8, 24, torch.bfloat16),
    (2, 5, 100, 256, 40, torch.float32),
    (1, 1, 1000, 13, 8, torch.float16),
    (70, 2, 1000, 512, 64, torch.bfloat16),
]
CONFIDENCE_CASES = [
    (70, 5, 4099, 8, 24, torch.bfloat16, True),
    (1, 1, 100, 256, 40, torch.float32, False),
    (3, 7, 1000, 1024, 1000, torch.float16, True),
]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """``|got - want| <= rtol * (1 + max|want|)`` elementwise, NaNs and infinities equal."""
    finite = want[torch.isfinite(want)]
    scale = 1.0 + (finite.abs().max().item() if finite.numel() else 0.0)
    return got.shape == want.shape and max_logit_difference(got, want) <= rtol * scale


def draft_inputs(batch, block, vocab, rank, dtype, base_dtype, temperatures, padded_weights=False,
                 *, bad_ids, g):
    """CPU inputs of one markov_draft case: misaligned base-logit rows, a NaN row and a row with
    a -inf half, int32 anchors on odd batches, out-of-range anchors when ``bad_ids``."""
    scale = rank ** -0.25
    w1, w2 = (torch.empty(vocab, rank + padded_weights, dtype=dtype)[:, :rank] for _ in range(2))
    w1.copy_(torch.randn(vocab, rank, generator=g) * scale)
    w2.copy_(torch.randn(vocab, rank, generator=g) * scale)
    base = torch.randn(batch, block, vocab, generator=g) * 3
    if block and batch > 2:
        base[1, 0] = float("nan")
        base[2, block - 1, : vocab // 2] = float("-inf")
    padded = torch.empty(batch, block, vocab + 1, dtype=base_dtype)[..., :vocab]
    padded.copy_(base.to(base_dtype))
    anchor = torch.randint(0, vocab, (batch,), generator=g)
    if bad_ids:
        anchor[::3] = vocab + 5
        anchor[1::4] = -7
    if batch % 2:
        anchor = anchor.int()
    t = torch.rand(batch, generator=g) + 0.3
    if temperatures == "greedy":
        t.zero_()
    elif temperatures == "mixed":
        t[::2] = 0.0
    seed = torch.randint(0, 2**62, (batch,), generator=g)
    position = torch.randint(0, 2**20, (batch,), generator=g)
    return padded, anchor, w1, w2, t, seed, position


def compare_draft(got, want, vocab, rtol=1e-4):
    """Rows whose tokens differ; asserts ids in range and draft logits close wherever the
    drafted prefix agrees (slot j's logits depend on x_j)."""
    tokens, logits = (t.cpu() for t in got)
    assert tokens.shape == want.tokens.shape and logits.shape == want.draft_logits.shape
    assert ((tokens >= 0) & (tokens < vocab)).all(), "draft token id out of range"
    same = same_prefix(tokens, want.tokens)
    assert _close(logits[same], want.draft_logits[same], rtol), "draft logits differ"
    return int((tokens != want.tokens).any(1).sum())


def draft_smoke(device, on_device, g):
    """Every drafting case on ``device`` against the reference: (differing rows, rows, cases)."""
    bad, rows, cases = 0, 0, 0
    bad_ids = device == "cuda"
    for batch, block, vocab, rank, dtype, base_dtype, temps, padded in DRAFT_CASES:
        args = draft_inputs(batch, block, vocab, rank, dtype, base_dtype, temps, padded,
                            bad_ids=bad_ids, g=g)
        want = reference.markov_draft(*args)
        got = dspark_ops.markov_draft(*map(on_device, args))
        bad += compare_draft(got, want, vocab)
        rows, cases = rows + batch, cases + 1
    for batch, block, vocab, rank, hidden, dtype in RNN_CASES:
        base, anchor, w1, w2, t, seed, position = draft_inputs(
            batch, block, vocab, rank, dtype, dtype, "mixed", bad_ids=bad_ids, g=g)
        h = torch.randn(batch, block, hidden, generator=g).to(dtype)
        joint = (torch.randn(3 * rank, 2 * rank + hidden, generator=g)
                 * (2 * rank + hidden) ** -0.5).to(dtype)
        joint_bias = (torch.randn(3 * rank, generator=g) * 0.1).to(dtype)
        args = (base, anchor, h, w1, w2, joint, joint_bias, t, seed, position)
        want = reference.rnn_draft(*args)
        got = dspark_ops.rnn_draft(*map(on_device, args))
        bad += compare_draft(got, want, vocab)
        rows, cases = rows + batch, cases + 1
    for batch, block, vocab, rank, hidden, dtype, extras in CONFIDENCE_CASES:
        h = torch.randn(batch, block, hidden + 1, generator=g).to(dtype)[..., :hidden]
        prev = torch.randint(0, vocab, (block, batch), generator=g).T  # strided ids
        if bad_ids:
            prev[::4, 0] = vocab + 3
        w1 = torch.randn(vocab, rank, generator=g).to(dtype)
        weight = (torch.randn(hidden + rank, generator=g) * (hidden + rank) ** -0.5).to(dtype)
        bias = torch.full((1,), 0.3).to(dtype) if extras else None
        tau = torch.linspace(0.5, 2.0, block) if extras else None
        args = (h, prev.int() if batch % 2 else prev, w1, weight, bias, tau)
        want = reference.draft_confidence(*args)
        got = dspark_ops.draft_confidence(*map(on_device, args)).cpu()
        assert got.shape == want.shape, "draft_confidence: wrong shape"
        assert _close(got, want, 1e-5), "draft_confidence differs"
        cases += 1
    return bad, rows, cases


def loss_smoke(device, on_device) -> int:
    """dspark_loss forward + backward against the eager formula in float64: both row paths of the
    kernel (16-byte rows and others), 16-bit and float32, chunk boundaries."""
    cases = 0
    for vocab, dtype, rows, chunk in ((1000, torch.float32, 9, 4), (1003, torch.float32, 5, None),
                                      (2048, torch.bfloat16, 7, 3), (777, torch.float16, 6, None)):
        gen = torch.Generator().manual_seed(vocab)
        width, rank = 24, 8
        data = {
            "hidden": torch.randn(rows, width, generator=gen) / width ** 0.5 * 3,
            "lm_head_weight": torch.randn(vocab, width, generator=gen),
            "target_hidden": torch.randn(rows, width, generator=gen) / width ** 0.5 * 3,
            "markov_latent": torch.randn(rows, rank, generator=gen) * 0.2,
            "markov_w2": torch.randn(vocab, rank, generator=gen),
        }
        # The reference runs on the same (rounded) values, in float64.
        data = {k: v.to(dtype) for k, v in data.items()}
        labels = torch.randint(0, vocab, (rows,), generator=gen)
        weights = torch.rand(rows, generator=gen)
        confidence = torch.randn(rows, generator=gen)
        grads = []
        for fn, move, cast in ((dspark_ops.dspark_loss, on_device, dtype),
                               (reference.dspark_loss, lambda t: t, torch.float64)):
            leaves = {k: move(v.to(cast)).detach().clone().requires_grad_(k != "target_hidden")
                      for k, v in data.items()}
            extra = {"chunk_rows": chunk} if fn is dspark_ops.dspark_loss else {}
            out = fn(leaves["hidden"], leaves["lm_head_weight"], move(labels), move(weights),
                     target_hidden=leaves["target_hidden"], markov_latent=leaves["markov_latent"],
                     markov_w2=leaves["markov_w2"], confidence_logits=move(confidence), **extra)
            out.loss.backward()
            grads.append((out.loss.item(), leaves["hidden"].grad.double().cpu(),
                          leaves["markov_w2"].grad.double().cpu()))
        (loss, g_h, g_w2), (want, w_h, w_w2) = grads
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert abs(loss - want) <= tol * max(1.0, abs(want)), \
            f"dspark_loss differs from the reference on {device} (V={vocab}, {dtype})"
        for got, ref, name in ((g_h, w_h, "hidden"), (g_w2, w_w2, "markov_w2")):
            assert (got - ref).abs().max() <= tol * max(1.0, ref.abs().max().item()), \
                f"dspark_loss's gradient of {name} differs on {device} (V={vocab}, {dtype})"
        cases += 1
    return cases


def main() -> int:
    # `--device cpu` runs the same checks on the CPU kernel (a dry run of this script), minus
    # out-of-range ids, which the CPU value checks reject.
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("cuda_smoke: skipped (no CUDA device)")
        return 0

    def on_device(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    worst = 0.0
    cases = 0
    for vocab in (1, 2, 100, 8193):
        for block in (0, 1, 7):
            for draft in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    cases += 1
                    args, kwargs = make_case(
                        16, block, vocab, dtype, draft=draft, ragged=cases % 2 == 0,
                        nan_rows=cases % 3 == 0, bad_ids=device == "cuda" and cases % 4 == 0,
                        seed=cases,
                    )
                    if cases % 2:  # per-request sampling filters (some off) and a token mask
                        fg = torch.Generator().manual_seed(cases)
                        kwargs.update(
                            top_k=torch.randint(0, 8, (16,), generator=fg, dtype=torch.int32),
                            top_p=torch.rand(16, generator=fg).clamp_min(0.05),
                            min_p=torch.rand(16, generator=fg) * 0.3,
                            allowed_token_mask=torch.randint(
                                -2**31, 2**31 - 1, (args[0].reshape(-1, vocab).shape[0], (vocab + 31) // 32),
                                generator=fg, dtype=torch.int32))
                    want = reference.verify(*args, **kwargs)
                    got = dspark_ops.verify(
                        *map(on_device, args), **{k: on_device(v) for k, v in kwargs.items()}
                    )
                    got = [t.cpu() for t in got[:3]]
                    assert ((got[0] >= -1) & (got[0] < vocab)).all(), "token id out of range"
                    bad = (
                        (got[0] != want.tokens).any(1)
                        | (got[1] != want.num_accepted)
                        | (got[2] != want.valid)
                    )
                    worst = max(worst, bad.float().mean().item())
    # Scheduling: shared-memory (<= 4096 pairs) and global-workspace sorts, caps, ties, capacity.
    g = torch.Generator().manual_seed(7)
    for batch, block in ((1, 1), (3, 0), (64, 7), (256, 16), (300, 16)):
        confidence = torch.round(torch.rand(batch, block, generator=g) * 8) / 8  # many ties
        caps = torch.randint(0, block + 1, (batch,), generator=g, dtype=torch.int32)
        for capacity in sorted({batch + 1, max(batch + 1, batch * (block + 1) // 2), batch * (block + 1) + 1}):
            rate = 1.0 / (1.0 + torch.arange(capacity, dtype=torch.float32) * 0.01)
            want = (
                reference.schedule_verify(confidence, rate, max_verify=caps),
                reference.plan_verify_budget(confidence, rate),
            )
            got = (
                dspark_ops.schedule_verify(on_device(confidence), on_device(rate), max_verify=on_device(caps)),
                dspark_ops.plan_verify_budget(on_device(confidence), on_device(rate)),
            )
            assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want)), "scheduling differs"
            alloc = dspark_ops.allocate_verify(on_device(confidence), got[1], max_verify=on_device(caps))
            assert torch.equal(alloc.cpu(), reference.allocate_verify(confidence, want[1], max_verify=caps))
        anchor = torch.randint(0, 1000, (batch,), generator=g)
        drafts = torch.randint(0, 1000, (batch, block), generator=g)
        position = torch.randint(0, 2**20, (batch,), generator=g)
        want = reference.pack_verify_inputs(anchor, drafts, caps, position)
        got = dspark_ops.pack_verify_inputs(*map(on_device, (anchor, drafts, caps, position)))
        assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want)), "pack_verify_inputs differs"

    # Attention: GQA, every head dim, windows, slot indirection, empty and full contexts; then
    # append_context_kv with rows past L (dropped) and a full cache row.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for dim, ratio, window in ((64, 1, None), (128, 4, 7), (256, 8, 1000)):
        batch, block, kv_heads, slots, length = 3, 5, 2, 4, 70
        q = torch.randn(batch, block, kv_heads * ratio, dim, generator=g).to(dtype)
        k_block, v_block = (torch.randn(batch, block, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        k_cache, v_cache = (torch.randn(slots, length, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        seqlens = torch.tensor([0, 33, length], dtype=torch.int32)
        slot = torch.tensor([3, 0, 2], dtype=torch.int32)
        want, want_lse = reference.block_draft_attention(
            q, k_block, v_block, k_cache, v_cache, seqlens, cache_slot=slot, window=window)
        got, got_lse = dspark_ops.block_draft_attention(
            *map(on_device, (q, k_block, v_block, k_cache, v_cache, seqlens)),
            cache_slot=on_device(slot), window=window, return_lse=True)
        err = (got.cpu().float() - want.float()).abs().max().item()
        err = max(err, (got_lse.cpu() - want_lse).abs().max().item())
        assert err < 5e-2, f"block_draft_attention differs by {err} (D={dim}, ratio={ratio})"
        k_new, v_new = (torch.randn(batch, 6, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        num_new = torch.tensor([6, 2, 4], dtype=torch.int32)
        start = torch.tensor([length - 3, 10, length], dtype=torch.int32)
        want = [k_cache.clone(), v_cache.clone(), start.clone()]
        reference.append_context_kv(want[0], want[1], k_new, v_new, num_new, want[2], cache_slot=slot)
        got = [on_device(k_cache), on_device(v_cache), on_device(start)]
        dspark_ops.append_context_kv(got[0], got[1], on_device(k_new), on_device(v_new),
                                     on_device(num_new), got[2], cache_slot=on_device(slot))
        assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want)), "append_context_kv differs"

    seeds = torch.randint(-(2**62), 2**62, (7,))
    positions = torch.randint(0, 2**40, (7,))
    for purpose in (0, 1, 2):
        want = reference.philox_uniform(seeds, positions, purpose, 37)
        got = dspark_ops.philox_uniform(on_device(seeds), on_device(positions), purpose, 37).cpu()
        assert torch.equal(got, want), f"philox_uniform differs from the reference on {device}"
    loss_cases = loss_smoke(device, on_device)
    draft_bad, draft_rows, draft_cases = draft_smoke(device, on_device, g)
    print(f"cuda_smoke ({device}): scheduling exact; {cases} verify cases, worst disagreement "
          f"{worst:.3%} of requests; {draft_cases} drafting cases, {draft_bad}/{draft_rows} "
          f"drafted requests differ; {loss_cases} dspark_loss cases within tolerance")
    return 0 if worst <= 0.01 and draft_bad <= 0.01 * draft_rows else 1


if __name__ == "__main__":
    sys.exit(main())
