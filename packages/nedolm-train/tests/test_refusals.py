"""Every refusal of the seed, through the real ``run()`` in this process: each error names what
differs (the file, the key, the saved and the current value)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import msgspec
import numpy as np
import pytest
import yaml

from nedolm.data.contract import aggregate_sha256, hash_entries
from nedolm.data.format import read_array, write_array
from nedolm.train.checkpoint import load_checkpoint
from nedolm.train.config import load_sft_config
from nedolm.train.signals import STOP_SIGNALS
from nedolm.train.trainer import run


def _run(config: Path, **kw) -> None:
    run(load_sft_config(config), compile=kw.pop("compile", False), **kw)


def _copy_corpus(corpus: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(corpus, tmp_path / "corpus"))


def _edit_json(path: Path, **changes) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**doc, **changes}), encoding="utf-8")


def _config_for(harness, tmp_path, corpus, base_run, name="run", **sections) -> Path:
    return harness.write_config(
        tmp_path / f"{name}.yaml", corpus, base_run, tmp_path / name, **sections
    )


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda d: (d / "SHARD_MANIFEST.json").unlink(), "SHARD_MANIFEST.json"),
        (
            lambda d: _edit_json(d / "FINAL_BINARY_VERIFY_REPORT.json", status="FAIL"),
            "FINAL_BINARY_VERIFY_REPORT.json: the final binary verifier is not PASS",
        ),
        (
            lambda d: _edit_json(d / "PACKING_POLICY_ADAPTIVE_AUDIT.json", status="FAIL"),
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
        ),
    ],
)
def test_missing_or_failed_contract_files(harness, tmp_path, corpus, base_run, damage, needle):
    data = _copy_corpus(corpus, tmp_path)
    damage(data)
    with pytest.raises(RuntimeError, match="validate dataset contract failed") as err:
        _run(_config_for(harness, tmp_path, data, base_run))
    assert needle in str(err.value)


def test_a_corpus_without_its_packing_audit_is_named_before_anything_is_built(
    harness, tmp_path, corpus, base_run
):
    data = _copy_corpus(corpus, tmp_path)
    (data / "PACKING_POLICY_ADAPTIVE_AUDIT.json").unlink()
    with pytest.raises(RuntimeError, match="read corpus seq_len failed") as err:
        _run(_config_for(harness, tmp_path, data, base_run))
    assert f"{data / 'PACKING_POLICY_ADAPTIVE_AUDIT.json'} has no usable seq_len" in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def _merge_first_two_documents(data: Path) -> None:
    """Overwrite shard 1's first EOS (documents 0 and 1 would share attention) and re-hash the
    manifest to match: only the recomputation from the binaries can see it."""
    tokens_path = data / "shards" / "sft-00001-of-00004.tokens.bin"
    index = read_array(data / "shards" / "sft-00001-of-00004.index.bin", "index")
    tokens = np.array(read_array(tokens_path, "tokens"))
    tokens[int(index["token_len"][0]) - 1] = tokens[1]
    write_array(tokens_path, "tokens", tokens)
    manifest = json.loads((data / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    entries = hash_entries(data, [data / e["path"] for e in manifest["files"]])
    files = [msgspec.to_builtins(e) for e in entries]
    _edit_json(data / "SHARD_MANIFEST.json", files=files, aggregate_sha256=aggregate_sha256(files))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (
            lambda d: _edit_json(d / "FINAL_BINARY_VERIFY_REPORT.json", documents=1),
            "FINAL_BINARY_VERIFY_REPORT.json: 'documents' is 1, recomputed",
        ),
        (
            lambda d: (d / "tokenizer" / "tokenizer.json").unlink(),
            "cannot re-encode the role headers",
        ),
        (_merge_first_two_documents, "sft-00001-of-00004.tokens.bin: 1 EOS missing"),
    ],
)
def test_run_refuses_what_verify_rejects(harness, tmp_path, corpus, base_run, damage, needle):
    """Issue 15: the start-up gate performs verify's checks; ``python -m nedolm.train`` refuses."""
    data = _copy_corpus(corpus, tmp_path)
    damage(data)
    job = harness.Job(_config_for(harness, tmp_path, data, base_run), args=("--no-compile",))
    assert job.wait() == [1]
    assert "validate dataset contract failed" in job.output() and needle in job.output()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_changed_shard_bytes(harness, tmp_path, corpus, base_run):
    data = _copy_corpus(corpus, tmp_path)
    shard = data / "shards" / "sft-00001-of-00004.tokens.bin"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError) as err:
        _run(_config_for(harness, tmp_path, data, base_run))
    assert "sha256 of shards/sft-00001-of-00004.tokens.bin changed" in str(err.value)


def test_plan_differs_from_audit(harness, tmp_path, corpus, base_run):
    data = _copy_corpus(corpus, tmp_path)
    audit = data / "PACKING_POLICY_ADAPTIVE_AUDIT.json"
    windows = json.loads(audit.read_text(encoding="utf-8"))["windows"]
    _edit_json(audit, windows=windows + 1)
    with pytest.raises(RuntimeError) as err:
        _run(_config_for(harness, tmp_path, data, base_run))
    assert f"'windows' is {windows + 1}, recomputed {windows}" in str(err.value)


def test_seq_len_above_the_models(harness, tmp_path, corpus, base_run):
    config = _config_for(harness, tmp_path, corpus, base_run, train={"seq_len": 512})
    with pytest.raises(RuntimeError) as err:
        _run(config)
    assert "train.seq_len=512 exceeds the model's max_seq_len=256" in str(err.value)


def _base_with_backend(base_run: Path, tmp_path: Path, attn_impl: str) -> Path:
    base = Path(shutil.copytree(base_run, tmp_path / "base"))
    doc = yaml.safe_load((base / "config.yaml").read_text(encoding="utf-8"))
    doc["model"]["attn_impl"] = attn_impl
    (base / "config.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return base


def test_backend_that_cannot_isolate_segments_here(harness, tmp_path, corpus, base_run):
    base = _base_with_backend(base_run, tmp_path, "flash")
    with pytest.raises(RuntimeError) as err:
        _run(_config_for(harness, tmp_path, corpus, base))
    message = str(err.value)
    assert "attn_impl='flash' cannot run here" in message
    assert f"set by the base model's config ({base / 'config.yaml'})" in message
    assert "`train.attn_impl: auto`" in message  # the fix, without editing the base run


def test_train_attn_impl_overrides_the_bases(harness, tmp_path, corpus, base_run):
    """A base written for flash trains here with `train.attn_impl` set, and the checkpoint
    records the backend that ran; a backend that cannot train here is refused by its key."""
    base = _base_with_backend(base_run, tmp_path, "flash")
    train = {"attn_impl": "sdpa", "max_steps": 1, "save_final_checkpoint": True}
    config = _config_for(harness, tmp_path, corpus, base, train=train)
    _run(config)
    ckpt = load_checkpoint(config.with_suffix("") / "checkpoints" / "step-00000001.pt")
    assert ckpt["contract"]["training"]["recipe"]["model_config"]["attn_impl"] == "sdpa"
    log = (config.with_suffix("") / "train.log").read_text(encoding="utf-8")
    assert "attn_impl sdpa, set by train.attn_impl" in log

    # torch's varlen kernel needs CUDA on every torch (flex trains on torch 2.10's CPU, not 2.13's)
    train = {"attn_impl": "torch_varlen"}
    varlen = _config_for(harness, tmp_path, corpus, base, "varlen", train=train)
    with pytest.raises(RuntimeError) as err:
        _run(varlen)
    assert "attn_impl='torch_varlen' cannot run here" in str(err.value)
    assert "It is set by train.attn_impl" in str(err.value)


@pytest.fixture(scope="module")
def checkpointed(harness, tmp_path_factory, corpus, base_run) -> Path:
    """A run dir holding a 2-step checkpoint (recipe: max_steps 2)."""
    root = tmp_path_factory.mktemp("checkpointed")
    config = harness.write_config(
        root / "run.yaml", corpus, base_run, root / "run", train={"max_steps": 2}
    )
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        _run(config)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    return root / "run"


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ({"optim": {"lr": 1e-3}}, "training.recipe.optim.lr: checkpoint 0.003 != now 0.001"),
        ({"validation": {"shard_ids": [1]}}, "training.val_shard_ids: checkpoint [2] != now [1]"),
        # Fewer steps than the finished run (more would extend it: test_run.py).
        ({"train": {"max_steps": 1}}, "training.recipe.max_steps: checkpoint 2 != now 1"),
        ({"train": {"max_steps": 5, "seed": 7}}, "training.recipe.seed: checkpoint"),
        ({"train": {"num_workers": 1}}, "execution.num_workers: checkpoint 0 != now 1"),
    ],
)
def test_resume_refuses_a_changed_run(
    harness, tmp_path, corpus, base_run, checkpointed, sections, needle
):
    run_dir = Path(shutil.copytree(checkpointed, tmp_path / "run"))
    sections = {**sections, "train": {"max_steps": 2, **sections.get("train", {})}}
    config = _config_for(harness, tmp_path, corpus, base_run, **sections)
    assert load_sft_config(config).run_dir == run_dir
    with pytest.raises(RuntimeError, match=r"refusing to resume from .*step-00000002\.pt") as err:
        _run(config)
    assert needle in str(err.value)


def test_resume_refuses_a_changed_compile_mode(harness, tmp_path, corpus, base_run, monkeypatch):
    config = _config_for(
        harness, tmp_path, corpus, base_run, train={"max_steps": 1, "compile": True}
    )
    monkeypatch.setenv("NEDOLM_TEST_FAULT", "compile_warmup@0")
    _run(config, compile=True)  # the warm-up fails: this run trains (and saves) eagerly
    monkeypatch.delenv("NEDOLM_TEST_FAULT")
    with pytest.raises(RuntimeError) as err:
        _run(config, compile=True)  # now the warm-up succeeds: another execution mode
    assert "execution.effective_compile: checkpoint False != now True" in str(err.value)


def test_resume_refuses_a_changed_dataset(harness, tmp_path, corpus, base_run, checkpointed):
    shutil.copytree(checkpointed, tmp_path / "run")
    data = _copy_corpus(corpus, tmp_path)
    manifest = data / "SHARD_MANIFEST.json"  # same content, other bytes: another contract file
    manifest.write_text(json.dumps(json.loads(manifest.read_text(encoding="utf-8")), indent=1))
    config = _config_for(harness, tmp_path, data, base_run, train={"max_steps": 2})
    with pytest.raises(RuntimeError) as err:
        _run(config)
    assert "dataset.fingerprint: checkpoint" in str(err.value)
    assert "dataset.shard_manifest_sha256: checkpoint" in str(err.value)
