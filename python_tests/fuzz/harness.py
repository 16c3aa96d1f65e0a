"""Fuzzing every op: valid calls and one-aspect mutations of each argument, each call run in a
worker subprocess and classified, so that a crash or a hang is a finding rather than a dead run.

Mutations (one argument at a time): ``None``; another dtype; one more or one fewer dimension;
zero size; a shape off by one; a non-contiguous or stride-0 (expanded) layout with the same
values; NaN, +-inf, huge and denormal floats; out-of-range ids, lengths and positions (-1, the
dtype's maximum and minimum); a tensor on ``meta`` among CPU tensors; an in-place output aliased
with another argument; and for plain arguments extreme ints and floats, the other bool, another
dtype. Backends: ``cpu`` (torch.ops.dspark_ops on CPU tensors) and ``sim`` (the CUDA entry points
and kernels in the SIMT emulator, whose value checks are off as on CUDA).

Each call is classified:

- ``result``: the op returned; where the CPU op accepts the call (a valid call) the result must
  match the reference within the op's tolerance, and every result must keep the invariants
  (ids in range, counts in range, confidences in [0, 1] for finite input, ...);
- ``error``: an exception naming the op and one of its arguments;
- findings: ``crash`` (the worker died), ``hang`` (no answer within the timeout), ``unclear-error``
  (an exception that names neither), ``mismatch`` (a valid call's result differs from the
  reference), ``invariant`` (a result breaks an invariant), ``input-modified`` (an argument the op
  does not write changed), ``sanitizer`` (an AddressSanitizer / UBSan report on the worker's
  stderr), ``emulator`` (a race or bounds report of the emulator).

Run ``python python_tests/fuzz/harness.py --help``; ``make fuzz`` runs a long campaign,
python_tests/test_fuzz.py a short fixed-seed one in the test suite.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

FINDINGS = ("crash", "hang", "unclear-error", "mismatch", "invariant", "input-modified",
            "sanitizer", "emulator")
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer",
                     "UndefinedBehaviorSanitizer")

TENSOR_KINDS = ("none", "dtype", "rank_up", "rank_down", "empty", "shape", "noncontig", "expand0",
                "nan", "posinf", "neginf", "huge", "denormal", "int_neg", "int_max", "int_min",
                "meta", "alias")
INT_KINDS = ("neg", "zero", "int32_max", "int64_max", "int64_min", "none")
FLOAT_KINDS = ("nan", "posinf", "neg", "zero", "tiny", "none")


# ---- mutations (run inside the worker; they need torch) -----------------------------------------

def mutate(spec, a: dict, arg: str, kind: str, rng: random.Random) -> Optional[dict]:
    """The call `a` with `arg` mutated by `kind`, or None where the mutation does not apply."""
    import torch

    a = dict(a)
    t = a[arg]
    if isinstance(t, torch.Tensor):
        if kind == "none":
            a[arg] = None
        elif kind == "dtype":
            choices = [d for d in (torch.float64, torch.float16, torch.bfloat16, torch.float32,
                                   torch.int32, torch.int64, torch.bool, torch.uint8)
                       if d != t.dtype]
            a[arg] = t.to(rng.choice(choices))
        elif kind == "rank_up":
            a[arg] = t.unsqueeze(0)
        elif kind == "rank_down":
            if t.dim() == 0:
                return None
            a[arg] = t[0]
        elif kind == "empty":
            if t.dim() == 0:
                return None
            a[arg] = t.narrow(rng.randrange(t.dim()), 0, 0)
        elif kind == "shape":
            if t.dim() == 0:
                return None
            d = rng.randrange(t.dim())
            a[arg] = (t.narrow(d, 0, t.shape[d] - 1) if t.shape[d] > 1
                      else torch.cat([t, t], d))
        elif kind == "noncontig":
            if t.dim() == 0 or t.numel() < 2:
                return None
            wide = torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)
            a[arg] = wide[..., ::2]  # same values, stride 2 along the last dimension
            assert torch.equal(a[arg], t) or t.is_floating_point()
        elif kind == "expand0":
            if t.dim() == 0 or t.shape[0] < 2:
                return None
            a[arg] = t[:1].expand_as(t)
        elif kind in ("nan", "posinf", "neginf", "huge", "denormal"):
            if not t.is_floating_point() or t.numel() == 0:
                return None
            value = {"nan": float("nan"), "posinf": float("inf"), "neginf": float("-inf"),
                     "huge": 3.0e38, "denormal": 1e-40}[kind]
            t = t.clone()
            if kind == "huge":
                t.mul_(3.0e38 / max(float(t.abs().max()), 1e-30)).clamp_(-3.0e38, 3.0e38)
            elif rng.random() < 0.5:
                t.fill_(value)
            else:
                t.view(-1)[rng.randrange(t.numel())] = value
            a[arg] = t
        elif kind in ("int_neg", "int_max", "int_min"):
            if t.is_floating_point() or t.dtype == torch.bool or t.numel() == 0:
                return None
            info = torch.iinfo(t.dtype)
            value = {"int_neg": -1, "int_max": info.max, "int_min": info.min}[kind]
            t = t.clone()
            t.view(-1)[rng.randrange(t.numel())] = value
            a[arg] = t
        elif kind == "meta":
            a[arg] = t.to("meta")
        elif kind == "alias":
            # An in-place output sharing memory with another argument of its shape.
            others = [k for k, v in a.items() if k != arg and isinstance(v, torch.Tensor)
                      and v.shape == t.shape and v.dtype == t.dtype]
            if arg not in spec.mutated or not others:
                return None
            a[arg] = a[rng.choice(others)]
        else:
            raise ValueError(kind)
        return a
    if isinstance(t, bool):
        if kind != "flip":
            return None
        a[arg] = not t
        return a
    if isinstance(t, int):
        if kind not in INT_KINDS:
            return None
        a[arg] = {"neg": -1, "zero": 0, "int32_max": 2**31 - 1, "int64_max": 2**63 - 1,
                  "int64_min": -(2**63), "none": None}[kind]
        return a
    if isinstance(t, float) or (t is None and arg in ("softmax_scale",)):
        if kind not in FLOAT_KINDS:
            return None
        a[arg] = {"nan": float("nan"), "posinf": float("inf"), "neg": -1.0, "zero": 0.0,
                  "tiny": 1e-30, "none": None}[kind]
        return a
    if isinstance(t, torch.dtype) or (t is None and arg == "draft_logits_dtype"):
        if kind not in ("float16", "int32", "bfloat16"):
            return None
        a[arg] = getattr(torch, kind)
        return a
    return None


def kinds_for(value_kind: str) -> tuple:
    return {"tensor": TENSOR_KINDS, "int": INT_KINDS, "float": FLOAT_KINDS, "bool": ("flip",),
            "dtype": ("float16", "int32", "bfloat16")}[value_kind]


# ---- the worker ---------------------------------------------------------------------------------

def _snapshot(a):
    import torch
    return {k: v.clone() for k, v in a.items()
            if isinstance(v, torch.Tensor) and v.device.type != "meta"}


def _same(x, y) -> bool:
    import torch
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point():
        return bool(torch.equal(torch.nan_to_num(x, 0.5, 1.5, -1.5), torch.nan_to_num(y, 0.5, 1.5,
                                                                                   -1.5))
                    and torch.equal(torch.isnan(x), torch.isnan(y)))
    return bool(torch.equal(x, y))


def _as_tuple(out):
    import torch
    if out is None:
        return ()
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _call(backend, spec, a):
    import torch
    ns = torch.ops.dspark_ops_sim if backend == "sim" else torch.ops.dspark_ops
    out = _as_tuple(getattr(ns, spec.name)(*a.values()))
    if spec.mutated:  # the op's results are its in-place outputs
        out = tuple(a[k] for k in spec.mutated)
    return out


def _names_op_and_argument(spec, a, message: str) -> bool:
    return spec.name in message and any(f"'{k}'" in message for k in a)


def run_one(job: dict) -> dict:
    """One call of the campaign, classified (runs in the worker)."""
    import torch
    from ops import BY_NAME

    spec = BY_NAME[job["op"]]
    rng = random.Random(f"{job['op']}/{job['seed']}/{job['arg']}/{job['kind']}")
    base = spec.build(job["seed"])
    a = base if job["kind"] == "valid" else mutate(spec, base, job["arg"], job["kind"], rng)
    if a is None:
        return {"class": "skipped"}
    backend = job["backend"]
    if backend == "sim":
        if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in a.values()):
            return {"class": "skipped"}  # the emulator library registers no fake kernels
        sim = torch.ops.dspark_ops_sim
        sim.set_device("h200")
        sim.set_plant("")
        sim.set_seed(job["seed"])
    # Whether the CPU op accepts the call: then it is valid and every backend must match the
    # reference; the emulated CUDA path (value checks off) may accept calls the CPU refuses.
    valid = True
    if backend != "cpu":
        try:
            _call("cpu", spec, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                for k, v in a.items()})
        except Exception:  # noqa: BLE001 - any refusal marks the call invalid
            valid = False
    before = _snapshot(a)
    try:
        out = _call(backend, spec, a)
    except Exception as e:  # noqa: BLE001 - classified below
        message = f"{type(e).__name__}: {e}"
        if backend == "sim" and ("dspark_sim" in message or "emulated" in message):
            return {"class": "emulator", "detail": message[:400]}
        if "can't allocate memory" in message or "out of memory" in message:
            return {"class": "out-of-memory"}  # a huge but valid size: torch's own clear error
        ok_type = isinstance(e, (TypeError, ValueError, RuntimeError, IndexError,
                                 NotImplementedError))
        if ok_type and _names_op_and_argument(spec, a, str(e)):
            return {"class": "error"}
        return {"class": "unclear-error", "detail": message[:400]}
    for k, v in before.items():
        if k not in spec.mutated and not _same(v, a[k]):
            return {"class": "input-modified", "detail": f"'{k}' changed"}
    violation = spec.invariants(a, out)
    if violation:
        return {"class": "invariant", "detail": violation[:400]}
    if backend == "sim" and any(
            isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
            and float(v.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) > spec.sim_compare_max
            for v in before.values()):
        return {"class": "result", "note": "outside the CUDA head's float32 range"}
    if valid and spec.reference is not None:
        # The arguments as they were before the call (in-place outputs included).
        ref_args = {k: (before[k].clone() if k in before else v) for k, v in a.items()}
        try:
            want = spec.reference(ref_args)
        except Exception as e:  # noqa: BLE001 - the reference has its own limits
            return {"class": "result", "note": f"reference raised {type(e).__name__}"}
        compare = spec.sim_compare if backend == "sim" and spec.sim_compare else spec.compare
        mismatch = compare(a, out, want)
        if mismatch:
            return {"class": "mismatch", "detail": mismatch[:400]}
    return {"class": "result"}


def _import_paths() -> None:
    """This checkout's dspark_ops and the harness's modules, whatever the working directory."""
    for path in (os.path.join(ROOT, "python_tests"), HERE, ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)


def worker_main() -> None:
    """Reads one JSON job per line on stdin, answers one JSON result per line on stdout."""
    _import_paths()
    import torch

    torch.set_num_threads(1)
    import dspark_ops  # noqa: F401
    if os.environ.get("DSPARK_OPS_FUZZ_SIM"):
        torch.ops.load_library(os.environ["DSPARK_OPS_FUZZ_SIM"])
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    for line in sys.stdin:
        job = json.loads(line)
        try:
            result = run_one(job)
        except Exception:  # noqa: BLE001 - a harness error is reported, not swallowed
            result = {"class": "harness-error", "detail": traceback.format_exc()[-800:]}
        out.write(json.dumps(result) + "\n")
        out.flush()
    # Skip the interpreter's teardown: under preloaded sanitizer runtimes, torch's operator
    # library deregistration at exit can abort after every call has answered (see Makefile).
    sys.stderr.flush()
    os._exit(0)


# ---- the campaign -------------------------------------------------------------------------------

class Worker:
    """A worker subprocess; restarted after a crash or a hang."""

    def __init__(self, env):
        self.env = env
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"], cwd=ROOT, env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)

    def _stderr_since(self, offset):
        self.stderr.flush()
        self.stderr.seek(offset)
        text = self.stderr.read()
        self.stderr.seek(0, 2)
        return text

    def run(self, job, timeout) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.stderr.seek(0, 2)
        offset = self.stderr.tell()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {"class": "hang", "detail": f"no answer in {timeout} s"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return {"class": "crash",
                    "detail": f"exit {code}: {self._stderr_since(offset)[-600:]}"}
        result = json.loads(line)
        report = self._stderr_since(offset)
        if any(m in report for m in SANITIZER_MARKERS):
            return {"class": "sanitizer", "detail": report[-600:]}
        return result

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def value_kind(value) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "dtype" if isinstance(value, torch.dtype) else "none"


def jobs(ops, backends, seeds):
    """Every (op, argument, mutation) of every seed and backend: the valid call first, then one
    mutation of one argument each."""
    _import_paths()
    import torch
    from ops import BY_NAME

    out = []
    for seed in seeds:
        for name in ops:
            spec = BY_NAME[name]
            call = spec.build(seed)
            schema = getattr(torch.ops.dspark_ops, name).default._schema
            types = {arg.name: str(arg.type) for arg in schema.arguments}
            for backend in backends:
                out.append(dict(op=name, seed=seed, arg="", kind="valid", backend=backend))
                for arg, value in call.items():
                    kind = value_kind(value)
                    if kind == "none":  # an optional argument left out: mutate its given form
                        t = types[arg]
                        kind = ("tensor" if t.startswith("Tensor") else "float"
                                if t.startswith("float") else "int" if t.startswith("int")
                                else "dtype" if t.startswith("ScalarType") else "none")
                        if kind in ("tensor", "none"):
                            continue  # a left-out tensor is mutated in the seeds that give it
                    for k in kinds_for(kind):
                        out.append(dict(op=name, seed=seed, arg=arg, kind=k, backend=backend))
    return out


def campaign(args) -> int:
    _import_paths()
    import dspark_ops
    from ops import OPS

    names = [spec.name for spec in OPS]
    missing = set(dspark_ops.OPS) - set(names)
    if missing:
        print(f"fuzz: no spec for {sorted(missing)}", file=sys.stderr)
        return 2
    ops = args.ops.split(",") if args.ops else names
    backends = args.backends.split(",")
    seeds = range(args.seed, args.seed + args.seeds)
    todo = jobs(ops, backends, seeds)
    random.Random(args.seed).shuffle(todo)
    if args.limit:
        todo = todo[:args.limit]
    env = dict(os.environ)
    if "sim" in backends:
        from emulator import library_path
        path = library_path()
        if not os.path.exists(path):
            print(f"fuzz: the emulator library {path} is not built", file=sys.stderr)
            return 2
        env["DSPARK_OPS_FUZZ_SIM"] = path
    worker = Worker(env)
    counts = collections.defaultdict(collections.Counter)
    findings = []
    start = time.monotonic()
    done = 0
    for job in todo:
        if args.budget and time.monotonic() - start > args.budget:
            break
        result = worker.run(job, args.timeout)
        done += 1
        cls = result["class"]
        counts[(job["op"], job["backend"])][cls] += 1
        if cls in FINDINGS or cls == "harness-error":
            findings.append((job, result))
            if args.verbose:
                print(f"FINDING {cls}: {json.dumps(job)}\n    {result.get('detail', '')}",
                      flush=True)
    worker.close()
    elapsed = time.monotonic() - start
    classes = sorted({c for cnt in counts.values() for c in cnt})
    print(f"fuzz: {done} of {len(todo)} calls in {elapsed:.0f} s "
          f"(seeds {seeds.start}..{seeds.stop - 1}, backends {','.join(backends)})")
    print("op".ljust(24) + "backend".ljust(8) + "".join(c.rjust(15) for c in classes))
    for (op, backend), cnt in sorted(counts.items()):
        print(op.ljust(24) + backend.ljust(8) + "".join(str(cnt[c]).rjust(15) for c in classes))
    for job, result in findings:
        print(f"FINDING {result['class']}: {json.dumps(job)}\n    {result.get('detail', '')}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"calls": done, "seconds": elapsed,
                       "counts": {f"{op}/{b}": dict(c) for (op, b), c in counts.items()},
                       "findings": [dict(job=j, result=r) for j, r in findings]}, f, indent=1)
    return 1 if findings else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help="first case seed (and the job order)")
    p.add_argument("--seeds", type=int, default=1, help="how many case seeds")
    p.add_argument("--backends", default="cpu", help="comma-separated: cpu, sim")
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--budget", type=float, default=0, help="stop after this many seconds")
    p.add_argument("--limit", type=int, default=0, help="at most this many calls")
    p.add_argument("--timeout", type=float, default=120, help="seconds before a call is a hang")
    p.add_argument("--report", default="", help="write counts and findings as JSON here")
    p.add_argument("--verbose", action="store_true", help="print findings as they happen")
    args = p.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    return campaign(args)


if __name__ == "__main__":
    sys.exit(main())
