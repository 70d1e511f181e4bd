"""``bench/gpu.sh --smoke`` runs every section of the GPU bench on the CPU, for real (the
scripts, the CLI subprocesses, the launcher), so the bench cannot rot between GPU sessions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = (
    "## a. Backend agreement vs sdpa",
    "## b. Training step, tiny",
    "### b. compile time by phase, every compiled row above (TORCH_TRACE)",
    "## Loss head: 204 target rows of 512",
    "## c. `nedolm-sft run`, tiny, 2x128, 2 micro-batches per step",
    "### c. compile time by phase (TORCH_TRACE)",
    "### c. checkpoint at step 7 (",
    "### c. trainer vs the model step alone",
    "### c. torch.profiler: top-15 CPU ops (no CUDA device",
    "### c. where a step's time goes",
    "## d. transformers LlamaForCausalLM",
    "## e. `nedolm-sft launch --nproc-per-node 1`, gloo (CPU)",
    "### c. `nedolm-sft generate` from the step 7 checkpoint",
    "## Section times (wall seconds, this run)",
)


def test_gpu_bench_smoke_mode_runs_every_section_into_one_file(tmp_path: Path) -> None:
    out = tmp_path / "results.md"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    text = out.read_text(encoding="utf-8")
    for header in SECTIONS:
        assert header in text, f"{header!r} missing from:\n{text}"
    number = r"[\d,.]+"
    ratio_rows = re.findall(rf"^\| ({number}) \| ({number}) \| ({number}) \|$", text, re.M)
    assert len(ratio_rows) == 2, text  # trainer / model step, trainer / Llama
    for first, second, ratio in ratio_rows:
        a, b = (float(v.replace(",", "")) for v in (first, second))
        assert abs(float(ratio) - a / b) < 0.01, (first, second, ratio)  # tokens/s rounded
    error = r"\d\.\de[+-]\d\d"
    head_row = rf"^\| nedolm fused \| {number} \| n/a \(CPU\) \| 1.00 \| ({error}) \| ({error}) \|$"
    head = re.search(head_row, text, re.M)
    assert head, text
    assert all(float(e) < 1e-5 for e in head.groups()), head.groups()  # float32 on CPU
    assert re.search(r"^\| ddp \| ok, 1 steps \|", text, re.M), text
    # (c)'s run accumulates as its heading says (the trainer's own schedule line).
    assert "(micro 2 x accum 2 x 1 ranks)" in text, text
    # (b)'s compiled rows are in its compile table: the block's graph, traced by the process.
    assert re.search(
        r"^\| [\d.]+ \| \d+/\d+ \| forward \| forward \| \d+ \| [\d.]+ \|", text, re.M
    ), text
    # (b) compares the compiled step of each backend and each morph dispatch, and (c) runs with
    # the fastest (on a CPU only sdpa trains).
    backend = re.search(
        r"^attention backend for the trainer's run: (\w+) \(compiled step", text, re.M
    )
    chosen = re.search(r"^morph dispatch for the trainer's run: (\w+) \(compiled step", text, re.M)
    assert backend and backend[1] == "sdpa" and chosen, text
    product = rf"^# The product: .*, attn_impl {backend[1]}, {chosen[1]} morph dispatch$"
    assert re.search(product, text, re.M), text
    assert re.search(r"^\| fsdp \| ok, 1 steps \|", text, re.M), text
    # The trainer's own profile window (3 steps after the measured ones) and the model step's.
    cpu_row = rf"({number}) \| n/a \(CPU\) \| \| \| \| ({number}) \|$"
    trainer = re.search(rf"^\| trainer, steps 4-6 \| {cpu_row}", text, re.M)
    alone = re.search(rf"^\| model step alone, 3 steps \| {cpu_row}", text, re.M)
    assert trainer and alone, text
    assert float(trainer[2]) >= 1.0  # the gradient norm, read every step
    # After the profile window, one checkpoint written behind a training step: its figures come
    # right after (c)'s tables; `generate` answering from it comes last, after (e), so a late
    # run skips that row and not (e) (issue 25's pause and reply time on a GPU).
    sections = (
        "## c. `nedolm-sft run`",
        "### c. checkpoint at step 7 (",
        "### c. trainer vs the model step alone",
        "## e.",
        "### c. `nedolm-sft generate` from the step 7 checkpoint",
    )
    order = [text.index(header) for header in sections]
    assert order == sorted(order), order
    checkpoint = text.split(sections[1], 1)[1]
    assert re.match(r"[\d.]+ GiB, in the background\)", checkpoint), checkpoint
    save = re.search(
        rf"^\| ({number}) \| ({number}) \| ({number}) \| {number} \|$", checkpoint, re.M
    )
    assert save, checkpoint
    pause, write, during = (float(v) for v in save.groups())
    assert pause >= 0 and write > 0 and during > 0, save.groups()
    generate = text.split(sections[-1], 1)[1]
    seconds = re.search(rf"^\| ({number}) \|$", generate, re.M)
    assert seconds and float(seconds[1]) > 0, generate
    assert re.search(r"^reply: \S", generate, re.M), generate
    # Each section's time beside its estimate: what a GPU run gives to correct EXPECTED_S.
    times = text.split(SECTIONS[-1], 1)[1]
    for name in ("c. model step", "d. Llama", "e. launch", "c. generate"):
        row = rf"^\| {re.escape(name)} \| \d+ \| ({number}) \|$"
        took = re.search(row, times, re.M)
        assert took and float(took[1]) > 0, (name, times)
