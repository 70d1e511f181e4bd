"""The config schema as a tree of keys: ``--set key.path=value`` overrides and readable errors.

msgspec validates the configs, but its messages name only where a problem is (``unknown field
`lrr` - at `$.optim```). A user fixes a typo faster when told the nearest valid name, and an
enum faster when told the values. Both come from walking the Struct types, the same schema that
decodes the YAML, so an override is typed and checked exactly like a key in the file.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

import msgspec
import yaml

_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`(?: - at `\$(?P<at>[^`]*)`)?")
_AT = re.compile(r"(?P<message>.+) - at `\$\.(?P<at>[^`]*)`")
_ENUM = re.compile(r"Invalid enum value (?P<value>.+?) - at `\$(?P<at>[^`]*)`")


class OverrideError(ValueError):
    """A ``--set`` item is malformed or names a key the schema does not have."""


def _struct_fields(info: msgspec.inspect.Type) -> dict[str, msgspec.inspect.Type] | None:
    """The fields of a (possibly optional) Struct type, or None when it is not a Struct."""
    if isinstance(info, msgspec.inspect.UnionType):
        structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
        info = structs[0] if len(structs) == 1 else info
    if isinstance(info, msgspec.inspect.StructType):
        return {f.encode_name: f.type for f in info.fields}
    return None


PEER_NAMES = {
    "learning_rate": "optim.lr",
    "lr_scheduler_type": "optim.schedule",
    "lr_scheduler": "optim.schedule",
    "max_grad_norm": "optim.grad_clip",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "adam_epsilon": "optim.eps",
    "num_train_epochs": "train.num_epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "max_seq_length": "train.seq_len",
    "max_length": "train.seq_len",
    "sequence_len": "train.seq_len",
    "cutoff_len": "train.seq_len",
    "gradient_checkpointing": "train.grad_checkpoint",
    "dataloader_num_workers": "train.num_workers",
    "dataloader_prefetch_factor": "train.prefetch_factor",
    "torch_compile": "train.compile",
    "save_steps": "train.ckpt_interval",
    "save_total_limit": "train.keep_last",
    "logging_steps": "train.log_interval",
    "eval_steps": "validation.interval",
    "per_device_eval_batch_size": "validation.micro_batch_size",
    "output_dir": "run_dir",
}
"""Keys of Hugging Face TrainingArguments, TRL, Axolotl and LLaMA-Factory configs, and ours:
a user who writes a peer's name is told the NedoLM name instead of a near miss."""


def _unknown_key(key: str, known: Sequence[str], where: str, root: type) -> str:
    full = f"{where}.{key}" if where else key
    ours = [PEER_NAMES[key]] if key in PEER_NAMES else _elsewhere(key, where, root)
    if ours:
        return f"unknown key `{full}`: NedoLM calls it {' or '.join(f'`{o}`' for o in ours)}"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(sorted(known))}"
    return f"unknown key `{key}`{f' in `{where}`' if where else ''}; {hint}"


def _elsewhere(key: str, where: str, root: type) -> list[str]:
    """The dotted names of schema key ``key`` in sections other than ``where``."""
    found = []
    pending: list[tuple[str, msgspec.inspect.Type]] = [("", msgspec.inspect.type_info(root))]
    while pending:
        section, info = pending.pop(0)
        for name, field in (_struct_fields(info) or {}).items():
            dotted = f"{section}.{name}" if section else name
            if name == key and section != where:
                found.append(dotted)
            pending.append((dotted, field))
    return found


def _type_at(root: type, path: Sequence[str]) -> msgspec.inspect.Type | None:
    info: msgspec.inspect.Type | None = msgspec.inspect.type_info(root)
    for part in path:
        fields = _struct_fields(info) if info is not None else None
        if fields is None or part not in fields:
            return None
        info = fields[part]
    return info


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], root: type) -> dict[str, Any]:
    """Set each ``key.path=value`` of ``overrides`` in the decoded YAML ``raw`` (a new dict).

    The value is read as YAML (``3``, ``1e-4``, ``[1, 2]``, ``true``); its type is checked when
    the result is decoded against ``root``. A key must exist in the schema.
    """
    result = _deep_copy(raw)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        if not sep or not dotted:
            raise OverrideError(f"--set {item!r}: expected KEY.PATH=VALUE")
        path = dotted.split(".")
        info: msgspec.inspect.Type = msgspec.inspect.type_info(root)
        node = result
        for depth, part in enumerate(path):
            fields = _struct_fields(info)
            where = ".".join(path[:depth])
            if fields is None:
                raise OverrideError(f"--set {dotted}: `{where}` is a value, not a section")
            if part not in fields:
                raise OverrideError(
                    f"--set {dotted}: {_unknown_key(part, list(fields), where, root)}"
                )
            info = fields[part]
            if depth == len(path) - 1:
                node[part] = yaml.safe_load(text)
            else:
                if node.get(part) is None:  # absent, or an empty `train:` in the file
                    node[part] = {}
                node = node[part]
                if not isinstance(node, dict):
                    raise OverrideError(f"--set {dotted}: `{part}` in the file is not a section")
    return result


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in raw.items()}


def explain(exc: msgspec.ValidationError, root: type) -> str:
    """msgspec's message, plus the nearest valid key or the allowed values where it helps."""
    message = str(exc)
    if match := _UNKNOWN.fullmatch(message):
        at = (match["at"] or "").lstrip(".")
        path = [p for p in at.split(".") if p]
        fields = _struct_fields(_type_at(root, path)) or {}
        return _unknown_key(match["key"], list(fields), at, root)
    if match := _ENUM.fullmatch(message):
        at = match["at"].lstrip(".")
        info = _type_at(root, at.split("."))
        if isinstance(info, msgspec.inspect.UnionType):
            info = next((t for t in info.types if isinstance(t, msgspec.inspect.LiteralType)), info)
        if isinstance(info, msgspec.inspect.LiteralType):
            values = ", ".join(str(v) for v in info.values)
            return f"`{at}`: {match['value']} is not one of: {values}"
    if (match := _AT.fullmatch(message)) and match["message"].startswith(f"{match['at']}."):
        return match["message"]  # a check of ours that names the key already
    return message
