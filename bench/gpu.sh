#!/usr/bin/env bash
# The GPU bench of the product, one command, about 8 minutes on an H100/H200:
#   a. attention backend agreement (bench/model_gpu.py: logits, loss, every gradient vs sdpa);
#   b. the model step per backend, eager and compiled (bench/model_gpu.py);
#   the fused loss head vs the naive one and Liger's when installed (bench/loss_gpu.py);
#   c. the real `nedolm-sft run` on a prepared real corpus at seq_len 4096 (bench/trainer_gpu.py),
#      with the attention backend and the morph dispatch (b) found fastest: tokens/s and MFU from
#      metrics.jsonl, first step, trainer / model-step, top-15 CUDA kernels; one asynchronous
#      checkpoint's training pause and write, and `nedolm-sft generate` from it;
#   d. transformers' LlamaForCausalLM of the same dense shape;
#   e. `nedolm-sft launch --nproc-per-node 1` with ddp and fsdp (NCCL).
# (b)'s process and (c)'s run are traced (TORCH_TRACE): bench/compile_trace.py tabulates where
# each one's compile time went.
# Every table goes to one file (--out, default bench/gpu_results.md) and to stdout.
# Runs from a plain checkout: the five src folders go on PYTHONPATH (no install); needs torch,
# numpy, pyyaml, click, safetensors, tokenizers, msgspec; transformers for (d), flash-attn optional.
#
# Usage: bench/gpu.sh [--smoke] [--out FILE] [-- bench/trainer_gpu.py flags, e.g. --data f.jsonl]
#   --smoke: every section on the CPU with a tiny model in about a minute (CI runs it); the parts
#   that need CUDA say so.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
SRC="packages/nedolm-data/src:packages/nedolm-model/src:packages/nedolm-dist/src"
export PYTHONPATH="$SRC:packages/nedolm-train/src:apps/sft/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONUNBUFFERED=1

smoke=0
out=bench/gpu_results.md
while [[ $# -gt 0 ]]; do
    case "$1" in
        --smoke) smoke=1; shift ;;
        --out) out=$2; shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done

# model_gpu.py stops starting rows after its --budget-s; trainer_gpu.py starts a section only if
# it is expected to end before its --deadline-s, 10 s inside its hard timeout. The hard timeouts
# guard against a hang (145 + 35 + 300 s: 8 minutes together, plus seconds for the trace table
# and the checks before).
if [[ $smoke == 1 ]]; then
    # Room for every step row on a loaded 2-core CI machine (a compile alone took 16 s there):
    # the smoke test checks (b)'s masked-vs-grouped comparison that (c)'s dispatch comes from.
    model_args=(--device cpu --preset tiny --seq-len 128 --batch 1 --micro-batches 2 --rounds 1
        --budget-s 60)
    loss_args=(--device cpu --rows 512 --vocab 1000 --dim 64)
    trainer_args=(--smoke)
    {
        echo "# bench/gpu.sh --smoke (CPU: checks the script, measures nothing)"
        echo
    } >"$out"
else
    command -v nvidia-smi >/dev/null || { echo "no NVIDIA GPU here (bench/gpu.sh --smoke checks the scripts on a CPU)" >&2; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")'
    model_args=(--budget-s 100)
    loss_args=()
    trainer_args=()
    {
        echo "# bench/gpu.sh on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
        echo
    } >"$out"
fi

# (c) runs with the attention backend and the morph dispatch whose compiled steps (b) found
# fastest, so one call measures the trainer as it would run best; an --attn-impl or --dispatch
# given after `--` still wins (argparse keeps the last one).
backend_file=$(mktemp)
dispatch_file=$(mktemp)
model_trace=$(mktemp -d)  # (b)'s compile phases, to set beside (c)'s warm-up (compile_trace.py)
trap 'rm -rf "$backend_file" "$dispatch_file" "$model_trace"' EXIT
model_args+=(--faster-backend-to "$backend_file" --faster-dispatch-to "$dispatch_file")

status=0
TORCH_TRACE=$model_trace timeout 145 "$PYTHON" bench/model_gpu.py "${model_args[@]}" 2>&1 |
    tee -a "$out" || status=1
"$PYTHON" bench/compile_trace.py "$model_trace" \
    --title "b. compile time by phase, every compiled row above (TORCH_TRACE)" | tee -a "$out" ||
    status=1
timeout 35 "$PYTHON" bench/loss_gpu.py "${loss_args[@]}" 2>&1 | tee -a "$out" || status=1
[[ -s $backend_file ]] && trainer_args+=(--attn-impl "$(<"$backend_file")")
[[ -s $dispatch_file ]] && trainer_args+=(--dispatch "$(<"$dispatch_file")")
# Its hard timeout, less 10 s to end the last subprocess, counted from its start (imports too).
trainer_args+=(--deadline-s 290 --started-at "$(date +%s)")
timeout 300 "$PYTHON" bench/trainer_gpu.py "${trainer_args[@]}" "$@" 2>&1 | tee -a "$out" || status=1
echo "tables written to $out"
exit $status
