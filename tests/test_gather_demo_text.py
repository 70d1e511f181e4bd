"""tools/gather_demo_text.py and the pretraining tool's --extra-text: real .deb files, real pages.

The packages are built here with ``dpkg-deb --build`` (the same reader then opens them as it
opens the archive's), so the page readers, the Turkish test, boilerplate and duplicate removal
and the atomic write are all exercised on real files. The pretraining tool must keep any extra
document that quotes the demo sample out of pretraining, and name a bad record's file and line.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = Path(str(files("nedolm_sft") / "default"))
CHAT_FIXTURES = ROOT / "packages" / "nedolm-data" / "tests" / "fixtures" / "tr_chat"

TURKISH = "Bu işlev, seçilen hücrelerdeki değerlerin toplamını verir ve sonucu gösterir."
ENGLISH = "Choose Tools - AutoCorrect Options and click the tab to see the settings."
HEADER = "LibreOffice Yardım sayfası için üst bilgi"


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gather() -> ModuleType:
    return load_tool("gather_demo_text")


@pytest.fixture(scope="module")
def pretrain() -> ModuleType:
    return load_tool("pretrain_demo_base")


def build_deb(cache: Path, name: str, version: str, pages: dict[str, bytes]) -> str:
    """A real binary package holding ``pages`` (paths under the package root); its sha256."""
    root = cache / f"{name}-root"
    (root / "DEBIAN").mkdir(parents=True)
    control = f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
    control += "Maintainer: Test <test@example.org>\nDescription: test pages\n"
    (root / "DEBIAN" / "control").write_text(control)
    for rel, data in pages.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    deb = cache / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--build", str(root), str(deb)], check=True, capture_output=True)
    return hashlib.sha256(deb.read_bytes()).hexdigest()


def help_page(*paragraphs: str) -> bytes:
    body = "".join(f"<p>{p}</p>" for p in paragraphs)
    footer = "<p>Help content debug info:</p><p>This page is: /text/a.xhp</p>"
    return f"<html><script>var x = 1;</script><body>{body}{footer}</body></html>".encode()


def test_is_turkish_tells_turkish_from_english(gather: ModuleType) -> None:
    assert gather.is_turkish(TURKISH)
    assert gather.is_turkish("Sütun genişliği")  # Turkish letters alone are enough
    assert not gather.is_turkish(ENGLISH)
    assert not gather.is_turkish("=SUM(A1:B2) 42")


def test_a_man_page_becomes_its_text(gather: ModuleType) -> None:
    roff = "\n".join(
        [
            ".ig",
            " * derleme notu: atlanmalı",
            "..",
            '.TH "LS" 1 "Eylül 2021"',
            ".SH İSİM",
            r"ls \- dizin içeriğini listeler",
            ".TP 4",
            r"\fB-a\fR, \fB--all\fR",
            r"\fB.\fR ile başlayan dosyaları gizlemez\(em hepsini gösterir.",
        ]
    )
    paragraphs = gather.roff_paragraphs(gzip.compress(roff.encode()))
    assert paragraphs == [
        "İSİM",
        "ls - dizin içeriğini listeler",
        "-a, --all . ile başlayan dosyaları gizlemez— hepsini gösterir.",
    ]


def test_a_help_page_loses_scripts_and_its_debug_footer(gather: ModuleType) -> None:
    assert gather.libreoffice_paragraphs(help_page(TURKISH, ENGLISH)) == [TURKISH, ENGLISH]


def test_gather_keeps_turkish_once_and_drops_boilerplate(
    gather: ModuleType, tmp_path: Path
) -> None:
    prefix = "usr/share/libreoffice/help/tr/text/scalc"
    other = "Satır yüksekliğini değiştirmek için bu komutu kullanın ve değeri girin lütfen."
    pages = {
        f"{prefix}/01.html": help_page(HEADER, TURKISH, ENGLISH),
        f"{prefix}/02.html": help_page(HEADER, TURKISH, other),  # TURKISH again: dropped
        f"{prefix}/03.html": help_page(HEADER, "Kısa sayfa."),  # too short once cleaned
        "usr/share/doc/readme.html": help_page(HEADER, "Sayfa değil, dizin dışında."),
    }
    sha256 = build_deb(tmp_path, "yardim-tr", "1.0-1", pages)
    package = gather.Package(
        "yardim-tr",
        "1.0-1",
        sha256,
        "MPL-2.0",
        re.compile(r"\./usr/share/libreoffice/help/tr/text/.*\.html"),
        gather.libreoffice_paragraphs,
    )
    out = tmp_path / "text.jsonl"
    counts = gather.gather(tmp_path, out, 2, 40, packages=[package])
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert counts == {"yardim-tr": 2}
    assert records == [
        {"text": TURKISH, "source": f"yardim-tr:{prefix}/01.html"},
        {"text": other, "source": f"yardim-tr:{prefix}/02.html"},
    ]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "text.jsonl",
        "yardim-tr_1.0-1_all.deb",
    ]  # no temporary left over


def test_a_deb_with_other_bytes_is_not_used(gather: ModuleType, tmp_path: Path) -> None:
    sha256 = build_deb(tmp_path, "yardim-tr", "1.0-1", {"usr/share/a.html": help_page(TURKISH)})
    built = gather.Package(
        "yardim-tr",
        "1.0-1",
        sha256,
        "MPL-2.0",
        re.compile(r".*\.html"),
        gather.libreoffice_paragraphs,
    )
    assert gather.fetch(built, tmp_path) == tmp_path / "yardim-tr_1.0-1_all.deb"
    pinned = dataclasses.replace(built, sha256="0" * 64)  # another build of the same version
    with pytest.raises(SystemExit, match=r"no yardim-tr 1\.0-1 \.deb with sha256 0{64}"):
        gather.fetch(pinned, tmp_path)  # and apt-get cannot find one either


def test_extra_text_quoting_the_demo_sample_is_left_out(
    pretrain: ModuleType, tmp_path: Path
) -> None:
    sample = [json.loads(line) for line in (DEFAULT / "tr_chat_sample.jsonl").open()]
    prompts = [json.loads(line) for line in (DEFAULT / "heldout_prompts.jsonl").open()]
    answer = next(m["content"] for m in sample[0]["messages"] if m["role"] == "assistant")
    clean = "Ankara, Türkiye'nin başkentidir ve İç Anadolu Bölgesi'nde yer alır."
    extra = tmp_path / "extra.jsonl"
    texts = [f"Bir belge.\n{answer}\nSonu.", f"Soru: {prompts[0]['prompt']}", clean, clean]
    extra.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    documents = pretrain.pretraining_documents(
        CHAT_FIXTURES, DEFAULT / "tr_chat_sample.jsonl", [extra]
    )
    chat_only = pretrain.pretraining_documents(CHAT_FIXTURES, DEFAULT / "tr_chat_sample.jsonl")
    assert documents == [*chat_only, clean]


def test_a_bad_extra_record_names_its_file_and_line(pretrain: ModuleType, tmp_path: Path) -> None:
    extra = tmp_path / "extra.jsonl"
    extra.write_text('{"text": "Merhaba dünya."}\n{"metin": "yanlış anahtar"}\n')
    with pytest.raises(SystemExit, match=r"extra\.jsonl:2: not a"):
        pretrain.pretraining_documents(CHAT_FIXTURES, DEFAULT / "tr_chat_sample.jsonl", [extra])
