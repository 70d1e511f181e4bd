#!/usr/bin/env bash
# CUDA checks of nedolm-model, one command, under 8 minutes on an H100/H200:
#   1. attention backend agreement in bf16 (logits, loss, every gradient vs sdpa);
#   2. training-step tokens/s and MFU of nedolm-0.8b at seq_len 4096 per available backend,
#      eager and compiled.
# Runs from a plain checkout (no install needed beyond torch, safetensors; flash-attn optional).
# Usage: bench/gpu.sh [bench/model_gpu.py flags, e.g. --batch 2 --dispatch sparse]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="packages/nedolm-model/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")'
# The script stops starting new configurations after --budget-s (default 420 s); the hard
# timeout only guards against a hang.
timeout 470 "$PYTHON" bench/model_gpu.py "$@"
