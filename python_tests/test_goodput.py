"""Goodput decoding: the cost table (pricing, keying, refusal, the cache, the profile), the
decision before drafting against a brute-force argmax (the plain path when nothing pays, the
margin, the probe schedule), the decision after drafting (Algorithm 1 on the measured costs,
padded to the cheapest width), lazy drafting, every proposer's greedy identity with plain
decoding, and exact sampling with the new early stops (and a broken stop that fails it)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from dspark_ops import costs as costs_module
from dspark_ops.costs import CostTable, CostTableMismatch, load_or_profile_costs, profile_costs
from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
from dspark_ops.demo import tiny_pair
from dspark_ops.goodput import AcceptanceEstimate, GoodputPolicy, verify_lengths
from dspark_ops.models import DSparkConfig, DSparkDraft
from dspark_ops.proposers import (
    BlockDraftProposer, OracleProposer, PromptLookupProposer, find_continuation,
)
from stats import chi_square_of_tokens, chi_square_passes

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


def table(target_ms, draft_ms, batch=1, key=None):
    """A cost table from milliseconds: target by width 1.., draft by slots 1.."""
    return CostTable(key or {"target": "t"}, {batch: [t / 1e3 for t in target_ms]},
                     [0.0] + [d / 1e3 for d in draft_ms])


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=64, block_size=5, context=0.2, noise=0.3, target_dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# The cost table


def test_target_cost_is_the_cheapest_padding():
    # The measured SmolLM2 shape: widths 2-3 cost more than 4.
    costs = table([45, 75, 88, 68, 71, 71, 71, 65], [5] * 7)
    assert costs.target(1, 1) == pytest.approx(0.045)
    assert costs.target(1, 2) == pytest.approx(0.065)  # padded to 8
    assert costs.cheapest_width(1, 2) == 8
    assert costs.cheapest_width(1, 2, limit=5) == 4
    assert costs.cheapest_width(1, 4, limit=4) == 4
    rates = costs.step_rate(1, 7)
    assert rates.shape == (9,)
    assert rates[1].item() == pytest.approx(1 / 0.045)
    assert rates[3].item() == pytest.approx(1 / 0.065)
    with pytest.raises(ValueError, match="outside the table"):
        costs.cheapest_width(1, 9)


def test_a_batch_not_profiled_is_priced_from_the_nearest():
    costs = CostTable({}, {1: [0.01, 0.02], 4: [0.04, 0.08]}, [0.0, 0.001])
    assert costs.target(8, 1) == pytest.approx(0.08)  # 4 scaled by 8 / 4
    assert costs.target(2, 2) == pytest.approx(0.04)  # 1 scaled by 2 (nearest in ratio, smaller)


def test_online_correction_moves_the_speed_factor_and_the_entry():
    costs = table([10, 20], [5])
    costs.observe_target(1, 2, 0.030, rate=0.5)
    speed = 1.5 ** 0.5  # the timing is 1.5x its price; half of that, in log space
    entry = 0.020 + 0.25 * 0.5 * (0.030 / speed - 0.020)
    assert costs.speed == pytest.approx(speed)
    assert costs.target(1, 2) == pytest.approx(speed * entry)
    assert costs.target(1, 1) == pytest.approx(speed * 0.010)  # not observed: the factor alone
    assert costs.draft(1) == pytest.approx(speed * 0.005)
    costs.observe_target(1, 7, 1.0)  # outside the table: ignored
    costs.observe_target(1, 1, float("nan"))  # not a timing: ignored
    assert costs.speed == pytest.approx(speed)
    costs.observe_target(3, 1, 0.020, rate=0.5)  # a new batch starts from the scaled entries
    assert costs.target_seconds[3][1] == pytest.approx(3 * entry)


def test_timings_at_one_width_converge_to_it():
    costs = table([10, 20, 30], [5])
    for _ in range(400):
        costs.observe_target(1, 2, 0.026)
        costs.observe_draft(1, 0.004)
    assert costs.target(1, 2) == pytest.approx(0.026, rel=1e-3)
    assert costs.draft(1) == pytest.approx(0.004, rel=1e-3)


def test_a_uniform_drift_seen_at_one_width_moves_every_width():
    """A table profiled in a slow spell (everything 1.5x): the rule then mostly runs plain
    steps, and the widths it does not use must follow them, or speculation looks dear."""
    true_ms = [10, 12, 16]
    costs = table([1.5 * t for t in true_ms], [1.5 * 5])
    for _ in range(60):
        costs.observe_target(1, 1, true_ms[0] / 1e3)
    for width, ms in enumerate(true_ms, 1):
        assert costs.target(1, width) == pytest.approx(ms / 1e3, rel=0.12)
    assert costs.draft(1) == pytest.approx(0.005, rel=0.12)


def test_a_drafting_time_moves_only_its_own_price():
    """A proposer profiled at 15 us (an oracle or a lookup) whose rounds time 1 ms of
    bookkeeping: the draft's price learns it, the target's prices stay. As a speed ratio it
    raised every target price with each speculative round, and the plain step's timings then
    pulled only width 1 back: the wide widths looked dear and the rule stayed plain."""
    costs = table([55, 75], [0.015])
    for _ in range(3):
        costs.observe_draft(1, 0.001, rate=0.5)
    assert costs.speed == 1.0
    assert [costs.target(1, w) for w in (1, 2)] == pytest.approx([0.055, 0.075])
    assert costs.draft(1) == pytest.approx(0.001 + (0.000015 - 0.001) * 0.5 ** 3)
    free = table([10, 20], [0])  # a proposer profiled as free learns its price the same way
    free.observe_draft(1, 0.002, rate=1.0)
    assert free.speed == 1.0 and free.draft(1) == pytest.approx(0.002)
    free.observe_target(1, 1, 0.02, rate=1.0)  # the target's timing scales the draft's price
    assert free.speed == pytest.approx(2.0) and free.draft(1) == pytest.approx(0.004)


def test_a_saved_table_keeps_its_corrected_prices(tmp_path):
    costs = table([10, 20], [5])
    for _ in range(5):
        costs.observe_target(1, 1, 0.013)
    costs.save(str(tmp_path / "t.json"))
    again = CostTable.load(str(tmp_path / "t.json"))
    assert again.speed == 1.0
    for width in (1, 2):
        assert again.target(1, width) == pytest.approx(costs.target(1, width))
    assert again.draft(1) == pytest.approx(costs.draft(1))


@pytest.mark.parametrize("bad, message", [
    (dict(target_seconds={}), "at least one batch size"),
    (dict(draft_seconds=[0.1]), "must start with 0.0"),
    (dict(draft_seconds=[0.0, -1.0]), "drafting time must be finite and >= 0"),
    (dict(target_seconds={1: [float("nan")]}), "step time must be finite and > 0"),
])
def test_table_errors(bad, message):
    kwargs = dict(key={}, target_seconds={1: [0.01]}, draft_seconds=[0.0])
    kwargs.update(bad)
    with pytest.raises(ValueError, match=message):
        CostTable(**kwargs)


def test_a_foreign_table_is_refused_by_name(tmp_path, pair):
    target, draft = pair
    proposer = BlockDraftProposer(draft)
    key = costs_module.cost_key(target, proposer, device="cpu", dtype=torch.float64)
    assert set(key) >= {"target", "proposer", "device", "dtype", "threads", "library", "estimate"}
    path = str(tmp_path / "costs.json")
    table([1, 2, 3, 4, 5, 6], [1] * 5, key=key).save(path)
    assert CostTable.load(path, key).key == key
    for field, value in (("threads", key["threads"] + 1), ("device", "cuda:H200"),
                         ("dtype", "bfloat16"), ("library", "0.0.1"),
                         ("estimate", "entry-by-entry medians")):
        with pytest.raises(CostTableMismatch, match=f"measured with {field} = "):
            CostTable.load(path, {**key, field: value})
    other, _ = tiny_pair(vocab=32, block_size=5)
    other_key = costs_module.cost_key(other, proposer, device="cpu", dtype=torch.float64)
    with pytest.raises(CostTableMismatch, match="measured with target = "):
        CostTable.load(path, other_key)
    other_proposer = BlockDraftProposer(draft, block_size=3)
    with pytest.raises(CostTableMismatch, match="measured with proposer = "):
        CostTable.load(path, costs_module.cost_key(target, other_proposer, device="cpu",
                                                   dtype=torch.float64))
    (tmp_path / "junk.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="is not a cost table"):
        CostTable.load(str(tmp_path / "junk.json"))


def test_prices_are_median_ratios_to_the_plain_step_of_the_same_repetition():
    """Five repetitions: two fast, three in a slow spell (3x) that begins in the third just
    after its plain step. Entry-by-entry medians would put width 2 at 3x its true price against
    the plain step; the per-repetition ratios recover every true ratio."""
    plain, widths, drafts = 0.05, [1.0, 1.1, 1.3], [0.2, 0.35]  # ratios to the plain step
    target_rows, draft_rows = [], []
    for rep, slow in enumerate([1, 1, 3, 3, 3]):
        first = 1 if rep == 2 else slow  # the spell starts after rep 2's plain step
        target_rows.append([plain * first] + [plain * r * slow for r in widths[1:]])
        draft_rows.append([plain * r * slow for r in drafts])
    table = costs_module.estimate_costs({"key": {}, "target": {1: target_rows},
                                         "draft": {1: draft_rows}})
    assert table.target_seconds[1] == pytest.approx([plain * r for r in widths], rel=1e-12)
    assert table.draft_seconds == pytest.approx([0.0] + [plain * r for r in drafts], rel=1e-12)
    # a second batch size gets its own plain step and ratios; drafts stay on the smallest's
    table = costs_module.estimate_costs({"key": {}, "target": {1: target_rows, 4: [
        [2 * plain, 4 * plain, 6 * plain]] * 3}, "draft": {1: draft_rows, 4: [[1.0, 1.0]] * 3}})
    assert table.target_seconds[4] == pytest.approx([2 * plain, 4 * plain, 6 * plain])
    assert table.draft_seconds[1:] == pytest.approx([plain * r for r in drafts])


def test_the_noise_study_prices_as_the_library_does():
    """bench.cost_noise's per-repetition estimator is estimate_costs' (divided by the plain
    step), and its spread covers every window of every run."""
    from bench.cost_noise import entrywise, per_repetition, spread

    generator = torch.Generator().manual_seed(0)
    shape = 0.05 * torch.tensor([1.0, 1.1, 1.3, 1.2, 1.5, 1.6, 1.6, 1.7], dtype=torch.float64)
    spells = 0.5 + 2.5 * torch.rand(7, 1, generator=generator, dtype=torch.float64)
    jitter = 0.9 + 0.2 * torch.rand(7, 8, generator=generator, dtype=torch.float64)
    rows = (shape * spells * jitter).tolist()
    table = costs_module.estimate_costs({"key": {}, "target": {1: rows}, "draft": {1: [[]] * 7}})
    assert per_repetition(rows) == pytest.approx(
        [s / table.target_seconds[1][0] for s in table.target_seconds[1]], rel=1e-12)
    assert entrywise(rows)[0] == 1.0 and entrywise(rows) != pytest.approx(per_repetition(rows))
    report = spread([rows, rows[:6]], window=5)
    assert {e["profiles"] for e in report.values()} == {3 + 2}
    for entry in report.values():
        for v in entry["widths"].values():
            assert v["min"] <= v["q1"] <= v["median"] <= v["q3"] <= v["max"]


def test_profile_measures_every_width_and_slot_and_is_cached(tmp_path, pair, monkeypatch):
    target, draft = pair
    proposer = BlockDraftProposer(draft, block_size=3)
    costs = profile_costs(target, proposer, batch_sizes=(1, 2), context=8, repeats=2,
                          progress=False)
    assert sorted(costs.target_seconds) == [1, 2]
    assert all(len(r) == 4 for r in costs.target_seconds.values())  # widths 1..G+1
    assert len(costs.draft_seconds) == 4 and costs.draft_seconds[0] == 0.0
    assert all(s > 0 for s in costs.draft_seconds[1:])
    calls = []
    real = costs_module.profile_costs
    monkeypatch.setattr(costs_module, "profile_costs",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    first = load_or_profile_costs(target, proposer, cache_dir=str(tmp_path), progress=False,
                                  context=8, repeats=1)
    again = load_or_profile_costs(target, proposer, cache_dir=str(tmp_path), progress=False)
    assert len(calls) == 1 and again.to_dict() == first.to_dict()
    monkeypatch.setattr(costs_module.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(costs_module.os, "cpu_count", lambda: 2)
    with pytest.warns(RuntimeWarning, match="load average of 9.0 on 2 cores"):
        profile_costs(target, proposer, context=8, repeats=1, progress=False)
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile_costs(target, proposer, repeats=0)
    with pytest.raises(ValueError, match="'batch_sizes' must be >= 1"):
        profile_costs(target, proposer, batch_sizes=(0,))


# --------------------------------------------------------------------------------------------
# The decision before drafting


def brute_force_k(costs, batch, survivals, limit, margin):
    """Every k, priced from first principles: expected tokens over the draft plus the cheapest
    target step at least as wide."""
    def goodput(k):
        tokens = sum(1 + sum(a[:k]) for a in survivals)
        width = min(range(k + 1, len(costs.target_seconds[batch]) + 1),
                    key=lambda w: costs.target_seconds[batch][w - 1])
        return tokens / (costs.draft_seconds[k] + costs.target_seconds[batch][width - 1])

    best = max(range(1, limit + 1), key=lambda k: (goodput(k), -k))
    return best if goodput(best) > margin * goodput(0) else 0


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_the_brute_force_argmax(seed):
    gen = torch.Generator().manual_seed(seed)
    K = 7
    target_ms = (40 + 60 * torch.rand(K + 1, generator=gen)).tolist()
    target_ms[0] = 30 + 30 * float(torch.rand(1, generator=gen))
    draft_ms = torch.cumsum(10 * torch.rand(K, generator=gen), 0).tolist()
    batch = 3
    costs = table(target_ms, draft_ms, batch=batch)
    policy = GoodputPolicy(costs, K, margin=1.0 + 0.2 * float(torch.rand(1, generator=gen)))
    policy.begin(batch)
    for r in range(batch):
        policy.estimate.per_request[r] = torch.rand(K, generator=gen).tolist()
    active = [0, 2]
    survivals = [policy.estimate.survival(r) for r in active]
    for limit in (1, 4, K):
        assert policy.choose(batch, active, limit) == brute_force_k(
            costs, batch, survivals, limit, policy.margin)


def test_nothing_pays_means_the_plain_path():
    costs = table([45, 75, 88, 68, 71, 71, 71, 65], [40] * 7)
    policy = GoodputPolicy(costs, 7, prior=0.3)
    policy.begin(1)
    assert policy.choose(1, [0], 7) == 0
    policy.estimate.per_request[0] = [0.95] * 7  # a draft that is almost always right
    assert policy.choose(1, [0], 7) == 7
    # Just above the plain path, but not by the margin: stay plain.
    costs = table([50, 50], [1e-3])
    policy = GoodputPolicy(costs, 1, margin=1.1, prior=0.05)
    policy.begin(1)
    assert 1.0 < (1.05 / 0.050) / (1 / 0.050) < 1.1
    policy.estimate.per_request[0] = [0.05]
    assert policy.choose(1, [0], 1) == 0
    policy.estimate.per_request[0] = [0.2]
    assert policy.choose(1, [0], 1) == 1
    assert policy.choose(1, [], 1) == 0 and policy.choose(1, [0], 0) == 0


def test_the_margin_turns_speculation_on_not_off():
    """Between 1 and ``margin`` times the plain path's goodput, speculation stays as it was:
    off stays off, on stays on (a probe does not count as on)."""
    costs = table([50, 50], [1e-3])
    # prior 0.05: a plain round ages the estimates back to it (no counts), as planted below
    policy = GoodputPolicy(costs, 1, margin=1.1, probe_every=100, probe_max=100, prior=0.05)
    policy.begin(1)
    policy.estimate.per_request[0] = [0.05]  # 1.05 times the plain path's goodput
    assert [policy.drafts_to_propose(1, [0], 1) for _ in range(3)] == [0, 0, 0]
    policy.estimate.per_request[0] = [0.2]
    assert policy.drafts_to_propose(1, [0], 1) == 1
    policy.estimate.per_request[0] = [0.05]
    assert [policy.drafts_to_propose(1, [0], 1) for _ in range(3)] == [1, 1, 1]
    policy.estimate.per_request[0] = [0.0]  # no better than plain: off
    assert policy.drafts_to_propose(1, [0], 1) == 0
    policy.estimate.per_request[0] = [0.05]
    assert policy.drafts_to_propose(1, [0], 1) == 0
    # Nothing to decide (no active request, or no room for a draft) keeps the state.
    policy.estimate.per_request[0] = [0.2]
    assert policy.drafts_to_propose(1, [0], 1) == 1
    assert policy.drafts_to_propose(1, [], 1) == 0 and policy.drafts_to_propose(1, [0], 0) == 0
    policy.estimate.per_request[0] = [0.05]
    assert policy.drafts_to_propose(1, [0], 1) == 1


def test_probe_schedule_backs_off_and_resets():
    costs = table([45, 75, 88, 68, 71, 71, 71, 65], [40] * 7)
    policy = GoodputPolicy(costs, 7, prior=0.0, probe_every=2, probe_max=8)
    policy.begin(1)
    decisions = [policy.drafts_to_propose(1, [0], 7) for _ in range(30)]
    probes = [i for i, k in enumerate(decisions) if k]
    # Waits of 2, 4, 8, 8 plain rounds between probes.
    assert probes == [2, 7, 16, 25]
    assert all(decisions[i] == policy.best_positive(1, [0], 7) for i in probes)
    policy.estimate.per_request[0] = [0.95] * 7  # the probe found a good draft: on, reset
    assert policy.drafts_to_propose(1, [0], 7) == 7
    assert policy.probe_wait == 2 and policy.plain_streak == 0


def test_speculation_turned_off_by_a_bad_spell_returns_on_its_merits():
    """A draft that pays (prior 0.9) meets five rejections in a row and goodput turns it off.
    The plain rounds age the counts, so the estimate drifts back toward the prior and
    speculation returns on its own, long before the next probe (100 rounds away). With
    estimates frozen while off, every round up to the probe was plain."""
    costs = table([50, 75], [1e-3])  # on when c > 0.65 (the margin 1.1 included)
    policy = GoodputPolicy(costs, 1, prior=0.9, probe_every=100, probe_max=100)
    policy.begin(1)
    assert policy.drafts_to_propose(1, [0], 1) == 1
    for _ in range(5):
        policy.observe(0, verified=1, accepted=0)
    decisions, estimates = [], []
    for _ in range(60):
        decisions.append(policy.drafts_to_propose(1, [0], 1))
        estimates.append(policy.estimate.conditional(0)[0])
    back = decisions.index(1)
    # After five rejections (rate 0.03) seen = 4.71 and the base's weight w = 1.72, for the
    # request and the pooled counts alike; the request's base is the aged pooled estimate, so
    # c = 0.9 * (w / (seen * 0.94^m + w))^2 after m plain rounds (idle rate 0.06): past 0.65
    # at m = 45.
    assert back == 45 and not any(decisions[:back])
    seen, w = sum(0.97 ** j for j in range(5)), 2 * 0.97 ** 5
    assert estimates[:back] == pytest.approx(
        [0.9 * (w / (seen * 0.94 ** m + w)) ** 2 for m in range(1, back + 1)])
    assert estimates[back - 1] > 0.65 > estimates[back - 2]


def test_acceptance_estimate_learns_only_what_was_verified():
    estimate = AcceptanceEstimate(4, prior=0.5, rate=0.5, strength=1.0)
    estimate.begin(2)
    estimate.observe(0, verified=3, accepted=1)  # position 1 accepted, 2 rejected, 3 unseen
    # one observation against the base's strength, decayed once: (hit + 0.5 * base) / 1.5; the
    # request's base at position 1 is the pooled estimate when it began (0.5), deeper ones
    # its own estimate of the position before times the pooled ratio (1: the profile is flat)
    c1 = 1.25 / 1.5
    c2 = 0.5 * c1 / 1.5
    assert estimate.conditional(0) == pytest.approx([c1, c2, c2, c2])
    assert estimate.conditional(1) == [0.5] * 4  # another request: untouched
    # the pooled estimate's base is the position before: 3 and 4 follow 2
    assert estimate.pooled == pytest.approx([c1, c2, c2, c2])
    estimate.observe(1, verified=2, accepted=2)  # all accepted: nothing seen past 2
    d2 = (1 + 0.5 * c1) / 1.5
    assert estimate.conditional(1) == pytest.approx([c1, d2, d2, d2])
    assert estimate.survival(1) == pytest.approx([c1, c1 * d2, c1 * d2 ** 2, c1 * d2 ** 3])
    # pooled counts decay by 1 - rate per observation: position 1 saw hit, hit; 2 miss, hit
    p1 = (1.5 + 0.25 * 0.5) / 1.75
    p2 = (1.0 + 0.25 * p1) / 1.75
    assert estimate.pooled == pytest.approx([p1, p2, p2, p2])
    # Request 0 verifies one draft, accepted: position 2's rejection ages (its counts halve,
    # the base keeps its weight) and its estimate moves back toward the base.
    estimate.observe(0, verified=1, accepted=1)
    e1 = (1 + 0.5 * 1 + 0.25 * 0.5) / (1 + 0.5 + 0.25)
    assert estimate.conditional(0)[:2] == pytest.approx([e1, 0.5 * e1 / (0.5 + 0.5)])
    estimate.begin(1)  # a new request starts from the pooled estimate
    assert estimate.conditional(0) == estimate.pooled
    with pytest.raises(ValueError, match="0 < rate <= 1"):
        AcceptanceEstimate(4, rate=0.0)
    with pytest.raises(ValueError, match="strength > 0"):
        AcceptanceEstimate(4, strength=0.0)
    with pytest.raises(ValueError, match="0 <= idle_rate <= 1"):
        AcceptanceEstimate(4, idle_rate=1.5)


def test_a_request_starts_from_the_pooled_profile():
    """A draft whose acceptance falls with the position: a new request's estimates are the
    pooled ones, and a request that does better at the positions it verifies is expected to do
    better, in proportion, at the ones past them."""
    estimate = AcceptanceEstimate(3, prior=0.8, rate=0.1, strength=2.0)
    estimate.begin(1)
    for _ in range(60):
        estimate.observe(0, verified=3, accepted=1)  # position 1 right, position 2 wrong
    pooled = list(estimate.pooled)
    assert pooled[0] > 0.95 and pooled[1] < 0.05
    estimate.begin(1)
    assert estimate.conditional(0) == pooled
    estimate.observe(0, verified=1, accepted=1)
    c = estimate.conditional(0)
    assert c[1] == pytest.approx(min(1.0, c[0] * pooled[1] / pooled[0]))
    assert c[2] == pytest.approx(min(1.0, c[1] * pooled[2] / pooled[1]))


def test_accepting_every_verified_draft_raises_the_positions_past_them():
    """A request whose drafts are all right, verified two at a time (what the estimates
    started from pays for): the positions past 2, never verified, follow the rising estimates
    of 1 and 2, so the rule comes to verify them. With a fixed per-request base they stayed at
    the start's 0.5 and the request verified 2 drafts a round to its end."""
    costs = table([34.7, 35.5, 37.7, 50.2, 53.3, 53.9, 60.1, 62.9], [0.1] * 7)
    policy = GoodputPolicy(costs, 7, prior=0.5)
    policy.begin(1)
    chosen = []
    for _ in range(12):
        k = policy.drafts_to_propose(1, [0], 7)
        chosen.append(k)
        policy.observe(0, verified=k, accepted=k)
    assert chosen[0] == 2 and max(chosen) > 2 and chosen[-1] == 7


def test_a_position_priced_out_by_rejections_is_tried_again():
    """Early rejections at position 3 price positions 3.. out (the rule verifies 2); the
    counts of positions not verified age, so position 3 returns toward its base (the estimate
    of position 2, which keeps accepting) and is verified again. Without the ageing the rule
    verified 2 drafts a round from then on."""
    costs = table([34.7, 35.5, 37.7, 50.2, 53.3, 53.9, 60.1, 62.9], [0.1] * 7)
    policy = GoodputPolicy(costs, 7, prior=0.9)
    policy.begin(1)
    assert policy.drafts_to_propose(1, [0], 7) == 7
    for _ in range(3):
        policy.observe(0, verified=7, accepted=2)  # positions 1, 2 right, 3 wrong
    chosen = []
    for _ in range(40):
        k = policy.drafts_to_propose(1, [0], 7)
        chosen.append(k)
        policy.observe(0, verified=k, accepted=k)
    assert chosen[0] == 2
    assert chosen[-1] > 2
    # Aged: after the rounds that stopped at 2, position 3 is close to its base again.
    estimate = AcceptanceEstimate(3, prior=0.9, rate=0.1, strength=2.0)
    estimate.begin(1)
    estimate.observe(0, verified=3, accepted=2)
    for _ in range(60):
        estimate.observe(0, verified=2, accepted=2)
    c = estimate.conditional(0)
    assert c[2] == pytest.approx(c[1], abs=0.02)


def test_acceptance_estimate_converges_and_forgets():
    """Averaged from the first observation (no pull toward the prior beyond its pseudo-counts),
    then an EMA of weight ``rate``: it follows a draft that changes."""
    estimate = AcceptanceEstimate(2, prior=0.5, rate=0.1, strength=2.0)
    estimate.begin(1)
    for _ in range(3):
        estimate.observe(0, verified=2, accepted=0)  # position 1 rejected three times
    seen, weight = 1 + 0.9 + 0.81, 2 * 0.9 ** 3
    assert estimate.conditional(0)[0] == pytest.approx(0.5 * weight / (seen + weight))
    # never reached: the request's estimate of position 1 (the pooled profile is flat)
    assert estimate.conditional(0)[1] == pytest.approx(estimate.conditional(0)[0])
    assert estimate.pooled[1] == pytest.approx(estimate.pooled[0])  # follows position 1
    for _ in range(200):
        estimate.observe(0, verified=2, accepted=2)
    assert estimate.conditional(0) == pytest.approx([1.0, 1.0], abs=0.02)
    for _ in range(200):
        estimate.observe(0, verified=2, accepted=0)
    assert estimate.conditional(0)[0] == pytest.approx(0.0, abs=0.02)


def test_policy_errors():
    costs = table([45, 75], [40])
    with pytest.raises(ValueError, match="prices at most 1 drafts"):
        GoodputPolicy(costs, 2)
    with pytest.raises(ValueError, match="margin >= 1"):
        GoodputPolicy(costs, 1, margin=0.5)


# --------------------------------------------------------------------------------------------
# The decision after drafting


def test_verify_lengths_pads_to_the_cheapest_width():
    # Widths 2-3 cost more than 4: a request Algorithm 1 stops at 1 draft verifies 3.
    costs = table([45, 75, 88, 68, 200], [1] * 4)
    confidence = torch.tensor([[0.9, 0.05, 0.05, 0.05]])
    active = torch.tensor([True])
    lengths = verify_lengths(confidence, active, costs)
    assert lengths.tolist() == [3]
    # ... but never past what it drafted.
    lengths = verify_lengths(confidence, active, costs, torch.tensor([2], dtype=torch.int32))
    assert lengths.tolist() == [2]
    # Finished requests verify nothing.
    assert verify_lengths(confidence, torch.tensor([False]), costs).tolist() == [0]


def test_verify_lengths_is_algorithm_1_on_the_measured_rates():
    costs = CostTable({}, {2: [0.05, 0.06, 0.07, 0.08]}, [0.0, 0.01, 0.02, 0.03])
    confidence = torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.9, 0.9]])
    active = torch.tensor([True, True])
    from dspark_ops import schedule_verify

    plain = schedule_verify(confidence, costs.step_rate(2, 3))
    lengths = verify_lengths(confidence, active, costs)
    assert lengths.tolist() == [max(int(n), brute_force_width(costs, confidence, int(plain.max()))
                                    - 1) for n in plain]


def brute_force_width(costs, confidence, algorithm_1):
    """The width of the highest expected tokens per second, drafting included, among those
    wider than Algorithm 1's widest request, every request verifying ``width - 1`` drafts."""
    batch, k = confidence.shape

    def goodput(width):
        tokens = sum(1 + sum(math.prod(row[:i + 1]) for i in range(width - 1))
                     for row in confidence.tolist())
        return tokens / (costs.draft(k) + costs.target(batch, width))

    best = max(range(algorithm_1 + 1, k + 2), key=lambda w: (goodput(w), -w))
    return costs.cheapest_width(batch, best, limit=k + 1)


@pytest.mark.parametrize("seed", range(30))
def test_verify_width_is_the_brute_force_goodput_argmax(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, k = 1 + seed % 3, 6
    target_ms = torch.cumsum(2 + 20 * torch.rand(k + 1, generator=gen), 0).tolist()
    costs = table(target_ms, (5 * torch.rand(k, generator=gen)).cumsum(0).tolist(), batch=batch)
    confidence = torch.rand(batch, k, generator=gen) ** 0.3
    from dspark_ops import schedule_verify

    plain = schedule_verify(confidence, costs.step_rate(batch, k))
    width = brute_force_width(costs, confidence, int(plain.max()))
    lengths = verify_lengths(confidence, torch.ones(batch, dtype=torch.bool), costs)
    assert lengths.tolist() == [max(int(n), width - 1) for n in plain]


def test_a_step_in_the_cost_curve_does_not_stop_verification():
    """SmolLM2 on 2 CPU threads: width 4 costs a third more than 3, then the curve is nearly
    flat. Algorithm 1 stops at 2 drafts of 0.9; verifying all 7 emits 5.2 tokens for 63 ms
    against 2.7 for 38 ms."""
    costs = table([34.7, 35.5, 37.7, 50.2, 53.3, 53.9, 60.1, 62.9], [0.1] * 7)
    confidence = torch.full((1, 7), 0.9)
    from dspark_ops import schedule_verify

    assert schedule_verify(confidence, costs.step_rate(1, 7)).tolist() == [2]
    assert verify_lengths(confidence, torch.tensor([True]), costs).tolist() == [7]


# --------------------------------------------------------------------------------------------
# Lazy drafting


@pytest.mark.parametrize("head", ["vanilla", "rnn", "dflash"])
def test_k_slots_are_the_first_k_of_the_block(head):
    target, draft = tiny_pair(vocab=64, block_size=6, context=0.2, noise=0.5,
                              markov_head_type="rnn" if head == "rnn" else "vanilla")
    if head == "dflash":
        draft.markov_head, draft.confidence_head = None, None
        draft.config = type(draft.config)(**{**draft.config.__dict__, "markov_rank": 0,
                                             "enable_confidence_head": False})
        torch.nn.init.normal_(draft.lm_head.weight)
    from dspark_ops.steps import prefill

    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    last, features, cache, cache_len = prefill(target, prompts, 32, "cpu")
    anchor = last.argmax(-1)
    proposer = BlockDraftProposer(draft)
    proposer.start(prompts, features, cache_len, anchor, 32)
    rows = []
    hook = draft.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2]))
    args = (anchor, cache_len.long(), torch.ones(2), torch.tensor([5, 6]), {}, None)
    full = proposer.propose(6, *args)
    for k in (1, 3):
        part = proposer.propose(k, *args)
        assert torch.equal(part.tokens, full.tokens[:, :k])
        torch.testing.assert_close(part.logits, full.logits[:, :k])
        if full.confidence is not None:
            torch.testing.assert_close(part.confidence, full.confidence[:, :k])
    hook.remove()
    assert rows == [6, 1, 3]  # LM-head rows: only the drafted slots


# --------------------------------------------------------------------------------------------
# Prompt lookup and the oracle


def test_find_continuation():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]
    assert find_continuation(tokens, 3, 1, 3) == [8, 9, 1]  # "6 7" recurs
    assert find_continuation([1, 2, 3, 2], 3, 1, 5) == [3, 2]  # latest earlier "2"
    assert find_continuation([1, 2, 3, 4], 3, 1, 5) == []
    assert find_continuation([4, 1, 4, 2, 4], 2, 1, 2) == [2, 4]  # the latest match wins
    assert find_continuation([7], 3, 1, 2) == []


def test_decoders_sharing_a_proposer_keep_their_own_block_size():
    """A decoder's block_size limits its own copy: the proposer passed in is never changed, so
    decoders of several block sizes over one proposer each draft their own k."""
    continuation = list(range(10, 40))
    oracle = OracleProposer([continuation], alpha=1.0, vocab_size=2000, max_drafts=7)
    target, _ = tiny_pair(seed=0)
    sizes = [SpeculativeDecoder(target, oracle, block_size=k, scheduler="fixed").block_size
             for k in (1, 3, 7)]
    assert sizes == [1, 3, 7] and oracle.max_drafts == 7


def test_oracle_drafts_are_right_at_rate_alpha():
    continuation = list(range(10, 1010))
    oracle = OracleProposer([continuation], alpha=0.7, vocab_size=2000, seed=3)
    right = sum(a == b for a, b in zip(oracle.proposals[0], continuation))
    assert 0.65 < right / len(continuation) < 0.75
    assert OracleProposer([continuation], 1.0, 2000).proposals[0] == continuation
    assert not any(a == b for a, b in zip(OracleProposer([continuation], 0.0, 2000).proposals[0],
                                          continuation))
    with pytest.raises(ValueError, match="'alpha' must be in"):
        OracleProposer([continuation], 1.5, 2000)


def _costs_for(target, proposer, draft_ms, batch=1):
    key = costs_module.cost_key(target, proposer, device="cpu", dtype=torch.float64)
    K = proposer.max_drafts
    return CostTable(key, {batch: [0.010 + 0.001 * w for w in range(K + 1)]},
                     [0.0] + [draft_ms / 1e3] * K)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "lookup", "oracle"])
@pytest.mark.parametrize("draft_ms", [0.0, 50.0])
def test_goodput_greedy_equals_plain_decoding(pair, kind, draft_ms, monkeypatch):
    target, draft = pair
    prompts = PROMPTS[:3]
    expected = generate_target_only(target, prompts, 24)
    if kind == "dflash":
        draft = _dflash(draft)
    elif kind == "eagle3":
        draft = _eagle3_for(target)
    elif kind == "lookup":
        draft = PromptLookupProposer(4)
    elif kind == "oracle":
        draft = OracleProposer(expected, 0.6, 64, max_drafts=5)
    costs = _costs_for(target, BlockDraftProposer(pair[1])
                       if kind in ("dspark", "dflash", "eagle3") else draft, draft_ms)
    # The prices as given: the rounds' wall-clock timings (slow under a loaded test run) would
    # otherwise move them, and with them the share of plain rounds asserted below.
    monkeypatch.setattr(costs, "observe_target", lambda *args, **kwargs: None)
    monkeypatch.setattr(costs, "observe_draft", lambda *args, **kwargs: None)
    decoder = SpeculativeDecoder(target, draft, block_size=5, costs=costs, probe_every=2)
    out = decoder.generate(prompts, 24)
    assert out.tokens == expected
    plain = sum(r.plain for r in out.rounds)
    if draft_ms:  # drafting costs 5 target steps: plain but for the probes
        assert plain >= 0.6 * len(out.rounds)
    elif kind != "lookup":
        assert plain < len(out.rounds)
    for r in out.rounds:
        assert all(0 <= a <= n <= r.drafted for a, n in zip(r.accepted, r.num_verify))


def _dflash(draft):
    from dspark_ops.models import DSparkDraft

    config = DSparkConfig(**{**draft.config.__dict__, "markov_rank": 0,
                             "enable_confidence_head": False})
    dflash = DSparkDraft(config)
    dflash.load_state_dict({k: v for k, v in draft.state_dict().items()
                            if not k.startswith(("markov_head", "confidence_head"))})
    with torch.no_grad():
        dflash.lm_head.weight.copy_(draft.markov_head.markov_w2.weight)  # bigram-ish proposals
    return dflash


def _eagle3_for(target):
    from dspark_ops.models import Eagle3Config, Eagle3Draft

    config = Eagle3Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          target_layer_ids=(0, 1), ttt_length=5)
    torch.manual_seed(0)
    draft = Eagle3Draft(config).double()
    return draft.float()


def test_the_plain_path_runs_no_draft_work(pair, monkeypatch):
    target, draft = pair
    calls = {"propose": 0, "draft_forward": 0}
    real_forward = type(draft).forward

    def counting_forward(self, *args, **kwargs):
        calls["draft_forward"] += 1
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(draft), "forward", counting_forward)
    proposer = BlockDraftProposer(draft)
    costs = _costs_for(target, proposer, 1e6)  # drafting never pays
    decoder = SpeculativeDecoder(target, proposer, costs=costs, probe_every=1000, probe_max=1000)
    out = decoder.generate(PROMPTS[:2], 16)
    assert out.tokens == generate_target_only(target, PROMPTS[:2], 16)
    assert all(r.plain for r in out.rounds) and calls["draft_forward"] == 0
    # The deferred context reaches the draft at its next round: a later probe drafts from the
    # same cache a speculating decoder would have built.
    decoder = SpeculativeDecoder(target, proposer, costs=costs, probe_every=3)
    out = decoder.generate(PROMPTS[:2], 16)
    assert out.tokens == generate_target_only(target, PROMPTS[:2], 16)
    assert calls["draft_forward"] > 0


def test_goodput_needs_a_cost_table(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="needs a measured cost table"):
        SpeculativeDecoder(target, draft, scheduler="goodput")
    costs = _costs_for(target, BlockDraftProposer(draft), 1.0)
    assert SpeculativeDecoder(target, draft, costs=costs).scheduler == "goodput"


# --------------------------------------------------------------------------------------------
# Exact sampling with the new early stops


def _chi_square(decoder, target, prompt, steps, trials):
    out = decoder.generate([prompt] * trials, steps, 1.0, torch.arange(trials))
    return chi_square_of_tokens(out.tokens, target, prompt, steps, 1.0), out


def _sampling_pair():
    return tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                     target_dtype=torch.float64)


def _selective_costs(target, proposer, trials):
    """Each verified width costs 30 % of a step more: drafting pays for some k, not all."""
    key = costs_module.cost_key(target, proposer, device="cpu", dtype=torch.float64)
    return CostTable(key, {trials: [1.0 + 0.3 * w for w in range(5)]}, [0.0, 0.1, 0.2, 0.3, 0.4])


def test_goodput_sampling_follows_the_target():
    target, draft = _sampling_pair()
    trials = 12000
    proposer = BlockDraftProposer(draft)
    decoder = SpeculativeDecoder(target, proposer, costs=_selective_costs(target, proposer, trials))
    decoder.policy.estimate.pooled = [0.9, 0.6, 0.3, 0.2]  # lazy: k = 2 or 3 slots
    (chi2, df), out = _chi_square(decoder, target, [1, 2, 3], 3, trials)
    assert chi_square_passes(chi2, df), (chi2, df)
    drafted = {r.drafted for r in out.rounds}
    assert drafted - {0, 4}, drafted  # some rounds drafted fewer slots than the block
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    assert 0 < accepted < verified


def test_chi_square_rejects_a_stop_that_looks_at_the_drafted_token(monkeypatch):
    """The same check fails when the verify length depends on the drafts themselves: verifying
    a draft only when it is the draft's most probable token (which makes that token more
    likely than the target says: a verified draft is accepted with min(1, p/q), an unverified
    slot is drawn from p, so P(y = x) = min(p, q) + (1 - q) p > p)."""
    target, draft = _sampling_pair()
    trials = 12000
    proposer = BlockDraftProposer(draft)
    decoder = SpeculativeDecoder(target, proposer, costs=_selective_costs(target, proposer, trials))
    decoder.policy.estimate.pooled = [0.9, 0.6, 0.3, 0.2]  # the same rounds as above

    def peeking(proposal, active, step_rate, history):
        probs = torch.softmax(proposal.logits.float(), -1)
        own = probs.gather(-1, proposal.tokens[..., None])[..., 0]
        sure = (own >= probs.max(-1).values).int().cumprod(1).sum(1)
        return torch.where(active, sure, 0).int()

    monkeypatch.setattr(decoder, "_num_verify", peeking)
    (chi2, df), _ = _chi_square(decoder, target, [1, 2, 3], 3, trials)
    assert not chi_square_passes(chi2, df), (chi2, df)


# --------------------------------------------------------------------------------------------
# The simulation of the rule (bench.goodput_sim)


def test_simulated_fixed_block_costs_what_the_table_says():
    from bench.goodput_sim import decode_seconds

    costs = table([10, 12, 14, 16], [1, 2, 3])
    # Every draft right: rounds of 3 drafts emit 4 tokens; 1 + 4 + 4 tokens, then 1 draft for
    # the last two.
    seconds = decode_seconds(costs, [True] * 20, 11, fixed_k=3)
    assert seconds == pytest.approx((10 + 2 * (3 + 16) + (1 + 12)) / 1e3)
    # Every draft wrong: each round emits the target's token alone, drafting no more than the
    # tokens still needed less one (the last round is the plain step).
    seconds = decode_seconds(costs, [False] * 20, 4, fixed_k=3)
    assert seconds == pytest.approx((10 + (2 + 14) + (1 + 12) + 10) / 1e3)
    with pytest.raises(ValueError, match="exactly one"):
        decode_seconds(costs, [True], 2)


def test_simulated_goodput_finds_the_best_block_and_the_plain_path():
    from bench.goodput_sim import simulate

    costs = table([34.7, 35.5, 37.7, 50.2, 53.3, 53.9, 60.1, 62.9], [0.1] * 7)
    rows = {r["alpha"]: r for r in simulate(costs, [0.0, 0.9], prompts=4, tokens=100, seeds=4)}
    assert rows[0.0]["goodput_vs_plain"] > 0.97  # nothing pays: (almost) the plain path
    assert rows[0.9]["best_fixed_k"] == 7 and rows[0.9]["goodput_vs_best_fixed"] > 0.9


@pytest.mark.parametrize("seed", range(20))
def test_verify_width_never_reads_confidences_past_the_first_drop(seed):
    """With a confidence computed from the drafts, the lengths are a stopping time: changing the
    fresh confidences after the slot each request's Algorithm 1 stopped at (which depend on the
    drafts before them) changes nothing; past it only the estimates known before drafting
    count. (Reading them would make whether a draft is verified depend on that draft.)"""
    from dspark_ops import schedule_verify

    gen = torch.Generator().manual_seed(seed)
    batch, k = 3, 7
    costs = table([34.7, 35.5, 37.7, 50.2, 53.3, 53.9, 60.1, 62.9], [0.1] * 7, batch=batch)
    confidence = torch.rand(batch, k, generator=gen)
    estimates = torch.full((batch, k), 0.9)
    active = torch.ones(batch, dtype=torch.bool)
    stopped = schedule_verify(confidence, costs.step_rate(batch, k))
    later = torch.arange(k)[None, :] > stopped[:, None]
    other = torch.where(later, torch.rand(batch, k, generator=gen), confidence)
    lengths = verify_lengths(confidence, active, costs, estimates=estimates)
    assert torch.equal(lengths, verify_lengths(other, active, costs, estimates=estimates))


def test_the_simulation_corrects_a_skewed_table_online():
    """bench.goodput_sim --profile-skew: the rule's own table, profiled 1.5x slow, follows the
    true timings of the rounds it runs, as the decoder's does."""
    from bench.goodput_sim import decode_seconds

    truth = table([10, 12, 16], [1, 1])
    believed = table([15, 18, 24], [1.5, 1.5])
    policy = GoodputPolicy(believed, 2)
    spent = decode_seconds(truth, [True] * 90, 80, policy=policy)
    assert believed.speed == pytest.approx(1 / 1.5, rel=0.1)
    assert believed.target(1, 1) == pytest.approx(0.010, rel=0.1)
    assert spent < 80 * 0.010  # it speculated: every draft is right
