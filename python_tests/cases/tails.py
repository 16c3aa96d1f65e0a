"""Vocabulary tails: the ops that scan the vocabulary in pieces (chunks, tiles, vectors) must reach
its last id and every piece's first and last. Each family's piece size is one named constant
below (read from its kernels); the vocabulary sizes and the ids to probe are derived from it:
sizes whose last piece holds one element, and every piece boundary. The builders put the winner
(verify's emitted token, a draft), the maximum, the only allowed token or the only mass at those
ids, one request (or row) per id, and say what the op must return.

Shared by test_verify.py, test_draft.py, test_loss.py and their test_sim_* twins.
"""

from __future__ import annotations

import math

import torch

from cases.common import generator
from cases.verify_filters import pack_mask

# ---- verify ------------------------------------------------------------------------------------
# csrc/cpu/verify_cpu.cpp: every pass walks blocks of kBlock = 1024 ids. csrc/kernels/verify.cuh
# (verify_chunk): min(16, ceil(V / 1024)) chunks of a multiple of 16 ids, the statistics loop
# taking 8 ids a thread. The CUDA plan cannot leave one id alone in its last chunk (its chunks are
# ceil(V / C) rounded up to 16, so the last holds more than V / C - 16 * C ids), so the sizes are
# those whose CPU block and whose CUDA chunk's last 16-id group hold one id.
VERIFY_BLOCK = 1024
VERIFY_ALIGN = 16  # CUDA chunk starts; also the statistics loop's vector group (8 or 16 ids)
VERIFY_MAX_CHUNKS = VERIFY_ALIGN  # the CUDA plan's most chunks per request
VERIFY_VOCABS = (VERIFY_ALIGN + 1, VERIFY_BLOCK + 1, 8 * VERIFY_BLOCK + 1)


def filters_keeping_one(kind: str, batch: int) -> dict:
    """The per-request filter of ``kind`` that keeps only a row's most likely token (top-k 1,
    top-p 0.01, min-p 1; {} for any other kind): the winner at a boundary id must be the only
    token left."""
    if kind == "top_k":
        return {"top_k": torch.ones(batch, dtype=torch.int32)}
    if kind == "top_p":
        return {"top_p": torch.full((batch,), 0.01)}
    if kind == "min_p":
        return {"min_p": torch.ones(batch)}
    return {}


def verify_cuda_chunks(vocab: int) -> list[tuple[int, int]]:
    """[x0, x1) of each chunk of kernels/verify.cuh's plan (verify_chunk)."""
    wanted = min(VERIFY_MAX_CHUNKS, -(-vocab // VERIFY_BLOCK))
    chunk = -(-(-(-vocab // wanted)) // VERIFY_ALIGN) * VERIFY_ALIGN
    return [(x0, min(x0 + chunk, vocab)) for x0 in range(0, vocab, chunk)]


def piece_edges(vocab: int, *sizes: int) -> list[int]:
    """The first and last id of every piece of each size (pieces [k s, (k + 1) s) cut at V)."""
    ids = {0, vocab - 1}
    for size in sizes:
        for x0 in range(0, vocab, size):
            ids.update((x0, min(x0 + size, vocab) - 1))
    return sorted(ids)


def verify_edges(vocab: int) -> list[int]:
    ids = set(piece_edges(vocab, VERIFY_BLOCK))
    for x0, x1 in verify_cuda_chunks(vocab):
        ids.update((x0, x1 - 1))
    return sorted(ids)


VERIFY_KINDS = ("race", "greedy", "top_k", "top_p", "min_p", "mask")


def verify_tail_case(vocab: int, kind: str, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """Keyword arguments of ``verify`` (logprobs on) with one request per boundary id x; every
    target row's winner is x and the drafts (id x + 1, or none) are rejected, so each request
    emits x as its first token: "race", sampled from a row whose mass sits on x (the race
    after a rejected one-hot draft, and for the bonus row num_draft = 0); "greedy", the maximum at x (the statistics' argmax);
    "top_k" (1), "top_p" (0.01), "min_p" (1): x the only token the filter keeps; "mask": x the
    only allowed token, on rows whose maximum is elsewhere. Returns the arguments and x."""
    where = torch.tensor(verify_edges(vocab))
    batch, block = where.numel(), 2
    gen = generator(seed)
    target = torch.randn(batch, block + 1, vocab, generator=gen)
    rows = torch.arange(batch)
    if kind == "mask":
        target[rows, :, (where + vocab // 2) % vocab] = 30.0  # elsewhere, and disallowed
        target[rows, :, where] = 0.5
    else:
        # "race": the rest of the row keeps ~1e-5 of the mass, far above the race's residual
        # floor (kMinResidualMass), so a race that missed x would emit another id rather than
        # fall back to racing the whole row.
        target[rows, :, where] = math.log(vocab) + 12.0 if kind == "race" else 6.0
    drafts = ((where + 1) % vocab)[:, None].expand(batch, block).contiguous()
    args = dict(
        target_logits=target, draft_tokens=drafts,
        num_draft=(torch.arange(batch) % (block + 1)).to(torch.int32),
        temperature=torch.full((batch,), 0.0 if kind == "greedy" else 1.0),
        seed=torch.arange(batch) * 7919 + seed, position=torch.arange(batch) * 1000,
        # One-hot drafts for the race (a draft distribution would leave no residual mass
        # outside x); the filters' rows are raced against draft distributions.
        draft_logits=None if kind in ("greedy", "race")
        else torch.randn(batch, block, vocab, generator=gen),
        return_logprobs=True)
    args.update(filters_keeping_one(kind, batch))
    if kind == "mask":
        allowed = torch.zeros(batch * (block + 1), vocab, dtype=torch.bool)
        allowed[torch.arange(allowed.shape[0]), where.repeat_interleave(block + 1)] = True
        args["allowed_token_mask"] = pack_mask(allowed)
    return args, where


# ---- drafting ----------------------------------------------------------------------------------
# csrc/cpu/draft_cpu.cpp: a slot's pass over the vocabulary in chunks of kChunk = 2048 ids.
# csrc/kernels/draft_slot.cuh: 16-row warp tiles, 128-row block tiles (kTileRows); 8 values a
# thread per load in the filter kernel (kFilterValues, filter.cuh); all divide 2048, so one id
# past a multiple of 2048 is alone in the last chunk and tile of every kind.
DRAFT_CHUNK = 2048
DRAFT_WARP_TILE = 16
DRAFT_BLOCK_TILE = 8 * DRAFT_WARP_TILE
DRAFT_VOCABS = (DRAFT_WARP_TILE + 1, DRAFT_BLOCK_TILE + 1, DRAFT_CHUNK + 1)
# draft_confidence sums [h; W1[x]] in segments of kConfidenceSegment = 2048, each on its own.
CONFIDENCE_SEGMENT = DRAFT_CHUNK


def draft_edges(vocab: int) -> list[int]:
    """Every block tile's and CPU chunk's first and last id, and those of the first, last and
    a middle warp tile."""
    ids = set(piece_edges(vocab, DRAFT_BLOCK_TILE, DRAFT_CHUNK))
    last = (vocab - 1) // DRAFT_WARP_TILE * DRAFT_WARP_TILE
    for x0 in (0, DRAFT_WARP_TILE, last // 2 // DRAFT_WARP_TILE * DRAFT_WARP_TILE, last):
        ids.update((x0, min(x0 + DRAFT_WARP_TILE, vocab) - 1))
    return sorted(i for i in ids if 0 <= i < vocab)


DRAFT_KINDS = ("sampled", "greedy", "top_k", "top_p", "min_p")


def draft_tail_case(vocab: int, head: str, kind: str, seed: int = 0):
    """A ``DraftCase`` with one request per boundary id x whose every slot's winner is x (base
    logits 30 there over a random row; the head's bias is small), and the filters of ``kind``
    ("top_k" 1, "top_p" 0.01, "min_p" 1: x the only token kept). Returns the case, the filter
    keyword arguments and x."""
    from cases.draft import make_case

    where = torch.tensor(draft_edges(vocab))
    batch, block = where.numel(), 2
    case = make_case(batch, block, vocab, 8, seed=seed, head=head, weights="bf16",
                     temperature=0.0 if kind == "greedy" else 1.0, bias_scale=0.1)
    base = case.base_logits.clone()
    base[torch.arange(batch), :, where] = 30.0
    return case.replace(base_logits=base), filters_keeping_one(kind, batch), where


def confidence_tail_cases(hidden_size: int, rank: int, vocab: int, seed: int = 0):
    """``draft_confidence`` calls (hidden, prev_tokens, w1, weight), one per boundary of the weight
    segments of ``[h; W1[x]]`` (``hidden_size + rank`` one past a segment leaves one weight in
    the last): the only nonzero weight sits at that edge, so each logit is one product, and the
    previous tokens are V - 1 (W1's last row) and 0."""
    gen = generator(seed)
    hidden = torch.randn(3, 2, hidden_size, generator=gen)
    w1 = torch.randn(vocab, rank, generator=gen)
    prev = torch.tensor([vocab - 1, 0]).expand(3, 2).contiguous()
    for edge in piece_edges(hidden_size + rank, CONFIDENCE_SEGMENT):
        weight = torch.zeros(hidden_size + rank)
        weight[edge] = 1.5
        yield hidden, prev, w1, weight


# ---- loss --------------------------------------------------------------------------------------
# csrc/kernels/loss.cuh: kLossThreads = 256 threads stride over the row, an element at a time, or
# 16 bytes (4 float32, 8 16-bit values) at a time where rows are 16-byte multiples. csrc/cpu/
# loss_cpu.cpp: vector loops of 8 or 16 float32 lanes (both divide 256) and a scalar tail.
LOSS_STRIDE = 256


def loss_vocabs(element_size: int) -> tuple[int, ...]:
    """A scalar-path size with one id in the last stride (and in the CPU's scalar tail), and a
    vector-path size with one vector in the last stride."""
    vec = 16 // element_size
    return (LOSS_STRIDE + 1, LOSS_STRIDE * vec + vec)


def loss_edges(vocab: int, element_size: int) -> list[int]:
    return piece_edges(vocab, LOSS_STRIDE, LOSS_STRIDE * (16 // element_size))


def loss_tail_case(vocab: int, dtype=torch.float32, *, spread: bool = False) -> tuple[dict, torch.Tensor]:
    """Keyword arguments of the ``dspark_loss`` op (the schema's names) with one row per boundary
    id x: the draft's mass sits on x (z[x] = 20 over a random row), the label is x and the
    target's mass sits on the next edge's id (or x itself on odd rows), so every term reads the
    tail. With ``spread``, z's mass is half on x and half elsewhere (gradients away from 0).
    Logits are exactly ``lm_head_weight``'s columns: hidden state i picks column i, the target
    column N + i. Returns the arguments and x."""
    edges = loss_edges(vocab, torch.tensor([], dtype=dtype).element_size())
    where = torch.tensor(edges)
    rows = where.numel()
    gen = generator(vocab)
    z = torch.randn(rows, vocab, generator=gen)
    t = torch.randn(rows, vocab, generator=gen)
    r = torch.arange(rows)
    other = torch.tensor(edges[1:] + edges[:1])
    z[r, where] = 20.0
    if spread:
        z[r, (where + vocab // 2) % vocab] = 20.0
    t[r, torch.where(r % 2 == 0, other, where)] = 20.0
    eye = torch.eye(2 * rows)
    args = dict(hidden=eye[:rows].to(dtype), lm_head_weight=torch.cat([z, t]).T.contiguous().to(dtype),
                labels=where.clone(), weights=torch.rand(rows, generator=gen) + 0.5,
                term_scale=torch.tensor([0.3, 0.7]), target_hidden=eye[rows:].to(dtype))
    return args, where


def loss_reference(args: dict) -> dict:
    """Per row, in float64 from the reference of record (dspark_ops.reference.dspark_loss): ce
    and l1 of each row alone (weight 1; its accept_rate gives l1) and the weighted loss's
    gradient of ``hidden`` (autograd)."""
    from dspark_ops import reference

    def f64(name):
        return args[name].double()

    rows = args["labels"].numel()
    ce, l1 = [], []
    for i in range(rows):
        one = reference.dspark_loss(f64("hidden")[i:i + 1], f64("lm_head_weight"),
                                    args["labels"][i:i + 1], torch.ones(1, dtype=torch.float64),
                                    target_hidden=f64("target_hidden")[i:i + 1],
                                    confidence_weight=0.0, denominators=1.0)
        ce.append(one.ce)
        l1.append(one.l1)
    hidden = f64("hidden").requires_grad_(True)
    s = args["term_scale"].double()
    out = reference.dspark_loss(hidden, f64("lm_head_weight"), args["labels"], f64("weights"),
                                target_hidden=f64("target_hidden"), ce_weight=float(s[0]),
                                l1_weight=float(s[1]), confidence_weight=0.0, denominators=1.0)
    out.loss.backward()
    return dict(loss=out.loss.detach(), ce=torch.stack(ce), l1=torch.stack(l1),
                grad_hidden=hidden.grad)


# ---- checks ------------------------------------------------------------------------------------


def check_verify_tail(op, args: dict, where: torch.Tensor) -> None:
    """``op`` (a verify entry point, called by keyword) emits each request's boundary id first,
    as the reference does, with the reference's logprobs."""
    from dspark_ops import reference
    from cases.verify_filters import LOGPROB_TOLERANCE

    tokens, accepted, valid, logprobs = op(**args)
    want = reference.verify(**args)
    assert tokens[:, 0].tolist() == where.tolist(), "a boundary id was not emitted"
    assert (accepted == 0).all() and valid.all()
    assert torch.equal(tokens, want.tokens) and torch.equal(accepted, want.num_accepted)
    torch.testing.assert_close(logprobs, want.logprobs, **LOGPROB_TOLERANCE)


def check_draft_tail(tokens: torch.Tensor, logits: torch.Tensor, case, filters: dict,
                     where: torch.Tensor) -> None:
    """Every slot drafted its request's boundary id; the stored logits are the reference's (within
    the CUDA head's float32 tolerance, which also bounds the CPU's), -inf where a filter dropped
    a token, so only the boundary id is finite under a filter."""
    from dspark_ops import reference

    want = case.call(reference, **filters)
    expected = where[:, None].expand_as(tokens)
    assert torch.equal(tokens, expected), (tokens != expected).nonzero()[:4].tolist()
    assert torch.equal(torch.isfinite(logits), torch.isfinite(want.draft_logits))
    if filters:
        finite = torch.isfinite(logits)
        assert finite.sum(-1).eq(1).all() and finite.gather(-1, tokens[..., None]).all()
    torch.testing.assert_close(logits, want.draft_logits, rtol=1e-5, atol=1e-4)


LOSS_OUTPUTS = ("loss", "ce", "l1", "grad_hidden")


def check_loss_tail(op, args: dict, tol: float) -> None:
    """The ``dspark_loss`` op (keyword arguments, chunks of two rows, gradients on) against the
    reference's per-row ce and l1, loss and hidden gradient."""
    got = dict(zip(LOSS_OUTPUTS, op(**args, compute_grad=True, chunk_rows=2)))
    want = loss_reference(args)
    for name in LOSS_OUTPUTS:
        # Absolute errors scale with the largest value (the gradient sums V products of logits).
        scale = max(1.0, float(want[name].abs().max()))
        torch.testing.assert_close(got[name].double(), want[name], rtol=tol, atol=tol * scale,
                                   msg=lambda m: f"{name}: {m}")
