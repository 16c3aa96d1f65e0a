"""torch.compile(fullgraph=True) and CUDA-graph capture over the ops (docs/semantics.md §5,
registration)."""

from __future__ import annotations

import os

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import DEVICES, cuda_only, cuda_param


def _round_inputs(device, batch=4, block=5, vocab=257, hidden_size=32, seed=0):
    """A decode round's tensors: target hidden states and LM head, drafts and their logits."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, block + 1, hidden_size, generator=gen)
    lm_head = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5 * 4
    noise = torch.randn(batch, block, vocab, generator=gen)
    draft_logits = hidden[:, :block] @ lm_head.T + 0.5 * noise
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * batch)[:batch]
    probs = torch.softmax(draft_logits / temperature.clamp_min(1e-5)[:, None, None], -1)
    drafts = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, block)
    tensors = dict(
        hidden=hidden,
        lm_head=lm_head,
        draft_tokens=drafts,
        num_draft=torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32),
        temperature=temperature,
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        position=torch.randint(0, 2**40, (batch,), generator=gen),
        draft_logits=draft_logits,
    )
    return {k: v.to(device) for k, v in tensors.items()}


def decode_round(hidden, lm_head, draft_tokens, num_draft, temperature, seed, position,
                 draft_logits):
    """Target logits, verification, and the next round's anchor and position."""
    target_logits = hidden @ lm_head.T
    out = dspark_ops.verify(target_logits, draft_tokens, num_draft, temperature, seed, position,
                            draft_logits=draft_logits)
    anchor = out.tokens.gather(1, out.num_accepted.long()[:, None])[:, 0]
    next_position = position + out.num_accepted.long() + 1
    return out.tokens, out.num_accepted, out.valid, anchor, next_position


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)


# Inductor on CUDA runs once, in test_compiled_reduce_overhead_on_cuda: Triton compiles on a fresh
# machine are slow and the GPU check has a time budget.
DEVICE_BACKENDS = [
    pytest.param("cpu", "aot_eager", id="cpu-aot_eager"),
    pytest.param("cpu", "inductor", id="cpu-inductor"),
    cuda_param("cuda", "aot_eager", id="cuda-aot_eager"),
]


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_compiled_decode_round_matches_eager(device, backend):
    torch._dynamo.reset()
    compiled = torch.compile(decode_round, fullgraph=True, backend=backend)
    for seed in range(2):  # second call: new values, same shapes (no recompile needed)
        inputs = _round_inputs(device, seed=seed)
        _assert_equal(compiled(**inputs), decode_round(**inputs))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_verify_dynamic_batch(device):
    # Symbolic batch sizes go through the fake kernel's shape rule.
    torch._dynamo.reset()

    def fn(target_logits, draft_tokens, num_draft, temperature, seed, position, draft_logits,
           target_start):
        return tuple(dspark_ops.verify(target_logits, draft_tokens, num_draft, temperature, seed,
                                       position, draft_logits=draft_logits,
                                       target_start=target_start))[:3]

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch in (3, 6):
        inputs = _round_inputs(device, batch=batch, seed=batch)
        target = (inputs["hidden"] @ inputs["lm_head"].T).reshape(-1, inputs["lm_head"].shape[0])
        start = torch.arange(batch, dtype=torch.int32, device=device) * 6
        args = (target, inputs["draft_tokens"], inputs["num_draft"], inputs["temperature"],
                inputs["seed"], inputs["position"], inputs["draft_logits"], start)
        got = compiled(*args)
        _assert_equal(got, fn(*args))
        expected = reference.verify(*args[:6], draft_logits=args[6], target_start=start)
        _assert_equal(got, tuple(expected)[:3])


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_compiled_verify_with_filters_and_logprobs(device, backend):
    # The new keyword arguments (top_k, top_p, min_p, the allowed-token bitmask) and
    # return_logprobs in one full graph: the logprobs output comes through the fake kernel's
    # [B, G+1] shape and every output equals the eager call's and the reference's.
    torch._dynamo.reset()

    def fn(target_logits, draft_tokens, num_draft, temperature, seed, position, draft_logits,
           top_k, top_p, min_p, mask):
        out = dspark_ops.verify(target_logits, draft_tokens, num_draft, temperature, seed,
                                position, draft_logits=draft_logits, top_k=top_k, top_p=top_p,
                                min_p=min_p, allowed_token_mask=mask, return_logprobs=True)
        return out.tokens, out.num_accepted, out.valid, out.logprobs

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for seed in range(2):  # second call: new values, same shapes
        inputs = _round_inputs(device, seed=30 + seed)
        gen = torch.Generator().manual_seed(40 + seed)
        batch, block = inputs["draft_tokens"].shape
        vocab = inputs["lm_head"].shape[0]
        target = inputs["hidden"] @ inputs["lm_head"].T
        filters = (torch.tensor([0, 3, 20, 1], dtype=torch.int32),
                   torch.tensor([0.9, 1.0, 0.5, 0.8]),
                   torch.tensor([0.0, 0.05, 0.1, 0.0]),
                   torch.randint(-(2**31), 2**31, (batch * (block + 1), -(-vocab // 32)),
                                 generator=gen, dtype=torch.int32))
        args = (target, inputs["draft_tokens"], inputs["num_draft"], inputs["temperature"],
                inputs["seed"], inputs["position"], inputs["draft_logits"],
                *(t.to(device) for t in filters))
        got = compiled(*args)
        _assert_equal(got, fn(*args))
        assert got[3].shape == (batch, block + 1)
        expected = reference.verify(*args[:6], draft_logits=args[6], top_k=args[7],
                                    top_p=args[8], min_p=args[9], allowed_token_mask=args[10],
                                    return_logprobs=True)
        _assert_equal(got[:3], tuple(expected)[:3])
        torch.testing.assert_close(got[3], expected.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_compiled_philox_uniform_matches_eager(device, backend):
    torch._dynamo.reset()

    def fn(seed, position):
        u = dspark_ops.philox_uniform(seed, position, 2, 16)
        return -torch.log(u), u

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(3)
    seed = torch.randint(-(2**62), 2**62, (8,), generator=gen).to(device)
    position = torch.randint(0, 2**40, (8,), generator=gen).to(device)
    got, expected = compiled(seed, position), fn(seed, position)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)


def _copy_into(static: dict, fresh: dict):
    for name, tensor in fresh.items():
        static[name].copy_(tensor)


def _capture(call, warm_up=None):
    """Runs ``warm_up`` (default ``call``) twice on a side stream, then captures one ``call`` in
    a CUDA graph; returns the graph and the captured call's outputs (refreshed by each replay).
    Skips under DSPARK_OPS_DEBUG=1, whose value checks sync, which capture forbids."""
    if os.environ.get("DSPARK_OPS_DEBUG", "") not in ("", "0"):
        pytest.skip("DSPARK_OPS_DEBUG=1 value checks sync, which graph capture forbids")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            (warm_up or call)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    return graph, captured


@cuda_only
@pytest.mark.parametrize("with_draft_logits", [True, False])
def test_cuda_graph_capture_and_replay(with_draft_logits):
    # Captured once, replayed with new values written into the static inputs: every replay
    # equals an eager call on those values (and the reference).
    static = _round_inputs("cuda", seed=10)
    if not with_draft_logits:
        static["draft_logits"] = None

    def run(inputs):
        target = inputs["hidden"] @ inputs["lm_head"].T
        return dspark_ops.verify(target, inputs["draft_tokens"], inputs["num_draft"],
                                 inputs["temperature"], inputs["seed"], inputs["position"],
                                 draft_logits=inputs["draft_logits"])

    graph, captured = _capture(lambda: run(static))

    for seed in (11, 12, 13):
        fresh = _round_inputs("cuda", seed=seed)
        if not with_draft_logits:
            fresh["draft_logits"] = None
        _copy_into(static, {k: v for k, v in fresh.items() if v is not None})
        graph.replay()
        torch.cuda.synchronize()
        eager = run(fresh)
        _assert_equal(tuple(t.clone() for t in captured), tuple(eager))
        target = fresh["hidden"] @ fresh["lm_head"].T
        expected = reference.verify(target, fresh["draft_tokens"], fresh["num_draft"],
                                    fresh["temperature"], fresh["seed"], fresh["position"],
                                    draft_logits=fresh["draft_logits"])
        _assert_equal(tuple(eager), tuple(expected))


@cuda_only
def test_compiled_reduce_overhead_on_cuda():
    # torch.compile's CUDA-graph mode over a decode round.
    torch._dynamo.reset()
    compiled = torch.compile(decode_round, fullgraph=True, mode="reduce-overhead")
    for seed in range(4):
        inputs = _round_inputs("cuda", seed=20 + seed)
        got = tuple(t.clone() for t in compiled(**inputs))
        _assert_equal(got, decode_round(**inputs))


# --------------------------------------------------------------------------------------------
# The drafting family in a round: base logits -> markov_draft -> draft_confidence -> a verify
# length from the survivals -> target logits -> verify with the draft logits.
# --------------------------------------------------------------------------------------------


def _draft_round_inputs(device, batch=4, block=5, vocab=257, rank=16, hidden_size=32, seed=0):
    gen = torch.Generator().manual_seed(3000 + seed)
    tensors = dict(
        hidden=torch.randn(batch, block, hidden_size, generator=gen),
        lm_head=torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5 * 3,
        target_hidden=torch.randn(batch, block + 1, hidden_size, generator=gen),
        target_head=torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5 * 3,
        anchor=torch.randint(0, vocab, (batch,), generator=gen),
        w1=torch.randn(vocab, rank, generator=gen) * rank**-0.25,
        w2=torch.randn(vocab, rank, generator=gen) * rank**-0.25,
        confidence_weight=torch.randn(hidden_size + rank, generator=gen) / 4,
        confidence_bias=torch.tensor(1.0),
        calib_temperature=1 + torch.rand(block, generator=gen),
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3] * batch)[:batch],
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        position=torch.randint(0, 2**40, (batch,), generator=gen),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def draft_round(hidden, lm_head, target_hidden, target_head, anchor, w1, w2, confidence_weight,
                confidence_bias, calib_temperature, temperature, seed, position):
    """Drafts a block with the Markov head, scores it, verifies the drafts whose survival is at
    least 1/4 against a target that also sees the draft hidden states."""
    base_logits = hidden @ lm_head.T
    draft = dspark_ops.markov_draft(base_logits, anchor, w1, w2, temperature, seed, position)
    prev_tokens = torch.cat([anchor[:, None], draft.tokens[:, :-1]], 1)
    confidence = dspark_ops.draft_confidence(hidden, prev_tokens, w1, confidence_weight,
                                             confidence_bias, calib_temperature)
    num_draft = (torch.cumprod(confidence, 1) >= 0.25).sum(1, dtype=torch.int32)
    target_logits = target_hidden @ target_head.T
    target_logits[:, :-1] += base_logits  # a target that agrees with the draft model in part
    out = dspark_ops.verify(target_logits, draft.tokens, num_draft, temperature, seed, position,
                            draft_logits=draft.draft_logits)
    return (draft.tokens, draft.draft_logits, confidence, num_draft, out.tokens,
            out.num_accepted, out.valid)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_compiled_draft_round_matches_eager(device, backend):
    torch._dynamo.reset()
    compiled = torch.compile(draft_round, fullgraph=True, backend=backend)
    verified = set()
    for seed in range(2):  # second call: new values, same shapes (no recompile needed)
        inputs = _draft_round_inputs(device, seed=seed)
        expected = draft_round(**inputs)
        _assert_equal(compiled(**inputs), expected)
        verified.update(expected[3].tolist())
        if device == "cpu":
            # The eager round is the reference's.
            draft = reference.markov_draft(inputs["hidden"] @ inputs["lm_head"].T,
                                           inputs["anchor"], inputs["w1"], inputs["w2"],
                                           inputs["temperature"], inputs["seed"],
                                           inputs["position"])
            assert torch.equal(expected[0], draft.tokens)
    assert len(verified) > 1  # the confidences really chose different verify lengths


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_draft_ops_dynamic_batch(device):
    # Symbolic batch sizes go through the fake kernels' shape rules (both heads, confidence).
    torch._dynamo.reset()

    def fn(base_logits, anchor, hidden, w1, w2, joint_weight, joint_bias, temperature, seed,
           position, confidence_weight):
        markov = dspark_ops.markov_draft(base_logits, anchor, w1, w2, temperature, seed, position)
        rnn = dspark_ops.rnn_draft(base_logits, anchor, hidden, w1, w2, joint_weight, joint_bias,
                                   temperature, seed, position)
        confidence = dspark_ops.draft_confidence(hidden, markov.tokens, w1, confidence_weight)
        return (*markov, *rnn, confidence)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch in (3, 6):
        inputs = _draft_round_inputs(device, batch=batch, seed=batch)
        rank, width = inputs["w1"].shape[1], 2 * inputs["w1"].shape[1] + inputs["hidden"].shape[2]
        gen = torch.Generator().manual_seed(batch)
        args = (inputs["hidden"] @ inputs["lm_head"].T, inputs["anchor"], inputs["hidden"],
                inputs["w1"], inputs["w2"],
                (torch.randn(3 * rank, width, generator=gen) / width**0.5).to(device),
                torch.randn(3 * rank, generator=gen).to(device), inputs["temperature"],
                inputs["seed"], inputs["position"], inputs["confidence_weight"])
        _assert_equal(compiled(*args), fn(*args))


def _markov_graph_inputs(seed, batch=8, block=6, vocab=1000, rank=32):
    gen = torch.Generator().manual_seed(4000 + seed)
    tensors = dict(
        base_logits=torch.randn(batch, block, vocab, generator=gen).bfloat16(),
        anchor=torch.randint(0, vocab, (batch,), generator=gen),
        w1=(torch.randn(vocab, rank, generator=gen) * rank**-0.25).bfloat16(),
        w2=(torch.randn(vocab, rank, generator=gen) * rank**-0.25).bfloat16(),
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3] * batch)[:batch],
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        position=torch.randint(0, 2**40, (batch,), generator=gen),
    )
    return {k: v.to("cuda") for k, v in tensors.items()}


@cuda_only
def test_cuda_graph_markov_draft_capture_and_replay():
    # Captured once; replays with new base logits, anchors, weights, temperatures, seeds and
    # positions written into the static inputs equal eager calls: no host sync inside the op.
    static = _markov_graph_inputs(0)

    def run(inputs):
        return dspark_ops.markov_draft(inputs["base_logits"], inputs["anchor"], inputs["w1"],
                                       inputs["w2"], inputs["temperature"], inputs["seed"],
                                       inputs["position"])

    graph, captured = _capture(lambda: run(static))

    drafts = set()
    for seed in (1, 2, 3):
        fresh = _markov_graph_inputs(seed)
        _copy_into(static, fresh)
        graph.replay()
        torch.cuda.synchronize()
        got = tuple(t.clone() for t in captured)
        _assert_equal(got, tuple(run(fresh)))
        drafts.add(tuple(got[0].flatten().tolist()))
    assert len(drafts) == 3  # the replays really drafted from the new inputs


# --------------------------------------------------------------------------------------------
# Scheduling ops in a round: plan (stale confidences) -> allocate (fresh) -> pack -> target over
# the ragged batch -> verify.
# --------------------------------------------------------------------------------------------


def _schedule_round_inputs(device, batch=6, block=5, vocab=73, seed=0):
    gen = torch.Generator().manual_seed(1000 + seed)
    draft_logits = 2 * torch.randn(batch, block, vocab, generator=gen)
    drafts = torch.multinomial(torch.softmax(draft_logits, -1).reshape(-1, vocab), 1,
                               generator=gen).reshape(batch, block)
    n = torch.arange(batch * (block + 1) + 1, dtype=torch.float64).clamp_min(1)
    tensors = dict(
        stale_confidence=torch.rand(batch, block, generator=gen),
        confidence=torch.rand(batch, block, generator=gen),
        step_rate=(1000.0 / (batch + n)).float(),
        max_verify=torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32),
        anchor=torch.randint(0, vocab, (batch,), generator=gen),
        draft_tokens=drafts,
        position=torch.randint(0, 2**40, (batch,), generator=gen),
        token_table=2 * torch.randn(vocab, vocab, generator=gen),
        position_table=torch.randn(31, vocab, generator=gen),
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3] * batch)[:batch],
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        draft_logits=draft_logits,
    )
    return {k: v.to(device) for k, v in tensors.items()}


def schedule_round(stale_confidence, confidence, step_rate, max_verify, anchor, draft_tokens,
                   position, token_table, position_table, temperature, seed, draft_logits):
    """Two-stage scheduling, packing, a table "target" over the packed ids, and verification;
    schedule_verify on the fresh confidences as well."""
    budget = dspark_ops.plan_verify_budget(stale_confidence, step_rate)
    num_verify = dspark_ops.allocate_verify(confidence, budget, max_verify=max_verify)
    packed = dspark_ops.pack_verify_inputs(anchor, draft_tokens, num_verify, position)
    target_logits = token_table[packed.input_ids] + position_table[packed.positions % 31]
    out = dspark_ops.verify(target_logits, draft_tokens, num_verify, temperature, seed, position,
                            draft_logits=draft_logits, target_start=packed.cu_seqlens[:-1])
    single_stage = dspark_ops.schedule_verify(confidence, step_rate, max_verify=max_verify)
    return (budget, num_verify, *packed, *out[:3], single_stage)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_compiled_schedule_round_matches_eager(device, backend):
    torch._dynamo.reset()
    compiled = torch.compile(schedule_round, fullgraph=True, backend=backend)
    for seed in range(2):  # new values, same shapes
        inputs = _schedule_round_inputs(device, seed=seed)
        expected = schedule_round(**inputs)
        assert int(expected[1].sum()) > 0  # some drafts are verified
        _assert_equal(compiled(**inputs), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_schedule_round_dynamic_batch(device):
    torch._dynamo.reset()
    compiled = torch.compile(schedule_round, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch in (3, 7):
        inputs = _schedule_round_inputs(device, batch=batch, seed=batch)
        _assert_equal(compiled(**inputs), schedule_round(**inputs))


@cuda_only
def test_cuda_graph_schedule_round_capture_and_replay():
    # Captured once; replays with fresh confidences (and drafts, positions, ...) written into the
    # static inputs equal eager calls: no host sync, no data-dependent shapes.
    static = _schedule_round_inputs("cuda", seed=30)
    graph, captured = _capture(lambda: schedule_round(**static))

    lengths = set()
    for seed in (31, 32, 33):
        fresh = _schedule_round_inputs("cuda", seed=seed)
        _copy_into(static, fresh)
        graph.replay()
        torch.cuda.synchronize()
        got = tuple(t.clone() for t in captured)
        _assert_equal(got, schedule_round(**fresh))
        lengths.add(tuple(got[1].tolist()))
    assert len(lengths) > 1  # the replays really scheduled differently


# --------------------------------------------------------------------------------------------
# The attention family in a round: append the accepted rows' K/V to the context caches (in place),
# then draft the next block over the grown context.
# --------------------------------------------------------------------------------------------


def _context_round_inputs(device, batch=4, block=5, heads=8, kv_heads=2, dim=64, length=24,
                          rows=4, seed=0):
    gen = torch.Generator().manual_seed(2000 + seed)
    slots = batch + 3
    dtype = torch.bfloat16
    tensors = dict(
        k_cache=torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype),
        v_cache=torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype),
        cache_seqlens=torch.tensor([0, length - 2, 9, length][:batch], dtype=torch.int32),
        k_new=torch.randn(batch, rows, kv_heads, dim, generator=gen).to(dtype),
        v_new=torch.randn(batch, rows, kv_heads, dim, generator=gen).to(dtype),
        num_new=torch.randint(1, rows + 1, (batch,), generator=gen, dtype=torch.int32),
        cache_slot=torch.randperm(slots, generator=gen)[:batch].int(),
        q=torch.randn(batch, block, heads, dim, generator=gen).to(dtype),
        k_block=torch.randn(batch, block, kv_heads, dim, generator=gen).to(dtype),
        v_block=torch.randn(batch, block, kv_heads, dim, generator=gen).to(dtype),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def context_round(k_cache, v_cache, cache_seqlens, k_new, v_new, num_new, cache_slot, q, k_block,
                  v_block):
    """Appends k_new/v_new (mutating the caches and cache_seqlens), then attends with and
    without a window over the updated caches."""
    dspark_ops.append_context_kv(k_cache, v_cache, k_new, v_new, num_new, cache_seqlens,
                                 cache_slot=cache_slot)
    out, lse = dspark_ops.block_draft_attention(q, k_block, v_block, k_cache, v_cache,
                                                cache_seqlens, cache_slot=cache_slot,
                                                return_lse=True)
    windowed = dspark_ops.block_draft_attention(q, k_block, v_block, k_cache, v_cache,
                                                cache_seqlens, cache_slot=cache_slot, window=6)
    return out.float() * 2, lse, windowed


def _clone_inputs(inputs: dict) -> dict:
    return {k: v.clone() for k, v in inputs.items()}


MUTATED = ("k_cache", "v_cache", "cache_seqlens")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_compiled_context_round_matches_eager(device, backend):
    torch._dynamo.reset()
    compiled = torch.compile(context_round, fullgraph=True, backend=backend)
    for seed in range(2):  # new values, same shapes
        inputs = _context_round_inputs(device, seed=seed)
        eager_inputs, compiled_inputs = _clone_inputs(inputs), _clone_inputs(inputs)
        expected = context_round(**eager_inputs)
        _assert_equal(compiled(**compiled_inputs), expected)
        # The mutation of the caches and cache_seqlens happened, in the caller's tensors.
        assert not torch.equal(eager_inputs["cache_seqlens"], inputs["cache_seqlens"])
        for name in MUTATED:
            assert torch.equal(compiled_inputs[name], eager_inputs[name]), name
        state = {name: inputs[name].cpu().clone() for name in MUTATED}
        reference.append_context_kv(state["k_cache"], state["v_cache"], inputs["k_new"].cpu(),
                                    inputs["v_new"].cpu(), inputs["num_new"].cpu(),
                                    state["cache_seqlens"], cache_slot=inputs["cache_slot"].cpu())
        for name in MUTATED:
            assert torch.equal(compiled_inputs[name].cpu(), state[name]), name


@cuda_only
def test_cuda_graph_context_round_capture_and_replay():
    # Captured once; each replay appends and attends over fresh values copied into the static
    # inputs, and equals an eager round on those values: no host sync inside either op.
    static = _context_round_inputs("cuda", seed=40)
    # Warm-up calls on copies: the round appends to the caches it is given.
    graph, captured = _capture(lambda: context_round(**static),
                               warm_up=lambda: context_round(**_clone_inputs(static)))

    for seed in (41, 42, 43):
        fresh = _context_round_inputs("cuda", seed=seed)
        _copy_into(static, fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager_inputs = _clone_inputs(fresh)
        _assert_equal(tuple(t.clone() for t in captured), context_round(**eager_inputs))
        for name in MUTATED:
            assert torch.equal(static[name], eager_inputs[name]), name
