#!/usr/bin/env bash
# Generate the LRA-scale ListOps data (96k/2k/2k, seed 0: what `listops-train --generate` makes) on this machine
# and store it xz-compressed in .listops-data/ (~57 MB, git-ignored via .git/info/exclude), to carry to the GPU
# machine instead of spending device time on generation:
#
#   bash bench/listops_data.sh                      # ~2 min generation + ~4 min xz on 2 cores
#   device run, carry [".listops-data"]:  LISTOPS_DATA=.listops-data LISTOPS_TYPES=a,b,c bash bench/gpu_session.sh listops
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PYTHONPATH=code "$python" -m nystromformer.cli listops-generate --out "$tmp" "$@"
mkdir -p .listops-data
grep -qx '/.listops-data/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.listops-data/' >> .git/info/exclude; }
for f in "$tmp"/*.tsv; do xz -6 -T0 -c "$f" > ".listops-data/$(basename "$f").xz"; done
ls -l .listops-data
