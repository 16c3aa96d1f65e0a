"""Operator registration: schemas, fake kernels and backends (torch.library.opcheck)."""

from __future__ import annotations

import pytest
import torch

import dspark_ops
from dspark_ops import _library
from conftest import DEVICES


def _verify_args(device, *, draft_logits=False, target_start=False, draft_temperature=False,
                 dtype=torch.float32, token_dtype=torch.int64):
    gen = torch.Generator().manual_seed(7)
    batch, block, vocab = 3, 4, 37
    n = torch.tensor([0, 2, 4], dtype=torch.int32)
    if target_start:
        start = torch.tensor([6, 0, 1], dtype=torch.int32)
        target = torch.randn(6 + 1 + 2, vocab, generator=gen)
    else:
        start = None
        target = torch.randn(batch, block + 1, vocab, generator=gen)
    args = (
        target.to(dtype),
        torch.randint(0, vocab, (batch, block), generator=gen).to(token_dtype),
        n,
        torch.tensor([0.0, 0.7, 1.3]),
        torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        torch.randint(0, 2**40, (batch,), generator=gen),
        torch.randn(batch, block, vocab, generator=gen).to(dtype) if draft_logits else None,
        start,
        torch.tensor([0.5, 0.0, 2.0]) if draft_temperature else None,
    )
    return tuple(None if a is None else a.to(device) for a in args)


VERIFY_COMBOS = {
    "one-hot": dict(),
    "draft-logits": dict(draft_logits=True),
    "ragged": dict(target_start=True),
    "all-optional": dict(draft_logits=True, target_start=True, draft_temperature=True),
    "draft-temperature-only": dict(draft_temperature=True),
    "bf16": dict(draft_logits=True, dtype=torch.bfloat16),
    "f16-int32-ids": dict(draft_logits=True, dtype=torch.float16, token_dtype=torch.int32),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", list(VERIFY_COMBOS))
def test_opcheck_verify(device, combo):
    args = _verify_args(device, **VERIFY_COMBOS[combo])
    torch.library.opcheck(torch.ops.dspark_ops.verify.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("purpose,count", [(0, 1), (1, 7), (2, 64)])
def test_opcheck_philox_uniform(device, purpose, count):
    gen = torch.Generator().manual_seed(8)
    seed = torch.randint(-(2**62), 2**62, (5,), generator=gen).to(device)
    position = torch.randint(0, 2**40, (5,), generator=gen).to(device)
    torch.library.opcheck(torch.ops.dspark_ops.philox_uniform.default,
                          (seed, position, purpose, count))


@pytest.mark.parametrize("device", DEVICES)
def test_fake_shapes_match_real(device):
    # The fake kernels give the real outputs' shapes, dtypes and devices.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _verify_args(device, draft_logits=True, target_start=True, draft_temperature=True)
    real = torch.ops.dspark_ops.verify(*args)
    with FakeTensorMode() as mode:
        fake_args = [None if a is None else mode.from_tensor(a) for a in args]
        fake = torch.ops.dspark_ops.verify(*fake_args)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)

    seed, position = args[4], args[5]
    real = torch.ops.dspark_ops.philox_uniform(seed, position, 1, 11)
    with FakeTensorMode() as mode:
        fake = torch.ops.dspark_ops.philox_uniform(mode.from_tensor(seed),
                                                   mode.from_tensor(position), 1, 11)
    assert (real.shape, real.dtype, real.device) == (fake.shape, fake.dtype, fake.device)


def test_every_op_is_registered():
    assert set(_library.OPS) == {"verify", "philox_uniform"}
    for name in _library.OPS:
        packet = getattr(torch.ops.dspark_ops, name)
        assert torch.Tag.pt2_compliant_tag in packet.default.tags, name


def test_schemas():
    verify = str(torch.ops.dspark_ops.verify.default._schema)
    assert verify == (
        "dspark_ops::verify(Tensor target_logits, Tensor draft_tokens, Tensor num_draft, "
        "Tensor temperature, Tensor seed, Tensor position, Tensor? draft_logits=None, "
        "Tensor? target_start=None, Tensor? draft_temperature=None) -> "
        "(Tensor tokens, Tensor num_accepted, Tensor valid)"
    )
    philox = str(torch.ops.dspark_ops.philox_uniform.default._schema)
    assert philox == (
        "dspark_ops::philox_uniform(Tensor seed, Tensor position, int purpose, int count) -> Tensor"
    )


@pytest.mark.parametrize("name", ["verify", "philox_uniform"])
def test_op_backends(name):
    flavour = _library.build_info()["flavour"]
    assert flavour in ("cpu", "cuda")
    expected = ["CPU", "CUDA", "Fake"] if flavour == "cuda" else ["CPU", "Fake"]
    assert _library.op_backends(name) == expected


def test_cuda_build_where_a_gpu_is_present():
    # A GPU machine running a CPU-only build would silently test nothing on CUDA.
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available (torch.cuda.is_available() is False)")
    assert _library.build_info()["flavour"] == "cuda", _library.build_info()


def test_public_api():
    assert dspark_ops.VerifyOutput._fields == ("tokens", "num_accepted", "valid")
    assert (dspark_ops.reference.PURPOSE_DRAFT, dspark_ops.reference.PURPOSE_ACCEPT,
            dspark_ops.reference.PURPOSE_RESAMPLE) == (0, 1, 2)
