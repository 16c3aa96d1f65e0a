"""Statistical helpers shared by the losslessness tests (docs/semantics.md §5)."""

from __future__ import annotations

import math

import torch

INF = float("inf")


def chi_square(samples: torch.Tensor, probs: torch.Tensor):
    """Pearson's statistic of ``samples`` against ``probs``, bins of expected count < 5 merged
    (ascending by expected count, greedily, until each merged bin expects >= 5).
    Returns (chi2, df)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    order = expected.argsort()
    exp_sorted, cnt_sorted = expected[order].tolist(), counts[order].tolist()
    bins_e, bins_c, acc_e, acc_c = [], [], 0.0, 0.0
    for e, c in zip(exp_sorted, cnt_sorted):
        acc_e, acc_c = acc_e + e, acc_c + c
        if acc_e >= 5:
            bins_e.append(acc_e)
            bins_c.append(acc_c)
            acc_e = acc_c = 0.0
    if acc_e > 0 or acc_c > 0:  # leftover (smallest bins come first, so this is rare)
        if bins_e:
            bins_e[-1] += acc_e
            bins_c[-1] += acc_c
        else:
            bins_e, bins_c = [acc_e], [acc_c]
    e, c = torch.tensor(bins_e), torch.tensor(bins_c)
    if (e == 0).any():
        return (INF if (c[e == 0] > 0).any() else 0.0), len(bins_e) - 1
    return ((c - e) ** 2 / e).sum().item(), len(bins_e) - 1


def chi_square_passes(chi2: float, df: int) -> bool:
    return chi2 < df + 10 * math.sqrt(2 * df)


def binomial_z(successes: int, trials: int, p: float) -> float:
    """z-score of ``successes`` out of ``trials`` against success probability ``p``."""
    return (successes - trials * p) / math.sqrt(trials * p * (1 - p))


@torch.no_grad()
def exact_joint(target, prompt, steps, temperature, **filters):
    """P(y_1..y_steps | prompt) for every sequence, by running the target on every prefix
    (each step's distribution filtered by reference.filter_logits with ``filters``)."""
    vocab = target.config.vocab_size
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        rows = [prompt + list(p) for p in prefixes]
        length = len(rows[0])
        ids = torch.tensor(rows)
        zeros = torch.zeros(len(rows), dtype=torch.int32)
        logits = target(ids, zeros + length, target.new_cache(len(rows), length), zeros)[0][:, -1].double()
        if filters:
            per_row = {k: torch.tensor([v] * len(rows)) for k, v in filters.items()}
            from dspark_ops import reference

            logits = reference.filter_logits(logits.float(), torch.full((len(rows),), temperature),
                                             **per_row).double()
        probs = torch.softmax(logits / temperature, -1)
        joint = {p + (y,): joint[p] * float(probs[i, y])
                 for i, p in enumerate(prefixes) for y in range(vocab)}
    return joint


def chi_square_of_tokens(tokens, target, prompt, steps, temperature, **filters):
    """chi-square of generated token lists' first ``steps`` tokens against the exact joint
    distribution (filtered with ``filters``)."""
    joint = exact_joint(target, prompt, steps, temperature, **filters)
    index = {seq: i for i, seq in enumerate(joint)}
    samples = torch.tensor([index[tuple(t[:steps])] for t in tokens])
    probs = torch.tensor(list(joint.values()))
    return chi_square(samples, probs / probs.sum())
