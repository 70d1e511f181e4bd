#!/usr/bin/env bash
# Makes here what a device-machine run of bench/gpu.sh carries, as two git-excluded folders:
#   .whl/       cp312 wheels of what that machine lacks: msgspec (a core dependency) and
#               liger-kernel (bench/loss_gpu.py's reference head; never a dependency)
#   .gpu_data/  the real corpus beyond what the repository ships: the shared tr_chat files (not
#               the alpaca-format copy of seed_tasks_tr)
# Then one call there, carrying [".whl", ".gpu_data"]: the command in bench/RESULTS.md.
#
# Usage: bench/gpu_bundle.sh [SHARED_DATA_DIR]   (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${1:-../shared/data}
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
[[ -d $shared/tr_chat ]] || { echo "no $shared/tr_chat: give the shared data directory" >&2; exit 2; }

for folder in .whl .gpu_data; do
    grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >>.git/info/exclude
done
rm -rf .whl .gpu_data
mkdir .whl .gpu_data
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl msgspec liger-kernel
find "$shared/tr_chat" -maxdepth 1 -name '*.jsonl' ! -name '*.alpaca.jsonl' -exec cp {} .gpu_data/ \;
ls .whl .gpu_data
du -sh .whl .gpu_data
