"""CPU benchmark of nedolm-model against references measured in the same run.

Prints three markdown tables (medians over --repeats interleaved runs):
  1. training-step tokens/s (forward, backward, AdamW) of the dense tiny-width model against
     transformers' LlamaForCausalLM of the same shape; target >= 1.5x;
  2. peak memory of the fused loss head for 16k targets at vocab 32064 against naive fp32
     logits + cross-entropy (each measured as peak RSS growth in a fresh subprocess, Linux);
     target <= 25%;
  3. step time of the morph model with masked and sparse dispatch relative to dense.

Usage: python bench/model.py [--repeats 3] [--threads 1]
(one thread by default: on a shared CPU it is the least noisy comparison)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nedolm.model import ModelConfig, build_model, fused_linear_cross_entropy

SHAPE = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=704)
VOCAB, BATCH, SEQ_LEN, TARGET_FRACTION = 32064, 4, 1024, 0.4
HEAD_TARGETS = 16384


def sft_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)
    labels[torch.rand(BATCH, SEQ_LEN, generator=gen) >= TARGET_FRACTION] = -100
    return input_ids, labels


def nedolm_step(cfg: ModelConfig) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build_model(cfg)
    if cfg.n_morph_classes:
        model.set_morph_classes(torch.randint(0, cfg.n_morph_classes, (cfg.vocab_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids, labels = sft_batch()

    def step() -> None:
        loss, _ = model(input_ids, labels, return_logits=False, loss_reduction="mean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def llama_step() -> Callable[[], None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=SHAPE["d_model"],
        num_hidden_layers=SHAPE["n_layers"],
        num_attention_heads=SHAPE["n_heads"],
        num_key_value_heads=SHAPE["n_kv_heads"],
        intermediate_size=SHAPE["ffn_dim"],
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()  # attention: sdpa, the transformers default
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids, labels = sft_batch()
    # HF shifts labels itself; give it the unshifted sequence so both see the same targets.
    hf_labels = torch.cat((torch.full((BATCH, 1), -100), labels[:, :-1]), dim=1)

    def step() -> None:
        model(input_ids=input_ids, labels=hf_labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def median_seconds(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Interleave the candidates so CPU contention hits them alike; one warm-up each."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def head_peak_bytes(kind: str) -> int:
    """Peak RSS growth of one loss-head forward + backward (run in this fresh process)."""
    torch.manual_seed(0)
    hidden = torch.randn(HEAD_TARGETS, SHAPE["d_model"], requires_grad=True)
    weight = (torch.randn(VOCAB, SHAPE["d_model"]) * 0.02).requires_grad_()
    targets = torch.randint(0, VOCAB, (HEAD_TARGETS,))
    # ru_maxrss survives exec (it would report the parent's peak); VmHWM is this process's own,
    # and writing 5 to clear_refs resets it to the current RSS.
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    baseline = _status_bytes("VmRSS")
    if kind == "naive":
        loss = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
    else:
        loss = fused_linear_cross_entropy(
            hidden, weight, targets, vocab_size=VOCAB, reduction="sum", fp32_logits=True
        )
    loss.backward()
    return _status_bytes("VmHWM") - baseline


def _status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def probe(kind: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--head-probe", kind],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head-probe", choices=["naive", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.head_probe:
        print(head_peak_bytes(args.head_probe))
        return

    tokens = BATCH * SEQ_LEN
    dense = ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, attn_impl="sdpa", **SHAPE)
    seconds = median_seconds({"nedolm": nedolm_step(dense), "llama": llama_step()}, args.repeats)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.repeats} repeats (medians)\n")
    rows = [
        ("transformers LlamaForCausalLM (sdpa)", seconds["llama"]),
        ("nedolm dense, fused loss head", seconds["nedolm"]),
    ]
    print(f"## Training step, {BATCH}x{SEQ_LEN} tokens, {TARGET_FRACTION:.0%} targets\n")
    print("| model | step s | tokens/s | vs Llama |\n|---|---|---|---|")
    for name, secs in rows:
        ratio = seconds["llama"] / secs
        print(f"| {name} | {secs:.3f} | {tokens / secs:,.0f} | {ratio:.2f}x |")

    naive, fused = probe("naive"), probe("fused")
    print(f"\n## Loss head peak memory, {HEAD_TARGETS} targets x vocab {VOCAB}\n")
    print("| head | peak MiB | vs naive |\n|---|---|---|")
    for name, peak in (("naive fp32 logits + CE", naive), ("fused chunked head", fused)):
        print(f"| {name} | {peak / 2**20:,.0f} | {peak / naive:.1%} |")

    morph = {
        "dense": dense,
        "masked": ModelConfig(**{**dense.to_dict(), "n_morph_classes": 3, "morph_expert_dim": 64}),
    }
    morph["sparse"] = ModelConfig(**{**morph["masked"].to_dict(), "morph_dispatch": "sparse"})
    seconds = median_seconds({k: nedolm_step(cfg) for k, cfg in morph.items()}, args.repeats)
    print("\n## Morph dispatch (3 classes x expert 64), training step\n")
    print("| model | step s | vs dense |\n|---|---|---|")
    for name, secs in seconds.items():
        print(f"| {name} | {secs:.3f} | {secs / seconds['dense']:.2f}x |")


if __name__ == "__main__":
    main()
