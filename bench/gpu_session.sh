#!/usr/bin/env bash
# Everything that needs a GPU, in stages that each fit the device tool's 10-minute command limit.
# Run from the repository root on the lent machine (its python3 has torch, triton and transformers; the
# project is used from code/ without installing). Outputs go to $OUT (the device tool brings them back).
#
#   bash bench/gpu_session.sh check       # GPU tests of the fast path (kernels vs reference) + versions
#   bash bench/gpu_session.sh attention   # issue #6 attention table (time, memory, ratios, error) + plot
#   bash bench/gpu_session.sh model       # issue #6 training tokens/s and memory at 512 and 4096
#   bash bench/gpu_session.sh profile     # issue #8 efficiency profile, every attention type, 128..32768
#   bash bench/gpu_session.sh listops TYPES   # issue #8 ListOps at LRA scale for the comma-separated TYPES
#
# Record what the tables say, with the device line they print, in docs/performance.md / docs/efficiency.md /
# docs/results.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/code${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
stage=${1:?stage: check, attention, model, profile or listops}

case "$stage" in
  check)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    "$python" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/device.txt"
    "$python" -m pytest -q -rs tests/test_nystrom_fast.py tests/test_attention.py tests/test_model.py 2>&1 | tee "$OUT/gpu-tests.txt"
    ;;
  attention)
    "$python" bench/attention_speed.py --check --csv "$OUT/attention.csv" --plot "$OUT/attention_speed.png" | tee "$OUT/attention.md"
    "$python" bench/attention_speed.py --pad 0.25 --lengths 512 4096 --check | tee "$OUT/attention-padded.md"
    ;;
  model)
    for fp32 in true false; do
      "$python" bench/model_speed.py --seq-len 512 --batch 32 --attention-fp32 "$fp32" | tee -a "$OUT/model-512.md"
    done
    "$python" bench/model_speed.py --seq-len 4096 --batch 4 --models nystrom softmax --attention-fp32 false | tee "$OUT/model-4096.md"
    ;;
  profile)
    "$python" bench/efficiency_profile.py --device cuda --num-head 12 --head-dim 64 --max-length 32768 \
      --csv "$OUT/efficiency.csv" --plot "$OUT/efficiency_gpu.png" | tee "$OUT/efficiency.md"
    ;;
  listops)
    types=${2:?listops needs comma-separated attention types, e.g. softmax,nystrom}
    "$python" -m nystromformer.cli listops-train --generate --out "$OUT/listops" --device cuda --attn-types "$types" \
      | tee "$OUT/listops-$types.txt"
    ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
