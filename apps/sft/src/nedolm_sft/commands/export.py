"""``nedolm-sft export``: a trained run as a self-contained Hugging Face style directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import click
import torch

from nedolm_sft.chat_model import export_bundle, load_chat_model
from nedolm_sft.commands.generate import data_dir_option, dtype_option

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@dtype_option([], "float32", "Weight dtype of the export (bf16, fp32 and fp16 name the same).")
@click.option("--overwrite", is_flag=True, help="Replace an existing export directory.")
@data_dir_option
def export(run_dir: Path, out: Path, dtype: str, overwrite: bool, data_dir: Path | None) -> None:
    """Export the newest checkpoint of RUN_DIR (an SFT or base run) with its tokenizer and chat
    template.

    A dense model (no morph classes) is written in Hugging Face Llama format and loads with
    transformers.LlamaForCausalLM.from_pretrained(OUT); a morph model is written with its own
    loader code and loads with
    transformers.AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True).
    Either kind's tokenizer loads with transformers.AutoTokenizer.from_pretrained(OUT) (no
    remote code), its ids named in config.json; either works with `nedolm-sft generate OUT`.

    \b
    Example:
      nedolm-sft export runs/sft-demo --out exports/sft-demo
      nedolm-sft export runs/base-tiny --data-dir corpus/ --out exports/base-tiny
    """
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise click.ClickException(f"{out} already exists and is not empty; pass --overwrite")
    chat = load_chat_model(run_dir, data_dir)
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_bundle(chat, tmp, dtype=DTYPES[dtype])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves nothing half-written
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    kind = "Llama" if chat.model.cfg.n_morph_classes == 0 else "NedoLM morph (trust_remote_code)"
    click.echo(f"exported {chat.source} → {out} ({kind} transformers format, {dtype})")
