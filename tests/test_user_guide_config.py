"""The user guide's configuration reference (§4) lists every key of the SFT config, no key the
config lacks, and each default as the code has it (four keys were missing from it once)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import yaml

from nedolm.train.config import SFTConfig

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "USER_GUIDE.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| (.*?) \|", re.M)


def reference_rows() -> dict[str, str]:
    """key -> default cell of §4's table."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## 4. Configuration reference", 1)[1].split("\n## 5.", 1)[0]
    return dict(ROW.findall(section))


def config_fields(
    struct: type, prefix: str = ""
) -> Iterator[tuple[str, msgspec.structs.FieldInfo]]:
    """Every leaf key of ``struct`` as the YAML spells it (``train.seq_len``)."""
    for field in msgspec.structs.fields(struct):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            yield from config_fields(field.type, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", field


def default_of(field: msgspec.structs.FieldInfo) -> Any:
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return field.default


def test_the_reference_lists_exactly_the_configs_keys() -> None:
    documented = set(reference_rows())
    keys = {key for key, _ in config_fields(SFTConfig)}
    assert keys - documented == set(), "config keys the guide's reference does not list"
    assert documented - keys == set(), "keys the guide lists that the config does not have"


def test_each_literal_default_in_the_reference_is_the_codes() -> None:
    rows = reference_rows()
    compared = 0
    for key, field in config_fields(SFTConfig):
        literal = re.fullmatch(r"`([^`]*)`", rows[key].strip())
        default = default_of(field)
        if literal is None or field.required:
            continue  # prose ("required", "base model's")
        value = yaml.safe_load(literal.group(1))
        if default is None and value is not None:
            continue  # says what unset resolves to (`100` warm-up steps)
        assert msgspec.convert(value, field.type, strict=False) == default, key
        compared += 1
    assert compared >= 40, compared
