"""Gather Turkish prose from Debian documentation packages, for pretraining the demo base.

The shipped chat data alone (about 314k tokens) is too little text for a base model that says
anything coherent, and no Turkish corpus can be fetched here. Debian's archive, though, carries
several megabytes of human-translated Turkish documentation under clear licences:

    libreoffice-help-tr  4:7.4.7-1+deb12u14  MPL-2.0 (some files Apache-2.0)  LibreOffice help
    manpages-tr          2.0.6-2             GPL (translations; the English     Turkish man pages
                                             pages' notices are kept in them)

(GNOME's Turkish help, gnome-user-docs 43.0-2, was tried: it is almost all untranslated.)

Each package is fetched at that exact version with ``apt-get download`` (into --cache, reused
when present; the file's sha256 is checked) and read straight from its data tarball, so the same
command gives the same text.
A help page becomes one document: its paragraphs, one per line, less

- paragraphs that are not Turkish (pages are partly untranslated; a word-list test decides),
- boilerplate (a paragraph found on more than --boilerplate pages of one package: headers,
  "related topics" and the like),
- any paragraph already kept for an earlier page (LibreOffice embeds the same snippets in many
  pages), and pages left with fewer than --min-chars characters.

Output: a JSON-lines file of ``{"text": ..., "source": "<package>:<path>"}``, pages in path
order. ``tools/pretrain_demo_base.py --extra-text FILE`` reads it.

Example::

    python tools/gather_demo_text.py --cache /tmp/demo-debs --out /tmp/demo_text.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Package:
    """A pinned Debian package and how to turn its member files into paragraph lists."""

    name: str
    version: str
    sha256: str  # of the .deb: the same bytes give the same text
    licence: str
    member: re.Pattern[str]  # the tar members that are pages
    paragraphs: Callable[[bytes], list[str]]


# ---------------------------------------------------------------------------- page readers

_BLOCK_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "td", "th", "div", "br", "title"}


class _HelpHTML(html.parser.HTMLParser):
    """The text of a LibreOffice help page, a line break at every block element."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def libreoffice_paragraphs(raw: bytes) -> list[str]:
    """Paragraphs of a LibreOffice help page, without its debug footer."""
    parser = _HelpHTML()
    parser.feed(raw.decode("utf-8"))
    text = "".join(parser.parts).split("Help content debug info:", 1)[0]
    return split_paragraphs(text)


_ROFF_ESCAPES = (
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\\((em|en)"), "—"),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\(.."), ""),  # other named glyphs
    (re.compile(r"\\[-e]"), lambda m: "-" if m.group() == "\\-" else "\\"),
    (re.compile(r"\\[&|^%c]"), ""),
    (re.compile(r"\\ "), " "),
)
_ROFF_TEXT_MACROS = {".SH", ".SS", ".B", ".I", ".BR", ".IR", ".RB", ".RI", ".BI", ".IB"}


def roff_paragraphs(raw: bytes) -> list[str]:
    """Paragraphs of a gzipped man page: its text lines, a break at every other macro.

    Headings and font-macro arguments are text; ``.ig`` blocks, comments and the other
    requests (spacing, indentation, ``.TH``) are dropped.
    """
    lines, ignoring = [], False
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if ignoring:
            ignoring = line.strip() != ".."
            continue
        if line.startswith((".ig", "'ig")):
            ignoring = True
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line.partition(" ")
            lines.append("\n")
            if macro in _ROFF_TEXT_MACROS:
                lines.append(rest.replace('"', "") + ("\n" if macro in (".SH", ".SS") else " "))
            continue
        lines.append(line + " ")
    text = "".join(lines)
    for pattern, replacement in _ROFF_ESCAPES:
        text = pattern.sub(replacement, text)
    return split_paragraphs(text)


def split_paragraphs(text: str) -> list[str]:
    """Non-empty lines of ``text`` with runs of whitespace collapsed."""
    return [p for p in (" ".join(line.split()) for line in text.split("\n")) if p]


PACKAGES = (
    Package(
        "libreoffice-help-tr",
        "4:7.4.7-1+deb12u14",
        "8fe832104805b66d2dc5c153564bcc55b5a084e10b3c3a3ea773c4b57659bfb8",
        "MPL-2.0",
        re.compile(r"\./usr/share/libreoffice/help/tr/text/.*\.html"),
        libreoffice_paragraphs,
    ),
    Package(
        "manpages-tr",
        "2.0.6-2",
        "babf3ded00dd7c30db8fb333c1ff482fd5a52483d2bffec7557e3f78ed77eef1",
        "GPL (package copyright; per-page upstream notices kept)",
        re.compile(r"\./usr/share/man/tr/man\d/.*\.gz"),
        roff_paragraphs,
    ),
)

# ---------------------------------------------------------------------------- Turkish test

_TURKISH = set(
    [
        "ve",
        "bir",
        "bu",
        "için",
        "ile",
        "da",
        "de",
        "olarak",
        "veya",
        "daha",
        "çok",
        "gibi",
        "olan",
        "en",
        "ya",
        "ise",
        "kadar",
        "sonra",
        "önce",
        "her",
        "hem",
        "ancak",
        "yani",
        "şu",
        "o",
        "ne",
        "nasıl",
        "tüm",
        "bütün",
        "diğer",
        "aynı",
        "yeni",
        "üzerinde",
        "içinde",
        "arasında",
        "göre",
        "değil",
        "var",
        "yok",
        "olur",
        "olarak",
        "istediğiniz",
        "seçin",
        "tıklayın",
        "ekle",
        "belge",
        "hücre",
        "dosya",
        "sayfa",
        "metin",
        "tablo",
        "işlev",
        "değer",
        "alan",
        "sütun",
        "satır",
        "komut",
        "pencere",
        "menü",
        "seçenek",
    ]
)
_ENGLISH = set(
    [
        "the",
        "of",
        "and",
        "to",
        "is",
        "in",
        "for",
        "that",
        "this",
        "with",
        "are",
        "be",
        "on",
        "by",
        "as",
        "or",
        "from",
        "it",
        "an",
        "you",
        "can",
        "which",
        "your",
        "click",
        "choose",
        "select",
        "use",
        "when",
        "will",
        "not",
        "if",
        "all",
        "each",
        "into",
        "new",
        "file",
    ]
)
_TURKISH_LETTERS = set("çğıöşüÇĞİÖŞÜ")
_WORD = re.compile(r"[^\W\d_]+")


def is_turkish(paragraph: str) -> bool:
    """True when Turkish words (or letters) outnumber common English words."""
    words = [w.lower() for w in _WORD.findall(paragraph)]
    if not words:
        return False
    turkish = sum(w in _TURKISH or not _TURKISH_LETTERS.isdisjoint(w) for w in words)
    english = sum(w in _ENGLISH for w in words)
    return turkish > english


# ---------------------------------------------------------------------------- fetching


def fetch(package: Package, cache: Path) -> Path:
    """The package's .deb in ``cache`` (checked by sha256), downloaded there when missing."""
    cache.mkdir(parents=True, exist_ok=True)

    def matching() -> list[Path]:
        found = sorted(cache.glob(f"{package.name}_*.deb"))
        return [p for p in found if hashlib.sha256(p.read_bytes()).hexdigest() == package.sha256]

    if not matching():
        subprocess.run(["apt-get", "download", f"{package.name}={package.version}"], cwd=cache)
    wanted = matching()
    if not wanted:
        raise SystemExit(
            f"{cache}: no {package.name} {package.version} .deb with sha256 {package.sha256}; "
            "if the mirror has moved on, snapshot.debian.org keeps that file"
        )
    return wanted[0]


def pages(package: Package, deb: Path) -> Iterator[tuple[str, list[str]]]:
    """(member path, paragraphs) of every page in the .deb, in path order."""
    tar_bytes = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and package.member.fullmatch(m.name)),
            key=lambda m: m.name,
        )
        for member in members:
            raw = tar.extractfile(member).read()  # type: ignore[union-attr]
            try:
                yield member.name.removeprefix("./"), package.paragraphs(raw)
            except (OSError, UnicodeDecodeError) as exc:  # bad gzip or encoding
                raise SystemExit(f"{deb}: {member.name}: cannot read the page: {exc}") from exc


# ---------------------------------------------------------------------------- documents


def package_documents(
    package: Package, deb: Path, seen: set[str], boilerplate: int, min_chars: int
) -> Iterator[dict[str, str]]:
    """The package's pages as documents; ``seen`` (paragraphs kept so far) is updated."""
    listed = list(pages(package, deb))
    spread = Counter(p for _, paragraphs in listed for p in set(paragraphs))
    for path, paragraphs in listed:
        kept: list[str] = []
        for paragraph in paragraphs:
            if spread[paragraph] > boilerplate or paragraph in seen or not is_turkish(paragraph):
                continue
            seen.add(paragraph)
            kept.append(paragraph)
        text = "\n".join(kept)
        if len(text) >= min_chars:
            yield {"text": text, "source": f"{package.name}:{path}"}


def gather(
    cache: Path,
    out: Path,
    boilerplate: int,
    min_chars: int,
    packages: Sequence[Package] = PACKAGES,
) -> dict[str, int]:
    """Write every package's documents to ``out`` atomically; returns documents per package."""
    seen: set[str] = set()
    counts: dict[str, int] = {}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            for package in packages:
                deb = fetch(package, cache)
                counts[package.name] = 0
                for document in package_documents(package, deb, seen, boilerplate, min_chars):
                    handle.write(json.dumps(document, ensure_ascii=False) + "\n")
                    counts[package.name] += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cache", type=Path, required=True, help="folder for the .deb files")
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    parser.add_argument(
        "--boilerplate", type=int, default=20, help="drop paragraphs on more pages than this"
    )
    parser.add_argument("--min-chars", type=int, default=200, help="drop shorter pages")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    counts = gather(args.cache, args.out, args.boilerplate, args.min_chars)
    print(json.dumps({"out": str(args.out), "documents": counts}))


if __name__ == "__main__":
    main()
