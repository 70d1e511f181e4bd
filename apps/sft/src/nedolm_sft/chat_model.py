"""A trained model together with what it needs to chat: its tokenizer and the corpus specials.

Every place a user points the app at resolves to the same bundle: an SFT run directory (newest
checkpoint and the prepared corpus the run trained on), a base run directory (``init-base``,
``import-hf``, a pretraining job: its weights with the tokenizer it names, or a corpus's) or an
export directory (written by ``nedolm-sft export``). Prompts and the exported chat template come from the
builder's renderer (``nedolm.data.render``), so the model sees at inference what it saw in
training.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import msgspec
import torch

from nedolm.data.contract import SHARD_MANIFEST_FILE
from nedolm.data.format import SPECIAL_TOKENS_FILE, SpecialTokens, read_special_tokens
from nedolm.data.records import MESSAGE_END_TOKEN, MESSAGE_START_TOKEN
from nedolm.data.render import ConversationLayout, LayoutError, chat_template
from nedolm.data.tokenizer import (
    TextTokenizer,
    build_special_tokens,
    load_tokenizer,
    read_tokenizer_bytes,
    registered_special_tokens,
)
from nedolm.model import ModelConfig, MorphTransformer, build_model, export_hf, generate, load_hf
from nedolm.model.hf import TokenIds
from nedolm.train.base import BASE_CONFIG_FILE, model_config
from nedolm.train.base_weights import read_base_weights
from nedolm.train.checkpoint import newest_model_checkpoint
from nedolm.train.config import load_run_config
from nedolm.train.precision import COMPUTE_DTYPES, choose_precision, gpu_of
from nedolm.train.state import load_model_weights

EXPORT_SIDECAR = "nedolm"
"""Export subdirectory with the corpus specials and the original tokenizer file."""


@dataclass(frozen=True)
class Placement:
    """Where a loaded model lives and in which floating dtype."""

    device: torch.device
    dtype: torch.dtype


HOST = Placement(torch.device("cpu"), torch.float32)
"""The checkpoints' own layout: no conversion."""


def resolve_placement(device: str, dtype: str) -> Placement:
    """``--device`` and ``--dtype`` ("auto": CUDA when there is one, then bfloat16 on a GPU
    with bf16 tensor cores and float32 elsewhere, as ``train.precision: auto`` trains)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        target = torch.device(device)
    except RuntimeError as exc:
        raise click.UsageError(f"--device {device}: {exc}") from exc
    if target.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise click.UsageError(f"--device {device}: this torch build sees no CUDA device")
        if target.index is not None and target.index >= count:
            raise click.UsageError(
                f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}"
            )
    if dtype == "auto":
        return Placement(target, COMPUTE_DTYPES[choose_precision("auto", gpu_of(target))])
    return Placement(target, getattr(torch, dtype))


@dataclass
class ChatModel:
    model: MorphTransformer
    tokenizer: TextTokenizer
    specials: SpecialTokens
    source: Path

    def render(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of ``(role, content)`` messages followed by an open assistant turn."""
        contents = self.tokenizer.encode_batch([content for _, content in messages])
        try:
            return self.layout.prompt([role for role, _ in messages], contents)
        except LayoutError as exc:
            raise click.ClickException(str(exc)) from None

    @property
    def layout(self) -> ConversationLayout:
        return ConversationLayout.from_specials(self.specials)

    def reply(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int = 0,
    ) -> Iterator[str]:
        """Stream the assistant's reply as text pieces; stops at ``<|mesaj_bitir|>`` or EOS."""
        prompt = self.render(messages)
        room = self.model.cfg.max_seq_len - len(prompt)
        if room <= 0:
            raise click.ClickException(
                f"the conversation is {len(prompt)} tokens; the model holds "
                f"{self.model.cfg.max_seq_len}. Start a new conversation or shorten the prompt."
            )
        ids: list[int] = []
        shown = ""
        for token in generate(
            self.model,
            prompt,
            max_new_tokens=min(max_new_tokens, room),
            temperature=temperature,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            stop_ids=(self.specials.message_end_id, self.specials.eos_id),
            generator=torch.Generator().manual_seed(seed),
        ):
            ids.append(token)
            text = self.tokenizer.decode(ids)
            if len(text) > len(shown) and not text.endswith("\ufffd"):
                yield text[len(shown) :]
                shown = text


def load_chat_model(
    path: Path, data_dir: Path | None = None, placement: Placement = HOST
) -> ChatModel:
    """Load from an export directory (has config.json), a base run (has config.yaml) or an SFT
    run directory (has checkpoints).

    Args:
        data_dir: a prepared corpus whose tokenizer and specials a base run uses (required for a
            base run that names no tokenizer, as ``init-base`` writes); refused for other kinds.
        placement: the model's device and dtype. A run's weights are copied from the mapped
            checkpoint straight into the model there (no float32 copy on the host first).
    """
    if not path.is_dir():
        raise click.ClickException(f"{path} is not a directory (expected a run or export dir)")
    if (path / SHARD_MANIFEST_FILE).is_file():
        raise click.UsageError(
            f"{path} is a prepared corpus, not a model: point at the run dir that trained on it "
            f"(or its export); for a base run, pass the corpus as --data-dir"
        )
    if (path / BASE_CONFIG_FILE).is_file():
        return load_base_chat_model(path, data_dir, placement)
    if data_dir is not None:
        raise click.UsageError(
            f"--data-dir is for base runs; {path} is an SFT run or export and brings its tokenizer"
        )
    if (path / "config.json").is_file():
        return _load_export(path, placement)
    return _load_run(path, placement)


def _empty_model(cfg: ModelConfig, placement: Placement) -> MorphTransformer:
    """A model to load every weight into, allocated where it will run; a state dict's float32
    tensors are rounded into it as ``Tensor.to`` rounds them."""
    return build_model(cfg, init_weights=False, device=placement.device, dtype=placement.dtype)


def _load_run(run_dir: Path, placement: Placement) -> ChatModel:
    # Only the model tensors are read (mapped) and verified, never the optimizer state.
    newest = newest_model_checkpoint(run_dir)
    if newest is None:
        raise click.ClickException(
            f"{run_dir} holds no checkpoint yet: train first (nedolm-sft run CONFIG) or point "
            "at an export directory"
        )
    checkpoint, payload = newest  # a file, or a sharded (FSDP) directory's payload
    if "sft_config" not in payload:
        raise click.ClickException(f"{checkpoint} is not an SFT checkpoint (no sft_config)")
    sft = payload["sft_config"]
    trained = payload["contract"]["training"]["recipe"]["model_config"]
    chat_cfg = ModelConfig(**{**trained, "morph_dispatch": "sparse", "attn_impl": "sdpa"})
    # Every weight is loaded next. A sharded (FSDP) checkpoint is read by DCP into a host model
    # in its own layout, then moved; `to` does nothing to a model built where it runs.
    model = _empty_model(chat_cfg, HOST if checkpoint.is_dir() else placement)
    load_model_weights(checkpoint, payload, model)
    model.to(placement.device, placement.dtype)
    return _with_corpus_tokenizer(model, Path(sft["data_dir"]), checkpoint)


def load_base_chat_model(
    base_run_dir: Path, data_dir: Path | None = None, placement: Placement = HOST
) -> ChatModel:
    """A base run's model (newest checkpoint or model.safetensors) with a corpus's tokenizer, or
    without ``data_dir`` the tokenizer the base run names (``import-hf`` copies it in)."""
    base = load_run_config(base_run_dir / BASE_CONFIG_FILE)
    try:
        weights, state = read_base_weights(base_run_dir)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    chat_cfg = model_config(base, morph_dispatch="sparse", attn_impl="sdpa")
    model = _empty_model(chat_cfg, placement)
    model.load_state_dict(state)
    del state  # nothing of the checkpoint stays mapped
    if data_dir is not None:
        return _with_corpus_tokenizer(model, data_dir, weights)
    if base.tokenizer is None:
        raise click.UsageError(
            f"{base_run_dir / BASE_CONFIG_FILE} names no tokenizer (a base run written by "
            "init-base): pass --data-dir with a corpus prepared for it"
        )
    tokenizer = load_tokenizer(base_run_dir / base.tokenizer)
    # A base model knows no corpus: the seed's role registry, as a corpus without tools has.
    specials = registered_special_tokens(build_special_tokens(tokenizer, tokenizer.name), set())
    return ChatModel(model.eval(), tokenizer, specials, weights)


def _with_corpus_tokenizer(model: MorphTransformer, data_dir: Path, source: Path) -> ChatModel:
    specials = read_special_tokens(data_dir)
    tokenizer = load_tokenizer(data_dir / specials.tokenizer.file)
    return ChatModel(model.eval(), tokenizer, specials, source)


def _load_export(export_dir: Path, placement: Placement) -> ChatModel:
    sidecar = export_dir / EXPORT_SIDECAR
    specials = read_special_tokens(sidecar)
    tokenizer = load_tokenizer(sidecar / Path(specials.tokenizer.file).name)
    model = load_hf(export_dir, attn_impl="sdpa").to(placement.device, placement.dtype)
    return ChatModel(model.eval(), tokenizer, specials, export_dir)


def export_bundle(chat: ChatModel, out_dir: Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write weights (HF Llama format when dense, NedoLM with its transformers loader code when
    morph), tokenizer files and a chat template."""
    # No BOS: the model was trained without one, so the exported tokenizer names none either.
    ids = TokenIds(eos=chat.specials.eos_id, pad=chat.specials.pad_id)
    export_hf(chat.model, out_dir, dtype=dtype, token_ids=ids)
    sidecar = out_dir / EXPORT_SIDECAR
    sidecar.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(chat.tokenizer.path, sidecar / chat.tokenizer.name)
    specials = msgspec.to_builtins(chat.specials)
    specials["tokenizer"]["file"] = chat.tokenizer.name
    (sidecar / SPECIAL_TOKENS_FILE).write_text(json.dumps(specials, indent=2) + "\n")
    if chat.specials.tokenizer.kind == "tokenizers":
        _write_hf_tokenizer(chat, out_dir)
    return out_dir


def _write_hf_tokenizer(chat: ChatModel, out_dir: Path) -> None:
    """tokenizer.json with the control and pad tokens added at their corpus ids + a template.

    A tokenizer that already holds them at those ids (an earlier export's, when a fine-tuned
    model is fine-tuned again) is written as it is.
    """
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(read_tokenizer_bytes(chat.tokenizer.path).decode("utf-8"))
    specials = chat.specials
    extra = {
        specials.message_start_id: MESSAGE_START_TOKEN,
        specials.message_end_id: MESSAGE_END_TOKEN,
    }
    if specials.pad_id >= tok.get_vocab_size(with_added_tokens=True):
        extra[specials.pad_id] = "<|pad|>"
    for token_id in sorted(extra):
        if tok.token_to_id(extra[token_id]) == token_id:
            continue
        if tok.get_vocab_size(with_added_tokens=True) != token_id:
            raise click.ClickException(
                f"cannot place {extra[token_id]} at id {token_id} in the exported tokenizer"
            )
        tok.add_special_tokens([AddedToken(extra[token_id], special=True, normalized=False)])
    tok.save(str(out_dir / "tokenizer.json"))
    eos = tok.id_to_token(specials.eos_id)
    template = chat_template(eos, specials.roles)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": tok.id_to_token(specials.pad_id),
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": chat.model.cfg.max_seq_len,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [specials.message_end_id, specials.eos_id], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
