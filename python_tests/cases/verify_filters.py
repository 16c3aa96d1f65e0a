"""verify's sampling filters and logprobs: the filter arguments of one call, random settings per
request, the ragged layout with its mask, and the logprob contract."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cases.common import INF, NAN, is_greedy
from cases.verify import Case
from dspark_ops import reference

LOGPROB_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass
class Filters:
    """The new keyword arguments of one verify call (None = not given)."""

    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    allowed_token_mask: Optional[torch.Tensor] = None

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to(self, device) -> "Filters":
        return Filters(**{k: None if v is None else v.to(device) for k, v in self.kwargs().items()})

    def replace(self, **changes) -> "Filters":
        return dataclasses.replace(self, **changes)


NO_FILTERS = Filters()


def pack_mask(allowed: torch.Tensor, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """int32 [R, ceil(V/32)] bitmask of bool ``allowed`` [R, V] (bit v % 32 of word v // 32);
    with ``gen``, the bits past V in the last word are random (they must be ignored)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.bool)
    if gen is not None:
        bits = torch.rand(rows, words * 32, generator=gen) < 0.5
    bits[:, :vocab] = allowed
    packed = (bits.reshape(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def target_rows(case: Case):
    """Every request's G+1 target rows as [B, G+1, V] float32 (padded or ragged; rows past the
    buffer clamped), with the index of each row in target_logits and whether it exists."""
    batch, block = case.draft_tokens.shape
    flat = case.target_logits.cpu().reshape(-1, case.vocab)
    start = (torch.arange(batch) * (block + 1) if case.target_start is None
             else case.target_start.cpu().long())
    index = start[:, None] + torch.arange(block + 1)
    exists = index < flat.shape[0]
    index = index.clamp_max(flat.shape[0] - 1)
    return flat[index].float(), index, exists


def processed_log_probs(case: Case, filters: Filters) -> torch.Tensor:
    """float64 [B, G+1, V]: log of the processed distribution of every row, spelt out from the
    contract: disallowed and non-finite -> -inf, reference.filter_logits, log_softmax(z / T)
    (T = 1 for greedy rows); NaN rows where no allowed finite logit is left."""
    batch, block = case.draft_tokens.shape
    rows, index, _ = target_rows(case)
    if filters.allowed_token_mask is not None:
        allowed = reference.allowed_tokens(filters.allowed_token_mask.cpu(), case.vocab)
        rows = torch.where(allowed[index], rows, -INF)
    temperature = case.temperature.cpu()
    def per_row(t):
        return None if t is None else t.cpu()[:, None].expand(batch, block + 1)
    z = reference.filter_logits(rows, per_row(temperature), top_k=per_row(filters.top_k),
                                top_p=per_row(filters.top_p), min_p=per_row(filters.min_p))
    t = torch.where(is_greedy(temperature), 1.0, temperature.double())
    return torch.log_softmax(z.double() / t[:, None, None], -1)


def check_logprob_contract(case: Case, filters: Filters, out) -> None:
    """Every emitted token has positive processed probability and its logprob is the log of it
    (an independent spelling of the rule, not reference.verify's); -inf past the emitted ones
    and at a row without an allowed finite logit (token 0)."""
    batch, block = case.draft_tokens.shape
    logprobs = out.logprobs.cpu()
    assert logprobs.dtype == torch.float32 and logprobs.shape == (batch, block + 1)
    tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu().long()
    j = torch.arange(block + 1)
    assert (logprobs[j[None] > accepted[:, None]] == -INF).all()
    expected = processed_log_probs(case, filters)
    emitted = j[None] <= accepted[:, None]
    row_ok = ~expected[..., 0].isnan() & target_rows(case)[2]
    at_token = expected.gather(-1, tokens.clamp_min(0)[..., None])[..., 0]
    check = emitted & row_ok
    assert (at_token[check] > -INF).all(), "a token outside the kept set was emitted"
    torch.testing.assert_close(logprobs[check], at_token[check].float(), **LOGPROB_TOLERANCE)
    dead = emitted & ~row_ok  # only the emitting row can lack an allowed finite logit
    assert (tokens[dead] == 0).all() and (logprobs[dead] == -INF).all()
    assert not out.valid.cpu()[dead.any(1)].any()


def random_filters(case: Case, kinds, gen: torch.Generator) -> Filters:
    """Per-request settings drawn for the ``kinds`` given ("top_k", "top_p", "min_p", "mask"),
    each request's value off part of the time; the mask has one row per target_logits row, of
    density 1, 0.9 or 0.6, with random bits past V."""
    batch, vocab = case.draft_tokens.shape[0], case.vocab
    pick = lambda values: torch.tensor(values)[  # noqa: E731
        torch.randint(0, len(values), (batch,), generator=gen)]
    filters = Filters()
    if "top_k" in kinds:
        filters.top_k = pick([0, 1, 2, 5, 20, max(vocab // 3, 1), vocab, vocab + 5]).int()
    if "top_p" in kinds:
        filters.top_p = pick([1.0, 0.95, 0.8, 0.5, 0.3, 1e-3]).float()
    if "min_p" in kinds:
        filters.min_p = pick([0.0, 0.01, 0.05, 0.2, 1.0]).float()
    if "mask" in kinds:
        rows = case.target_logits.reshape(-1, vocab).shape[0]
        density = torch.tensor([1.0, 0.9, 0.6])[torch.randint(0, 3, (rows, 1), generator=gen)]
        allowed = torch.rand(rows, vocab, generator=gen) < density
        filters.allowed_token_mask = pack_mask(allowed, gen)
    return filters


KINDS = {
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "min_p": ("min_p",),
    "mask": ("mask",),
    "all": ("top_k", "top_p", "min_p"),
    "all-mask": ("top_k", "top_p", "min_p", "mask"),
}


def to_ragged_with_mask(case: Case, mask: torch.Tensor, gen: torch.Generator):
    """The padded case (and its [B*(G+1), W] mask) packed as a ragged buffer: each request's n+1
    rows in a shuffled order with junk rows between them (NaN logits, random mask words)."""
    batch, block = case.draft_tokens.shape
    rows = case.target_logits.reshape(batch, block + 1, -1)
    mask = mask.reshape(batch, block + 1, -1)
    vocab, words = rows.shape[-1], mask.shape[-1]
    logit_pieces, mask_pieces, cursor = [], [], 0
    start = torch.zeros(batch, dtype=torch.int32)
    for b in torch.randperm(batch, generator=gen).tolist():
        junk = int(torch.randint(0, 3, (), generator=gen))
        logit_pieces.append(torch.full((junk, vocab), NAN, dtype=rows.dtype))
        mask_pieces.append(torch.randint(-(2**31), 2**31, (junk, words), generator=gen).int())
        cursor += junk
        start[b] = cursor
        n = int(case.num_draft[b])
        logit_pieces.append(rows[b, : n + 1])
        mask_pieces.append(mask[b, : n + 1])
        cursor += n + 1
    return (case.replace(target_logits=torch.cat(logit_pieces), target_start=start),
            torch.cat(mask_pieces))
