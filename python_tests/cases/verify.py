"""Inputs of verify and the checks of its outputs, shared by test_verify.py,
test_verify_filters.py, test_sim_verify.py and the drafting tests that hand drafts to verify."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

import dspark_ops
from cases.common import INF, NAN, generator, i32, is_greedy
from dspark_ops import reference
from stats import chi_square, chi_square_passes


# --------------------------------------------------------------------------------------------
# Building inputs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One call's arguments; ``call`` runs the op or the reference on them."""

    target_logits: torch.Tensor
    draft_tokens: torch.Tensor
    num_draft: torch.Tensor
    temperature: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    draft_logits: Optional[torch.Tensor] = None
    target_start: Optional[torch.Tensor] = None
    draft_temperature: Optional[torch.Tensor] = None

    @property
    def vocab(self) -> int:
        return self.target_logits.shape[-1]

    def call(self, fn=dspark_ops.verify, **extra):
        return fn(
            self.target_logits, self.draft_tokens, self.num_draft, self.temperature, self.seed,
            self.position, draft_logits=self.draft_logits, target_start=self.target_start,
            draft_temperature=self.draft_temperature, **extra,
        )

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def to(self, device) -> "Case":
        return Case(**{
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
        })

    def select(self, index: torch.Tensor) -> "Case":
        """The requests ``index`` (padded layout only), in that order."""
        assert self.target_start is None and self.target_logits.dim() == 3
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Case(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})


def peaky_logits(shape, vocab: int, gen: torch.Generator, heads: int = 3) -> torch.Tensor:
    """float32 logits: a dense random tail plus a few boosted tokens per row, as real LM logits
    have, so that sampled drafts are accepted at realistic rates at any vocabulary size."""
    logits = torch.randn(*shape, vocab, generator=gen)
    if vocab > heads:
        index = torch.rand(*shape, vocab, generator=gen).topk(heads, dim=-1).indices
        boost = math.log(vocab) + 3 * torch.rand(*shape, heads, generator=gen)
        logits.scatter_add_(-1, index, boost)
    return logits


def make_temperature(kind, batch: int, gen: torch.Generator) -> torch.Tensor:
    if isinstance(kind, torch.Tensor):
        return kind.float()
    if isinstance(kind, (int, float)):
        return torch.full((batch,), float(kind))
    sampled = 0.4 + 1.2 * torch.rand(batch, generator=gen)
    if kind == "sampled":
        return sampled
    if kind == "greedy":
        return torch.zeros(batch)
    if kind == "mixed":
        # Greedy (0, 1e-6, exactly the 1e-5 threshold) and sampled requests in one launch.
        greedy = torch.tensor([0.0, 1e-6, 1e-5])[torch.randint(0, 3, (batch,), generator=gen)]
        return torch.where(torch.rand(batch, generator=gen) < 0.4, greedy, sampled)
    raise ValueError(kind)


def finite_or_neg_inf(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return torch.where(torch.isfinite(logits), logits, -INF)


def sample_drafts(draft_logits: torch.Tensor, draft_temperature: torch.Tensor,
                  gen: torch.Generator) -> torch.Tensor:
    """Draft tokens drawn from exactly q = softmax(draft_logits / T_d) (argmax when greedy)."""
    logits = finite_or_neg_inf(draft_logits.cpu()).double()
    batch, block, vocab = logits.shape
    if block == 0:
        return torch.zeros(batch, 0, dtype=torch.int64)
    t = draft_temperature.cpu().double().clamp_min(reference.GREEDY_TEMPERATURE)
    probs = torch.softmax(logits / t[:, None, None], dim=-1)
    probs = torch.where(probs.isnan(), 1.0, probs)  # rows with no finite logit: any token
    sampled = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, block)
    return torch.where(is_greedy(draft_temperature.cpu())[:, None], logits.argmax(-1), sampled)


def make_case(batch: int, block: int, vocab: int, *, seed: int, temperature="sampled",
              draft="logits", dtype=torch.float32, draft_dtype=None, draft_temperature=None,
              num_draft=None, noise: float = 0.5, token_dtype=torch.int64) -> Case:
    """A realistic padded-layout case: draft logits are the target's plus noise and the draft
    tokens are sampled from them, so acceptance, rejection and bonus rows all occur."""
    gen = generator(seed)
    target = peaky_logits((batch, block + 1), vocab, gen)
    draft_logits = target[:, :block] + noise * torch.randn(batch, block, vocab, generator=gen)
    temperature = make_temperature(temperature, batch, gen)
    if draft_temperature is not None:
        draft_temperature = make_temperature(draft_temperature, batch, gen)
    target = target.to(dtype)
    draft_logits = draft_logits.to(draft_dtype or dtype)
    drafts = sample_drafts(
        draft_logits, temperature if draft_temperature is None else draft_temperature, gen
    )
    if num_draft is None:
        num_draft = torch.randint(0, block + 1, (batch,), generator=gen)
    elif isinstance(num_draft, int):
        num_draft = torch.full((batch,), num_draft)
    return Case(
        target_logits=target,
        draft_tokens=drafts.to(token_dtype),
        num_draft=num_draft.to(torch.int32),
        temperature=temperature,
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        # Across the 2^32 boundary of the counter's position words.
        position=torch.randint(0, 2**33, (batch,), generator=gen),
        draft_logits=draft_logits if draft == "logits" else None,
        draft_temperature=draft_temperature,
    )


def one_hot_logits(tokens: torch.Tensor, vocab: int, *, floor=-INF, value=None,
                   gen=None) -> torch.Tensor:
    """Logit rows whose only finite entry (or only one that survives exp) is ``tokens``."""
    rows = torch.full((*tokens.shape, vocab), floor)
    if gen is not None and floor != -INF:
        rows += torch.randn(rows.shape, generator=gen)  # finite, but exp() underflows to 0
    if value is None:
        top = torch.randn(tokens.shape, generator=gen)
    else:
        top = torch.full(tokens.shape, value)
    rows.scatter_(-1, tokens[..., None], top[..., None])
    return rows


def distinct_tokens(count: int, vocab: int, gen: torch.Generator, rows: int) -> torch.Tensor:
    """[rows, count] random token ids, distinct within a row."""
    return torch.rand(rows, vocab, generator=gen).argsort(-1)[:, :count]


# --------------------------------------------------------------------------------------------
# Checking outputs
# --------------------------------------------------------------------------------------------


def check_output_contract(case: Case, out) -> None:
    """What every output must satisfy whatever the inputs (docs/semantics.md §3.1)."""
    batch, block = case.draft_tokens.shape
    tokens, accepted, valid = out[:3]
    assert tokens.dtype == torch.int64 and tokens.shape == (batch, block + 1)
    assert accepted.dtype == torch.int32 and accepted.shape == (batch,)
    assert valid.dtype == torch.bool and valid.shape == (batch,)
    assert tokens.device == accepted.device == valid.device == case.draft_tokens.device
    tokens, accepted = tokens.cpu(), accepted.cpu().long()
    n = case.num_draft.cpu().long()
    assert ((accepted >= 0) & (accepted <= n)).all()
    j = torch.arange(block + 1)
    drafts = torch.cat([case.draft_tokens.cpu().long(), torch.full((batch, 1), -1)], 1)
    accepted_part = j < accepted[:, None]
    assert torch.equal(tokens[accepted_part], drafts[accepted_part])
    emitted = tokens.gather(1, accepted[:, None])[:, 0]
    assert ((emitted >= 0) & (emitted < case.vocab)).all(), f"ids out of range: {emitted}"
    assert (tokens[j > accepted[:, None]] == -1).all()


def describe_difference(case: Case, got, expected) -> str:
    bad = (got.tokens != expected.tokens).any(1) | (got.num_accepted != expected.num_accepted)
    bad |= got.valid != expected.valid
    b = int(bad.nonzero()[0, 0])
    return (
        f"{int(bad.sum())} of {bad.numel()} requests differ; first b={b}: "
        f"op tokens={got.tokens[b].tolist()} accepted={int(got.num_accepted[b])} "
        f"valid={bool(got.valid[b])}; reference tokens={expected.tokens[b].tolist()} "
        f"accepted={int(expected.num_accepted[b])} valid={bool(expected.valid[b])}; "
        f"num_draft={int(case.num_draft[b])} temperature={float(case.temperature[b])} "
        f"seed={int(case.seed[b])} position={int(case.position[b])}"
    )


def assert_same_outputs(got, expected, case: Case) -> None:
    same = (
        torch.equal(got.tokens, expected.tokens)
        and torch.equal(got.num_accepted, expected.num_accepted)
        and torch.equal(got.valid, expected.valid)
    )
    assert same, describe_difference(case, got, expected)


def greedy_expectation(target_rows: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor):
    """Greedy rule spelt out: accept while the draft is the row's first argmax."""
    argmax = finite_or_neg_inf(target_rows).argmax(-1)  # [B, G+1]; torch.argmax: first max
    batch = drafts.shape[0]
    match = torch.cat([drafts.long() == argmax[:, :-1], torch.zeros(batch, 1, dtype=torch.bool)], 1)
    match &= torch.arange(match.shape[1]) < n[:, None]
    accepted = match.int().cumprod(1).sum(1)
    return accepted, argmax.gather(1, accepted[:, None].long())[:, 0]


def padded_rows(case: Case) -> torch.Tensor:
    """[B, G+1, V] view of the target rows of a padded-layout case."""
    batch, block = case.draft_tokens.shape
    return case.target_logits.reshape(batch, block + 1, -1)


# --------------------------------------------------------------------------------------------
# Constructed cases, the ragged layout, non-finite logits
# --------------------------------------------------------------------------------------------


def certain_accepts(batch, block, vocab, gen):
    """Random drafts with p = q = one-hot on the draft at every row, so every row accepts (the
    bonus row is one-hot too). Tests overwrite the row where something else should happen."""
    drafts = torch.randint(0, vocab, (batch, block), generator=gen)
    target = one_hot_logits(torch.cat([drafts, drafts[:, :1]], 1), vocab, gen=gen)
    draft_logits = one_hot_logits(drafts, vocab, gen=gen)
    return drafts, target, draft_logits


def num_draft_zero_case(batch: int, block: int, vocab: int, seed: int, layout: str) -> Case:
    """num_draft = 0 with garbage (also out-of-range) draft ids and NaN in every row but row 0;
    ``ragged``: each request contributes exactly its row 0, in a shuffled order."""
    case = make_case(batch, block, vocab, seed=seed, temperature="mixed", num_draft=0)
    gen = generator(seed + 1)
    case.draft_tokens = torch.randint(-5, vocab + 5, (batch, block), generator=gen)
    target = case.target_logits.clone()
    target[:, 1:] = NAN
    if layout == "padded":
        case.target_logits = target
    else:
        order = torch.randperm(batch, generator=gen)
        case.target_logits = torch.cat([target[order, 0], torch.full((3, vocab), NAN)])
        case.target_start = torch.argsort(order).int()
    return case


def first_rows(case: Case) -> torch.Tensor:
    """Row 0 of every request's target logits, padded or ragged, on the CPU."""
    target = case.target_logits.cpu()
    if case.target_start is None:
        return target[:, 0]
    return target[case.target_start.cpu().long()]


def to_ragged(case: Case, gen: torch.Generator) -> Case:
    """The padded case packed as a ragged [R, V] buffer: each request's n+1 rows contiguous,
    requests in a shuffled order, junk rows (NaN or random) between and after them."""
    batch, block = case.draft_tokens.shape
    rows = padded_rows(case)
    vocab = rows.shape[-1]
    pieces, start, cursor = [], torch.zeros(batch, dtype=torch.int32), 0
    for b in torch.randperm(batch, generator=gen).tolist():
        junk = int(torch.randint(0, 3, (), generator=gen))
        fill = torch.full((junk, vocab), NAN) if b % 2 else torch.randn(junk, vocab, generator=gen)
        pieces.append(fill.to(rows.dtype))
        cursor += junk
        start[b] = cursor
        n = int(case.num_draft[b])
        pieces.append(rows[b, : n + 1])
        cursor += n + 1
    pieces.append(torch.full((2, vocab), NAN, dtype=rows.dtype))
    return case.replace(target_logits=torch.cat(pieces), target_start=start)


def _mixed_non_finite(shape):
    return torch.tensor([NAN, -INF, INF])[torch.arange(shape[-1]) % 3].expand(shape)


BAD_ROWS = {
    "nan": lambda shape: torch.full(shape, NAN),
    "neg-inf": lambda shape: torch.full(shape, -INF),
    "mixed": _mixed_non_finite,
}


def with_non_finite_logits(case: Case, gen: torch.Generator, draft: str) -> Case:
    """The case with 30% NaN, 3% +inf and 3% -inf target logits, most of the drafts' own target
    entries NaN (where the draft logits stay finite), 20% NaN draft logits elsewhere; draft logits
    dropped for one-hot drafts (``draft != "logits"``)."""
    batch, block = case.draft_tokens.shape
    target = case.target_logits.clone()
    poison = torch.rand(target.shape, generator=gen)
    target[poison < 0.3] = NAN
    target[(poison >= 0.3) & (poison < 0.33)] = INF
    target[(poison >= 0.33) & (poison < 0.36)] = -INF
    on_draft = torch.rand(case.draft_tokens.shape, generator=gen) < 0.6
    rows, j = torch.arange(batch)[:, None], torch.arange(block)[None]
    at_drafts = target[rows, j, case.draft_tokens]
    target[rows, j, case.draft_tokens] = torch.where(on_draft, NAN, at_drafts)
    draft_logits = case.draft_logits.clone()
    draft_logits[torch.rand(draft_logits.shape, generator=gen) < 0.2] = NAN
    draft_logits[rows, j, case.draft_tokens] = case.draft_logits[rows, j, case.draft_tokens]
    return case.replace(target_logits=target,
                        draft_logits=draft_logits if draft == "logits" else None)


# --------------------------------------------------------------------------------------------
# Statistical losslessness (docs/semantics.md §5)
# --------------------------------------------------------------------------------------------


STAT_VOCAB = 4096
STAT_BLOCK = 4
MIN_TRIALS_PER_POSITION = 100  # positions reached by fewer trials are not tested


def positions_distributed_as_target(tokens, num_accepted, target_probs):
    """For every output position k, the tokens of the trials that emitted position k must be
    distributed as p_k. Returns [(k, trials, chi2, df, passed)] for positions with enough trials."""
    results = []
    for k in range(target_probs.shape[0]):
        emitted = num_accepted >= k
        trials = int(emitted.sum())
        if trials < MIN_TRIALS_PER_POSITION:
            continue
        chi2, df = chi_square(tokens[emitted, k], target_probs[k])
        results.append((k, trials, chi2, df, df > 0 and chi_square_passes(chi2, df)))
    return results


def accepted_length_distribution(alpha: torch.Tensor) -> torch.Tensor:
    """P(num_accepted = i), i = 0..n, for per-row acceptance probabilities alpha[0..n-1]:
    Π_{k<i} α_k (1 - α_i), and Π α for a full accept."""
    survive = torch.cat([torch.ones(1, dtype=alpha.dtype), alpha.cumprod(0)])
    return torch.cat([survive[:-1] * (1 - alpha), survive[-1:]])


def stat_rows(gen: torch.Generator, temperature: float, vocab: int = STAT_VOCAB):
    """Per-position target and draft logits (float32) that differ substantially: each has a few
    heavy tokens (partly shared) over a dense random tail, so the residual max(p - q, 0) is far
    from p and one-hot drafts are accepted often enough to reach every position."""
    block = STAT_BLOCK
    tail_p = torch.softmax(torch.randn(block + 1, vocab, generator=gen, dtype=torch.float64), -1)
    tail_q = torch.softmax(torch.randn(block, vocab, generator=gen, dtype=torch.float64), -1)
    heads = distinct_tokens(4, vocab, gen, block + 1)
    p = 0.3 * tail_p
    p.scatter_add_(1, heads[:, :3],
                   torch.tensor([[0.4, 0.2, 0.1]], dtype=torch.float64).expand(block + 1, 3))
    q = 0.3 * tail_q
    q.scatter_add_(1, heads[:block][:, [0, 3, 1]],
                   torch.tensor([[0.45, 0.15, 0.1]], dtype=torch.float64).expand(block, 3))
    # logits = log(prob) * T so that softmax(logits / T) = prob (up to float32 rounding).
    return (p.log() * temperature).float(), (q.log() * temperature).float()


# --------------------------------------------------------------------------------------------
# The valid base of the argument-error tests
# --------------------------------------------------------------------------------------------


B, G, V = 3, 4, 100


def valid_args(device) -> dict:
    gen = generator(91)
    return dict(
        target_logits=torch.randn(B * (G + 1), V, generator=gen).to(device),
        draft_tokens=torch.randint(0, V, (B, G), generator=gen).to(device),
        num_draft=torch.tensor([0, 2, 4], dtype=torch.int32, device=device),
        temperature=torch.tensor([0.0, 0.8, 1.0], device=device),
        seed=torch.tensor([1, -2, 3], dtype=torch.int64, device=device),
        position=torch.tensor([10, 20, 2**33], dtype=torch.int64, device=device),
        draft_logits=torch.randn(B, G, V, generator=gen).to(device),
        target_start=None,
        draft_temperature=torch.tensor([0.5, 0.0, 2.0], device=device),
    )


def ragged_args():
    # A valid ragged layout: 12 rows, requests at 0, 3 and 7 (num_draft 0, 2, 4).
    return dict(target_logits=torch.randn(12, V), target_start=i32(0, 3, 7))
