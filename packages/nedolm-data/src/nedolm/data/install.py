"""Output install: a finished corpus in a temporary directory → ``out``, atomically.

The build writes into ``.<out>.tmp-<pid>`` beside ``out`` and renames it into place only
after the verifier passed, so a crash never leaves a corpus that looks valid. Rebuilding the
same corpus leaves ``out`` untouched; replacing a different one needs ``overwrite``.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from nedolm.data.atomic import fsync_dir, process_alive
from nedolm.data.build_options import BuildError
from nedolm.data.contract import PACKING_AUDIT_FILE, SHARD_MANIFEST_FILE
from nedolm.data.inputs import input_sha256


def check_out(out: Path) -> None:
    """Refuse early what no rebuild could replace: a file, or a directory that is no corpus."""
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / SHARD_MANIFEST_FILE).exists():
        raise BuildError(f"{out}: exists, is not empty and holds no corpus; refusing to replace it")


def check_out_corpus(
    out: Path, inputs: Sequence[Path], tokenizer_sha256: str, seq_len: int, overwrite: bool
) -> None:
    """Refuse before the build an ``out`` whose corpus came from other inputs, another
    tokenizer or another ``seq_len``: the rebuild could only be refused after all the work.
    The same provenance may still differ in other options; ``install`` compares the bytes."""
    if overwrite or not (out / SHARD_MANIFEST_FILE).is_file():
        return
    try:
        build = json.loads((out / SHARD_MANIFEST_FILE).read_text(encoding="utf-8"))["build"]
        audit = json.loads((out / PACKING_AUDIT_FILE).read_text(encoding="utf-8"))
        recorded = ([s["sha256"] for s in build["sources"]], build["tokenizer_sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a readable corpus: the comparison after the build decides
    differs = [
        what
        for what, same in (
            ("inputs", recorded[0] == [input_sha256(p) for p in inputs]),
            ("tokenizer", recorded[1] == tokenizer_sha256),
            ("seq_len", audit.get("seq_len") == seq_len),
        )
        if not same
    ]
    if differs:
        raise BuildError(
            f"{out}: holds a different corpus; pass --overwrite to replace it "
            f"({', '.join(differs)} differ)"
        )


def fresh_tmp_dir(out: Path, *subdirs: str) -> Path:
    """``.<out>.tmp-<pid>`` beside ``out`` with ``subdirs``; leftovers of dead builds go first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for subdir in subdirs:
        (tmp / subdir).mkdir()
    return tmp


def install(tmp: Path, out: Path, overwrite: bool) -> bool:
    """Move the finished corpus to ``out``; True if ``out`` already held the same bytes."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return False
    if _same_tree(tmp, out):
        shutil.rmtree(tmp)
        return True
    if not overwrite:
        raise BuildError(f"{out}: holds a different corpus; pass --overwrite to replace it")
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old)
    return False


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)
