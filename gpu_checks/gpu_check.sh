#!/usr/bin/env bash
# GPU check of dspark_ops, in one call on a machine with an NVIDIA GPU (about 6 minutes on an H200:
# the build 75 s, the benchmarks 91 s, the sanitizers 32 s, the agreement 60 s; step limits
# summing to 15):
#   1. build the extension for this GPU's arch (pip, no build isolation, no dependencies fetched)
#   2. run the CUDA tests
#   3. compute-sanitizer memcheck and racecheck over gpu_checks/cuda_smoke.py (every kernel, the
#      drafting ops included)
#   4. CPU-vs-CUDA agreement on shared seeds: verify tokens, draft tokens and draft logits
#   5. the benchmarks (python -m bench: every bench/bench_*.py family, draft included), then the
#      per-op profile (python -m gpu_checks.profile_ops: eager with and without the L2 flush,
#      CUDA-graph replay cold and warm, per-kernel device times, verify's sweep over G; not yet
#      run on a GPU, estimated at 30-60 s, limit 75 s), the per-kernel times the static model
#      is calibrated from
#   6. with --with-sim (about 2 more minutes; needs g++ and ninja): the SIMT emulator (csrc/sim/)
#      against this GPU on the same inputs
#   7. the static performance MODEL of the built kernels (python -m bench.static; no GPU needed:
#      its launch plans come from the SIMT emulator, built in the background from step 2 on; g++
#      and ninja), printed in the summary next to the measured times of step 5
# and print a summary table last. Logs, the kernels' resource usage and JSON results go to OUTDIR.
#
# Usage: bash gpu_checks/gpu_check.sh OUTDIR [--dry-run] [--with-sim]
#   --dry-run runs everything that needs no GPU (build for sm_90, CPU versions of the checks: the
#   smoke run and the agreement script comparing the CPU with itself), to catch script errors
#   before spending GPU time.
set -uo pipefail

OUT=${1:?usage: bash gpu_checks/gpu_check.sh OUTDIR [--dry-run]}
DRY_RUN=0
WITH_SIM=0
for flag in "${@:2}"; do
  [[ "$flag" == "--dry-run" ]] && DRY_RUN=1
  [[ "$flag" == "--with-sim" ]] && WITH_SIM=1
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/*.csv "$OUT"/*.txt "$OUT"/*.xml  # no stale results
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
: >"$OUT/steps.tsv"

# run_step NAME TIMEOUT_S COMMAND...: logs to OUT/NAME.log, records status and seconds.
run_step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local status=ok
  ((rc == 124)) && status="timeout(${limit}s)"
  ((rc != 0 && rc != 124)) && status="failed(rc=$rc)"
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$OUT/steps.tsv"
  tail -n 3 "$OUT/$name.log"
  return $rc
}

if ((DRY_RUN)); then
  ARCH=9.0
  BUILD_LIMIT=900  # a CI machine has 2 cores; an H200 host builds one arch in about a minute
else
  BUILD_LIMIT=150  # 75 s from scratch on an H200 host (16 cores)
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  ARCH=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
fi

# 1. Build for this GPU only, with the flags of a plain build, so that a tree already built for
#    this arch (CI's) only relinks; then the registers, stack, local and shared memory of every
#    kernel of the built library, as the binary records them (cuobjdump's resource usage).
TORCH_CUDA_ARCH_LIST=$ARCH DSPARK_OPS_CUDA=1 MAX_JOBS=$(nproc) \
  run_step build "$BUILD_LIMIT" $PY -m pip install --no-build-isolation --no-deps -v -e .
build_ok=$?
CUOBJDUMP=$(command -v cuobjdump || $PY -c "import os, triton; print(os.path.join(os.path.dirname(
  triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump'))" 2>/dev/null)
"$CUOBJDUMP" --dump-resource-usage dspark_ops/_C*.so >"$OUT/resource_usage.txt" 2>&1
$PY -m dspark_ops.info >"$OUT/info.txt" 2>&1

if ((build_ok == 0)); then
  # The static model's launch plans need the SIMT emulator: built beside the next steps on half
  # the cores (a dry run reuses the flavour its test run built).
  if ((!DRY_RUN)); then
    MAX_JOBS=$(( ($(nproc) + 1) / 2 )) $PY csrc/sim/build.py plain >"$OUT/sim_build.log" 2>&1 &
    sim_pid=$!
  fi
  if ((DRY_RUN)); then
    run_step cuda_tests 90 $PY -m pytest python_tests -m cuda -q -p no:cacheprovider
    run_step smoke_cpu 60 $PY -m gpu_checks.cuda_smoke --device cpu
  else
    # About 1,000 CUDA cases, most milliseconds; the torch.compile ones compile Triton kernels.
    run_step cuda_tests 240 $PY -m pytest python_tests -m cuda -q -p no:cacheprovider \
      --junitxml="$OUT/cuda_tests.xml"
    if command -v compute-sanitizer >/dev/null; then
      run_step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m gpu_checks.cuda_smoke
      run_step racecheck 60 compute-sanitizer --tool racecheck --error-exitcode 1 $PY -m gpu_checks.cuda_smoke
      # racecheck also reports hazards inside cuBLAS's own kernels (seen under the loss's
      # products on an H200); only a hazard in one of our kernels fails the step.
      if [[ $(tail -n 1 "$OUT/steps.tsv" | cut -f2) == "failed(rc=1)" ]] &&
        grep -q "Race reported" "$OUT/racecheck.log" &&
        ! grep -A1 "Race reported" "$OUT/racecheck.log" | grep -q "dspark_ops"; then
        sed -i '$ s/\tfailed(rc=1)\t/\tok\t/' "$OUT/steps.tsv"
        echo "racecheck: every hazard is in another library's kernel, none in dspark_ops'" |
          tee -a "$OUT/racecheck.log"
      fi
    else
      printf 'sanitizer\tnot installed\t0\n' >>"$OUT/steps.tsv"
    fi
  fi
  if ((DRY_RUN)); then
    run_step agreement 90 $PY -m gpu_checks.cpu_cuda_agreement --cpu-only --out "$OUT/agreement.json"
    # Every row once, each competitor called once: the script and the rows work, nothing timed.
    run_step bench 420 $PY -m bench --smoke --results-dir "$OUT"
    run_step profile 120 $PY -m gpu_checks.profile_ops --dry-run --out "$OUT"
  else
    # The drafting section adds a few seconds; the draft family about 30 s (torch.compile of
    # the eager step, once).
    run_step agreement 100 $PY -m gpu_checks.cpu_cuda_agreement --out "$OUT/agreement.json"
    run_step bench 180 $PY -m bench --results-dir "$OUT"
    run_step profile 75 $PY -m gpu_checks.profile_ops --out "$OUT"
  fi
  # 7. The static model of this build's sm_90 code (its own folder: a failed run leaves nothing).
  rm -rf "$OUT/static_model"
  [[ -n "${sim_pid:-}" ]] && wait "$sim_pid"
  run_step static_model 120 $PY -m bench.static --results-dir "$OUT/static_model"
  # The emulator's mma.sync, shuffles and launch plans against the hardware's (tensor-core paths
  # within float32 summation order, verify tokens exactly).
  if ((WITH_SIM)); then
    run_step sim_build 150 $PY csrc/sim/build.py plain &&
      run_step sim_vs_gpu 30 $PY -m pytest python_tests/test_sim_core.py -q -p no:cacheprovider \
        -k emulation_agrees_with_the_gpu
  fi
fi

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line]
summary = {"steps": {name: {"status": status, "seconds": int(sec)} for name, status, sec in steps}}
agreement = out / "agreement.json"
if agreement.exists():
    summary["agreement"] = json.loads(agreement.read_text())
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print("\n=== dspark_ops GPU check summary ===")
print(f"{'step':<14}{'status':<22}{'seconds':>8}")
for name, status, sec in steps:
    print(f"{name:<14}{status:<22}{sec:>8}")
def fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"
draft = summary.get("agreement", {}).get("draft")
if draft:
    print(f"\nagreement: verify {summary['agreement']['agree']}/{summary['agreement']['requests']}"
          f" requests; drafting slot-0 tokens / rel err:")
    for config in draft["configs"]:
        agree, rel = config["slot_token_agreement"][:1], config["slot_logit_rel_error"][:1]
        print(f"  {config['name']:<40}{fmt(100 * agree[0] if agree else None)}%  "
              f"{rel[0] if rel else 0.0:.1e}  {'ok' if config['passed'] else 'FAIL'}")
for path in sorted(out.glob("verify_*.json")) + sorted(out.glob("draft_*.json")):
    rows = json.loads(path.read_text())["rows"]
    print(f"\n{path.name} (us; x = other/ours; full table in bench.log)")
    labels = [r["shape"] if r["op"] == "verify" else f"{r['op']} {r['shape']}" for r in rows]
    width = max([22] + [len(label) + 2 for label in labels])
    for row, label in zip(rows, labels):
        anchors = " ".join(f"{k}={fmt(v, 2)}x" for k, v in row.get("anchor_speedup", {}).items())
        print(f"  {label:<{width}}{row['variant']:<18}ours {fmt(row['ours_us']):>9}  "
              f"ref {fmt(row['speedup'], 2)}x  {fmt(row['gbps'], 0)} GB/s "
              f"({fmt(row['pct_copy'], 0)}% copy)  {anchors}")
EOF
if [[ -f "$OUT/static_model/static_sm90.json" ]]; then
  echo
  profile=()
  [[ -f "$OUT/profile_ops.json" ]] && profile=(--profile "$OUT/profile_ops.json")
  $PY -m gpu_checks.model_vs_measured --model "$OUT/static_model/static_sm90.json" \
    --bench "$OUT"/all_*.json "${profile[@]}"
fi
! grep -qv $'\tok\t' "$OUT/steps.tsv"
