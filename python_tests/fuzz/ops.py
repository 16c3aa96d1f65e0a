"""Per op: a valid call (every schema argument by name, small shapes, drawn from a seed), the
reference result of a call, how to compare a backend's result with it, and the invariants every
result must hold whatever the input.

A valid call's optional arguments are given or left out by the seed, so mutations reach both.
``OPS`` lists the specs in csrc/schemas.h order; the harness checks it covers dspark_ops.OPS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from dspark_ops import reference as R


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _flag(seed: int, bit: int) -> bool:
    return bool((seed >> bit) & 1)


@dataclass
class OpSpec:
    """How the harness calls, checks and compares one op."""

    name: str
    build: Callable[[int], dict]  # seed -> {schema argument: value}
    reference: Optional[Callable[[dict], tuple]]  # valid call -> expected outputs (or None)
    compare: Callable[[dict, tuple, tuple], Optional[str]]  # -> a mismatch, or None
    invariants: Callable[[dict, tuple], Optional[str]]  # any accepted call -> a violation, or None
    mutated: tuple = ()  # arguments the op writes in place
    # Arguments whose values index or count (int tensors): out-of-range mutations target these.
    values_checked: tuple = field(default_factory=tuple)
    # The emulated CUDA result is compared with the reference only while every floating input
    # stays below this magnitude: the CUDA drafting heads sum in float32 and redo a sum in
    # float64 only where it overflows or reaches 1e30 (docs/semantics.md §3.2); products near
    # float32's maximum that cancel leave the float32 sum, and even float64 sums in other
    # orders, apart from the reference by more than its rounding.
    sim_compare_max: float = float("inf")
    # The emulated CUDA result's comparison where its documented precision is not the CPU's
    # (None: compare).
    sim_compare: Optional[Callable[[dict, tuple, tuple], Optional[str]]] = None


def _close(name, got, want, rtol, atol) -> Optional[str]:
    """NaN and the infinities must sit where the reference has them; finite values within
    atol + rtol * |want| (atol scaled by the row's magnitude)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    for what, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(f(got), f(want)):
            return f"{name}: {what} positions differ from the reference"
    finite = torch.isfinite(want)
    if finite.any():
        scale = want[finite].abs().max().item()
        err = (got[finite] - want[finite]).abs()
        bound = atol * max(1.0, scale) + rtol * want[finite].abs()
        if (err > bound).any():
            i = int((err - bound).argmax())
            return (f"{name}: {got[finite][i].item()!r} != reference {want[finite][i].item()!r} "
                    f"(max error {err.max().item():.3g})")
    return None


def _close_where_finite(name, got, want, rtol, atol) -> Optional[str]:
    """_close with NaN and +-inf as one class: not finite where the reference is not."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape == want.shape and not torch.equal(torch.isfinite(got), torch.isfinite(want)):
        return f"{name}: non-finite positions differ from the reference"
    return _close(name, got.nan_to_num(0.0, 0.0, 0.0), want.nan_to_num(0.0, 0.0, 0.0), rtol, atol)


def _equal(name, got, want) -> Optional[str]:
    """Bitwise equal values (NaN equal to NaN)."""
    got, want = got.cpu(), want.cpu()
    same = got.shape == want.shape
    if same:
        got = got.to(want.dtype)
        same = torch.equal(got, want) or (
            want.is_floating_point() and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)))
    if not same:
        bad = (got != want).nonzero()[:1].tolist() if got.shape == want.shape else "shape"
        return f"{name}: differs from the reference (first at {bad})"
    return None


def _first(*checks) -> Optional[str]:
    return next((c for c in checks if c is not None), None)


def _ids_in(name, ids, low, high) -> Optional[str]:
    ids = ids.cpu()
    if ids.numel() and (ids.min() < low or ids.max() > high):
        return f"{name}: values outside [{low}, {high}]: {ids.tolist()}"
    return None


# ---- verify -------------------------------------------------------------------------------------

def _verify_build(seed):
    g = _gen(seed)
    B, G, V = 3, 4, 37
    a = dict(
        target_logits=torch.randn(B, G + 1, V, generator=g),
        draft_tokens=torch.randint(0, V, (B, G), generator=g),
        num_draft=torch.tensor([0, 2, G], dtype=torch.int32),
        temperature=torch.tensor([0.0, 0.7, 1.3]),
        seed=torch.randint(-(2**62), 2**62, (B,), generator=g),
        position=torch.randint(0, 2**40, (B,), generator=g),
        draft_logits=None, target_start=None, draft_temperature=None, top_k=None, top_p=None,
        min_p=None, allowed_token_mask=None, return_logprobs=_flag(seed, 3),
    )
    if _flag(seed, 0):
        a["draft_logits"] = torch.randn(B, G, V, generator=g)
        a["draft_temperature"] = torch.tensor([0.5, 0.0, 2.0])
    if _flag(seed, 1):
        a.update(top_k=torch.tensor([0, 5, 40], dtype=torch.int32),
                 top_p=torch.tensor([0.9, 1.0, 0.5]), min_p=torch.tensor([0.05, 0.1, 0.0]))
    if _flag(seed, 2):
        a["target_start"] = torch.tensor([(G + 1) * b for b in range(B)], dtype=torch.int32)
        a["allowed_token_mask"] = torch.randint(-(2**31), 2**31, (B * (G + 1), 2), generator=g,
                                                dtype=torch.int32)
    return a


def _verify_reference(a):
    kw = {k: a[k] for k in ("draft_logits", "target_start", "draft_temperature", "top_k", "top_p",
                            "min_p", "allowed_token_mask", "return_logprobs")}
    r = R.verify(a["target_logits"], a["draft_tokens"], a["num_draft"], a["temperature"],
                 a["seed"], a["position"], **kw)
    return tuple(r)


def _verify_compare(a, got, want):
    checks = [_equal(n, got[i], want[i]) for i, n in enumerate(("tokens", "num_accepted", "valid"))]
    if a["return_logprobs"]:
        checks.append(_close("logprobs", got[3], want[3], 1e-4, 1e-5))
    return _first(*checks)


def _verify_invariants(a, out):
    tokens, num_accepted = out[0], out[1]
    V = a["target_logits"].shape[-1]
    G = tokens.shape[1] - 1
    return _first(_ids_in("tokens", tokens, -1, V - 1), _ids_in("num_accepted", num_accepted, 0, G))


# ---- drafting -----------------------------------------------------------------------------------

def _draft_common(seed, head):
    g = _gen(seed)
    B, G, V, r, d = 3, 3, 37, 8, 16
    a = dict(base_logits=torch.randn(B, G, V, generator=g),
             anchor=torch.randint(0, V, (B,), generator=g))
    if head == "rnn":
        a["hidden"] = torch.randn(B, G, d, generator=g)
    a["w1"] = torch.randn(V, r, generator=g) / 2
    a["w2"] = torch.randn(V, r, generator=g) / 2
    if head == "rnn":
        a["joint_weight"] = torch.randn(3 * r, 2 * r + d, generator=g) / (2 * r + d) ** 0.5
        a["joint_bias"] = torch.randn(3 * r, generator=g)
    a.update(temperature=torch.tensor([0.0, 0.7, 1.3]),
             seed=torch.randint(-(2**62), 2**62, (B,), generator=g),
             position=torch.randint(0, 2**40, (B,), generator=g),
             top_k=None, top_p=None, min_p=None, draft_logits_dtype=None)
    if _flag(seed, 0):
        a.update(top_k=torch.tensor([0, 5, 40], dtype=torch.int32),
                 top_p=torch.tensor([0.9, 1.0, 0.5]), min_p=torch.tensor([0.05, 0.1, 0.0]))
    if _flag(seed, 1):
        a["draft_logits_dtype"] = torch.bfloat16
    return a


def _draft_reference(head):
    def run(a):
        kw = dict(top_k=a["top_k"], top_p=a["top_p"], min_p=a["min_p"],
                  draft_logits_dtype=a["draft_logits_dtype"])
        if head == "rnn":
            r = R.rnn_draft(a["base_logits"], a["anchor"], a["hidden"], a["w1"], a["w2"],
                            a["joint_weight"], a["joint_bias"], a["temperature"], a["seed"],
                            a["position"], **kw)
        else:
            r = R.markov_draft(a["base_logits"], a["anchor"], a["w1"], a["w2"], a["temperature"],
                               a["seed"], a["position"], **kw)
        return tuple(r)
    return run


def _draft_compare(a, got, want):
    # float32 draft logits are within a proven bound of the float64 head (bfloat16: exact).
    return _first(_equal("tokens", got[0], want[0]),
                  _close("draft_logits", got[1], want[1], 1e-5, 1e-6))


def _draft_compare_cuda(a, got, want):
    # CUDA rounds its float32 z to bfloat16 without the CPU's midpoint certificate: the stored
    # value carries z's float32 accumulation error (docs/semantics.md §3.2; allowed here as for
    # float32 logits, 1e-6 of the row's largest value) plus one bfloat16 rounding, at most 2^-7
    # of its magnitude. A logit near 0 from cancelling terms may so differ by several of its own
    # bfloat16 ulps.
    if a["draft_logits_dtype"] != torch.bfloat16:
        return _draft_compare(a, got, want)
    return _first(_equal("tokens", got[0], want[0]),
                  _close("draft_logits", got[1], want[1], 2.0**-7, 1e-6))


def _draft_invariants(a, out):
    V = a["base_logits"].shape[-1]
    return _ids_in("tokens", out[0], 0, V - 1)


# ---- draft_confidence ---------------------------------------------------------------------------

def _confidence_build(seed):
    g = _gen(seed)
    B, G, V, r, d = 3, 4, 37, 8, 16
    return dict(hidden=torch.randn(B, G, d, generator=g),
                prev_tokens=torch.randint(0, V, (B, G), generator=g),
                w1=torch.randn(V, r, generator=g),
                weight=torch.randn(d + r, generator=g) / 4,
                bias=torch.randn(1, generator=g) if _flag(seed, 0) else None,
                calib_temperature=torch.rand(G, generator=g) + 0.5 if _flag(seed, 1) else None)


def _confidence_reference(a):
    return (R.draft_confidence(a["hidden"], a["prev_tokens"], a["w1"], a["weight"], a["bias"],
                               a["calib_temperature"]),)


def _confidence_invariants(a, out):
    c = out[0].cpu()
    finite = all(t is None or not t.is_floating_point() or bool(torch.isfinite(t).all())
                 for t in (a["hidden"], a["w1"], a["weight"], a["bias"], a["calib_temperature"]))
    if finite and c.numel() and not bool(((c >= 0) & (c <= 1)).all()):
        return f"confidence outside [0, 1] for finite inputs: {c.tolist()}"
    return None


# ---- scheduling ---------------------------------------------------------------------------------

def _schedule_build(seed, step_rate=True, budget=False, max_verify=True):
    """The scheduling ops' arguments, in schema order: confidence, then step_rate or budget,
    then max_verify (left out by plan_verify_budget)."""
    g = _gen(seed)
    B, G = 3, 4
    a = dict(confidence=torch.rand(B, G, generator=g))
    if step_rate:
        a["step_rate"] = torch.rand(B * (G + 1) + 1, generator=g) + 0.5
    if budget:
        a["budget"] = torch.tensor([B + 5], dtype=torch.int32)
    if max_verify:
        a["max_verify"] = (torch.randint(0, G + 1, (B,), generator=g, dtype=torch.int32)
                           if _flag(seed, 0) else None)
    return a


def _nv_invariants(a, out):
    return _ids_in("num_verify", out[0], 0, a["confidence"].shape[1])


def _pack_build(seed):
    g = _gen(seed)
    B, G, V = 3, 4, 50
    return dict(anchor=torch.randint(0, V, (B,), generator=g),
                draft_tokens=torch.randint(0, V, (B, G), generator=g),
                num_verify=torch.tensor([0, 2, G], dtype=torch.int32),
                position=torch.randint(0, 2**40, (B,), generator=g))


def _pack_invariants(a, out):
    cu = out[2].cpu()
    if cu.numel() and (cu[0] != 0 or (cu[1:] < cu[:-1]).any()):
        return f"cu_seqlens not a non-decreasing sequence from 0: {cu.tolist()}"
    return None


# ---- attention ----------------------------------------------------------------------------------

def _attention_build(seed):
    g = _gen(seed)
    B, G, H, Hkv, D, L = 2, 3, 4, 2, 64, 5
    slots = 3 if _flag(seed, 0) else B
    return dict(q=torch.randn(B, G, H, D, generator=g).bfloat16(),
                k_block=torch.randn(B, G, Hkv, D, generator=g).bfloat16(),
                v_block=torch.randn(B, G, Hkv, D, generator=g).bfloat16(),
                k_cache=torch.randn(slots, L, Hkv, D, generator=g).bfloat16(),
                v_cache=torch.randn(slots, L, Hkv, D, generator=g).bfloat16(),
                cache_seqlens=torch.tensor([2, L], dtype=torch.int32),
                cache_slot=torch.tensor([2, 0], dtype=torch.int32) if _flag(seed, 0) else None,
                softmax_scale=0.1 if _flag(seed, 1) else None,
                window=3 if _flag(seed, 2) else None,
                return_lse=_flag(seed, 3))


def _attention_reference(a):
    out, lse = R.block_draft_attention(
        a["q"], a["k_block"], a["v_block"], a["k_cache"], a["v_cache"], a["cache_seqlens"],
        cache_slot=a["cache_slot"], softmax_scale=a["softmax_scale"], window=a["window"],
        return_lse=True)
    return out, lse


def _attention_compare(a, got, want):
    checks = [_close("out", got[0], want[0], 2e-2, 2e-2)]
    if a["return_lse"]:
        checks.append(_close("lse", got[1], want[1], 1e-3, 1e-3))
    return _first(*checks)


def _append_build(seed):
    g = _gen(seed)
    B, n, Hkv, D, L = 3, 4, 2, 64, 9
    slots = 5 if _flag(seed, 0) else B
    return dict(k_cache=torch.randn(slots, L, Hkv, D, generator=g).bfloat16(),
                v_cache=torch.randn(slots, L, Hkv, D, generator=g).bfloat16(),
                k_new=torch.randn(B, n, Hkv, D, generator=g).bfloat16(),
                v_new=torch.randn(B, n, Hkv, D, generator=g).bfloat16(),
                num_new=torch.tensor([4, 0, 2], dtype=torch.int32),
                cache_seqlens=torch.tensor([0, 7, L] if _flag(seed, 1) else [0, 2, 5],
                                           dtype=torch.int32),
                cache_slot=torch.tensor([4, 0, 2], dtype=torch.int32) if _flag(seed, 0) else None)


def _append_reference(a):
    k, v, s = a["k_cache"].clone(), a["v_cache"].clone(), a["cache_seqlens"].clone()
    R.append_context_kv(k, v, a["k_new"], a["v_new"], a["num_new"], s, cache_slot=a["cache_slot"])
    return k, v, s


def _append_compare(a, got, want):
    # The op returns nothing: its results are the mutated arguments.
    return _first(_equal("k_cache", got[0], want[0]), _equal("v_cache", got[1], want[1]),
                  _equal("cache_seqlens", got[2], want[2]))


def _append_invariants(a, out):
    return _ids_in("cache_seqlens", out[2], 0, a["k_cache"].shape[1])


# ---- random -------------------------------------------------------------------------------------

def _philox_build(seed):
    g = _gen(seed)
    N = 3
    return dict(seed=torch.randint(-(2**62), 2**62, (N,), generator=g),
                position=torch.randint(0, 2**40, (N,), generator=g),
                purpose=seed % 3, count=5)


def _philox_invariants(a, out):
    u = out[0].cpu()
    if u.numel() and not bool(((u > 0) & (u < 1)).all()):
        return "uniforms outside (0, 1)"
    return None


# ---- loss ---------------------------------------------------------------------------------------

def _loss_build(seed):
    g = _gen(seed)
    N, V, d, r = 5, 23, 8, 4
    a = dict(hidden=torch.randn(N, d, generator=g) / d**0.5,
             lm_head_weight=torch.randn(V, d, generator=g),
             labels=torch.randint(0, V, (N,), generator=g),
             weights=torch.rand(N, generator=g) + 0.1,
             term_scale=torch.tensor([0.1, 0.9]),
             target_hidden=torch.randn(N, d, generator=g) / d**0.5 if _flag(seed, 0) else None,
             markov_latent=None, markov_w2=None,
             compute_grad=_flag(seed, 2), lm_head_grad=_flag(seed, 2) and _flag(seed, 3),
             chunk_rows=2 if _flag(seed, 4) else 0,
             logit_softcap=2.0 if _flag(seed, 0) != _flag(seed, 1) else None)
    if _flag(seed, 1):
        a["markov_latent"] = torch.randn(N, r, generator=g) / 4
        a["markov_w2"] = torch.randn(V, r, generator=g)
    return a


def _loss_reference(a):
    """dspark_ops.reference.dspark_loss (the reference of record, float32 as the op), called
    once per row (weight 1, plain sums) for ce and l1, and once over the call's weights for the
    loss and, with compute_grad, the inputs' gradients (autograd), in the op's output order."""
    s = [float(v) for v in a["term_scale"]]
    kw = dict(target_hidden=a["target_hidden"], markov_latent=a["markov_latent"],
              markov_w2=a["markov_w2"], confidence_weight=0.0, denominators=1.0,
              logit_softcap=a.get("logit_softcap"))
    ce, l1 = [], []
    for i in range(a["labels"].numel()):
        row = dict(kw, target_hidden=None if a["target_hidden"] is None else a["target_hidden"][i:i + 1],
                   markov_latent=None if a["markov_latent"] is None else a["markov_latent"][i:i + 1])
        one = R.dspark_loss(hidden=a["hidden"][i:i + 1], lm_head_weight=a["lm_head_weight"],
                            labels=a["labels"][i:i + 1], weights=torch.ones(1), **row)
        ce.append(one.ce)
        if a["target_hidden"] is not None:
            l1.append(one.l1)
    names = ["hidden", "markov_latent", "markov_w2"] + (["lm_head_weight"] if a["lm_head_grad"] else [])
    leaves = {n: a[n].detach().clone().requires_grad_(a["compute_grad"])
              for n in names if a[n] is not None}
    out = R.dspark_loss(hidden=leaves["hidden"],
                        lm_head_weight=leaves.get("lm_head_weight", a["lm_head_weight"]),
                        labels=a["labels"], weights=a["weights"],
                        **dict(kw, markov_latent=leaves.get("markov_latent"),
                               markov_w2=leaves.get("markov_w2")),
                        ce_weight=s[0], l1_weight=s[1] if a["target_hidden"] is not None else 0.0)
    grads = ()
    if a["compute_grad"]:
        out.loss.backward()
        grads = tuple(leaves[n].grad if n in leaves else None for n in names)
    return (out.loss.detach(), torch.stack(ce),
            torch.stack(l1) if l1 else torch.zeros(0)) + grads


def _loss_compare(a, got, want):
    """The values and, with compute_grad, the gradients (absolute error scaled by each tensor's
    largest value) against the reference, non-finite inputs included (docs/semantics.md §3.7):
    NaN where the reference has NaN for NaN inputs; for +-inf inputs the same values not finite
    (NaN or +-inf: the fused pass gives NaN where the reference's logsumexp gives inf), the
    others within tolerance, and no gradient (which of their elements a non-finite row turns
    NaN is not defined). Only inputs whose float32 products come near float32's range are not
    compared: the op's products and the reference's round in other orders, so where one
    overflows the other need not."""
    tensors = [v for v in a.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if any(float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) > 1e6 for t in tensors if t.numel()):
        return None
    names = ("loss", "ce", "l1", "grad_hidden", "grad_markov_latent", "grad_markov_w2",
             "grad_lm_head_weight")
    if any(bool(torch.isinf(t).any()) for t in tensors):
        return _first(*(_close_where_finite(n, got[i], want[i], 1e-4, 1e-5)
                        for i, n in enumerate(names[:3])))
    # Where a draft and a target probability coincide in exact arithmetic, rounding picks the
    # L1 term's subgradient (docs/semantics.md §3.7): values are compared, gradients are not.
    compared = names[:3] if _l1_near_tie(a) else names
    return _first(*(_close(n, got[i], want[i], 1e-4, 1e-5) for i, n in enumerate(compared)
                    if i < len(want) and want[i] is not None))


def _l1_near_tie(a) -> bool:
    """Whether some p_v and q_v of a row are equal up to rounding (relative 1e-6, float64 from
    the inputs): there sign(p_v - q_v), and so the L1 term's gradient, is decided by rounding,
    in the op as in the reference (constant rows, from an LM head of identical rows, tie
    exactly in the reference's softmax and only up to rounding in the op's logsumexp)."""
    if a["target_hidden"] is None:
        return False
    W = a["lm_head_weight"].double()
    z, t = a["hidden"].double() @ W.t(), a["target_hidden"].double() @ W.t()
    cap = a.get("logit_softcap")
    if cap:
        z, t = cap * torch.tanh(z / cap), cap * torch.tanh(t / cap)
    if a["markov_latent"] is not None:
        z = z + a["markov_latent"].double() @ a["markov_w2"].double().t()
    p, q = z.softmax(-1), t.softmax(-1)
    return bool(((p - q).abs() <= 1e-6 * torch.maximum(p, q)).any())


def _no_invariants(a, out):
    return None


def _schedule_ref(fn, *names, **kw_names):
    def run(a):
        kw = {k: a[k] for k in kw_names.get("kw", ())}
        return (fn(*(a[n] for n in names), **kw),)
    return run


OPS = [
    OpSpec("verify", _verify_build, _verify_reference, _verify_compare, _verify_invariants,
           values_checked=("draft_tokens", "num_draft", "target_start", "top_k", "position")),
    OpSpec("markov_draft", lambda s: _draft_common(s, "markov"), _draft_reference("markov"),
           _draft_compare, _draft_invariants, values_checked=("anchor", "top_k", "position"),
           sim_compare_max=1e30, sim_compare=_draft_compare_cuda),
    OpSpec("rnn_draft", lambda s: _draft_common(s, "rnn"), _draft_reference("rnn"),
           _draft_compare, _draft_invariants, values_checked=("anchor", "top_k", "position"),
           sim_compare_max=1e30, sim_compare=_draft_compare_cuda),
    OpSpec("draft_confidence", _confidence_build, _confidence_reference,
           lambda a, g, w: _close("confidence", g[0], w[0], 1e-5, 1e-6), _confidence_invariants,
           values_checked=("prev_tokens",)),
    OpSpec("schedule_verify", lambda s: _schedule_build(s),
           _schedule_ref(R.schedule_verify, "confidence", "step_rate", kw=("max_verify",)),
           lambda a, g, w: _equal("num_verify", g[0], w[0]), _nv_invariants,
           values_checked=("max_verify",)),
    OpSpec("plan_verify_budget", lambda s: _schedule_build(s, max_verify=False),
           _schedule_ref(R.plan_verify_budget, "confidence", "step_rate"),
           lambda a, g, w: _equal("budget", g[0], w[0]), _no_invariants),
    OpSpec("allocate_verify", lambda s: _schedule_build(s, step_rate=False, budget=True),
           _schedule_ref(R.allocate_verify, "confidence", "budget", kw=("max_verify",)),
           lambda a, g, w: _equal("num_verify", g[0], w[0]), _nv_invariants,
           values_checked=("budget", "max_verify")),
    OpSpec("pack_verify_inputs", _pack_build,
           lambda a: tuple(R.pack_verify_inputs(a["anchor"], a["draft_tokens"], a["num_verify"],
                                                a["position"])),
           lambda a, g, w: _first(*(_equal(n, g[i], w[i]) for i, n in
                                    enumerate(("input_ids", "positions", "cu_seqlens")))),
           _pack_invariants, values_checked=("num_verify", "position")),
    OpSpec("block_draft_attention", _attention_build, _attention_reference, _attention_compare,
           _no_invariants, values_checked=("cache_seqlens", "cache_slot")),
    OpSpec("append_context_kv", _append_build, _append_reference, _append_compare,
           _append_invariants, mutated=("k_cache", "v_cache", "cache_seqlens"),
           values_checked=("num_new", "cache_seqlens", "cache_slot")),
    OpSpec("philox_uniform", _philox_build,
           lambda a: (R.philox_uniform(a["seed"], a["position"], a["purpose"], a["count"]),),
           lambda a, g, w: _equal("uniforms", g[0], w[0]), _philox_invariants,
           values_checked=("position",)),
    OpSpec("dspark_loss", _loss_build, _loss_reference, _loss_compare, _no_invariants,
           values_checked=("labels",)),
]

BY_NAME = {spec.name: spec for spec in OPS}

