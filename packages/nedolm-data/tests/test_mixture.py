"""Mixtures (``BuildOptions.weights``): each input's share of the corpus matches its weight
exactly under the documented rounding, whole conversations are drawn, and the accounting adds
up (records = kept + left out + dropped per input, the corpus holds kept + repeated).

Per-source counts are measured from the binaries, independently of the manifest: each corpus
document is matched by its exact tokens to the input it came from, using a plain build of the
same inputs (every usable record once) as the reference.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from nedolm.data.build_options import BuildError
from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import discover_shards
from nedolm.data.mixture import mixture_counts
from nedolm.data.verify import check_corpus

SEQ_LEN = 512  # xquad_tr.jsonl loses one record (a 602-token context message) at this length


def _documents(corpus: Path) -> list[bytes]:
    """Every document's tokens (as bytes), over all shards."""
    docs = []
    for shard in discover_shards(corpus):
        tokens = np.asarray(shard.tokens)
        for start, length in zip(
            shard.index["token_start"].tolist(), shard.index["token_len"].tolist(), strict=True
        ):
            docs.append(tokens[start : start + length].tobytes())
    return docs


def _origin(inputs: list[Path], tokenizer: Path, out: Path) -> dict[bytes, str]:
    """Document tokens -> the input they come from, from a plain build of each input alone."""
    origin = {}
    for path in inputs:
        build_corpus([path], tokenizer, out / path.stem, BuildOptions(seq_len=SEQ_LEN, shards=1))
        for doc in _documents(out / path.stem):
            origin[doc] = path.name
    return origin


def _sources(corpus: Path) -> dict[str, dict]:
    manifest = json.loads((corpus / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    return {s["name"]: s for s in manifest["build"]["sources"]}


def test_two_source_mixture_counts_match_the_weights_and_add_up(
    tmp_path: Path, fixtures_dir: Path, tokenizer_json: Path
) -> None:
    arc, xquad = (
        fixtures_dir / "tr_chat" / "arc_tr.jsonl",
        fixtures_dir / "tr_chat" / "xquad_tr.jsonl",
    )
    origin = _origin([arc, xquad], tokenizer_json, tmp_path / "alone")
    out = tmp_path / "mix"
    options = BuildOptions(seq_len=SEQ_LEN, shards=2, val_fraction=0, weights=(0.5, 0.5))
    report = build_corpus([arc, xquad], tokenizer_json, out, options)
    assert check_corpus(out) == []

    # Usable: arc 8 of 8, xquad 5 of 6 (one too long), so the total is 13. Shares 6.5 and 6.5:
    # floors 6 + 6, the one left goes to the tie's earlier input, arc: 7 and 6.
    measured = Counter(origin[doc] for doc in _documents(out))
    assert measured == {"arc_tr.jsonl": 7, "xquad_tr.jsonl": 6}
    distinct = Counter(origin[doc] for doc in set(_documents(out)))
    sources = _sources(out)
    assert sources["arc_tr.jsonl"] | {"sha256": ""} == {
        "name": "arc_tr.jsonl", "sha256": "", "records": 8, "kept": 7, "dropped": {},
        "unk_target_tokens": 0, "lost_characters": 0, "duplicate_conversations": 0,
        "weight": 0.5, "left_out": 1,
    }  # fmt: skip
    xq = sources["xquad_tr.jsonl"]
    assert (xq["records"], xq["kept"], xq["repeated"], xq.get("left_out", 0)) == (6, 5, 1, 0)
    assert xq["dropped"] == {"message_too_long": 1}
    for name, s in sources.items():
        # kept + left out + dropped = input; kept + repeated = what the corpus holds
        assert s["records"] == s["kept"] + s.get("left_out", 0) + sum(s["dropped"].values())
        assert s["kept"] + s.get("repeated", 0) == measured[name]
        assert s["kept"] == distinct[name]  # repeats are whole copies of kept conversations
    assert report.documents == 13


def test_weights_split_an_explicit_total_by_largest_remainder(
    tmp_path: Path, fixtures_dir: Path, tokenizer_json: Path
) -> None:
    names = ("arc_tr.jsonl", "nutuk_qa.jsonl", "truthfulqa_tr.jsonl")  # 8 usable records each
    inputs = [fixtures_dir / "tr_chat" / n for n in names]
    origin = _origin(inputs, tokenizer_json, tmp_path / "alone")
    # 0.7 : 0.2 : 0.1 of 20 is exactly 14, 4, 2: arc is drawn 14 times from 8 (all 8 once,
    # 6 of them twice), nutuk down to 4 of 8, truthfulqa down to 2 of 8.
    out = tmp_path / "mix"
    weights = (0.7, 0.2, 0.1)
    options = BuildOptions(seq_len=SEQ_LEN, shards=2, val_fraction=0, weights=weights, mix_total=20)
    build_corpus(inputs, tokenizer_json, out, options)
    measured = Counter(origin[doc] for doc in _documents(out))
    assert measured == dict(zip(names, [14, 4, 2], strict=True))
    per_conversation = Counter(doc for doc in _documents(out) if origin[doc] == names[0])
    assert sorted(per_conversation.values()) == [1, 1, 2, 2, 2, 2, 2, 2]
    sources = _sources(out)
    assert [(sources[n]["kept"], sources[n].get("repeated", 0), sources[n].get("left_out", 0))
            for n in names] == [(8, 6, 0), (4, 0, 4), (2, 0, 6)]  # fmt: skip
    # Equal weights of 10: 3.33 each, floors 3 + 3 + 3, the one left to the earliest input.
    assert mixture_counts((1, 1, 1), 10) == [4, 3, 3]
    # Weights are the decimals written: 15 * 0.1 / 0.9 is 1 + 2/3 for both 0.1s, so the two
    # left after the floors (1, 1, 11) go to the tie's earlier inputs (binary floats would
    # make the three fractions differ and give [2, 1, 12]).
    assert mixture_counts((0.1, 0.1, 0.7), 15) == [2, 2, 11]


def test_a_mixture_is_deterministic_by_seed(
    tmp_path: Path, fixtures_dir: Path, tokenizer_json: Path
) -> None:
    inputs = [fixtures_dir / "tr_chat" / n for n in ("arc_tr.jsonl", "nutuk_qa.jsonl")]

    def build(out: Path, seed: int) -> list[bytes]:
        options = BuildOptions(
            seq_len=SEQ_LEN, shards=2, val_fraction=0, weights=(1, 1), mix_total=9, seed=seed
        )
        build_corpus(inputs, tokenizer_json, out, options)
        return _documents(out)

    first = build(tmp_path / "a", seed=1)
    assert build(tmp_path / "b", seed=1) == first
    assert build(tmp_path / "a", seed=1) == first  # an identical rebuild
    assert sorted(build(tmp_path / "c", seed=2)) != sorted(first)  # another draw


def test_bad_mixtures_are_refused(tmp_path: Path, fixtures_dir: Path, tokenizer_json: Path) -> None:
    arc = fixtures_dir / "tr_chat" / "arc_tr.jsonl"
    with pytest.raises(BuildError, match="weights must be positive"):
        BuildOptions(seq_len=SEQ_LEN, weights=(1.0, 0.0))
    with pytest.raises(BuildError, match="1 mixture weights for 2 inputs"):
        build_corpus(
            [arc, arc], tokenizer_json, tmp_path / "o", BuildOptions(SEQ_LEN, weights=(1,))
        )
    # At seq_len 128 every arc record is too long: nothing to draw the mixture's share from.
    nutuk = fixtures_dir / "tr_chat" / "nutuk_qa.jsonl"
    with pytest.raises(BuildError, match=r"arc_tr\.jsonl: no usable conversation"):
        build_corpus(
            [arc, nutuk], tokenizer_json, tmp_path / "o", BuildOptions(128, weights=(1, 1))
        )
    assert not (tmp_path / "o").exists()
