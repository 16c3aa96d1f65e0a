"""Operator registration: schemas, fake kernels and backends (torch.library.opcheck)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspark_ops
from dspark_ops import _library
from cases.loss import TRAINABLE, WITH_LM_HEAD, make_loss_case, with_grad
from conftest import DEVICES
from source_tree import header_ops, header_schemas, op_name


def _verify_args(device, *, draft_logits=False, target_start=False, draft_temperature=False,
                 dtype=torch.float32, token_dtype=torch.int64, filters=False, mask=False,
                 logprobs=False):
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
        # top_k, top_p, min_p (one request with each filter off), the allowed-token bitmask.
        torch.tensor([0, 5, 40], dtype=torch.int32) if filters else None,
        torch.tensor([0.9, 1.0, 0.5]) if filters else None,
        torch.tensor([0.05, 0.1, 0.0]) if filters else None,
        torch.randint(-(2**31), 2**31, (target.reshape(-1, vocab).shape[0], 2), generator=gen,
                      dtype=torch.int32) if mask else None,
    )
    return (*(None if a is None else a.to(device) for a in args), logprobs)


VERIFY_COMBOS = {
    "one-hot": dict(),
    "draft-logits": dict(draft_logits=True),
    "ragged": dict(target_start=True),
    "all-optional": dict(draft_logits=True, target_start=True, draft_temperature=True),
    "draft-temperature-only": dict(draft_temperature=True),
    "bf16": dict(draft_logits=True, dtype=torch.bfloat16),
    "f16-int32-ids": dict(draft_logits=True, dtype=torch.float16, token_dtype=torch.int32),
    "filters": dict(draft_logits=True, filters=True),
    "mask-ragged": dict(target_start=True, mask=True),
    "logprobs": dict(logprobs=True),
    "filters-mask-logprobs": dict(draft_logits=True, target_start=True, filters=True, mask=True,
                                  logprobs=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", list(VERIFY_COMBOS))
def test_opcheck_verify(device, combo):
    args = _verify_args(device, **VERIFY_COMBOS[combo])
    torch.library.opcheck(torch.ops.dspark_ops.verify.default, args)


def _draft_args(device, *, head="markov", weight_dtype=torch.float32, base_dtype=torch.float32,
                id_dtype=torch.int64, block=4):
    """markov_draft's (or, with head="rnn", rnn_draft's) schema arguments: B=3, V=37, r=8,
    d=16, greedy and sampled requests."""
    gen = torch.Generator().manual_seed(12)
    batch, vocab, rank, hidden_size = 3, 37, 8, 16
    base = torch.randn(batch, block, vocab, generator=gen).to(base_dtype)
    anchor = torch.randint(0, vocab, (batch,), generator=gen).to(id_dtype)
    w1 = (torch.randn(vocab, rank, generator=gen) / 2).to(weight_dtype)
    w2 = (torch.randn(vocab, rank, generator=gen) / 2).to(weight_dtype)
    sampling = (
        torch.tensor([0.0, 0.7, 1.3]),
        torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        torch.randint(0, 2**40, (batch,), generator=gen),
    )
    if head == "markov":
        args = (base, anchor, w1, w2, *sampling)
    else:
        width = 2 * rank + hidden_size
        hidden = torch.randn(batch, block, hidden_size, generator=gen).to(base_dtype)
        joint_weight = (torch.randn(3 * rank, width, generator=gen) / width**0.5).to(weight_dtype)
        joint_bias = torch.randn(3 * rank, generator=gen).to(weight_dtype)
        args = (base, anchor, hidden, w1, w2, joint_weight, joint_bias, *sampling)
    return tuple(a.to(device) for a in args)


DRAFT_COMBOS = {
    "markov-f32": dict(),
    "markov-bf16-int32-ids": dict(weight_dtype=torch.bfloat16, base_dtype=torch.bfloat16,
                                  id_dtype=torch.int32),
    "markov-f16-weights-f32-base": dict(weight_dtype=torch.float16),
    "markov-G0": dict(block=0),
    "rnn-f32": dict(head="rnn"),
    "rnn-bf16-int32-ids": dict(head="rnn", weight_dtype=torch.bfloat16,
                               base_dtype=torch.float16, id_dtype=torch.int32),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", list(DRAFT_COMBOS))
def test_opcheck_draft(device, combo):
    options = DRAFT_COMBOS[combo]
    op = torch.ops.dspark_ops.rnn_draft if options.get("head") == "rnn" else (
        torch.ops.dspark_ops.markov_draft)
    torch.library.opcheck(op.default, _draft_args(device, **options))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_opcheck_draft_bf16_logits(device, head):
    # draft_logits_dtype=torch.bfloat16: the fake registration must give the bfloat16 output.
    op = torch.ops.dspark_ops.rnn_draft if head == "rnn" else torch.ops.dspark_ops.markov_draft
    kwargs = dict(draft_logits_dtype=torch.bfloat16)
    torch.library.opcheck(op.default, _draft_args(device, head=head), kwargs)
    assert op(*_draft_args(device, head=head), **kwargs)[1].dtype == torch.bfloat16


def _confidence_args(device, *, bias=False, calib=False, dtype=torch.float32,
                     id_dtype=torch.int64):
    """draft_confidence's schema arguments: B=3, G=4, V=37, r=8, d=16."""
    gen = torch.Generator().manual_seed(13)
    batch, block, vocab, rank, hidden_size = 3, 4, 37, 8, 16
    args = (
        torch.randn(batch, block, hidden_size, generator=gen).to(dtype),
        torch.randint(0, vocab, (batch, block), generator=gen).to(id_dtype),
        torch.randn(vocab, rank, generator=gen).to(dtype),
        (torch.randn(hidden_size + rank, generator=gen) / 4).to(dtype),
        torch.tensor(0.3).to(dtype) if bias else None,
        0.5 + torch.rand(block, generator=gen) if calib else None,
    )
    return tuple(None if a is None else a.to(device) for a in args)


CONFIDENCE_COMBOS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "calib": dict(calib=True),
    "bias-calib": dict(bias=True, calib=True),
    "bf16-int32-ids": dict(bias=True, calib=True, dtype=torch.bfloat16, id_dtype=torch.int32),
    "f16": dict(calib=True, dtype=torch.float16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", list(CONFIDENCE_COMBOS))
def test_opcheck_draft_confidence(device, combo):
    args = _confidence_args(device, **CONFIDENCE_COMBOS[combo])
    torch.library.opcheck(torch.ops.dspark_ops.draft_confidence.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("purpose,count", [(0, 1), (1, 7), (2, 64)])
def test_opcheck_philox_uniform(device, purpose, count):
    gen = torch.Generator().manual_seed(8)
    seed = torch.randint(-(2**62), 2**62, (5,), generator=gen).to(device)
    position = torch.randint(0, 2**40, (5,), generator=gen).to(device)
    torch.library.opcheck(torch.ops.dspark_ops.philox_uniform.default,
                          (seed, position, purpose, count))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["dspark", "dspark_grad", "lm_head_grad", "dflash"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_opcheck_dspark_loss(device, variant, cap):
    args = make_loss_case(5, 33, 8, rank=0 if variant == "dflash" else 3, device=device,
                          target=variant != "dflash")
    grad = variant != "dspark"
    if grad:
        args = with_grad(args, WITH_LM_HEAD if variant == "lm_head_grad" else TRAINABLE)
    torch.library.opcheck(
        torch.ops.dspark_ops.dspark_loss.default,
        (args["hidden"], args["lm_head_weight"], args["labels"], args["weights"],
         torch.tensor([0.1, 0.9], device=device)),
        dict(target_hidden=args.get("target_hidden"), markov_latent=args.get("markov_latent"),
             markov_w2=args.get("markov_w2"), compute_grad=grad,
             lm_head_grad=variant == "lm_head_grad", chunk_rows=2, logit_softcap=cap))


def _schedule_args(device, batch=5, block=6, seed=9):
    gen = torch.Generator().manual_seed(seed)
    confidence = torch.rand(batch, block, generator=gen)
    confidence[1, 2] = 0.0  # a cut-off mid-row
    n = torch.arange(batch * (block + 1) + 1, dtype=torch.float64).clamp_min(1)
    step_rate = (1.0 / (batch + n)).float()
    max_verify = torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32)
    budget = torch.tensor([batch + batch * block // 2], dtype=torch.int32)
    anchor = torch.randint(0, 1000, (batch,), generator=gen)
    drafts = torch.randint(0, 1000, (batch, block), generator=gen)
    num_verify = torch.randint(0, block + 1, (batch,), generator=gen, dtype=torch.int32)
    position = torch.randint(0, 2**40, (batch,), generator=gen)
    tensors = dict(confidence=confidence, step_rate=step_rate, max_verify=max_verify,
                   budget=budget, anchor=anchor, draft_tokens=drafts, num_verify=num_verify,
                   position=position)
    return {k: v.to(device) for k, v in tensors.items()}


def _schedule_op_args(name, a, *, caps=False, index_dtype=torch.int64):
    caps = a["max_verify"] if caps else None
    if name == "schedule_verify":
        return (a["confidence"], a["step_rate"], caps)
    if name == "plan_verify_budget":
        return (a["confidence"], a["step_rate"])
    if name == "allocate_verify":
        return (a["confidence"], a["budget"], caps)
    return (a["anchor"].to(index_dtype), a["draft_tokens"].to(index_dtype), a["num_verify"],
            a["position"])


SCHEDULE_COMBOS = [
    ("schedule_verify", dict()),
    ("schedule_verify", dict(caps=True)),
    ("plan_verify_budget", dict()),
    ("allocate_verify", dict()),
    ("allocate_verify", dict(caps=True)),
    ("pack_verify_inputs", dict()),
    ("pack_verify_inputs", dict(index_dtype=torch.int32)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,options", SCHEDULE_COMBOS,
                         ids=[f"{n}-{'-'.join(map(str, o.values())) or 'plain'}"
                              for n, o in SCHEDULE_COMBOS])
def test_opcheck_schedule_ops(device, name, options):
    args = _schedule_op_args(name, _schedule_args(device), **options)
    torch.library.opcheck(getattr(torch.ops.dspark_ops, name).default, args)


def _attention_args(device, *, slot=False, window=None, scale=None, return_lse=False,
                    dtype=torch.bfloat16):
    """block_draft_attention's schema arguments: B=3, G=4, Hq=8, Hkv=2 (GQA 4), D=64, L=9."""
    gen = torch.Generator().manual_seed(10)
    batch, block, heads, kv_heads, dim, length = 3, 4, 8, 2, 64, 9
    slots = 5 if slot else batch
    tensors = (
        torch.randn(batch, block, heads, dim, generator=gen).to(dtype),
        torch.randn(batch, block, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(batch, block, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype),
        torch.tensor([0, length, 5], dtype=torch.int32),
        torch.tensor([4, 0, 2], dtype=torch.int32) if slot else None,
    )
    return (*(None if t is None else t.to(device) for t in tensors), scale, window, return_lse)


ATTENTION_COMBOS = {
    "plain": dict(),
    "lse": dict(return_lse=True),
    "slot": dict(slot=True),
    "window": dict(window=3),
    "window-0-lse": dict(window=0, return_lse=True),
    "all-optional": dict(slot=True, window=4, scale=0.3, return_lse=True),
    "f16": dict(slot=True, return_lse=True, dtype=torch.float16),
    "f32": dict(slot=True, window=2, return_lse=True, dtype=torch.float32),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", list(ATTENTION_COMBOS))
def test_opcheck_block_draft_attention(device, combo):
    options = ATTENTION_COMBOS[combo]
    if device == "cuda" and options.get("dtype") == torch.float32:
        pytest.skip("the CUDA kernels take float16/bfloat16 only")
    args = _attention_args(device, **options)
    torch.library.opcheck(torch.ops.dspark_ops.block_draft_attention.default, args)


def _append_args(device, *, slot=False, capped=False, dtype=torch.bfloat16):
    """append_context_kv's schema arguments: B=3, n_max=4, Hkv=2, D=64, L=9; ``capped``: some
    rows land past L and are dropped."""
    gen = torch.Generator().manual_seed(11)
    batch, rows, kv_heads, dim, length = 3, 4, 2, 64, 9
    slots = 5 if slot else batch
    tensors = (
        torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(batch, rows, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(batch, rows, kv_heads, dim, generator=gen).to(dtype),
        torch.tensor([4, 0, 2], dtype=torch.int32),
        torch.tensor([0, 7, length] if capped else [0, 2, 5], dtype=torch.int32),
        torch.tensor([4, 0, 2], dtype=torch.int32) if slot else None,
    )
    return tuple(None if t is None else t.to(device) for t in tensors)


APPEND_COMBOS = {
    "plain": dict(),
    "slot": dict(slot=True),
    "capped": dict(capped=True),
    "slot-capped-f16": dict(slot=True, capped=True, dtype=torch.float16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", list(APPEND_COMBOS))
def test_opcheck_append_context_kv(device, combo):
    # opcheck also checks that the mutated arguments are exactly those the schema marks (a!).
    args = _append_args(device, **APPEND_COMBOS[combo])
    torch.library.opcheck(torch.ops.dspark_ops.append_context_kv.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_fake_shapes_match_real(device):
    # The fake kernels give the real outputs' shapes, dtypes and devices.
    from torch._subclasses.fake_tensor import FakeTensorMode

    for logprobs in (False, True):  # logprobs: [B, 0] unless asked for, then [B, G+1]
        args = _verify_args(device, draft_logits=True, target_start=True, draft_temperature=True,
                            filters=True, mask=True, logprobs=logprobs)
        real = torch.ops.dspark_ops.verify(*args)
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = torch.ops.dspark_ops.verify(*fake_args)
        assert len(real) == len(fake) == 4 and real[3].shape == (3, 5 if logprobs else 0)
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)

    seed, position = args[4], args[5]
    real = torch.ops.dspark_ops.philox_uniform(seed, position, 1, 11)
    with FakeTensorMode() as mode:
        fake = torch.ops.dspark_ops.philox_uniform(mode.from_tensor(seed),
                                                   mode.from_tensor(position), 1, 11)
    assert (real.shape, real.dtype, real.device) == (fake.shape, fake.dtype, fake.device)

    schedule_args = _schedule_args(device)
    for name, options in SCHEDULE_COMBOS:
        op = getattr(torch.ops.dspark_ops, name)
        args = _schedule_op_args(name, schedule_args, **options)
        real = op(*args)
        with FakeTensorMode() as mode:
            fake = op(*[None if a is None else mode.from_tensor(a) for a in args])
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(real) == len(fake), name
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), name

    for combo in ("plain", "lse", "all-optional"):
        args = _attention_args(device, **ATTENTION_COMBOS[combo])
        real = torch.ops.dspark_ops.block_draft_attention(*args)
        with FakeTensorMode() as mode:
            fake = torch.ops.dspark_ops.block_draft_attention(
                *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert len(real) == len(fake) == 2, combo
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), combo

    draft_calls = [(torch.ops.dspark_ops.markov_draft, _draft_args(device, **options))
                   for options in DRAFT_COMBOS.values() if options.get("head") != "rnn"]
    draft_calls += [(torch.ops.dspark_ops.rnn_draft, _draft_args(device, **options))
                    for options in DRAFT_COMBOS.values() if options.get("head") == "rnn"]
    draft_calls += [(torch.ops.dspark_ops.draft_confidence, _confidence_args(device, **options))
                    for options in CONFIDENCE_COMBOS.values()]
    for op, args in draft_calls:
        real = op(*args)
        with FakeTensorMode() as mode:
            fake = op(*[None if a is None else mode.from_tensor(a) for a in args])
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(real) == len(fake), op
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), op

    args = _append_args(device, slot=True)
    assert torch.ops.dspark_ops.append_context_kv(*args) is None
    with FakeTensorMode() as mode:
        fake_args = [None if a is None else mode.from_tensor(a) for a in args]
        assert torch.ops.dspark_ops.append_context_kv(*fake_args) is None


def test_every_op_is_registered():
    # csrc/schemas.h is the list: the loaded library reports it, in its order, and registers
    # those ops and no others.
    assert dspark_ops.OPS == _library.OPS == tuple(header_ops())
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("dspark_ops::")}
    assert registered == set(_library.OPS)
    for name in _library.OPS:
        packet = getattr(torch.ops.dspark_ops, name)
        assert torch.Tag.pt2_compliant_tag in packet.default.tags, name


def test_schemas():
    # Each op's registered schema is the text of csrc/schemas.h, as compiled into the library.
    assert _library.schemas() == tuple(header_schemas())
    for text in header_schemas():
        registered = getattr(torch.ops.dspark_ops, op_name(text)).default._schema
        assert str(registered) == f"dspark_ops::{text}"
    # The caches and cache_seqlens are mutated in place (and nothing else).
    mutated = [a.name for a in torch.ops.dspark_ops.append_context_kv.default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache", "cache_seqlens"]


@pytest.mark.parametrize("name", _library.OPS)
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
    assert dspark_ops.VerifyOutput._fields == ("tokens", "num_accepted", "valid", "logprobs")
    assert dspark_ops.VerifyBatch._fields == ("input_ids", "positions", "cu_seqlens")
    assert dspark_ops.DraftOutput._fields == ("tokens", "draft_logits")
    for name in ("schedule_verify", "plan_verify_budget", "allocate_verify", "pack_verify_inputs",
                 "profile_step_rate", "VerifyBatch", "block_draft_attention", "append_context_kv",
                 "markov_draft", "rnn_draft", "draft_confidence", "DraftOutput",
                 "expected_calibration_error", "fit_sequential_temperatures"):
        assert name in dspark_ops.__all__ and callable(getattr(dspark_ops, name)), name
    assert (dspark_ops.reference.PURPOSE_DRAFT, dspark_ops.reference.PURPOSE_ACCEPT,
            dspark_ops.reference.PURPOSE_RESAMPLE) == (0, 1, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_error_messages_keep_their_numbers(device):
    # An argument error's message formats shapes and strides with the C++ streams: a library
    # holding a second, exported copy of libstdc++ (a compiler that links it statically) cuts
    # the message at its first number here, and crashed the process on a GPU machine.
    k_cache = torch.zeros(1, 6, 2, 64, device=device).expand(3, 6, 2, 64)
    v_cache = torch.zeros(3, 6, 2, 64, device=device)
    rows = torch.zeros(3, 2, 2, 64, device=device)
    counts = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError) as error:
        torch.ops.dspark_ops.append_context_kv(k_cache, v_cache, rows, rows.clone(), counts,
                                               counts.clone(), None)
    assert str(error.value).splitlines()[0].endswith(
        "got shape [3, 6, 2, 64] and strides [0, 128, 64, 1]"), str(error.value)


def _exported_libstdcxx_names(path: str) -> list:
    """The std::locale names a shared object exports: only a copy of libstdc++ linked into it
    defines them (torch's own libstdc++ is a library of its own)."""
    table = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                           check=True).stdout
    names = [line.split()[-1] for line in table.splitlines() if line.strip()]
    return [name for name in names if name.startswith(("_ZNSt6locale", "_ZNKSt6locale"))]


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None,
                    reason="GNU nm on Linux")
def test_library_exports_no_copy_of_libstdcxx():
    # setup.py (and CMakeLists.txt) keep a statically linked libstdc++ private
    # (--exclude-libs): where it is exported, calls split between it and the copy torch loads.
    dspark_ops.OPS  # loads the library
    path, _ = _library._loaded_library()
    assert _exported_libstdcxx_names(path) == [], path


def test_import_leaves_the_reference_alone():
    # The output types have their own module: the ops never import the reference implementations.
    code = ("import sys, dspark_ops; "
            "assert 'dspark_ops.reference' not in sys.modules, 'imported by dspark_ops'; "
            "assert dspark_ops.reference.VerifyOutput is dspark_ops.VerifyOutput; "
            "assert dspark_ops.sampling.filter_logits is dspark_ops.reference.filter_logits")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    with pytest.raises(AttributeError, match="no attribute 'not_an_op'"):
        dspark_ops.not_an_op


def test_cpu_only_build_on_a_gpu_machine_warns():
    info = {"flavour": "cpu", "reason": "DSPARK_OPS_CUDA=0"}
    with pytest.warns(RuntimeWarning, match=r"without CUDA kernels \(DSPARK_OPS_CUDA=0\)"):
        _library._warn_if_cpu_only(info, cuda_available=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _library._warn_if_cpu_only(info, cuda_available=False)
        _library._warn_if_cpu_only({"flavour": "cuda"}, cuda_available=True)


# ---- Arguments every entry point refuses the same way: None and mixed devices -----------------

def _first_call(name):
    """A valid call of op `name` (every schema argument, in order) from the fuzz harness's specs,
    and the names of its Tensor arguments that are given."""
    from fuzz.ops import BY_NAME

    call = BY_NAME[name].build(3)  # seed 3: optional tensors given
    return call, [k for k, v in call.items() if isinstance(v, torch.Tensor)]


def test_fuzz_specs_cover_every_op():
    from fuzz.ops import OPS

    assert [spec.name for spec in OPS] == list(dspark_ops.OPS)


@pytest.mark.parametrize("name", _library.OPS)
def test_one_meta_tensor_among_cpu_tensors_is_refused(name):
    # One tensor on meta, the rest on CPU, dispatches to the fake kernel: it must refuse the call
    # as the CPU entry point would, not hand back uninitialised CPU outputs (or, for an in-place
    # op, silently write nothing).
    call, tensors = _first_call(name)
    first = tensors[0]
    for arg in tensors[1:]:
        mixed = dict(call, **{arg: call[arg].to("meta")})
        before = {k: call[k].clone() for k in tensors}
        with pytest.raises(ValueError, match=rf"{name}\(\): '{arg}' must be on cpu like "
                                             rf"'{first}', got meta"):
            getattr(torch.ops.dspark_ops, name)(*mixed.values())
        assert all(torch.equal(before[k], call[k]) for k in tensors)
    # All on meta: the fake kernel gives the shapes.
    on_meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    out = getattr(torch.ops.dspark_ops, name)(*on_meta.values())
    for t in out if isinstance(out, (tuple, list)) else ([] if out is None else [out]):
        assert t.device.type == "meta"


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", _library.OPS)
def test_none_for_a_required_tensor_names_the_op_and_argument(name, device):
    # On CPU the entry point's checks refuse it, on meta the fake kernel's.
    call, tensors = _first_call(name)
    schema = getattr(torch.ops.dspark_ops, name).default._schema
    required = [a.name for a in schema.arguments if isinstance(a.type, torch.TensorType)]
    assert required
    for arg in required:
        broken = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                  for k, v in call.items()}
        broken[arg] = None
        with pytest.raises(TypeError, match=rf"{name}\(\): '{arg}' must be a tensor, got None"):
            getattr(torch.ops.dspark_ops, name)(*broken.values())
