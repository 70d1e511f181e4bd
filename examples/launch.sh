#!/usr/bin/env bash
# Fine-tune on every GPU of this machine: one process per GPU, NCCL, DDP.
#   examples/launch.sh examples/sft-0.8b-8xh200.yaml
# `nedolm-sft launch` is torchrun for this job (it takes torchrun's options): SIGTERM or SIGUSR1
# to it stops every rank on one checkpoint and exits 0. Re-running the same command resumes.
set -euo pipefail
CONFIG=${1:?usage: launch.sh CONFIG [extra nedolm-sft run options]}
shift
GPUS=${GPUS:-$(nvidia-smi --list-gpus | wc -l)}
exec nedolm-sft launch --standalone --nproc-per-node "$GPUS" "$CONFIG" "$@"
