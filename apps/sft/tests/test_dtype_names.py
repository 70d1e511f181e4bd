"""bf16 and bfloat16 (fp32/float32, fp16/float16) name the same dtype wherever a dtype is taken:
``export --dtype`` and ``generate --dtype`` (torch's names before) as ``train.precision`` (ours)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from nedolm.train.testing import SMALL_BASE, init_tiny_base
from nedolm_sft.cli import cli


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    return init_tiny_base(tmp_path_factory.mktemp("base") / "base", corpus, SMALL_BASE, seed=1)


def invoke(*args: object) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def float_dtypes(export: Path) -> set[str]:
    """The dtypes of the exported floating-point tensors (the morph class table is int64)."""
    with safe_open(export / "model.safetensors", framework="pt") as weights:
        names = weights.keys()
        dtypes = {str(weights.get_slice(name).get_dtype()) for name in names}
    return {d for d in dtypes if d.startswith(("F", "BF"))}


@pytest.mark.parametrize(("short", "torch_name"), [("bf16", "BF16"), ("fp16", "F16")])
def test_export_takes_the_short_dtype_names(
    base: Path, corpus: Path, tmp_path: Path, short: str, torch_name: str
) -> None:
    invoke("export", base, "--data-dir", corpus, "--out", tmp_path / "out", "--dtype", short)
    assert float_dtypes(tmp_path / "out") == {torch_name}


def test_generate_takes_bf16_as_bfloat16(base: Path, corpus: Path) -> None:
    args = ("generate", base, "--data-dir", corpus, "--prompt", "Merhaba", "--max-new-tokens", 4)
    assert invoke(*args, "--dtype", "bf16") == invoke(*args, "--dtype", "bfloat16")
