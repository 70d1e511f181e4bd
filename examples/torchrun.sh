#!/usr/bin/env bash
# Fine-tune on every GPU of this machine: one process per GPU, NCCL, DDP.
#   examples/torchrun.sh examples/sft-0.8b-8xh200.yaml
# Re-running the same command resumes from the run directory's newest checkpoint.
set -euo pipefail
CONFIG=${1:?usage: torchrun.sh CONFIG [extra nedolm-sft run options]}
shift
GPUS=${GPUS:-$(nvidia-smi --list-gpus | wc -l)}
exec torchrun --standalone --nproc-per-node "$GPUS" -m nedolm_sft run "$CONFIG" "$@"
