"""``prepare --mix`` / ``--mix-file`` as a user types them: the summary and ``stats`` account
for each source (kept, repeated, left out, dropped), the two spellings build the same corpus,
and misuse gets one clear error. Real processes on the committed real-data fixture."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
TOKENIZER = FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"
ARC, NUTUK = FIXTURES / "tr_chat" / "arc_tr.jsonl", FIXTURES / "tr_chat" / "nutuk_qa.jsonl"
RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture
COMMON = ("--tokenizer", str(TOKENIZER), "--seq-len", "512", "--shards", "2", "--no-progress")


def test_mixture_accounting_in_prepare_and_stats(nedolm_sft: RunCli, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    arc_copy, nutuk_copy = (shutil.copy(p, tmp_path / "data") for p in (ARC, NUTUK))
    mix_file = tmp_path / "mix.yaml"  # paths in it are relative to it
    mix_file.write_text("data/arc_tr.jsonl: 0.7\ndata/nutuk_qa.jsonl: 0.3\n", encoding="utf-8")
    out = tmp_path / "c"
    args = ("--mix-total", "20", "--out", str(out), *COMMON)
    result = nedolm_sft("prepare", "--mix-file", str(mix_file), *args)
    assert result.returncode == 0, result.stderr
    # 0.7 and 0.3 of 20: arc 14 from its 8 (6 repeated), nutuk 6 of its 8 (2 left out)
    arc = "mixture arc_tr.jsonl (weight 0.7): 14 conversations = kept 8 + repeated 6; left out 0"
    nutuk = "mixture nutuk_qa.jsonl (weight 0.3): 6 conversations = kept 6 + repeated 0; left out 2"
    assert "records 16 = kept 14 + left out 2 + dropped 0" in result.stdout
    assert arc in result.stdout and nutuk in result.stdout
    assert "20 documents" in result.stdout
    stats = nedolm_sft("stats", str(out))
    assert stats.returncode == 0, stats.stderr
    assert arc in stats.stdout and nutuk in stats.stdout
    assert "documents 20," in stats.stdout

    again = nedolm_sft("prepare", "--mix", f"{arc_copy}=0.7", "--mix", f"{nutuk_copy}=0.3", *args)
    assert again.returncode == 0, again.stderr
    assert "unchanged (identical rebuild)" in again.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((str(ARC), "--mix", f"{NUTUK}=1"), "either as INPUTS or with --mix"),
        (("--mix", f"{ARC}=heavy"), f"--mix {ARC}=heavy: the weight must be a positive number"),
        (("--mix", f"{ARC}=0"), "the weight must be a positive number"),
        (("--mix", f"{ARC}=1", "--mix", f"{ARC}=2"), f"{ARC}: weighed twice"),
        (("--mix", f"{ARC.parent / 'nope.jsonl'}=1"), "nope.jsonl: input file not found"),
        ((str(ARC), "--mix-total", "5"), "--mix-total needs --mix"),
        ((str(ARC), "--val-input", str(NUTUK), "--val-fraction", "0.1"), "not both"),
        # at seq_len 96 every tquad_dev_v2 record is too long, while nutuk keeps all of its own
        ((str(NUTUK), "--val-input", str(FIXTURES / "tr_chat" / "tquad_dev_v2.jsonl"),
          "--seq-len", "96"), "tquad_dev_v2.jsonl: the validation input kept no document"),
    ],
)  # fmt: skip
def test_mixture_misuse_is_one_clear_error(
    nedolm_sft: RunCli, tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    result = nedolm_sft("prepare", *COMMON, "--out", str(tmp_path / "c"), *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert needle in result.stderr, result.stderr
    assert not (tmp_path / "c").exists()
