"""The seed trainer's own gate still accepts every corpus the builder writes (issue 15).

The seed's ``_validate_dataset_contract`` is read from the seed file at test time (the product
never contains it): its source is cut out with ``ast`` and run with the names it uses.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.contract import validate_dataset_contract

SEED = Path(os.environ.get("NEDOLM_SEED", "/work/shared/seed")) / "sft_train.py"
SEED_EOS_ID = 2  # the seed's config.EOS_ID (NedoLM's tokenizer, as mistral_v1's)


def _seed_gate():
    """The seed's ``_validate_dataset_contract`` (with its ``_sha256`` helper), compiled."""
    if not SEED.is_file():
        pytest.skip(f"the seed trainer is not at {SEED} (set NEDOLM_SEED to its directory)")
    tree = ast.parse(SEED.read_text(encoding="utf-8"))
    wanted = {"_sha256", "_validate_dataset_contract"}
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in functions} == wanted, f"{SEED} no longer defines {wanted}"
    namespace: dict[str, Any] = {
        "Any": Any,
        "Path": Path,
        "ThreadPoolExecutor": ThreadPoolExecutor,
        "hashlib": hashlib,
        "json": json,
        "EOS_ID": SEED_EOS_ID,
    }
    module = ast.Module(body=functions, type_ignores=[])
    exec(compile(module, str(SEED), "exec"), namespace)
    return namespace["_validate_dataset_contract"]


@pytest.fixture(scope="module")
def sentencepiece_corpus(tmp_path_factory, tr_chat_inputs, sentencepiece_model) -> Path:
    out = tmp_path_factory.mktemp("sp") / "data"
    build_corpus(tr_chat_inputs, sentencepiece_model, out, BuildOptions(seq_len=256, shards=3))
    return out


@pytest.mark.parametrize(
    ("corpus_fixture", "seq_len"), [("fixture_corpus", 1024), ("sentencepiece_corpus", 256)]
)
def test_the_seed_gate_accepts_what_the_builder_writes(request, corpus_fixture, seq_len):
    corpus = request.getfixturevalue(corpus_fixture)
    vocab = json.loads((corpus / "SPECIAL_TOKENS.json").read_text())["vocab_size"]
    seed = _seed_gate()(corpus, vocab, seq_len)
    ours = validate_dataset_contract(corpus, vocab, seq_len)
    assert {k: ours[k] for k in seed} == seed  # same fingerprint and counts


def test_the_extracted_seed_gate_does_refuse(tmp_path, fixture_corpus):
    """The extraction runs the seed's checks, not a no-op: a wrong digest is refused."""
    corpus = Path(shutil.copytree(fixture_corpus, tmp_path / "data"))
    manifest = corpus / "SHARD_MANIFEST.json"
    doc = json.loads(manifest.read_text(encoding="utf-8"))
    manifest.write_text(json.dumps({**doc, "aggregate_sha256": "0" * 64}), encoding="utf-8")
    vocab = json.loads((corpus / "SPECIAL_TOKENS.json").read_text())["vocab_size"]
    with pytest.raises(RuntimeError, match="aggregate digest is invalid"):
        _seed_gate()(corpus, vocab, 1024)
