"""Philox4x32-10 and the uniforms every sampling op draws (csrc/common/philox.h)."""

from __future__ import annotations

import pytest
import torch

import dspark_ops
from dspark_ops import reference
from conftest import DEVICES, cuda_only, non_contiguous

MASK32 = 0xFFFFFFFF
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Random123's known-answer vectors for philox4x32_10 (kat_vectors): counter, key, output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (MASK32, MASK32, MASK32, MASK32),
        (MASK32, MASK32),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _signed64(hi: int, lo: int) -> int:
    """The int64 whose two's-complement words are (hi, lo)."""
    value = (hi << 32) | lo
    return value - 2**64 if value >= 2**63 else value


def _assert_uniforms_of_words(uniforms, words):
    """Each uniform comes from its 32-bit word: within 2^-24 of word / 2^32 (the exact float32
    rounding is pinned by the op-vs-reference tests) and strictly inside (0, 1)."""
    for u, w in zip(uniforms, words):
        assert 0.0 < u < 1.0, (u, hex(w))
        assert abs(u - w * 2.0**-32) <= 2.0**-24, (u, hex(w))


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected):
    words = reference.philox4x32_10(
        [torch.tensor(c) for c in counter], [torch.tensor(k) for k in key]
    )
    assert tuple(int(w) for w in words) == expected


def test_philox_known_answers_vectorised():
    # The same vectors as one batched call: the reference must not mix lanes.
    counters = torch.tensor([c for c, _, _ in KNOWN_ANSWERS]).T
    keys = torch.tensor([k for _, k, _ in KNOWN_ANSWERS]).T
    words = torch.stack(reference.philox4x32_10(list(counters), list(keys)), 1)
    assert words.tolist() == [list(e) for _, _, e in KNOWN_ANSWERS]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_reference_uniform_counter_layout(counter, key, expected):
    # counter = (element >> 2, purpose, position lo, position hi), key = (seed lo, seed hi):
    # the Random123 vectors seen through philox_uniform.
    seed = torch.tensor(_signed64(key[1], key[0]))
    position = torch.tensor(_signed64(counter[3], counter[2]))
    elements = 4 * counter[0] + torch.arange(4)
    got = reference.philox_uniform(seed, position, counter[1], elements)
    _assert_uniforms_of_words(got.tolist(), expected)


def test_op_known_answer(device):
    # Only the all-zero vector is reachable through the op (the others need element indices
    # beyond any count that fits in memory).
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    got = dspark_ops.philox_uniform(seed, seed.clone(), 0, 4)
    _assert_uniforms_of_words(got.cpu()[0].tolist(), KNOWN_ANSWERS[0][2])
    assert torch.equal(got, reference.philox_uniform(seed, seed, 0, 4))


def _seeds_and_positions(n: int, device: str):
    g = torch.Generator().manual_seed(1234)
    edge = torch.tensor([0, -1, 1, INT64_MIN, INT64_MAX, 2**32 - 1, 2**32, -(2**32), 2**40 + 7])
    seed = torch.cat([edge, torch.randint(INT64_MIN, INT64_MAX, (n - len(edge),), generator=g)])
    position = torch.cat(
        [edge.flip(0), torch.randint(INT64_MIN, INT64_MAX, (n - len(edge),), generator=g)]
    )
    return seed.to(device), position.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("purpose", [0, 1, 2])
@pytest.mark.parametrize("count", [1, 3, 6, 13, 1001])
def test_op_matches_reference(device, purpose, count):
    seed, position = _seeds_and_positions(24, device)
    got = dspark_ops.philox_uniform(seed, position, purpose, count)
    expected = reference.philox_uniform(seed, position, purpose, count)
    assert got.dtype == torch.float32 and got.shape == (24, count) and got.device == seed.device
    assert torch.equal(got, expected)


def test_op_non_contiguous_inputs(device):
    seed, position = _seeds_and_positions(16, device)
    got = dspark_ops.philox_uniform(non_contiguous(seed), non_contiguous(position), 1, 9)
    assert torch.equal(got, dspark_ops.philox_uniform(seed, position, 1, 9))


def test_op_empty(device):
    seed, position = _seeds_and_positions(12, device)
    assert dspark_ops.philox_uniform(seed, position, 2, 0).shape == (12, 0)
    empty = seed[:0]
    assert dspark_ops.philox_uniform(empty, empty, 2, 5).shape == (0, 5)


def test_stream_is_independent_of_count_and_row(device):
    # Element k of a stream is the same whatever else is drawn: a longer draw extends a shorter
    # one, and a stream drawn alone equals its row in a batch.
    seed, position = _seeds_and_positions(10, device)
    long = dspark_ops.philox_uniform(seed, position, 2, 37)
    assert torch.equal(dspark_ops.philox_uniform(seed, position, 2, 5), long[:, :5])
    for i in (0, 4, 9):
        alone = dspark_ops.philox_uniform(seed[i : i + 1], position[i : i + 1], 2, 37)
        assert torch.equal(alone, long[i : i + 1])
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0)).to(device)
    assert torch.equal(dspark_ops.philox_uniform(seed[perm], position[perm], 2, 37), long[perm])


def test_values_in_open_interval_and_uniform(device):
    seed, position = _seeds_and_positions(64, device)
    u = dspark_ops.philox_uniform(seed, position, 1, 16384).cpu().double().flatten()
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    # 256 equal bins: chi-square goodness of fit, df = 255, loose bound (no false positives).
    counts = torch.bincount((u * 256).long(), minlength=256).double()
    expected = u.numel() / 256
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 255 + 10 * (2 * 255) ** 0.5


# Streams whose element 0 is an extreme Philox word (found by search): the largest words must
# not round up to 1 and the smallest must not map to 0, or -log(u) / -log1p(-u) in the
# exponential race become 0 or infinite.
EXTREME_WORD_STREAMS = [
    (dict(seed=12345, position=579566, purpose=2), 0xFFFFFFB6),
    (dict(seed=12345, position=621595, purpose=2), 0x72),
]


@pytest.mark.parametrize("stream,word", EXTREME_WORD_STREAMS, ids=["high", "low"])
def test_extreme_word_streams(stream, word):
    words = reference.philox4x32_10(
        (torch.tensor(0), torch.tensor(stream["purpose"]), torch.tensor(stream["position"]),
         torch.tensor(0)),
        (torch.tensor(stream["seed"]), torch.tensor(0)),
    )
    assert int(words[0]) == word


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stream,word", EXTREME_WORD_STREAMS, ids=["high", "low"])
def test_extreme_words_stay_inside_open_interval(device, stream, word):
    seed = torch.tensor([stream["seed"]], device=device)
    position = torch.tensor([stream["position"]], device=device)
    expected = reference.philox_uniform(seed, position, stream["purpose"], 1)
    got = dspark_ops.philox_uniform(seed, position, stream["purpose"], 1)
    _assert_uniforms_of_words(expected.cpu()[0].tolist(), [word])
    _assert_uniforms_of_words(got.cpu()[0].tolist(), [word])
    assert torch.equal(got, expected)


def _fraction_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).double().mean().item()


def test_streams_differ(device):
    seed, position = _seeds_and_positions(32, device)
    base = dspark_ops.philox_uniform(seed, position, 1, 64)
    variants = {
        "purpose": dspark_ops.philox_uniform(seed, position, 2, 64),
        "purpose 0": dspark_ops.philox_uniform(seed, position, 0, 64),
        "position + 1": dspark_ops.philox_uniform(seed, position + 1, 1, 64),
        "position + 2^32": dspark_ops.philox_uniform(seed, position + 2**32, 1, 64),
        "seed + 1": dspark_ops.philox_uniform(seed + 1, position, 1, 64),
        "seed + 2^32": dspark_ops.philox_uniform(seed + 2**32, position, 1, 64),
    }
    # Seed and position play different roles (rows where they are equal excluded).
    differ = seed != position
    swapped = dspark_ops.philox_uniform(position, seed, 1, 64)
    assert differ.sum() >= 30
    assert _fraction_equal(base[differ], swapped[differ]) < 0.01
    for name, other in variants.items():
        # 24-bit uniforms: chance agreement is about 2^-24 per element.
        assert _fraction_equal(base, other) < 0.01, name
    # Elements within a stream, and lanes of one Philox block, differ too.
    assert _fraction_equal(base[:, :4], base[:, 4:8]) < 0.01
    assert _fraction_equal(base[:, 0], base[:, 1]) < 0.01


def _philox_args(device, **overrides):
    args = dict(
        seed=torch.arange(3, dtype=torch.int64, device=device) + 11,
        position=torch.arange(3, dtype=torch.int64, device=device) + 5,
        purpose=1,
        count=4,
    )
    args.update(overrides)
    return args


def _philox_call(args):
    return dspark_ops.philox_uniform(args["seed"], args["position"], args["purpose"], args["count"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "override,error,message",
    [
        (
            lambda d: dict(seed=torch.zeros(3, 1, dtype=torch.int64, device=d)),
            ValueError,
            r"philox_uniform\(\): 'seed' must be 1-D \[N\], got a 2-D tensor of shape \[3, 1\]",
        ),
        (
            lambda d: dict(seed=torch.tensor(3, device=d)),
            ValueError,
            r"philox_uniform\(\): 'seed' must be 1-D \[N\], got a 0-D tensor",
        ),
        (
            lambda d: dict(seed=torch.zeros(3, dtype=torch.int32, device=d)),
            TypeError,
            r"philox_uniform\(\): 'seed' must have dtype Long, got Int",
        ),
        (
            lambda d: dict(seed=torch.zeros(3, dtype=torch.float32, device=d)),
            TypeError,
            r"philox_uniform\(\): 'seed' must have dtype Long, got Float",
        ),
        (
            lambda d: dict(position=torch.zeros(3, dtype=torch.int32, device=d)),
            TypeError,
            r"philox_uniform\(\): 'position' must have dtype Long, got Int",
        ),
        (
            lambda d: dict(position=torch.zeros(4, dtype=torch.int64, device=d)),
            ValueError,
            r"philox_uniform\(\): 'position' must have shape \[N\] = \[3\], got \[4\]",
        ),
        (
            lambda d: dict(position=torch.zeros(3, 1, dtype=torch.int64, device=d)),
            ValueError,
            r"philox_uniform\(\): 'position' must have shape \[N\] = \[3\], got \[3, 1\]",
        ),
        (
            lambda d: dict(purpose=-1),
            ValueError,
            r"philox_uniform\(\): 'purpose' must lie in \{0, 1, 2\} \(0 draft proposals, "
            r"1 acceptance tests, 2 resampling\), got -1",
        ),
        (
            lambda d: dict(purpose=3),
            ValueError,
            r"philox_uniform\(\): 'purpose' must lie in \{0, 1, 2\} .*, got 3$",
        ),
        (
            lambda d: dict(purpose=MASK32),
            ValueError,
            r"philox_uniform\(\): 'purpose' must lie in \{0, 1, 2\} .*, got 4294967295",
        ),
        (
            lambda d: dict(count=-1),
            ValueError,
            r"philox_uniform\(\): 'count' must lie in \[0, 2\^32\], got -1",
        ),
        (
            lambda d: dict(count=2**32 + 1),
            ValueError,
            r"philox_uniform\(\): 'count' must lie in \[0, 2\^32\], got 4294967297",
        ),
    ],
    ids=[
        "seed-2d", "seed-0d", "seed-int32", "seed-float", "position-int32", "position-length",
        "position-2d", "purpose-negative", "purpose-3", "purpose-2^32-1", "count-negative",
        "count-too-large",
    ],
)
def test_argument_errors(device, override, error, message):
    with pytest.raises(error, match=message):
        _philox_call(_philox_args(device, **override(device)))


def test_argument_limits_accepted(device):
    # Every purpose an op draws from is legal, and so is the empty draw.
    for purpose in (reference.PURPOSE_DRAFT, reference.PURPOSE_ACCEPT, reference.PURPOSE_RESAMPLE):
        assert _philox_call(_philox_args(device, purpose=purpose)).shape == (3, 4)
    assert _philox_call(_philox_args(device, count=0)).shape == (3, 0)


@cuda_only
def test_device_mismatch():
    args = _philox_args("cuda", position=torch.zeros(3, dtype=torch.int64))
    message = r"philox_uniform\(\): 'position' must be on cuda:\d+ like 'seed', got cpu"
    with pytest.raises(ValueError, match=message):
        _philox_call(args)


@cuda_only
def test_cpu_and_cuda_agree():
    seed, position = _seeds_and_positions(32, "cpu")
    for purpose in (0, 1, 2):
        cpu = dspark_ops.philox_uniform(seed, position, purpose, 777)
        cuda = dspark_ops.philox_uniform(seed.cuda(), position.cuda(), purpose, 777)
        assert torch.equal(cpu, cuda.cpu())
