"""``nedolm-sft inspect`` on a corpus built from the real-data fixture of nedolm-data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.packing import discover_sft_shards
from nedolm.data.synthetic import random_conversations, write_corpus
from nedolm_sft.cli import cli

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
TOKENIZER = FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"
INPUTS = sorted((FIXTURES / "tr_chat").glob("*.jsonl"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "corpus"
    build_corpus(INPUTS, TOKENIZER, out, BuildOptions(seq_len=512, shards=2))
    return out


def invoke(*args: object, color: bool = False) -> Result:
    return CliRunner().invoke(cli, ["inspect", *map(str, args)], color=color)


def test_all_json_streams_one_line_per_window(corpus: Path) -> None:
    result = invoke(corpus, "--all", "--json")  # seq_len from the packing audit
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    shards = discover_sft_shards(corpus, 512)
    assert len(lines) == sum(s.plan.counts.windows for s in shards)
    assert [r["window"] for r in lines] == list(range(len(lines)))
    first = shards[0].plan.pieces
    got = [p for r in lines if r["shard"] == shards[0].shard_id for p in r["pieces"]]
    assert [(p["doc"], p["start"], p["end"], p["target_from"]) for p in got] == [
        tuple(int(x) for x in row) for row in first[["doc", "start", "end", "target_from"]]
    ]


def test_window_text_highlights_decoded_targets(corpus: Path) -> None:
    as_json = json.loads(invoke(corpus, "--window", 2, "--json").output)
    result = invoke(corpus, "--window", 2, color=True)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("\x1b[1mwindow 2 (shard 0, window 2)")
    assert "⟦kullanici⟧" in result.output and "⟦asistan⟧" in result.output
    # Every assistant target run is rendered bold green; context runs are not.
    targets = [r for p in as_json["pieces"] for r in p["runs"] if r["target"]]
    assert targets
    assert result.output.count("\x1b[32m\x1b[1m") == len(targets)
    plain = invoke(corpus, "--window", 2).output
    assert "\x1b[" not in plain
    assert as_json["targets"] == sum(len(r["token_ids"]) for r in targets)


def test_doc_shows_every_window_of_a_chain(corpus: Path) -> None:
    pieces = discover_sft_shards(corpus, 512)[0].plan.pieces
    docs, counts = np.unique(pieces["doc"], return_counts=True)
    doc = int(docs[np.argmax(counts)])
    views = json.loads(invoke(corpus, "--doc", doc, "--json").output)
    assert len(views) == counts.max() > 1
    assert all(doc in [p["doc"] for p in v["pieces"]] for v in views)


def test_bad_requests(corpus: Path, tmp_path: Path) -> None:
    result = invoke(corpus, "--window", 10**6)
    assert result.exit_code == 1
    assert "window 1000000 does not exist" in result.output
    result = invoke(corpus, "--window", 1, "--all")
    assert result.exit_code == 2
    assert "mutually exclusive" in result.output
    write_corpus(tmp_path, [random_conversations(np.random.default_rng(0), 4, 5)])
    result = invoke(tmp_path)  # no packing audit: seq_len must be given
    assert result.exit_code == 2
    assert "PACKING_POLICY_ADAPTIVE_AUDIT.json has no usable seq_len" in result.output
    result = invoke(tmp_path, "--seq-len", 64, "--window", 0)  # no tokenizer copy: ids
    assert result.exit_code == 0, result.output
    assert "⟦asistan⟧" in result.output


def test_tool_messages_and_calls_are_shown_distinctly(tmp_path: Path) -> None:
    source = FIXTURES / "tool_chat" / "glaive_toolcall_en_demo.jsonl"
    out = tmp_path / "tools"
    build_corpus([source], TOKENIZER, out, BuildOptions(seq_len=4096))
    result = invoke(out, "--all", color=True)
    assert result.exit_code == 0, result.output
    assert "\x1b[33m⟦araç⟧ " in result.output  # the tool role header, in its own colour
    calls = [line for line in result.output.splitlines() if "⚙ " in line]
    assert calls and all('⚙ {"name": "' in line and '"arguments": ' in line for line in calls)
    plain = invoke(out, "--all").output
    assert plain.count("⚙ ") == len(calls)
