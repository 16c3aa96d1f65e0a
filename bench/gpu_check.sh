#!/usr/bin/env bash
# GPU check of dspark_ops, in one call on a machine with an NVIDIA GPU (under 8 minutes on an H200):
#   1. build the extension for this GPU's arch (pip, no build isolation, no dependencies fetched)
#   2. run the CUDA tests
#   3. compute-sanitizer memcheck and racecheck over bench/cuda_smoke.py
#   4. CPU-vs-CUDA token agreement on shared seeds
#   5. the benchmarks (python -m bench)
# and print a summary table last. Logs, ptxas report and JSON results go to OUTDIR.
#
# Usage: bash bench/gpu_check.sh OUTDIR [--dry-run]
#   --dry-run runs everything that needs no GPU (build for sm_90, CPU versions of the checks), to
#   catch script errors before spending GPU time.
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR [--dry-run]}
DRY_RUN=0
[[ "${2:-}" == "--dry-run" ]] && DRY_RUN=1
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
  BUILD_LIMIT=120
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  ARCH=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
fi

# 1. Build for this GPU only, with the ptxas register/spill report.
TORCH_CUDA_ARCH_LIST=$ARCH DSPARK_OPS_CUDA=1 DSPARK_OPS_PTXAS_VERBOSE=1 MAX_JOBS=$(nproc) \
  run_step build "$BUILD_LIMIT" $PY -m pip install --no-build-isolation --no-deps -v -e .
build_ok=$?
grep -E "Compiling entry|registers|spill" "$OUT/build.log" >"$OUT/ptxas.txt" 2>/dev/null
$PY -m dspark_ops.info >"$OUT/info.txt" 2>&1

if ((build_ok == 0)); then
  if ((DRY_RUN)); then
    run_step cuda_tests 90 $PY -m pytest python_tests -m cuda -q -p no:cacheprovider
    run_step smoke_cpu 60 $PY -m bench.cuda_smoke --device cpu
  else
    run_step cuda_tests 150 $PY -m pytest python_tests -m cuda -q -p no:cacheprovider \
      --junitxml="$OUT/cuda_tests.xml"
    if command -v compute-sanitizer >/dev/null; then
      run_step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m bench.cuda_smoke
      run_step racecheck 60 compute-sanitizer --tool racecheck --error-exitcode 1 $PY -m bench.cuda_smoke
    else
      printf 'sanitizer\tnot installed\t0\n' >>"$OUT/steps.tsv"
    fi
  fi
  run_step agreement 40 $PY -m bench.cpu_cuda_agreement --out "$OUT/agreement.json"
  if ((DRY_RUN)); then
    run_step bench 150 $PY -m bench --quick
  else
    run_step bench 100 $PY -m bench
  fi
  cp bench/results/*.json bench/results/*.csv "$OUT/" 2>/dev/null
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
for path in sorted(out.glob("verify_*.json")):
    rows = json.loads(path.read_text())["rows"]
    print(f"\n{path.name} (us; x = other/ours; full table in bench.log)")
    for row in rows:
        anchors = " ".join(f"{k}={fmt(v, 2)}x" for k, v in row.get("anchor_speedup", {}).items())
        print(f"  {row['shape']:<22}{row['variant']:<18}ours {fmt(row['ours_us']):>9}  "
              f"ref {fmt(row['speedup'], 2)}x  {fmt(row['gbps'], 0)} GB/s "
              f"({fmt(row['pct_copy'], 0)}% copy)  {anchors}")
EOF
! grep -qv $'\tok\t' "$OUT/steps.tsv"
