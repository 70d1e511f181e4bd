"""``nedolm-sft prepare / verify / stats`` on the real-data fixture of nedolm-data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from nedolm_sft.cli import cli

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
TOKENIZER = FIXTURES / "tokenizer" / "mistral_v1.model.gz"
INPUTS = sorted((FIXTURES / "tr_chat").glob("*.jsonl"))


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "corpus"
    result = _run(
        "prepare",
        *INPUTS,
        "--tokenizer",
        TOKENIZER,
        "--out",
        out,
        "--seq-len",
        1024,
        "--shards",
        2,
        "--val-shards",
        "1",
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.mark.parametrize("command", ["prepare", "verify", "stats"])
def test_help_has_an_example(command):
    result = _run(command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.output and f"nedolm-sft {command}" in result.output


def test_prepare_reports_every_record(corpus):
    _, output = corpus
    total = sum(
        1 for p in INPUTS for line in p.read_text(encoding="utf-8").splitlines() if line.strip()
    )
    assert f"records {total} = kept {total - 2} + dropped 2 (message_too_long 2)" in output
    assert "2 shards, validation [1]" in output and "verify PASS" in output


def test_verify_passes_then_names_a_flipped_shard(corpus, tmp_path):
    out = shutil.copytree(corpus[0], tmp_path / "copy")
    assert _run("verify", out).exit_code == 0
    path = out / "shards" / "sft-00001-of-00002.tokens.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["verify", str(out)])
    assert result.exit_code == 1
    assert "sft-00001-of-00002.tokens.bin" in result.output
    assert "problem(s); the corpus is not valid" in result.output


def test_stats_json_matches_the_audit(corpus):
    out, _ = corpus
    result = _run("stats", out, "--json")
    assert result.exit_code == 0
    stats = json.loads(result.output)
    audit = json.loads((out / "PACKING_POLICY_ADAPTIVE_AUDIT.json").read_text(encoding="utf-8"))
    assert stats["packing"]["windows"] == audit["windows"]
    assert stats["packing"]["hard_continuations"] == 0
    assert stats["corpus"]["dropped"] == {"message_too_long": 2}
    assert stats["packing_quality"]["adaptive"]["targets_lost"] == 0
    text = _run("stats", out, "--seq-len", 2048)
    assert text.exit_code == 0 and "seq_len 2048: windows" in text.output


def test_stats_of_a_corpus_without_its_packing_audit_names_the_file(corpus, tmp_path):
    copy = Path(shutil.copytree(corpus[0], tmp_path / "corpus"))
    (copy / "PACKING_POLICY_ADAPTIVE_AUDIT.json").unlink()
    result = _run("stats", copy)
    assert result.exit_code == 1
    assert "PACKING_POLICY_ADAPTIVE_AUDIT.json has no usable seq_len" in result.output


@pytest.mark.parametrize(
    ("extra", "exit_code", "message"),
    [
        (["--no-progress"], 1, "Error: bad.jsonl:1: messages[1]: content is empty"),
        (["--map-role", "tool"], 2, "'tool' is not FROM=TO"),
        (["--val-shards", "a,b"], 2, "not a comma-separated list"),
    ],
)
def test_bad_options_and_inputs_are_one_line_errors(tmp_path, extra, exit_code, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}\n',
        encoding="utf-8",
    )
    args = ["prepare", str(bad), "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(cli, [*args, "--seq-len", "64", *extra])
    assert result.exit_code == exit_code
    assert message in result.output


@pytest.mark.slow  # a real interpreter importing the whole app (torch included)
def test_real_process_exits_non_zero_without_traceback(tmp_path):
    missing = tmp_path / "nothing"
    missing.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", "from nedolm_sft.cli import main; main()", "verify", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "verified SFT contract missing" in proc.stderr


TOOL_CHAT = FIXTURES / "tool_chat" / "glaive_toolcall_en_demo.jsonl"
UPSTREAM_GLAIVE = FIXTURES / "tool_chat" / "upstream"  # whole files, gzipped (fixtures README)


def _mixed(tmp_path: Path) -> Path:
    """Three good lines of a real file with a malformed line and an unsupported role."""
    good = TOOL_CHAT.read_text(encoding="utf-8").splitlines()[:3]
    lines = [good[0], "{broken", good[1], '{"messages": [{"role": "narrator", "content": "x"}]}']
    source = tmp_path / "mixed.jsonl"
    source.write_text("\n".join([*lines, good[2]]) + "\n", encoding="utf-8")
    return source


def test_prepare_drops_bad_records_with_one_switch_and_says_why(tmp_path):
    """--on-bad-record drop: bad lines of a real file are dropped, counted, located, and each
    reason printed with what it is and what to do."""
    source = _mixed(tmp_path)
    report_file = tmp_path / "report.json"
    args = ["prepare", source, "--tokenizer", TOKENIZER, "--out", tmp_path / "o", "--seq-len"]
    result = _run(*args, 4096, "--on-bad-record", "drop", "--report", report_file, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "records 5 = kept 3 + dropped 2 (invalid_json 1, unsupported_role 1)" in result.output
    assert (
        "dropped invalid_json 1: not a JSON object (malformed, cut, or a bare value);"
        " fix the record; e.g.:\n  mixed.jsonl:2: malformed JSON" in result.output
    )
    assert (
        "dropped unsupported_role 1: a role outside system/user/assistant/tool;"
        " map it with --map-role FROM=TO; e.g.:\n  mixed.jsonl:4: " in result.output
    )
    report = json.loads(report_file.read_text(encoding="utf-8"))
    (only,) = report["sources"]
    assert only["records"] == only["kept"] + sum(only["dropped"].values()) == 5
    assert report["drop_examples"]["unsupported_role"][0].startswith("mixed.jsonl:4: ")

    refused = CliRunner().invoke(cli, [str(a) for a in args] + ["4096", "--no-progress"])
    assert refused.exit_code == 1
    assert len(refused.output.strip().splitlines()) == 1
    assert refused.output.startswith("Error: mixed.jsonl:2: malformed JSON: ")
    assert refused.output.rstrip().endswith(
        "; --on-bad-record drop drops and counts such records instead"
    )


def test_old_bad_record_flags_still_work(tmp_path):
    """skip (the old verb) means drop; --invalid-records (hidden, the old name) and the
    --unsupported-roles refinement each set their own part of the policy."""
    source = _mixed(tmp_path)
    args = ["prepare", source, "--tokenizer", TOKENIZER, "--seq-len", 4096, "--no-progress"]
    both = "records 5 = kept 3 + dropped 2 (invalid_json 1, unsupported_role 1)"
    skip = _run(*args, "--out", tmp_path / "a", "--on-bad-record", "skip")
    assert skip.exit_code == 0 and both in skip.output
    old = _run(
        *args, "--out", tmp_path / "b", "--invalid-records", "drop", "--unsupported-roles", "drop"
    )
    assert old.exit_code == 0 and both in old.output
    assert "note: --invalid-records is the old name of --on-bad-record" in old.output
    roles_only = CliRunner().invoke(
        cli, [str(a) for a in [*args, "--out", tmp_path / "c", "--unsupported-roles", "drop"]]
    )
    assert roles_only.exit_code == 1 and "mixed.jsonl:2: malformed JSON" in roles_only.output
    help_text = _run("prepare", "--help").output
    assert "--on-bad-record [error|drop]" in help_text and "--invalid-records" not in help_text


def test_length_drops_name_the_longest_message(tmp_path):
    """The upstream glaive array at seq_len 1024 drops records with an assistant message longer
    than a window, the Turkish fixtures one with a long context message: each hint names
    --seq-len and the longest such message, which the examples list."""
    report_file = tmp_path / "report.json"
    glaive = UPSTREAM_GLAIVE / "glaive_toolcall_en_demo.json.gz"
    args = ["--tokenizer", TOKENIZER, "--seq-len", 1024, "--no-progress", "--report", report_file]
    result = _run("prepare", glaive, *INPUTS, "--out", tmp_path / "o", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(report_file.read_text(encoding="utf-8"))
    longest = report["drop_longest"]
    assert set(longest) == {"hard_continuation", "message_too_long"}
    for reason, what in (
        ("hard_continuation", "an assistant message"),
        ("message_too_long", "a context message (system, user or tool)"),
    ):
        assert (
            f": {what} longer than --seq-len 1024 tokens (longest: {longest[reason]}); raise --seq-len"
            in result.output
        )
        lengths = [int(m.split(" of ")[1].split()[0]) for m in report["drop_examples"][reason]]
        assert max(lengths) == longest[reason] > 1025
    assert "glaive_toolcall_en_demo.json.gz: record 243: a message (assistant) of" in result.output

    # stats, even when planning for another context, hints at the length the build dropped at
    stats = _run("stats", tmp_path / "o", "--seq-len", 2048)
    assert stats.exit_code == 0, stats.output
    dropped = sum((Counter(s["dropped"]) for s in report["sources"]), Counter())
    assert (
        f"dropped hard_continuation {dropped['hard_continuation']}: an assistant message longer"
        " than --seq-len 1024 tokens; raise --seq-len or split it" in stats.output
    )


def test_prepare_warns_of_duplicates_once_and_names_dedup(tmp_path):
    again = tmp_path / "again.jsonl"
    shutil.copyfile(INPUTS[0], again)
    args = ["--tokenizer", TOKENIZER, "--seq-len", 1024, "--no-progress"]
    report_file = tmp_path / "report.json"
    result = _run(
        "prepare", *INPUTS, again, "--out", tmp_path / "a", *args, "--report", report_file
    )
    assert result.exit_code == 0, result.output
    sources = json.loads(report_file.read_text(encoding="utf-8"))["sources"]
    copies = sum(1 for line in again.read_text(encoding="utf-8").splitlines() if line.strip())
    assert sources[-1]["duplicate_conversations"] == copies
    dups = sum(s["duplicate_conversations"] for s in sources)  # + the Alpaca twin of seed_tasks
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    # mistral_v1 loses no character: no warning about that; the length drops have their own
    warnings.remove(next(w for w in warnings if w.startswith("warning: dropped")))
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: {dups} kept conversations (")
    assert warnings[0].endswith("--dedup drops them")
    deduped = _run("prepare", *INPUTS, again, "--out", tmp_path / "b", *args, "--dedup")
    assert "repeat an earlier one" not in deduped.output


def test_prepare_reads_parquet_and_trains_tool_calls_on_request(tmp_path):
    records = [json.loads(line) for line in TOOL_CHAT.read_text(encoding="utf-8").splitlines()]
    table = pa.Table.from_pylist([{"turns": r["messages"], "id": r["id"]} for r in records])
    source = tmp_path / "calls.parquet"
    pq.write_table(table, source)
    targets = {}
    for flag in ([], ["--train-tool-calls"]):
        out = tmp_path / f"o{len(flag)}"
        args = ["prepare", source, "--tokenizer", TOKENIZER, "--out", out, "--seq-len", 4096]
        result = _run(*args, "--format", "parquet", "--messages-field", "turns", *flag)
        assert result.exit_code == 0, result.output
        assert "records 8 = kept 8 + dropped 0" in result.output
        audit = json.loads((out / "PACKING_POLICY_ADAPTIVE_AUDIT.json").read_text())
        targets[bool(flag)] = audit["assistant_target_tokens"]
    assert targets[True] > targets[False]


def test_prepare_and_stats_report_coverage_and_duplicates(tmp_path):
    """tanai cannot encode some characters of the real data and drops its newlines: prepare's
    table and stats name the counts per source; a copied input is all duplicates."""
    again = tmp_path / "again.jsonl"
    shutil.copyfile(INPUTS[0], again)
    out, report_path = tmp_path / "corpus", tmp_path / "report.json"
    tanai = FIXTURES / "tokenizer" / "tanai.tokenizer.json.gz"
    args = ["--tokenizer", tanai, "--out", out, "--seq-len", 1024, "--shards", 2, "--no-progress"]
    result = _run("prepare", *INPUTS, again, *args, "--dedup", "--report", report_path)
    assert result.exit_code == 0, result.output
    sources = json.loads(report_path.read_text(encoding="utf-8"))["sources"]
    copy = sources[-1]
    assert copy["kept"] == 0 and copy["duplicate_conversations"] == copy["dropped"].get(
        "duplicate_conversation"
    )
    assert copy["records"] == sum(copy["dropped"].values())
    unk = sum(s["unk_target_tokens"] for s in sources)
    lost = sum(s["lost_characters"] for s in sources)
    assert unk > 0 and lost > 0
    for s in sources:  # the prepare table: one row per source with the three counts
        row = f"{s['records']:>8}  {s['kept']:>8}  {s['unk_target_tokens']:>6}  {s['lost_characters']:>6}"
        assert f"{s['name']}  " in result.output and row in result.output

    assert f"warning: the tokenizer loses {lost} characters (" in result.output
    stats = _run("stats", out)
    assert stats.exit_code == 0
    assert f"<unk> ids in targets: {unk} (" in stats.output
    assert f"characters the tokenizer does not round-trip: {lost} (" in stats.output
    dups = sum(s["duplicate_conversations"] for s in sources)
    assert f"exact duplicate conversations: {dups} (" in stats.output


def _tokens_and_segments(data_dir: Path) -> dict[str, bytes]:
    shards = sorted((data_dir / "shards").glob("*.bin"))
    return {p.name: p.read_bytes() for p in shards if not p.name.endswith(".index.bin")}


def test_prepare_reads_the_upstream_json_array_as_its_jsonl_twin(tmp_path):
    """LLaMA-Factory's glaive_toolcall_en_demo.json (one ShareGPT JSON array, 300 records) and
    the curated OpenAI JSON lines converted from it: the same tokens and targets (the index
    files differ only in record keys, which name the file and the curator's ids)."""
    built = {}
    for source in (
        UPSTREAM_GLAIVE / "glaive_toolcall_en_demo.json.gz",
        UPSTREAM_GLAIVE / "glaive_toolcall_en_demo.jsonl.gz",
    ):
        out = tmp_path / source.name
        result = _run(
            "prepare",
            source,
            "--tokenizer",
            TOKENIZER,
            "--out",
            out,
            "--seq-len",
            4096,
            "--no-progress",
        )
        assert result.exit_code == 0, result.output
        # one record holds an assistant message longer than 4096 tokens: the same drop in both
        assert "records 300 = kept 299 + dropped 1 (hard_continuation 1)" in result.output
        built[source.suffixes[0]] = _tokens_and_segments(out)
    assert len(built[".json"]) == 2 * 20
    assert built[".json"] == built[".jsonl"]


def test_prepare_holds_out_a_validation_shard_by_default(tmp_path):
    args = ["--tokenizer", TOKENIZER, "--seq-len", 1024, "--no-progress"]
    result = _run("prepare", *INPUTS, "--out", tmp_path / "a", *args)
    assert result.exit_code == 0, result.output
    assert "20 shards, validation [19]," in result.output
    manifest = json.loads((tmp_path / "a" / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    assert manifest["validation_shard_ids"] == [19]

    result = _run("prepare", *INPUTS, "--out", tmp_path / "b", *args, "--shards", 4)
    assert result.exit_code == 0 and "4 shards, validation [3]," in result.output
    result = _run("prepare", *INPUTS, "--out", tmp_path / "c", *args, "--val-fraction", 0)
    assert result.exit_code == 0 and "20 shards, validation []," in result.output
