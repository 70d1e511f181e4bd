"""``prepare`` says out loud when it drops data: one warning line past 5% of the records or of
the assistant tokens (the main reason and its fix), and ``--max-drop-fraction`` fails the build
without leaving a corpus behind. Real processes on the committed real-data fixture."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
TOKENIZER = FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"
INPUTS = [str(p) for p in sorted((FIXTURES / "tr_chat").glob("*.jsonl"))]
RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture


def _prepare(nedolm_sft: RunCli, out: Path, seq_len: int, *args: str, inputs=INPUTS):
    return nedolm_sft(
        "prepare", *inputs, "--tokenizer", str(TOKENIZER), "--out", str(out),
        "--seq-len", str(seq_len), "--shards", "2", "--no-progress", *args,
    )  # fmt: skip


def _drop_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: dropped")]


def test_prepare_warns_in_one_line_when_it_drops_a_quarter(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    # At seq_len 256, 16 of the 64 records hold a message longer than a window.
    result = _prepare(nedolm_sft, tmp_path / "c", 256)
    assert result.returncode == 0, result.stderr
    (warning,) = _drop_warnings(result.stderr)
    assert "dropped 25.0% of the records (16 of 64)" in warning
    assert "mostly message_too_long (12)" in warning
    assert "raise --seq-len or shorten it" in warning  # the fix, from the drop hints
    assert "--max-drop-fraction" in warning


def test_prepare_warns_on_the_assistant_token_share_alone(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    # At 512 one xquad record of 22 is too long (4.5% < 5%), but it holds 6.3% of the targets.
    inputs = [
        p for p in INPUTS if Path(p).name in ("arc_tr.jsonl", "nutuk_qa.jsonl", "xquad_tr.jsonl")
    ]
    result = _prepare(nedolm_sft, tmp_path / "c", 512, inputs=inputs)
    assert result.returncode == 0, result.stderr
    (warning,) = _drop_warnings(result.stderr)
    assert "dropped 4.5% of the records (1 of 22) and 6.3% of the assistant tokens" in warning


def test_prepare_is_quiet_under_five_percent(nedolm_sft: RunCli, tmp_path: Path) -> None:
    # At 512 these 40 records lose one (2.5%) holding 2.1% of the assistant tokens.
    names = ("arc_tr.jsonl", "nutuk_qa.jsonl", "truthfulqa_tr.jsonl", "xquad_tr.jsonl",
             "seed_tasks_tr.jsonl")  # fmt: skip
    inputs = [p for p in INPUTS if Path(p).name in names]
    result = _prepare(nedolm_sft, tmp_path / "c", 512, inputs=inputs)
    assert result.returncode == 0, result.stderr
    assert "records 40 = kept 39 + dropped 1" in result.stdout
    assert _drop_warnings(result.stderr) == []


def test_max_drop_fraction_fails_the_build_and_writes_no_corpus(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    out = tmp_path / "c"
    result = _prepare(nedolm_sft, out, 256, "--max-drop-fraction", "0.1")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "dropped 25.0% of the records (16 of 64)" in result.stderr
    assert "more than --max-drop-fraction 0.1, so no corpus was written" in result.stderr
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary build directory left either
    verify = nedolm_sft("verify", str(out))
    assert verify.returncode != 0

    # The same build under a limit it does not pass is written (and still warned about).
    result = _prepare(nedolm_sft, out, 256, "--max-drop-fraction", "0.9")
    assert result.returncode == 0, result.stderr
    assert len(_drop_warnings(result.stderr)) == 1
    assert nedolm_sft("verify", str(out)).returncode == 0
