"""The builder's shard bytes are pinned: a refactor of the builder must not change one byte.

The digests were taken from the builder before it was split into encode/shards/install
modules; a change of the document layout or the shard format must update them knowingly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import SHARDS_DIR

FIXTURE_CORPUS_SHARDS = {
    "sft-00000-of-00002.index.bin": "74240a2bc065084e82317c307f39a003cc03fc4fb3233d8928dfcd50667faeeb",
    "sft-00000-of-00002.segments.bin": "dc8b8582bc7814e1cdd07a68479f4da39fe5679d45c924825316aa9c3e68a56c",
    "sft-00000-of-00002.tokens.bin": "9d12810f428327495bf5920e5e30dc53abedabd46f89894f4a58e51d89029608",
    "sft-00001-of-00002.index.bin": "e983fc1b6d89a939b71478a2520f66ddd435353661ef6e53beebaa915e176af8",
    "sft-00001-of-00002.segments.bin": "4750f0a981b59902d83bc1b51306e3277cb4a6ed040cdeebd3fbc6a89714c5ae",
    "sft-00001-of-00002.tokens.bin": "199441cf83f92c2d9534bfa90d34addba4643422d0cda0b7705acc7834a33f7b",
}
"""``fixture_corpus`` (tokenizer.json, seq_len 1024, 2 round-robin shards)."""

FILLED_SHARDS = {
    "sft-00000-of-00003.index.bin": "3ff8fa1ab55a44240e0cd1991a16dddbf85007f919c911551adc80ed8d7c58f8",
    "sft-00000-of-00003.segments.bin": "b1401a19dea3951f3dcd0b2a4b2fc7319a96d63845302500d87ae1f0f701ef4d",
    "sft-00000-of-00003.tokens.bin": "9979639fd22395c25dda4814d7903ec4c649f975edd9e4b154b4e3eb5edc20e9",
    "sft-00001-of-00003.index.bin": "6fbd779b6428c0c7b5fa8272b051069dbb06466897d4523f738263167db060b7",
    "sft-00001-of-00003.segments.bin": "808ff695ef01307ed1fde2eaf12cbb5a212edf6dbbb15d6b71656c6b92f678fb",
    "sft-00001-of-00003.tokens.bin": "5dbfa8b46692f00e586346ba617bb48327988c013bf86e1b25d887daffd36437",
    "sft-00002-of-00003.index.bin": "01fefdd33c1fdf2e85a98f2e661b6c3b71c05fff55401e38292f8d6ee9be7953",
    "sft-00002-of-00003.segments.bin": "53e0f3324018e06c9206eda682847c4c269932c78dcef2187d6679ffeb788a68",
    "sft-00002-of-00003.tokens.bin": "724caf6dc3e6891a0f638c4fa81f13507d980bd21dc01bb3aaaf3387318c4d71",
}
"""SentencePiece model, seq_len 256 (drops long documents), shards filled to 5,000 tokens."""


def shard_digests(data_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((data_dir / SHARDS_DIR).iterdir())
    }


def test_round_robin_shards_are_byte_identical_to_the_pinned_build(fixture_corpus: Path) -> None:
    assert shard_digests(fixture_corpus) == FIXTURE_CORPUS_SHARDS


def test_filled_shards_are_byte_identical_to_the_pinned_build(
    tmp_path: Path, tr_chat_inputs: list[Path], sentencepiece_model: Path
) -> None:
    out = tmp_path / "data"
    build_corpus(
        tr_chat_inputs, sentencepiece_model, out, BuildOptions(seq_len=256, shard_tokens=5_000)
    )
    assert shard_digests(out) == FILLED_SHARDS
