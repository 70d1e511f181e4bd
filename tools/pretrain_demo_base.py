"""Pretrain the small Turkish base model that ``nedolm-sft demo`` fine-tunes, on CPU, reproducibly.

The text is the content of the shipped Turkish chat files (``tr_chat/*.jsonl``) as plain
documents: each conversation's messages joined by newlines, followed by EOS, with no control
tokens or role headers (those are what SFT teaches). The chat files alone are only ~314k
tokens, so ``--extra-text`` adds plain documents (Turkish documentation gathered from Debian
packages by ``tools/gather_demo_text.py``). Every record that shares a message with the demo's
own sample (``nedolm_sft/default/tr_chat_sample.jsonl``) is left out, and so is every extra
document quoting a sample message or held-out prompt, so neither the demo's validation
conversations nor its held-out prompts were ever seen in pretraining. A fixed slice of all the
documents (by content hash) is held out; its loss is reported, overall and per part, and its
text is written beside the weights so the figure can be re-checked.

Everything is seeded (document order, initialisation, the held-out slice) and the run is a
fixed number of steps, so the same command on the same torch build (and, with
``--precision bfloat16``, the same kind of CPU) gives the same weights.
The model is the project's own MorphTransformer (dense: a plain Llama model; tied embeddings
unless ``--tie-embeddings false``) trained with its own loss, AdamW groups and learning-rate
schedule. Vocabulary and special ids are those ``nedolm.data`` assigns for the shipped
tokenizer, so the result loads as a base run.

Output (written to a temporary directory, then renamed into place)::

    OUT/config.yaml          the base run's RunConfig, as ``nedolm-sft init-base`` writes it
    OUT/model.safetensors    the weights (bf16 storage when fp32 would exceed the size cap)
    OUT/heldout.txt.gz       the held-out documents, one per line
    OUT/RECIPE.md            command, data, hyperparameters, wall time, machine, held-out loss
    OUT/pretraining.json     parameters, tokens seen, held-out loss (the demo prints them)

Example (the exact command of the shipped base is in its RECIPE.md)::

    python tools/gather_demo_text.py --cache /tmp/demo-debs --out /tmp/demo_text.jsonl
    python tools/pretrain_demo_base.py --data-dir /work/shared/data/tr_chat \\
        --extra-text /tmp/demo_text.jsonl --out apps/sft/src/nedolm_sft/default/base
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from nedolm.data.inputs import read_records
from nedolm.data.sources import Conversation, RecordPolicy, Rejected, parse_record
from nedolm.data.tokenizer import build_special_tokens, load_tokenizer
from nedolm.model import IGNORE_INDEX, ModelConfig, MorphTransformer, build_model, packed_layout
from nedolm.train.config import OptimConfig, RunConfig
from nedolm.train.optim import build_optimizer, lr_at_step, set_lr

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "apps/sft/src/nedolm_sft/default"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
HELDOUT_FILE = "heldout.txt.gz"
RECIPE_FILE = "RECIPE.md"
PRETRAINING_FILE = "pretraining.json"  # what ``nedolm-sft demo`` says about the base
HELDOUT_PROMPTS_FILE = "heldout_prompts.jsonl"
MIN_BANNED_CHARS = 20
PART_NAMES = {"all": "all", "chat": "chat conversations", "extra": "extra text"}
MAX_WEIGHTS_BYTES = 25 * 1024 * 1024
PRECISION_NAMES = {"float32": "float32", "bfloat16": "bf16 autocast over float32 weights"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything that decides the weights, besides the data and the torch build."""

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    tie_embeddings: bool = True  # False: an output head of its own (twice the embedding bytes)
    seq_len: int = 256  # tokens per training row (documents are packed, attention isolated)
    batch_rows: int = 8
    steps: int = 300  # the learning-rate schedule spans this many steps
    stop_step: int = 0  # stop after this step (0: after ``steps``); set by --minutes
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.1
    seed: int = 20261203
    precision: str = "float32"  # or "bfloat16": bf16 autocast (AMX/AVX-512 matmuls), fp32 weights
    eval_interval: int = 50
    heldout_every: int = 40  # a document is held out when its content hash is 0 modulo this


# ---------------------------------------------------------------------------- data


def conversation_text(conversation: Conversation) -> str:
    """A conversation as one plain document: its message contents, one per line."""
    return "\n".join(message.text for message in conversation.messages)


def read_conversations(path: Path) -> Iterator[Conversation]:
    """The parseable conversations of a chat JSONL file (malformed records are skipped)."""
    policy = RecordPolicy(invalid_records="drop", unsupported_roles="drop")
    for line_no, raw in read_records(path):
        parsed = raw if isinstance(raw, Rejected) else parse_record(raw, path.name, line_no, policy)
        if isinstance(parsed, Conversation):
            yield parsed


def banned_messages(excluded: Path) -> set[str]:
    """Every message of the demo sample ``excluded``, and every held-out prompt beside it."""
    banned = {m.text.strip() for c in read_conversations(excluded) for m in c.messages}
    prompts = excluded.with_name(HELDOUT_PROMPTS_FILE)
    if prompts.is_file():
        records = (json.loads(raw) for _, raw in read_records(prompts) if isinstance(raw, bytes))
        banned |= {str(record["prompt"]).strip() for record in records}
    return banned


def read_extra_text(path: Path) -> Iterator[str]:
    """The ``text`` of every record of a JSON-lines file written by ``gather_demo_text.py``."""
    for line_no, raw in read_records(path):
        record = None if isinstance(raw, Rejected) else json.loads(raw)
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SystemExit(f'{path}:{line_no}: not a {{"text": ...}} record')
        yield record["text"]


def pretraining_documents(data_dir: Path, excluded: Path, extra: Sequence[Path] = ()) -> list[str]:
    """Unique plain-text documents of ``data_dir/*.jsonl`` and ``extra``, none from ``excluded``.

    A conversation is left out when it shares any message with the demo sample (not only the
    whole record: that also catches the same conversation shipped in another format, e.g. the
    Alpaca and chat copies of the seed tasks). An ``extra`` document is left out when it
    contains a sample message or held-out prompt of at least ``MIN_BANNED_CHARS`` characters
    (shorter ones, like "1919", are too common to mean a leak).
    """
    banned = banned_messages(excluded)
    documents: dict[str, None] = {}  # insertion-ordered set
    for path in sorted(Path(data_dir).glob("*.jsonl")):
        for conversation in read_conversations(path):
            if not any(m.text.strip() in banned for m in conversation.messages):
                documents.setdefault(conversation_text(conversation), None)
    if not documents:
        raise SystemExit(f"{data_dir}: no *.jsonl conversation left for pretraining")
    long_banned = [text for text in banned if len(text) >= MIN_BANNED_CHARS]
    for path in extra:
        for text in read_extra_text(path):
            if not any(b in text for b in long_banned):
                documents.setdefault(text, None)
    return list(documents)


def is_heldout(document: str, every: int) -> bool:
    """The fixed held-out slice: about 1 document in ``every``, chosen by content hash."""
    digest = hashlib.blake2b(document.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


def encode_documents(tokenizer_path: Path, documents: Sequence[str]) -> list[list[int]]:
    """Token ids of each document followed by EOS."""
    tokenizer = load_tokenizer(tokenizer_path)
    return [[*ids, tokenizer.eos_id] for ids in tokenizer.encode_batch(list(documents))]


def token_rows(documents: Sequence[list[int]], row_len: int) -> torch.Tensor:
    """Documents concatenated and cut into [N, row_len] rows; the ragged tail is dropped."""
    stream = torch.tensor([t for doc in documents for t in doc], dtype=torch.long)
    usable = len(stream) // row_len * row_len
    if usable == 0:
        raise SystemExit(f"only {len(stream)} tokens: fewer than one row of {row_len}")
    return stream[:usable].view(-1, row_len)


def heldout_rows(documents: Sequence[list[int]], row_len: int) -> torch.Tensor:
    """The held-out stream in rows, its tail padded with EOS (whose targets are ignored)."""
    stream = [t for doc in documents for t in doc]
    eos = stream[-1]
    stream += [eos] * (-len(stream) % row_len)
    return torch.tensor(stream, dtype=torch.long).view(-1, row_len)


def epoch_batches(
    documents: Sequence[list[int]], row_len: int, batch_rows: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless [batch_rows, row_len] batches; each epoch reshuffles the documents from ``seed``."""
    for epoch in range(sys.maxsize):
        order = list(range(len(documents)))
        random.Random(seed + epoch).shuffle(order)
        rows = token_rows([documents[i] for i in order], row_len)
        for start in range(0, len(rows) - batch_rows + 1, batch_rows):
            yield rows[start : start + batch_rows]


# ---------------------------------------------------------------------------- model


def lm_loss(model: MorphTransformer, rows: torch.Tensor, eos_id: int, reduction: str) -> tuple:
    """Next-token loss of packed rows [B, S+1] with documents isolated; (loss, target count).

    The token after an EOS starts an unrelated document, so EOS positions have no target.
    """
    inputs, labels = rows[:, :-1], rows[:, 1:].clone()
    labels[inputs == eos_id] = IGNORE_INDEX
    cu_seqlens, position_ids = packed_layout(inputs, eos_id)
    loss, _ = model(
        inputs,
        labels,
        return_logits=False,
        loss_reduction=reduction,
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
    )
    return loss, int((labels != IGNORE_INDEX).sum())


@torch.no_grad()
def heldout_totals(model: MorphTransformer, rows: torch.Tensor, eos_id: int) -> tuple[float, int]:
    """(summed next-token loss in nats, target count) over every held-out target, in float32."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), 16):
        loss_sum, targets = lm_loss(model, rows[start : start + 16], eos_id, "sum")
        total, count = total + float(loss_sum), count + targets
    model.train(was_training)
    return total, count


def heldout_loss(model: MorphTransformer, rows: torch.Tensor, eos_id: int) -> float:
    """Mean next-token loss (nats) over every held-out target."""
    total, count = heldout_totals(model, rows, eos_id)
    return total / count


def heldout_scores(
    model: MorphTransformer, tokenizer_path: Path, texts: Sequence[str], row_len: int, eos_id: int
) -> tuple[float, float]:
    """(nats per token, bits per character) of ``texts``: the second compares tokenizers."""
    rows = heldout_rows(encode_documents(tokenizer_path, texts), row_len)
    total, count = heldout_totals(model, rows, eos_id)
    return total / count, total / math.log(2) / sum(len(t) for t in texts)


def dense_model_config(recipe: Recipe, vocab_size: int) -> ModelConfig:
    """A dense (Llama-equivalent) MorphTransformer sized by ``recipe``."""
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=recipe.d_model,
        n_layers=recipe.n_layers,
        n_heads=recipe.n_heads,
        n_kv_heads=recipe.n_kv_heads,
        ffn_dim=recipe.ffn_dim,
        tie_embeddings=recipe.tie_embeddings,
        max_seq_len=1024,
    )


def weights_to_store(model: MorphTransformer) -> dict[str, torch.Tensor]:
    """The state dict in float32, or bf16 when float32 would not fit MAX_WEIGHTS_BYTES."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    fp32_bytes = sum(v.numel() * 4 for v in state.values())
    dtype = torch.float32 if fp32_bytes <= MAX_WEIGHTS_BYTES else torch.bfloat16
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def load_stored(cfg: ModelConfig, weights: Path) -> MorphTransformer:
    """A float32 model holding the stored weights (exactly what a base run load sees)."""
    model = build_model(cfg)
    model.load_state_dict({k: v.float() for k, v in load_file(weights).items()})
    return model


# ---------------------------------------------------------------------------- output


def write_base(
    out: Path,
    model: MorphTransformer,
    eos_id: int,
    heldout_text: Sequence[str],
    recipe_md: str,
    pretraining: dict[str, float] | None = None,
) -> None:
    """Write the base run into a temporary sibling of ``out``, then rename it into place."""
    out = out.resolve()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        run_config = RunConfig(
            model=dataclasses.asdict(model.cfg), eos_id=eos_id, tokenizer="../tokenizer.json.gz"
        )
        (tmp / CONFIG_FILE).write_bytes(msgspec.yaml.encode(run_config))
        save_file(weights_to_store(model), str(tmp / WEIGHTS_FILE))
        os.chmod(tmp / WEIGHTS_FILE, 0o644)
        lines = "".join(json.dumps(text, ensure_ascii=False) + "\n" for text in heldout_text)
        (tmp / HELDOUT_FILE).write_bytes(gzip.compress(lines.encode(), mtime=0))
        (tmp / RECIPE_FILE).write_text(recipe_md, encoding="utf-8")
        if pretraining is not None:
            (tmp / PRETRAINING_FILE).write_text(json.dumps(pretraining, indent=1) + "\n")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_heldout_text(base_dir: Path) -> list[str]:
    """The held-out documents written beside a base by ``write_base``."""
    with gzip.open(Path(base_dir) / HELDOUT_FILE, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def machine() -> str:
    """CPU model, core count and OS, for the record."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
        if line.startswith("model name")
    ]
    cpu = names[0] if names else platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}"


def recipe_markdown(
    *,
    argv: Sequence[str],
    recipe: Recipe,
    cfg: ModelConfig,
    stats: dict[str, object],
    curve: list[tuple[int, float]],
) -> str:
    """RECIPE.md: how these weights were made and what they score, for a human and for tests."""
    lines = [
        "# The demo base model: how it was made",
        "",
        "Pretrained from scratch by `tools/pretrain_demo_base.py` (see its docstring and the user",
        "guide). Re-running the command below on the same torch build and CPU kind reproduces the",
        "weights (bf16 matmuls take other kernels on other CPUs: AMX, AVX-512, AVX2).",
        "",
        "```",
        "python " + " ".join(argv),
        "```",
        "",
        f"- Model: dense MorphTransformer (Llama-equivalent, "
        f"{'tied embeddings' if cfg.tie_embeddings else 'own output head'}), {stats['params']:,} "
        f"parameters: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} KV), SwiGLU {cfg.ffn_dim}, vocabulary {cfg.vocab_size} padded to "
        f"{cfg.padded_vocab_size}.",
        f"- Data: {stats['documents']:,} unique plain-text documents, EOS after each: "
        f"{stats['chat_documents']:,} conversations of `{stats['data_dir']}/*.jsonl` (messages "
        "joined by newlines; every record sharing a message with the demo sample "
        "`tr_chat_sample.jsonl` excluded)"
        + (
            f" and {stats['documents'] - stats['chat_documents']:,} documents of "
            + ", ".join(f"`{path}`" for path in stats["extra_text"])
            + " (made by `tools/gather_demo_text.py`; any quoting a sample message or held-out "
            "prompt excluded)"
            if stats["extra_text"]
            else ""
        )
        + f"; {stats['train_tokens']:,} training tokens. Tokenizer: the shipped "
        f"`tokenizer.json.gz` (sha256 {stats['tokenizer_sha256']}).",
        f"- Held-out slice: the {stats['heldout_documents']} documents whose blake2b-64 content "
        f"hash is 0 mod {recipe.heldout_every} ({stats['heldout_tokens']:,} tokens), stored in "
        f"`{HELDOUT_FILE}`.",
        f"- Training: {recipe.stop_step or recipe.steps} steps (schedule over {recipe.steps}) of {recipe.batch_rows} packed rows x {recipe.seq_len} "
        f"tokens (documents attention-isolated), AdamW (betas 0.9/0.95, weight decay "
        f"{recipe.weight_decay}, no decay on norms/embeddings), lr {recipe.lr} with "
        f"{recipe.warmup_steps} warm-up steps and cosine decay to {recipe.min_lr_ratio} x, "
        f"grad clip 1.0, seed {recipe.seed}, {PRECISION_NAMES[recipe.precision]}, "
        f"{stats['threads']} torch thread{'s' if stats['threads'] != 1 else ''}; "
        f"{(recipe.stop_step or recipe.steps) * recipe.batch_rows * recipe.seq_len:,} token "
        "positions seen.",
        f"- Stored: `{WEIGHTS_FILE}` in {stats['weights_dtype']} ({stats['weights_bytes']:,} "
        "bytes).",
        f"- Machine: {stats['machine']}; torch {torch.__version__}; wall time "
        f"{stats['wall_minutes']:.1f} min.",
        "",
        "Held-out loss by step (nats per token):",
        "",
        "| step | held-out loss |",
        "|---:|---:|",
        *(f"| {step} | {loss:.4f} |" for step, loss in curve),
        "",
        "Held-out scores of the stored weights by part of the mixture (bits per character: the "
        "summed loss over the characters of the documents, for comparing tokenizers):",
        "",
        "| part | documents | nats per token | bits per character |",
        "|---|---:|---:|---:|",
        *(
            f"| {PART_NAMES[name]} | {stats['heldout_parts'][name]} | {nats:.4f} | {bpc:.4f} |"
            for name, (nats, bpc) in stats["heldout_scores"].items()
        ),
        "",
        "Final held-out loss of the stored weights, as loaded by a base run "
        f"(nats per token): {stats['final_heldout_loss']:.4f}",
        "",
    ]
    return "\n".join(lines)


def read_recipe_loss(recipe_md: str) -> float:
    """The final held-out loss recorded by ``recipe_markdown``."""
    return float(recipe_md.rsplit("(nats per token):", 1)[1].split()[0])


# ---------------------------------------------------------------------------- main


def pretrain(args: argparse.Namespace, argv: Sequence[str]) -> float:
    """Run the recipe and write the base; returns the stored weights' held-out loss."""
    began = time.monotonic()
    torch.set_num_threads(args.threads)
    recipe = Recipe(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)},
    )
    if recipe.precision not in PRECISION_NAMES:
        raise SystemExit(
            f"--precision {recipe.precision}: expected one of {sorted(PRECISION_NAMES)}"
        )
    tokenizer_path = args.default_dir / "tokenizer.json.gz"
    specials = build_special_tokens(load_tokenizer(tokenizer_path), tokenizer_path.name)
    sample = args.default_dir / "tr_chat_sample.jsonl"
    documents = pretraining_documents(args.data_dir, sample, args.extra_text)
    chat_count = len(pretraining_documents(args.data_dir, sample))  # they come first
    if args.max_documents:
        documents = documents[: args.max_documents]
    heldout_text = [d for d in documents if is_heldout(d, recipe.heldout_every)]
    if not heldout_text:
        raise SystemExit(f"no document is held out at --heldout-every {recipe.heldout_every}")
    train_text = [d for d in documents if not is_heldout(d, recipe.heldout_every)]
    train_docs = encode_documents(tokenizer_path, train_text)
    heldout_docs = encode_documents(tokenizer_path, heldout_text)
    heldout = heldout_rows(heldout_docs, recipe.seq_len + 1)
    eos_id = specials.eos_id

    def report(entry: dict[str, object]) -> None:
        print(json.dumps(entry), flush=True)

    autocast = recipe.precision == "bfloat16"  # held-out scores are always float32
    cfg = dense_model_config(recipe, specials.vocab_size)
    torch.manual_seed(recipe.seed)
    model = build_model(cfg)
    optim_cfg = OptimConfig(
        lr=recipe.lr,
        min_lr_ratio=recipe.min_lr_ratio,
        weight_decay=recipe.weight_decay,
        warmup_steps=recipe.warmup_steps,
        schedule="cosine",
    )
    optimizer = build_optimizer(model, optim_cfg)
    batches = epoch_batches(train_docs, recipe.seq_len + 1, recipe.batch_rows, recipe.seed)
    curve = [(0, heldout_loss(model, heldout, eos_id))]
    report({"step": 0, "heldout_loss": curve[-1][1], "params": model.num_params()})
    last = recipe.stop_step or recipe.steps
    for step in range(last):
        set_lr(optimizer, lr_at_step(step, optim_cfg, recipe.steps))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = lm_loss(model, next(batches), eos_id, "mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % 25 == 0:
            report(
                {
                    "step": done,
                    "loss": float(loss.detach()),
                    "minutes": (time.monotonic() - began) / 60,
                }
            )
        out_of_time = args.minutes and time.monotonic() - began > 60 * args.minutes
        if done % recipe.eval_interval == 0 or done == last or out_of_time:
            curve.append((done, heldout_loss(model, heldout, eos_id)))
            report({"step": done, "heldout_loss": curve[-1][1]})
        if out_of_time and done < last:
            # Recorded as --stop-step so that the command in RECIPE.md reproduces these weights.
            argv = [*without_option(argv, "--minutes"), "--stop-step", str(done)]
            recipe = dataclasses.replace(recipe, stop_step=done)
            break

    stored = weights_to_store(model)
    check_dir = args.out.resolve().with_name(f".{args.out.name}.check-{os.getpid()}")
    check_dir.mkdir(parents=True, exist_ok=True)
    try:  # measure the stored (possibly bf16-rounded) weights, not the in-memory ones
        save_file(stored, str(check_dir / WEIGHTS_FILE))
        final_model = load_stored(cfg, check_dir / WEIGHTS_FILE)
        final = heldout_loss(final_model, heldout, eos_id)
        parts = {
            "all": heldout_text,
            "chat": [d for d in documents[:chat_count] if is_heldout(d, recipe.heldout_every)],
            "extra": [d for d in documents[chat_count:] if is_heldout(d, recipe.heldout_every)],
        }
        scores = {
            name: heldout_scores(final_model, tokenizer_path, texts, recipe.seq_len + 1, eos_id)
            for name, texts in parts.items()
            if texts
        }
    finally:
        shutil.rmtree(check_dir, ignore_errors=True)
    dtype = next(iter(stored.values())).dtype
    stats = {
        "data_dir": args.data_dir,
        "params": model.num_params(),
        "documents": len(documents),
        "chat_documents": min(chat_count, len(documents)),
        "extra_text": [str(path) for path in args.extra_text],
        "heldout_parts": {name: len(texts) for name, texts in parts.items()},
        "heldout_scores": scores,
        "train_tokens": sum(len(d) for d in train_docs),
        "heldout_documents": len(heldout_text),
        "heldout_tokens": sum(len(d) for d in heldout_docs),
        "tokenizer_sha256": specials.tokenizer.sha256,
        "weights_dtype": str(dtype).removeprefix("torch."),
        "weights_bytes": sum(v.numel() * v.element_size() for v in stored.values()),
        "machine": machine(),
        "threads": args.threads,
        "wall_minutes": (time.monotonic() - began) / 60,
        "final_heldout_loss": final,
    }
    recipe_md = recipe_markdown(argv=argv, recipe=recipe, cfg=cfg, stats=stats, curve=curve)
    pretraining = {
        "parameters": stats["params"],
        "tokens_seen": (recipe.stop_step or recipe.steps) * recipe.batch_rows * recipe.seq_len,
        "training_tokens": stats["train_tokens"],
        "heldout_loss": round(final, 4),
    }
    write_base(args.out, model, eos_id, heldout_text, recipe_md, pretraining)
    report({"final_heldout_loss": final, "out": str(args.out)})
    return final


def without_option(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` less ``flag`` and its value (either ``--flag V`` or ``--flag=V``)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept


def parse_bool(text: str) -> bool:
    """``true``/``false`` (any case) as a bool: ``bool("false")`` would be True."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="the tr_chat/*.jsonl folder")
    parser.add_argument("--out", type=Path, required=True, help="the base run folder to write")
    parser.add_argument("--default-dir", type=Path, default=DEFAULT_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="wall-time budget: stop after the step that exceeds it, recorded as --stop-step",
    )
    parser.add_argument(
        "--extra-text",
        type=Path,
        action="append",
        default=[],
        help='a JSON-lines file of {"text": ...} documents to add (tools/gather_demo_text.py)',
    )
    parser.add_argument(
        "--max-documents", type=int, default=0, help="use only the first N documents (tests)"
    )
    for field in dataclasses.fields(Recipe):
        flag = "--" + field.name.replace("_", "-")
        kind = parse_bool if isinstance(field.default, bool) else type(field.default)
        parser.add_argument(flag, dest=field.name, type=kind, default=field.default)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    pretrain(parse_args(argv), ["tools/pretrain_demo_base.py", *argv])


if __name__ == "__main__":
    main()
