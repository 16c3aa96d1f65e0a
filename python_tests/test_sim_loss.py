"""dspark_loss's CUDA glue and kernel, run in the SIMT emulator: the same values and gradients as
the CPU kernel over every path of the kernel (with and without target logits, the label term,
the LM head's target-side gradient, chunk boundaries, vocabulary tails shorter than a block's
stride, float32 and 16-bit logits, the logit soft cap's instantiation with and without the Markov
bias), out-of-range labels never used as an index, and a planted reduction fault caught."""

from __future__ import annotations

import pytest
import torch

import emulator
from bench.static.plans import parse_records
from cases.loss import make_loss_case
from cases.tails import check_loss_tail, loss_tail_case, loss_vocabs

pytestmark = pytest.mark.sim


def call(op, args, *, grad=True, lm_head_grad=False, chunk_rows=0, term_scale=(0.1, 0.9),
         logit_softcap=None):
    return op(args["hidden"], args["lm_head_weight"], args["labels"], args["weights"],
              torch.tensor(term_scale), target_hidden=args.get("target_hidden"),
              markov_latent=args.get("markov_latent"), markov_w2=args.get("markov_w2"),
              compute_grad=grad, lm_head_grad=lm_head_grad, chunk_rows=chunk_rows,
              logit_softcap=logit_softcap)


NAMES = ("loss", "ce", "l1", "grad_hidden", "grad_markov_latent", "grad_markov_w2",
         "grad_lm_head_weight")


def assert_matches_cpu(sim, args, tol, **options):
    emulated = call(sim.dspark_loss, args, **options)
    cpu = call(torch.ops.dspark_ops.dspark_loss, args, **options)
    for name, ours, expected in zip(NAMES, emulated, cpu):
        assert ours.shape == expected.shape and ours.dtype == expected.dtype, name
        torch.testing.assert_close(ours.float(), expected.float(), atol=tol, rtol=tol,
                                   msg=lambda m: f"{name}: {m}")
    return emulated


# 1000 and 4100 (float32) rows are 16-byte multiples: the vector path; the others the scalar one.
@pytest.mark.parametrize("vocab", [1, 17, 255, 1000, 4100, 8193])
@pytest.mark.parametrize("variant", ["dspark", "dflash", "lm_head"])
def test_matches_cpu(sim, vocab, variant):
    args = make_loss_case(5, vocab, 9, rank=0 if variant == "dflash" else 4, seed=vocab,
                          target=variant != "dflash", zero_weights=1)
    sim.clear_launch_log()
    assert_matches_cpu(sim, args, 2e-5, chunk_rows=2, lm_head_grad=variant == "lm_head")
    launches = {k.replace("dspark_ops::kernels::", ""): n for k, n in emulator.launches().items()}
    assert launches == {"dspark_loss_kernel<float, false>": 3}  # 5 rows in chunks of 2


# Logits of spread ~4 under a cap of 3 (tanh bends most of them) and a Markov bias large enough
# that capping before or after it differs.
def capped_case(rows, vocab, width, rank, **kw):
    args = make_loss_case(rows, vocab, width, rank=rank, logit_scale=4.0, **kw)
    if rank:
        args["markov_latent"] = args["markov_latent"] * 4
    return args


@pytest.mark.parametrize("vocab", [17, 1000, 4100])
@pytest.mark.parametrize("variant", ["dspark", "no_markov", "dflash", "lm_head"])
def test_softcap_matches_cpu(sim, vocab, variant):
    """The capped instantiation: the bias row read beside z (or not, without a Markov head),
    d loss / d z over the bias, the slopes' products over z and t."""
    rank = 0 if variant in ("dflash", "no_markov") else 4
    args = capped_case(5, vocab, 9, rank, seed=vocab + 1, target=variant != "dflash",
                       zero_weights=1)
    sim.clear_launch_log()
    assert_matches_cpu(sim, args, 2e-5, chunk_rows=2, lm_head_grad=variant == "lm_head",
                       logit_softcap=3.0)
    launches = {k.replace("dspark_ops::kernels::", ""): n for k, n in emulator.launches().items()}
    assert launches == {"dspark_loss_kernel<float, true>": 3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [700, 704])
def test_softcap_16_bit_logits(sim, dtype, vocab):
    args = capped_case(3, vocab, 16, 4, dtype=dtype, seed=2)
    assert_matches_cpu(sim, args, 2e-2, lm_head_grad=True, logit_softcap=3.0)


def test_softcap_forward_only(sim):
    args = capped_case(4, 300, 8, 3, seed=6)
    out = assert_matches_cpu(sim, args, 2e-5, grad=False, logit_softcap=3.0)
    assert all(t.numel() == 0 for t in out[3:])


def test_softcap_subnormal_cap(sim):
    """1 / s past float32's range is clamped: zero products stay 0, the others saturate."""
    args = capped_case(3, 300, 8, 3, seed=7)
    args["hidden"][0] = 0
    out = assert_matches_cpu(sim, args, 2e-5, lm_head_grad=True, logit_softcap=1e-40)
    assert all(torch.isfinite(t).all() for t in out)


def test_softcap_is_refused_on_the_cuda_path(sim):
    args = make_loss_case(2, 10, 4, rank=2, confidence=False)
    for cap in (0.0, float("nan"), 1e39):
        with pytest.raises(ValueError, match=r"dspark_loss\(\): 'logit_softcap' must be finite"):
            call(sim.dspark_loss, args, logit_softcap=cap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [700, 704])  # 704: 16-byte rows, eight values per load
def test_16_bit_logits(sim, dtype, vocab):
    args = make_loss_case(3, vocab, 16, rank=4, dtype=dtype, seed=1)
    assert_matches_cpu(sim, args, 2e-2, lm_head_grad=True)


def test_forward_only(sim):
    args = make_loss_case(4, 300, 8, rank=3, seed=2)
    out = assert_matches_cpu(sim, args, 2e-5, grad=False)
    assert all(t.numel() == 0 for t in out[3:])


def test_large_vocabulary(sim):
    """SmolLM2's vocabulary: 192 elements per thread."""
    args = make_loss_case(2, 49_152, 8, rank=2, seed=3, logit_scale=3.0)
    assert_matches_cpu(sim, args, 2e-5)


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["uncapped", "capped"])
def test_default_chunks_spread_the_rows_evenly(sim, softcap):
    """chunk_rows=0 at DeepSpec's shape: the fewest chunks whose bf16 scratch (z and t, and the
    bias apart with a cap) fits 256 MiB, the rows spread evenly over them, so that no short last
    chunk reads all of the LM head for a few rows. Planned only, hidden size and rank 0."""
    rows, vocab = 3584, 151_936
    bf16 = dict(dtype=torch.bfloat16)
    args = dict(hidden=torch.zeros(rows, 0, **bf16), lm_head_weight=torch.zeros(vocab, 0, **bf16),
                labels=torch.zeros(rows, dtype=torch.int64), weights=torch.ones(rows),
                target_hidden=torch.zeros(rows, 0, **bf16),
                markov_latent=torch.zeros(rows, 0, **bf16),
                markov_w2=torch.zeros(vocab, 0, **bf16))
    sim.clear_launch_log()
    sim.set_plan_only(True)
    try:
        call(sim.dspark_loss, args, logit_softcap=softcap)
    finally:
        sim.set_plan_only(False)
    chunks = [r["grid"][0] for r in parse_records(sim.launch_records())]
    most = (256 << 20) // (vocab * 2 * (3 if softcap else 2))   # 441 rows, 294 with the cap
    assert sum(chunks) == rows and len(chunks) == -(-rows // most)
    assert max(chunks) <= most and max(chunks) - min(chunks) < len(chunks)


def test_out_of_range_labels_are_not_indices(sim):
    """Value checks are off on the CUDA path (as on a GPU without DSPARK_OPS_DEBUG): a label
    outside [0, V) gives that row a NaN ce and reads nothing out of bounds (the bounds flavour
    would report it); the other rows are unaffected."""
    args = make_loss_case(3, 50, 8, seed=4, confidence=False)
    labels = args["labels"].clone()
    labels[1] = 50
    labels[2] = -(2**40)
    out = sim.dspark_loss(args["hidden"], args["lm_head_weight"], labels, args["weights"],
                          torch.tensor([0.1, 0.9]), target_hidden=args["target_hidden"],
                          compute_grad=True)
    cpu = call(torch.ops.dspark_ops.dspark_loss, args)
    assert torch.isnan(out[1][1:]).all()
    torch.testing.assert_close(out[1][0], cpu[1][0])
    torch.testing.assert_close(out[2], cpu[2])  # l1 does not use the label


def test_float64_is_refused_on_the_cuda_path(sim):
    args = make_loss_case(2, 10, 4, dtype=torch.float64, confidence=False)
    with pytest.raises(TypeError, match=r"dspark_loss\(\): float64 'hidden' runs on CPU only"):
        call(sim.dspark_loss, args)


def test_planted_shuffle_fault_is_caught(sim):
    """A reduction reading the wrong lane changes the logsumexps: the comparison fails."""
    args = make_loss_case(2, 300, 8, seed=5, confidence=False)
    with emulator.planted("shuffle_off_by_one"):
        with pytest.raises(AssertionError):
            assert_matches_cpu(sim, args, 2e-5)


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mass_at_boundary_ids(sim, dtype, spread):
    """The draft's and target's mass on V - 1 and each stride's first and last id, the label
    there, V one past a block's stride (the scalar path) or one vector past it (the 16-byte
    path): ce, l1, the loss and the hidden gradient are the reference's."""
    for vocab in loss_vocabs(torch.tensor([], dtype=dtype).element_size()):
        args, _ = loss_tail_case(vocab, dtype, spread=spread)
        # float32: z - lse rounds at the scale of the logits (20), ~1e-6 of p.
        check_loss_tail(sim.dspark_loss, args, 2e-4 if dtype == torch.float32 else 2e-2)


# (vocab, id) over kLossThreads = 256 threads: the only element of a thread's share (scalar path:
# V = 23; V = 301, where threads 45.. hold one), the first or the last of two (V = 301: thread 5
# holds 5 and 261), the first of a 16-byte vector (V = 300).
@pytest.mark.parametrize("vocab,nan_id", [(23, 5), (301, 100), (301, 5), (301, 261), (300, 8)])
def test_one_nan_logit_makes_the_row_nan(sim, vocab, nan_id):
    """A NaN in one row of the LM head makes that logit NaN in every row: ce (and l1) NaN there,
    as the reference and the CPU kernel give, wherever it falls in a thread's share of the row.
    A thread whose only elements are NaN has no maximum (-inf) but a NaN sum: its partial must
    not be merged away as an empty one."""
    args = make_loss_case(3, vocab, 8, seed=6, confidence=False)
    weight = args["lm_head_weight"].clone()
    weight[nan_id, 2] = float("nan")
    args["lm_head_weight"] = weight
    got = sim.dspark_loss(hidden=args["hidden"], lm_head_weight=weight, labels=args["labels"],
                          weights=args["weights"], term_scale=torch.tensor([0.1, 0.9]),
                          target_hidden=args["target_hidden"])
    cpu = call(torch.ops.dspark_ops.dspark_loss, args, grad=False)
    assert cpu[1].isnan().all() and cpu[2].isnan().all()
    assert got[1].isnan().all() and got[2].isnan().all() and got[0].isnan()
