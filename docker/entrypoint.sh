#!/usr/bin/env bash
# The image's entry point: `nystromformer COMMAND ...`, except that `pretrain` runs under torchrun with one
# process per visible GPU (one process on a CPU-only machine). The model folder is the working directory.
set -euo pipefail
home=${NYSTROMFORMER_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
python=${PYTHON:-python}
command=${1:-pretrain}
[ $# -gt 0 ] && shift
if [ "$command" = pretrain ]; then
  gpus=$("$python" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
  # One process: no torchrun, so that `docker stop` (SIGTERM) ends with the run's own status 143, not torchrun's 1
  [ "$gpus" -eq 1 ] && exec "$python" "$home/code/run_pretrain.py" "$@"
  exec "$python" -m torch.distributed.run --standalone --nproc_per_node "$gpus" "$home/code/run_pretrain.py" "$@"
fi
exec "$python" -m nystromformer.cli "$command" "$@"
