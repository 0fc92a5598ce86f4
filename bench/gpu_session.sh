#!/usr/bin/env bash
# Everything that needs a GPU, in stages; several stages can run in one call of the device tool (10 minutes a
# command). Run from the repository root on the lent machine (its python3 has torch, triton and transformers;
# the project is used from code/ without installing).
#
#   bash bench/gpu_session.sh check       # GPU tests of the fast path (kernels vs reference) + versions
#   bash bench/gpu_session.sh targets     # issue #6's ten targets judged from one pass (bench/targets_report.py)
#   bash bench/gpu_session.sh pinv        # the pseudo-inverse kernel's variants (precision × warps) vs PyTorch
#   bash bench/gpu_session.sh middle      # the landmark middle alone: PyTorch ops + pinv kernel vs landmark_core,
#                                         # each with the iteration's backward direct or transposed, and the
#                                         # iteration on mma.sync instead of wgmma (DISABLE_MMA_V3=1)
#   bash bench/gpu_session.sh attention   # issue #6 attention table (time, memory, ratios, error) + plot + kernels
#   bash bench/gpu_session.sh settings    # the n-long kernels' launch settings swept, each wrapper alone
#   bash bench/gpu_session.sh settings_fp32  # the same for fp32 inputs, into best.json's fp32 section
#   bash bench/gpu_session.sh tuned       # the sweep's best settings in force: GPU tests, attention, training
#   bash bench/gpu_session.sh model       # issue #6 training tokens/s and memory at 512 and 4096
#   bash bench/gpu_session.sh loop        # `nystromformer pretrain` itself vs the bare step, at 512 and 4096
#   bash bench/gpu_session.sh compile     # the bare training step (model_speed) with the encoders compiled
#                                         # (CUDA graphs), + the ceiling; not `pretrain` itself
#   bash bench/gpu_session.sh profile     # issue #8 efficiency profile, every attention type, 128..32768
#   bash bench/gpu_session.sh listops     # issue #8 ListOps at LRA scale, every attention type in parallel
#   bash bench/gpu_session.sh check attention model profile     # several, in order
#   DRY_RUN=1 bash bench/gpu_session.sh check attention          # here, before device time: every command's
#                                         # arguments checked, nothing run (bench/gpu_session_dry_run.py)
#
# Each command runs under STAGE_LIMIT seconds (default 300) and within SESSION_LIMIT (default 570) of the start,
# skipped when under 30 s are left, so split long plans over several calls — except listops, whose parallel runs
# have their own LISTOPS_LIMIT (default 540): give it a call of its own; a
# failing stage does not stop the next. Results go to $RESULTS (default /tmp/gpu-results), one folder per stage,
# and are packed into $OUT/gpu-results.tgz (the device tool returns at most 8 files) with the log $OUT/session.log.
# Record what the tables say, with the device line they print, in docs/performance.md / docs/efficiency.md /
# docs/results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
RESULTS=${RESULTS:-/tmp/gpu-results}
export PYTHONPATH="$PWD/code${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ $# -gt 0 ] || { echo "stages: check targets pinv middle attention settings settings_fp32 tuned model loop compile profile listops" >&2; exit 2; }
dry_run=; case ${DRY_RUN:-0} in 0|"") ;; *) dry_run=1 ;; esac
# The device's python3 has torch; here a dry run uses `make setup`'s environment unless PYTHON names another
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -n "$dry_run" ] && [ -x .venv/bin/python ]; then python=$PWD/.venv/bin/python; fi
"$python" -c 'import torch' 2> /dev/null || {
  echo "gpu_session.sh: $python cannot import torch: run \`make setup\` or set PYTHON to an interpreter that can" >&2
  exit 2; }
# The GPU tests in GPU_TEST_WORKERS processes (default 8; 0: one) where pytest-xdist is installed (the image has
# it): they are compile-bound (Triton compiles each kernel variant at its first launch, one at a time in a
# process; 142 tests took 192 s on 2026-11-23) and share the one GPU only for small fp64-checked shapes.
# A GPU in an exclusive compute mode takes one process: then one.
workers=()
if [ "${GPU_TEST_WORKERS:-8}" != 0 ] && "$python" -c 'import xdist' 2> /dev/null; then
  workers=(-p xdist -n "${GPU_TEST_WORKERS:-8}"); fi
if [ ${#workers[@]} -gt 0 ] && [ -z "$dry_run" ] && command -v nvidia-smi > /dev/null \
    && ! nvidia-smi --query-gpu=compute_mode --format=csv,noheader | grep -qx Default; then
  echo "=== the GPU is not in the Default compute mode: the GPU tests run in one process" >&2; workers=(); fi
if [ -n "$dry_run" ]; then
  # Each command goes to bench/gpu_session_dry_run.py, which checks its arguments (a script's argparse, pytest's
  # collection) and runs nothing; results and the log go to a temporary folder, and an empty settings file stands
  # in for the settings stage's best.json.
  RESULTS=$(mktemp -d -t gpu-session-dry-run.XXXXXX); OUT=$RESULTS
  mkdir -p "$RESULTS/settings"; echo '{}' > "$RESULTS/settings/best.json"
  printf '#!/usr/bin/env bash\n%q %q "$@" || { echo "$*" >> %q; exit 1; }\n' "$python" \
    "$PWD/bench/gpu_session_dry_run.py" "$RESULTS/dry-run-failed" > "$RESULTS/python"
  chmod +x "$RESULTS/python"; python=$RESULTS/python
  nvidia-smi() { echo "dry run: nvidia-smi (not run)"; }
fi
mkdir -p "$OUT" "$RESULTS"
limit=${STAGE_LIMIT:-300}
# The device tool stops a call at 600 s (or sooner, when less device time is left: set SESSION_LIMIT below what
# is left): every command gets at most what is left of SESSION_LIMIT (default 570 s from the start), so the last
# stage ends on its own and its results are packed, rather than being cut off unseen. At its limit a command gets
# SIGTERM, on which the benchmarks print the rows they measured (bench/time_limit.py), and SIGKILL 20 s later.
session_end=$(( $(date +%s) + ${SESSION_LIMIT:-570} ))
limited() {
  if [ -n "$dry_run" ]; then "$@"; return; fi  # a check is seconds: no limit skips or cuts one off
  local left=$(( session_end - $(date +%s) - 20 ))
  # (on stderr: into the session log, also where the command's output goes to a results file)
  if [ "$left" -lt 30 ]; then echo "=== skipped, ${left}s of SESSION_LIMIT left: $*" >&2; return 124; fi
  timeout -k 20 "$(( left < limit ? left : limit ))" "$@"
}
exec > >(tee -a "$OUT/session.log") 2>&1

stage_check() {
  local d=$RESULTS/check; mkdir -p "$d"
  rm -f "$d"/gpu-tests.txt "$d"/host-time-test.txt  # a rerun on a warm machine: no earlier call's verdicts
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$d/device.txt"
  "$python" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$d/device.txt"
  # Only the tests marked gpu: the CPU tests (the interpreter's, the sm_90 compiles, test_attention.py's and
  # test_model.py's) are CI's work, and under -x one of them failing on the device's torch would stop the rest.
  limited "$python" -m pytest -q -rs -x -p no:cacheprovider ${workers[@]+"${workers[@]}"} -m gpu \
    tests/test_nystrom_fast.py \
    tests/test_pretrain.py::test_on_a_gpu_a_training_step_waits_for_the_device_only_to_read_its_loss \
    2>&1 | tee "$d/gpu-tests.txt" | tail -n 25
  # alone: it times a device sleep, which other processes' kernels on the GPU would shorten or stretch (its own
  # file: gpu-tests.txt holds the tests above, as targets_report.py reads it)
  limited "$python" -m pytest -q -rs -p no:cacheprovider \
    tests/test_bench.py::test_gpu_host_time_is_the_hosts_own_work_and_shows_a_synchronization_as_the_devices_sleep \
    2>&1 | tee "$d/host-time-test.txt" | tail -n 3
}

stage_targets() {
  # Issue #6's ten targets in one pass, with the fewest rows that judge them (a session has 15 minutes of device
  # time): SDPA and both kernel settings, eager and replayed as a CUDA graph (each row measures both; the issue's
  # conv of 33); the training step with the shipped folders' conv of 65 at 512, with bf16 and with their fp32
  # attention, and at 4096; then bench/targets_report.py's verdicts from their CSV files and the check stage's
  # test output.
  local d=$RESULTS/targets; mkdir -p "$d"
  # a rerun on a warm machine: a command skipped or stopped before its first row must not leave an earlier call's
  # table for the report to judge as this one's
  rm -f "$d"/attention.csv "$d"/attention.md "$d"/attention_speed.png "$d"/model-*.csv "$d"/model-*.md \
    "$d"/untimed-*.jsonl "$d"/targets.md
  local attention=(bench/attention_speed.py --graphs --check --impls sdpa fast-triton fast-triton-all)
  local bf16=(bench/model_speed.py --seq-len 512 --batch 32 --conv 65 --attention-fp32 false --models softmax \
    nystrom-all hf-nystromformer nystrom nystrom-all-recompute)
  local long=(bench/model_speed.py --seq-len 4096 --batch 4 --conv 65 --attention-fp32 false --models softmax \
    nystrom-all nystrom-all-recompute)
  local fp32=(bench/model_speed.py --seq-len 512 --batch 32 --conv 65 --attention-fp32 true --models softmax nystrom \
    nystrom-all hf-nystromformer)
  # every table's untimed compile pieces in one pool (compile_first.py), not one pool a table after another; the
  # four lists are printed at once (each a process that imports torch)
  local pids=() i=0 command
  for command in attention bf16 long fp32; do
    local -n args=$command
    "$python" "${args[@]}" --print-untimed > "$d/untimed-$command.jsonl" & pids+=($!)
  done
  for command in attention bf16 long fp32; do  # each pid (a bare `wait` would wait for the log's tee too)
    wait "${pids[i++]}" || echo "=== $command: --print-untimed failed: its table compiles in its timed run"
  done
  limited "$python" bench/compile_first.py "$d"/untimed-{attention,bf16,long,fp32}.jsonl \
    --workers "${COMPILE_WORKERS:-10}"
  limited "$python" "${attention[@]}" --compile-workers 0 --csv "$d/attention.csv" --plot "$d/attention_speed.png" \
    > "$d/attention.md"
  sed -n '1,/^$/p' "$d/attention.md"
  limited "$python" "${bf16[@]}" --compile-workers 0 --csv "$d/model-512-bf16.csv" > "$d/model-512-bf16.md"
  limited "$python" "${long[@]}" --compile-workers 0 --csv "$d/model-4096-bf16.csv" > "$d/model-4096-bf16.md"
  limited "$python" "${fp32[@]}" --compile-workers 0 --csv "$d/model-512-fp32.csv" > "$d/model-512-fp32.md"
  "$python" bench/targets_report.py "$d" --tests "$RESULTS/check/gpu-tests.txt" | tee "$d/targets.md"
}

stage_pinv() {
  local d=$RESULTS/pinv; mkdir -p "$d"
  limited "$python" bench/pinv_speed.py | tee "$d/pinv.md"
}

stage_middle() {
  local d=$RESULTS/middle; mkdir -p "$d"
  limited "$python" bench/pinv_speed.py --middle-only | tee "$d/middle.md"
  # The iteration with mma.sync instead of wgmma (Triton's process-wide DISABLE_MMA_V3, part of its cache key):
  # 96 KB of shared memory in the backward instead of 160, so two programs per SM instead of one (ptxas, sm_90).
  limited env DISABLE_MMA_V3=1 "$python" bench/pinv_speed.py --matrices 1536 192 --precisions tf32 \
    --warps 4,4 8,8 | tee "$d/mma-sync.md"
}

stage_attention() {
  local d=$RESULTS/attention; mkdir -p "$d"
  limited "$python" bench/attention_speed.py --check --csv "$d/attention.csv" --plot "$d/attention_speed.png" \
    --kernels fast-triton fast-triton-all > "$d/attention.md"
  sed -n '1,/^$/p' "$d/attention.md"
  limited "$python" bench/attention_speed.py --pad 0.25 --lengths 512 4096 --check | tee "$d/attention-padded.md"
  # the one-node layer's variants, built on the CPU: the conv inside pass 2's forward (seventeenth session)
  # against the conv kernel after it; the conv's backward in one pass (twenty-second) against two kernels; the
  # landmarks recomputed in the backward (NYSTROM_RECOMPUTE=1, eighteenth)
  limited "$python" bench/attention_speed.py --impls sdpa fast-triton-all fast-triton-all-conv-apart \
    fast-triton-all-conv-bwd-apart fast-triton-all-recompute --lengths 512 4096 65536 --check \
    | tee "$d/one-node-variants.md"
  # the same forward+backward replayed as one CUDA graph: the kernels' own time, without the host's between
  # launches (on 2026-11-23 the profiler's kernel sums were 1.9-2.0 ms at n >= 4096, the timed 3.0-3.8 ms)
  # (the first command's kernels, at its shapes: no need to compile first)
  limited "$python" bench/attention_speed.py --graphs --impls sdpa fast-triton fast-triton-all --compile-workers 0 \
    | tee "$d/attention-graphs.md"
}

stage_settings() {
  # rows a tile, tiles a program, warps, stages of the wrappers over the n-long tensors (bench/bytes_moved.py: the
  # layer's bytes are ~1.9x the old 12-tensor floor's, its time 7.1x it): each wrapper in its own process, outputs checked
  # at the shipped configs' conv of 65 (each entry applies only where a wrapper chooses what it chose here); into
  # BEST's settings when given (a file carried from an earlier call: its other entries are kept)
  local d=$RESULTS/settings limit=${SETTINGS_LIMIT:-540}; mkdir -p "$d"  # ~70 settings to compile: give it a call
  settings_from_best "$d"
  limited "$python" bench/kernel_settings.py --conv 65 --lengths 4096 65536 --best "$d/best.json" \
    | tee "$d/kernel-settings.md"
}

settings_from_best() {
  # once a call: a second settings stage adds to the first one's file, never back to BEST's; tuned then times it
  if [ -z "${settings_ran:-}" ] && [ -n "${BEST:-}" ] && [ -s "$BEST" ] && [ ! "$BEST" -ef "$1/best.json" ]; then
    cp "$BEST" "$1/best.json"; echo "=== settings: starting from $BEST"; fi
  settings_ran=1
}

stage_settings_fp32() {
  # the same for fp32 inputs (the shipped folders' attention_fp32: true), into best.json's fp32 section; its own
  # call: fp32 settings compile slower, and some do not fit (their rows say so and never become best)
  local d=$RESULTS/settings limit=${SETTINGS_LIMIT:-540}; mkdir -p "$d"
  settings_from_best "$d"
  limited "$python" bench/kernel_settings.py --dtype fp32 --conv 65 --lengths 4096 65536 --best "$d/best.json" \
    | tee "$d/kernel-settings-fp32.md"
}

stage_tuned() {
  # the settings stage's best.json in force (NYSTROM_LAUNCH_SETTINGS): the GPU tests of the fast path first, then
  # the attention table (eager and CUDA graph) and the bf16 training step at 512 (and the fp32 one when the file has
  # an fp32 section), at the conv of 65 the settings were swept at, to set beside the chosen ones'
  # BEST: a settings file from an earlier call (the machine may be a fresh one: carry the file, see
  # docs/performance.md), else this machine's settings stage's
  # (this call's settings file when a settings stage ran before it: it holds BEST's entries and the new ones)
  local d=$RESULTS/tuned best=${BEST:-$RESULTS/settings/best.json}; mkdir -p "$d"
  [ -n "${settings_ran:-}" ] && best=$RESULTS/settings/best.json
  [ -s "$best" ] || { echo "=== tuned: no $best (run the settings stage first, or set BEST)"; return 1; }
  "$python" -c 'import json, sys; sys.exit(not any(json.load(open(sys.argv[1])).values()))' "$best" || {
    echo "=== tuned: $best chose no setting (every wrapper keeps its own): nothing to time"; return 1; }
  cp "$best" "$d/best.json"
  limited env NYSTROM_LAUNCH_SETTINGS="$best" "$python" -m pytest -q -rs -x -p no:cacheprovider \
    ${workers[@]+"${workers[@]}"} tests/test_nystrom_fast.py -m gpu 2>&1 | tee "$d/gpu-tests.txt" | tail -n 5
  local tests_rc=${PIPESTATUS[0]}  # pytest's own status: a failure, an error or a time-out stops the stage
  [ "$tests_rc" -eq 0 ] || { echo "=== tuned: the GPU tests with $best did not pass (status $tests_rc)"; return 1; }
  limited env NYSTROM_LAUNCH_SETTINGS="$best" "$python" bench/attention_speed.py --graphs --conv 65 \
    --impls sdpa fast-triton-all | tee "$d/attention.md"
  limited env NYSTROM_LAUNCH_SETTINGS="$best" "$python" bench/model_speed.py --seq-len 512 --batch 32 --conv 65 \
    --attention-fp32 false --models nystrom-all softmax | tee "$d/model-512.md"
  # the fp32 section, where the file has one, at the shipped folders' attention (fp32, conv 65)
  if "$python" -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get("fp32"))' "$best"; then
    limited env NYSTROM_LAUNCH_SETTINGS="$best" "$python" bench/model_speed.py --seq-len 512 --batch 32 --conv 65 \
      --attention-fp32 true --models nystrom-all softmax | tee "$d/model-512-fp32.md"
  fi
}

stage_model() {
  local d=$RESULTS/model; mkdir -p "$d"
  for fp32 in true false; do
    limited "$python" bench/model_speed.py --seq-len 512 --batch 32 --attention-fp32 "$fp32" \
      $([ "$fp32" = false ] && echo --kernels nystrom nystrom-all softmax) \
      $([ "$fp32" = true ] && echo --host-profile nystrom nystrom-all) >> "$d/model-512.md"
  done
  # the issue's comparisons first: a run stopped at its limit prints the rows it measured (bench/time_limit.py)
  limited "$python" bench/model_speed.py --seq-len 4096 --batch 4 --models softmax nystrom-all nystrom \
    hf-nystromformer nystrom-all-recompute attention-free hf-roberta nystrom-overlap nystrom-all-overlap \
    --attention-fp32 false --kernels nystrom-all > "$d/model-4096.md"
  grep -h -A10 '^# MLM' "$d/model-512.md" "$d/model-4096.md"
}

stage_loop() {
  # `nystromformer pretrain` itself against the bare step: what the loop (data, masking, logging, syncs) costs.
  local d=$RESULTS/loop; mkdir -p "$d"
  limited "$python" bench/pretrain_loop.py --seq-len 512 --batch 32 | tee "$d/loop-512.md" | grep -A5 '^# pretraining'
  limited "$python" bench/pretrain_loop.py --seq-len 4096 --batch 4 | tee "$d/loop-4096.md" | grep -A5 '^# pretraining'
  # the shipped folders' micro-batch of 8 and fp32 attention: 4 micro-batches a step (one autocast region)
  limited "$python" bench/pretrain_loop.py --seq-len 512 --batch 32 --micro-batch 8 --attention-fp32 true \
    | tee "$d/loop-512-micro-8.md" | grep -A5 '^# pretraining'
  # the same recipe in one pass of 32 rows (rows_per_pass: the Nyström init still over each micro-batch of 8)
  limited "$python" bench/pretrain_loop.py --seq-len 512 --batch 32 --micro-batch 8 --rows-per-pass 32 \
    --attention-fp32 true | tee "$d/loop-512-micro-8-pass-32.md" | grep -A5 '^# pretraining'
}

stage_compile() {
  # CUDA graphs against the host-bound step (docs/performance.md); baselines uncompiled, as transformers ships them.
  # (each model compiles cold, minutes each: the comparison's two first, as a stopped run keeps its rows)
  local d=$RESULTS/compile; mkdir -p "$d"
  limited "$python" bench/model_speed.py --seq-len 512 --batch 32 --attention-fp32 false \
    --compile reduce-overhead --models softmax nystrom-all nystrom attention-free hf-roberta > "$d/model-512.md"
  limited "$python" bench/model_speed.py --seq-len 4096 --batch 4 --attention-fp32 false \
    --compile reduce-overhead --models softmax nystrom-all nystrom attention-free hf-roberta > "$d/model-4096.md"
  grep -h -A9 '^# MLM' "$d/model-512.md" "$d/model-4096.md"
}

stage_profile() {
  local d=$RESULTS/profile; mkdir -p "$d"
  limited "$python" bench/efficiency_profile.py --device cuda --num-head 12 --head-dim 64 --max-length 32768 \
    --csv "$d/efficiency.csv" --plot "$d/efficiency_gpu.png" | tee "$d/efficiency.md"
}

stage_listops() {
  # One process per attention type, all at once on the one GPU (the LRA models are tiny); each generates the
  # same seeded data itself, unless LISTOPS_DATA names a folder of basic_{train,val,test}.tsv[.xz] files (made by
  # bench/listops_data.sh here and carried: generating 96k trees in 9 processes took ~3 minutes of device time).
  # LISTOPS_TYPES narrows the set; LISTOPS_ARGS adds flags (e.g. --time-limit-s 300).
  local d=$RESULTS/listops; mkdir -p "$d"
  local source=--generate
  if [ -n "${LISTOPS_DATA:-}" ]; then
    mkdir -p /tmp/listops-data
    "$python" -c 'import lzma, shutil, sys, pathlib
for f in pathlib.Path(sys.argv[1]).iterdir():
    if f.suffix == ".xz":
        with lzma.open(f) as src, open(pathlib.Path(sys.argv[2]) / f.stem, "wb") as dst: shutil.copyfileobj(src, dst)
    else: shutil.copy(f, sys.argv[2])' "$LISTOPS_DATA" /tmp/listops-data
    source="--data /tmp/listops-data"
  fi
  local types=${LISTOPS_TYPES:-softmax,nystrom,linformer,performer,linear,reformer,longformer,bigbird,linformer_revisited}
  local pids=()
  for t in ${types//,/ }; do
    OMP_NUM_THREADS=1 timeout "${LISTOPS_LIMIT:-540}" "$python" -m nystromformer.cli listops-train $source \
      --out "$d/$t" --device cuda --attn-types "$t" ${LISTOPS_ARGS:-} > "$d/$t.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for t in ${types//,/ }; do
    echo "== $t"; grep -h '"result"' "$d/$t.log" || tail -n 3 "$d/$t.log"
  done
}

for stage in "$@"; do
  echo "=== stage $stage $(date -u +%T)"
  if ! declare -F "stage_$stage" > /dev/null; then
    echo "unknown stage $stage" >&2; [ -z "$dry_run" ] || echo "stage $stage" >> "$RESULTS/dry-run-failed"
  elif [ -n "$dry_run" ]; then "stage_$stage"  # judged by its commands' checks (a grep of a table finds none)
  else "stage_$stage" || echo "=== stage $stage FAILED ($?)"; fi
  # after every stage: a command cut off at its limit keeps these (written whole, then renamed: a call killed
  # while packing keeps the previous stage's archive)
  [ -n "$dry_run" ] || { tar czf "$OUT/.gpu-results.tgz.tmp" -C "$RESULTS" . && mv "$OUT/.gpu-results.tgz.tmp" \
    "$OUT/gpu-results.tgz"; }
done
echo "=== done $(date -u +%T)"
if [ -n "$dry_run" ]; then
  if [ -s "$RESULTS/dry-run-failed" ]; then
    echo "=== dry run: $(wc -l < "$RESULTS/dry-run-failed") command(s) FAILED their check (above)"; exit 1; fi
  echo "=== dry run: every command's arguments check out (log: $OUT/session.log)"
fi
