"""Inputs of the drafting ops (markov_draft, rnn_draft, draft_confidence) and the checks of
their outputs, shared by test_draft.py, test_draft_bf16.py, test_draft_filters.py and
test_sim_draft.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

import dspark_ops
from cases.common import INF, generator, is_greedy
from dspark_ops import reference

# Head weights: the dtype the op receives, and whether float32 values are rounded to bfloat16
# first. With 16-bit mantissas every product is exact in float64 and so is the whole dot product
# of the reference. "f32full" keeps full 24-bit mantissas: the float64 sum order may then differ
# from the reference's BLAS in the last bit of z (1 ulp after rounding to float32). The CPU
# kernel's float32 head is within logits_tolerance of either; its tokens are always exact.
WEIGHTS = {
    "f32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
    "f16": (torch.float16, False),
    "f32full": (torch.float32, False),
}


ULP_RTOL = 1.2e-7  # just above 2**-23: one float32 ulp relative to the value


RNN_RTOL = 1e-6  # tanh / sigmoid in float64 may differ from torch's in the last float64 bits


# --------------------------------------------------------------------------------------------
# Building inputs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DraftCase:
    """One call's arguments, for the Markov head or (with ``hidden``) the RNN head."""

    base_logits: torch.Tensor
    anchor: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    temperature: torch.Tensor
    seed: Optional[torch.Tensor]
    position: torch.Tensor
    hidden: Optional[torch.Tensor] = None
    joint_weight: Optional[torch.Tensor] = None
    joint_bias: Optional[torch.Tensor] = None

    PER_REQUEST = ("base_logits", "anchor", "temperature", "seed", "position", "hidden")

    @property
    def head(self) -> str:
        return "markov" if self.hidden is None else "rnn"

    @property
    def vocab(self) -> int:
        return self.base_logits.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.base_logits.device

    def call(self, ops=dspark_ops, **extra):
        """Runs ``ops.markov_draft`` / ``ops.rnn_draft`` (the op, or ``reference``)."""
        if self.head == "markov":
            return ops.markov_draft(self.base_logits, self.anchor, self.w1, self.w2,
                                    self.temperature, self.seed, self.position, **extra)
        return ops.rnn_draft(self.base_logits, self.anchor, self.hidden, self.w1, self.w2,
                             self.joint_weight, self.joint_bias, self.temperature, self.seed,
                             self.position, **extra)

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes) -> "DraftCase":
        return dataclasses.replace(self, **changes)

    def to(self, device) -> "DraftCase":
        return DraftCase(**{k: None if v is None else v.to(device)
                            for k, v in self.fields().items()})

    def select(self, index: torch.Tensor) -> "DraftCase":
        """The requests ``index``, in that order (the weights are shared)."""
        return self.replace(**{k: getattr(self, k)[index] for k in self.PER_REQUEST
                               if getattr(self, k) is not None})


def peaky_logits(shape, vocab: int, gen: torch.Generator, heads: int = 3) -> torch.Tensor:
    """float32 logits: a dense random tail plus a few boosted tokens per row, as LM logits have."""
    logits = torch.randn(*shape, vocab, generator=gen)
    if vocab > heads:
        index = torch.rand(*shape, vocab, generator=gen).topk(heads, dim=-1).indices
        boost = 0.5 * math.log(vocab) + 2 * torch.rand(*shape, heads, generator=gen)
        logits.scatter_add_(-1, index, boost)
    return logits


def make_weight(shape, scale: float, kind: str, gen: torch.Generator) -> torch.Tensor:
    dtype, bf16_values = WEIGHTS[kind]
    w = torch.randn(*shape, generator=gen) * scale
    if bf16_values:
        w = w.to(torch.bfloat16)
    return w.to(dtype)


def make_temperature(kind, batch: int, gen: torch.Generator) -> torch.Tensor:
    if isinstance(kind, torch.Tensor):
        return kind.float()
    if isinstance(kind, (int, float)):
        return torch.full((batch,), float(kind))
    sampled = 0.4 + 1.2 * torch.rand(batch, generator=gen)
    if kind == "sampled":
        return sampled
    if kind == "greedy":
        return torch.tensor([0.0, 1e-6, 1e-5])[torch.arange(batch) % 3]
    if kind == "mixed":
        # Every third request greedy (0, 1e-6, exactly the 1e-5 threshold), so even B = 2 mixes.
        greedy = torch.tensor([0.0, 1e-6, 1e-5])[torch.arange(batch) // 3 % 3]
        return torch.where(torch.arange(batch) % 3 == 0, greedy, sampled)
    raise ValueError(kind)


def make_case(batch: int, block: int, vocab: int, rank: int = 8, *, seed: int,
              temperature="mixed", weights: str = "bf16", base_dtype=torch.float32,
              anchor_dtype=torch.int64, head: str = "markov", hidden_size: int = 16,
              bias_scale: float = 1.0) -> DraftCase:
    """Random inputs whose head bias (std about ``bias_scale``) is comparable to the spread of
    the base logits, so the previous token really changes the next draft."""
    gen = generator(seed)
    base = peaky_logits((batch, block), vocab, gen).to(base_dtype)
    if head == "markov":
        scale = (bias_scale / rank**0.5) ** 0.5  # W2 . W1[x] ~ sqrt(r) * scale^2
        w1, w2 = (make_weight((vocab, rank), scale, weights, gen) for _ in range(2))
        extra = {}
    else:
        width = 2 * rank + hidden_size
        w1 = make_weight((vocab, rank), 1.0, weights, gen)
        w2 = make_weight((vocab, rank), 1.7 * bias_scale / rank**0.5, weights, gen)
        extra = dict(
            hidden=torch.randn(batch, block, hidden_size, generator=gen).to(base_dtype),
            joint_weight=make_weight((3 * rank, width), 1.5 / width**0.5, weights, gen),
            joint_bias=make_weight((3 * rank,), 0.5, weights, gen),
        )
    return DraftCase(
        base_logits=base,
        anchor=torch.randint(0, vocab, (batch,), generator=gen).to(anchor_dtype),
        w1=w1,
        w2=w2,
        temperature=make_temperature(temperature, batch, gen),
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        # Across the 2^32 boundary of the counter's position words.
        position=torch.randint(0, 2**33, (batch,), generator=gen),
        **extra,
    )


# --------------------------------------------------------------------------------------------
# Checking outputs
# --------------------------------------------------------------------------------------------


def embed(w1: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """W1[ids] in float64; ids outside [0, V) give zero rows (as the ops specify)."""
    ids = ids.long()
    in_range = (ids >= 0) & (ids < w1.shape[0])
    rows = w1[ids.clamp(0, w1.shape[0] - 1)].double()
    return torch.where(in_range[..., None], rows, 0.0)


def previous_tokens(anchor: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[anchor, x_1, ..., x_{G-1}]: the token each slot is biased by."""
    return torch.cat([anchor.long()[:, None], tokens[:, :-1].long()], 1)


def teacher_forced_logits(case: DraftCase, tokens: torch.Tensor) -> torch.Tensor:
    """z_j (docs/semantics.md §1 step 3) for the given drafts, in float64 rounded once to float32,
    on the CPU: what draft_logits must be for these tokens."""
    case, tokens = case.to("cpu"), tokens.cpu()
    prev = previous_tokens(case.anchor, tokens)
    w2 = case.w2.double()
    if case.head == "markov":
        bias = embed(case.w1, prev) @ w2.T
    else:
        rank = case.w1.shape[1]
        weight, jbias = case.joint_weight.double(), case.joint_bias.double()
        state = torch.zeros(tokens.shape[0], rank, dtype=torch.float64)
        inputs = []
        for j in range(tokens.shape[1]):
            u = torch.cat([state, embed(case.w1, prev[:, j]), case.hidden[:, j].double()], -1)
            g, c, o = (u @ weight.T + jbias).split(rank, -1)
            inputs.append(torch.tanh(o))
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
        bias = torch.stack(inputs, 1) @ w2.T if inputs else torch.zeros(*tokens.shape, case.vocab,
                                                                         dtype=torch.float64)
    return (bias + case.base_logits.double()).float()


def check_output_contract(case: DraftCase, out) -> None:
    """What every output must satisfy whatever the inputs (docs/semantics.md §3.2)."""
    batch, block, vocab = case.base_logits.shape
    assert isinstance(out, dspark_ops.DraftOutput)
    assert out.tokens.dtype == torch.int64 and out.tokens.shape == (batch, block)
    assert out.draft_logits.dtype == torch.float32
    assert out.draft_logits.shape == (batch, block, vocab)
    assert out.tokens.device == out.draft_logits.device == case.device
    tokens = out.tokens.cpu()
    assert ((tokens >= 0) & (tokens < vocab)).all(), f"ids out of range: {tokens}"


def describe_token_difference(case: DraftCase, got: torch.Tensor, expected: torch.Tensor) -> str:
    bad = (got.cpu() != expected.cpu()).nonzero()
    b, j = bad[0].tolist()
    return (
        f"{bad.shape[0]} of {got.numel()} tokens differ; first b={b} j={j}: op {got[b].tolist()} "
        f"reference {expected[b].tolist()}; temperature={float(case.temperature[b])} "
        f"seed={int(case.seed[b])} position={int(case.position[b])}"
    )


def fast_head_bound(case: DraftCase) -> float:
    """The CPU kernel's float32 head against the float64 reference (docs/semantics.md §3.2):
    |draft_logits - reference| <= gamma(n + 1) ||x||_2 max_v ||W2[v]||_2 (1 + 2^-12) + 2^-22 |z|,
    gamma(n) = n 2^-24 / (1 - n 2^-24), n = ceil(r / 8) + 8, x the bias input (W1[x_j], or
    tanh(o_j) with ||x|| <= sqrt(r)); the absolute part returned here."""
    rank = case.w1.shape[1]
    n = -(-rank // 8) + 8 + 1
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24) + (rank + 2) * 2.0**-53
    w_max = float(case.w2.cpu().double().norm(dim=1).max())
    x_max = (math.sqrt(rank) if case.head == "rnn"
             else float(case.w1.cpu().double().norm(dim=1).max()))
    return gamma * x_max * w_max * (1 + 2.0**-12) + 2.0**-126


def logits_tolerance(case: DraftCase) -> dict:
    """CPU draft_logits against the reference: within the float32 head's certified bound (rows
    the kernel recomputed in float64 are bit-exact; tokens always are)."""
    rtol = max(2.0**-22, RNN_RTOL if case.head == "rnn" else ULP_RTOL)
    return dict(rtol=rtol, atol=fast_head_bound(case))


def bf16_representable(*tensors) -> bool:
    return all(torch.equal(t, t.to(torch.bfloat16).to(t.dtype)) for t in tensors)


def cuda_tolerance(case: DraftCase, z: torch.Tensor, factor: float = 1.0) -> dict:
    """CUDA's float32 head against float64 math: relative 1e-3, and an absolute part scaled by
    the largest head bias |z - base| (the float32 dot product's rounding grows with it)."""
    bias = (z.double() - case.base_logits.cpu().double()).abs()
    bias = bias[torch.isfinite(bias)]
    scale = float(bias.max()) if bias.numel() else 0.0
    return dict(rtol=1e-3, atol=factor * 1e-3 * max(1.0, scale))


def draft_keys(z: torch.Tensor, temperature, seed, position) -> torch.Tensor:
    """reference.draft_sample's Gumbel-max keys (z for greedy rows; -inf where z is not finite)."""
    greedy = is_greedy(temperature)
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature)[:, None]
    u = reference.philox_uniform(seed, position, reference.PURPOSE_DRAFT, z.shape[-1])
    key = torch.where(greedy[:, None], z, z * inv_t - torch.log(-torch.log1p(-u)))
    return torch.where(torch.isfinite(z), key, -INF)


def assert_sampled_from_stored_logits(case: DraftCase, out, max_mismatch: float = 0.01) -> None:
    """Every token is the Gumbel-max winner of its own stored draft_logits row (recomputed on the
    CPU with reference.draft_sample), except where the two best keys are within float rounding of
    each other (CUDA computes the keys with its own log/log1p). Greedy rows match exactly."""
    case = case.to("cpu")
    z, tokens = out.draft_logits.cpu(), out.tokens.cpu()
    greedy = is_greedy(case.temperature)
    mismatches = 0
    for j in range(tokens.shape[1]):
        position = case.position + 1 + j
        expected = reference.draft_sample(z[:, j], case.temperature, case.seed, position)
        differ = expected != tokens[:, j]
        if not differ.any():
            continue
        assert not (differ & greedy).any(), describe_token_difference(
            case, tokens[:, j:j + 1], expected[:, None])
        keys = draft_keys(z[:, j], case.temperature, case.seed, position)
        rows = differ.nonzero()[:, 0]
        best, theirs = keys[rows, expected[rows]], keys[rows, tokens[rows, j]]
        gap = best - theirs
        assert (gap <= 1e-4 * (1 + best.abs())).all(), (
            f"slot {j}: tokens {tokens[rows, j].tolist()} are not near-ties of the winners "
            f"{expected[rows].tolist()} (key gaps {gap.tolist()})")
        mismatches += int(differ.sum())
    assert mismatches <= max(1, max_mismatch * tokens.numel()), mismatches


# --------------------------------------------------------------------------------------------
# Constructed cases
# --------------------------------------------------------------------------------------------


def near_tie_case(temperature: float, seed: int, batch: int = 16, vocab: int = 512,
                  rank: int = 256, dtype: torch.dtype = torch.float16,
                  spread: float = 0.0) -> DraftCase:
    """One slot whose float64 Gumbel keys (greedy: logits) all lie within ~1e-3 of each other,
    while the float32 dot products err by ~1e-3 too: large weights (|W2 . W1[x]| ~ 4e3, heavy
    cancellation) and base logits chosen as c + T log E_v - (W2 . W1[x0])_v, so that only the
    exact head can tell the winner. 16-bit weights keep the float64 dot product exact.
    ``spread > 0`` spreads the float64 logits evenly-at-random over ``[3, 3 + spread)`` instead
    (distinct values whose order the float32 head gets wrong), for the filters' boundaries."""
    gen = generator(seed)
    w1 = (torch.randn(vocab, rank, generator=gen) * 16).to(dtype)
    w2 = (torch.randn(vocab, rank, generator=gen) * 16).to(dtype)
    anchor = torch.randint(0, vocab, (batch,), generator=gen)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    position = torch.randint(0, 2**33, (batch,), generator=gen)
    temperatures = torch.full((batch,), temperature)
    dot = embed(w1, anchor) @ w2.double().T
    base = 3.0 + spread * torch.rand(batch, vocab, generator=gen, dtype=torch.float64) - dot
    if temperature > reference.GREEDY_TEMPERATURE:
        u = reference.philox_uniform(seeds, position + 1, reference.PURPOSE_DRAFT, vocab)
        base = base + temperature * torch.log(-torch.log1p(-u.double()))
    return DraftCase(base_logits=base.float()[:, None], anchor=anchor, w1=w1, w2=w2,
                     temperature=temperatures, seed=seeds, position=position)


def with_bound_scale(monkeypatch, scale: str, fn):
    monkeypatch.setenv("DSPARK_OPS_DRAFT_BOUND_SCALE", scale)
    try:
        return fn()
    finally:
        monkeypatch.delenv("DSPARK_OPS_DRAFT_BOUND_SCALE")


def rnn_state_case(gen: torch.Generator, w2: torch.Tensor, weights: torch.dtype = torch.float32):
    """An RNN-head case whose output rows of J read the state only (o = s_j) and whose gate and
    candidate are constants: s_{j+1} = sig(g) s_j + (1 - sig(g)) tanh(c), s_0 = 0, so slot j's
    bias is W2 . tanh(s_j), from the state before its update (slot 0 unbiased). Returns the case
    (weights of dtype ``weights``; w2 is [200, 8]) and the float32 draft_logits it must give."""
    batch, block, vocab, hidden_size = 4, 6, 200, 16
    rank = w2.shape[1]
    g, c = 0.4, 1.2
    joint_weight = torch.zeros(3 * rank, 2 * rank + hidden_size)
    joint_weight[2 * rank:, :rank] = torch.eye(rank)
    joint_bias = torch.cat([torch.full((rank,), g), torch.linspace(-c, c, rank),
                            torch.zeros(rank)]).to(weights)
    case = DraftCase(
        peaky_logits((batch, block), vocab, gen), torch.randint(0, vocab, (batch,), generator=gen),
        torch.randn(vocab, rank, generator=gen).to(weights), w2.to(weights),
        make_temperature("mixed", batch, gen),
        torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        torch.randint(0, 2**40, (batch,), generator=gen),
        hidden=torch.randn(batch, block, hidden_size, generator=gen),
        joint_weight=joint_weight.to(weights), joint_bias=joint_bias,
    )
    gate = torch.sigmoid(joint_bias[:rank].double())
    candidate = torch.tanh(joint_bias[rank:2 * rank].double())
    state, expected = torch.zeros(rank, dtype=torch.float64), []
    for j in range(block):
        bias = w2.to(weights).double() @ torch.tanh(state)
        expected.append(case.base_logits[:, j].double() + bias)
        state = gate * state + (1 - gate) * candidate
    return case, torch.stack(expected, 1).float()


# --------------------------------------------------------------------------------------------
# draft_confidence
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ConfidenceCase:
    hidden: torch.Tensor
    prev_tokens: torch.Tensor
    w1: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    calib_temperature: Optional[torch.Tensor] = None

    def call(self, ops=dspark_ops):
        return ops.draft_confidence(self.hidden, self.prev_tokens, self.w1, self.weight, self.bias,
                                    self.calib_temperature)

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes) -> "ConfidenceCase":
        return dataclasses.replace(self, **changes)

    def to(self, device) -> "ConfidenceCase":
        return ConfidenceCase(**{k: None if v is None else v.to(device)
                                 for k, v in self.fields().items()})


def make_confidence_case(batch, block, vocab, rank, hidden_size, *, seed,
                         hidden_dtype=torch.float32, w1_dtype=torch.float32,
                         weight_dtype=torch.float32, bias=True, calib=True, ids_dtype=torch.int64,
                         bias_shape=()) -> ConfidenceCase:
    gen = generator(seed)
    width = hidden_size + rank
    return ConfidenceCase(
        hidden=torch.randn(batch, block, hidden_size, generator=gen).to(hidden_dtype),
        prev_tokens=torch.randint(0, vocab, (batch, block), generator=gen).to(ids_dtype),
        w1=torch.randn(vocab, rank, generator=gen).to(w1_dtype),
        weight=(2 * torch.randn(width, generator=gen) / width**0.5).to(weight_dtype),
        bias=torch.randn(bias_shape, generator=gen).to(weight_dtype) if bias else None,
        calib_temperature=0.3 + 3 * torch.rand(block, generator=gen) if calib else None,
    )


def confidence_logits(case: ConfidenceCase) -> torch.Tensor:
    """w . [h_j; W1[x_j]] + b in float64, rounded to float32 (docs/semantics.md §1 step 4)."""
    case = case.to("cpu")
    features = torch.cat([case.hidden.double(), embed(case.w1, case.prev_tokens)], -1)
    logit = features @ case.weight.double()
    if case.bias is not None:
        logit = logit + case.bias.double().reshape(())
    return logit.float()


# --------------------------------------------------------------------------------------------
# Sampling filters
# --------------------------------------------------------------------------------------------


# Per-request settings, some off, cycled over the batch.
FILTER_SETS = {
    "top_k": dict(top_k=[1, 5, 0, 40]),
    "top_p": dict(top_p=[0.5, 0.9, 1.0, 0.05]),
    "min_p": dict(min_p=[0.0, 0.1, 0.5, 1.0]),
    "all": dict(top_k=[3, 0, 50, 8], top_p=[0.8, 0.95, 1.0, 0.3], min_p=[0.05, 0.0, 0.2, 0.01]),
}


def filters_for(name: str, batch: int, device) -> dict:
    out = {}
    for key, values in FILTER_SETS[name].items():
        dtype = torch.int32 if key == "top_k" else torch.float32
        out[key] = torch.tensor([values[b % len(values)] for b in range(batch)], dtype=dtype,
                                device=device)
    return out
