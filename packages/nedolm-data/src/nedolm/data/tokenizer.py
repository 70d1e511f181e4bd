"""Tokenizer adapters and the corpus's special ids.

Two real formats are supported, each behind an optional extra: a Hugging Face
``tokenizer.json`` (``tokenizers``; ``.json.gz`` is read too; a model directory holding
``tokenizer.json`` and ``tokenizer_config.json``, whose ``eos_token`` then names EOS) and a
SentencePiece model
(``sentencepiece``; gzipped models too). Both encode content with no special tokens added and with special-token
strings NOT interpreted, so text typed by a user can never become a control id.

One caveat the builder must still guard against: a ``tokenizers`` Unigram model whose vocabulary
holds ``<s>`` or ``</s>`` as a normal piece can pick that piece for the literal text even with
special-token parsing off (SentencePiece never does). The builder therefore checks content ids
against ``content_forbidden_ids`` after encoding, and the verifier checks the binaries against the
same set. Characters outside the vocabulary become ``<unk>``: a coverage gap of the tokenizer,
not a control token, so the builder counts them per source instead of refusing the record.
"""

from __future__ import annotations

import gzip
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec

from nedolm.data.format import (
    ControlToken,
    SpecialTokens,
    TokenizerInfo,
)
from nedolm.data.hashing import file_sha256
from nedolm.data.lossless import PROBE, reversible_pipeline
from nedolm.data.records import (
    MESSAGE_END_TOKEN,
    MESSAGE_START_TOKEN,
    ROLE_HEADERS,
    registered_roles,
)
from nedolm.data.render import role_header_text
from nedolm.data.schema import SPECIAL_TOKENS_SCHEMA

_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded or lacks what the corpus needs; names the file."""


def read_tokenizer_bytes(path: Path) -> bytes:
    """The tokenizer file's contents, gunzipped when its name ends in ``.gz``."""
    raw = Path(path).read_bytes()
    return gzip.decompress(raw) if path.name.endswith(".gz") else raw


class TextTokenizer(ABC):
    """What the builder needs from a tokenizer: batch encoding, decoding and special ids."""

    kind: str
    path: Path
    base_vocab_size: int
    eos_id: int
    pad_id: int | None  # the tokenizer's own pad id, if it has one
    unk_id: int | None  # stands for characters outside the vocabulary, if the model has one
    lossless: bool = False  # decode(encode(text)) == text for every text without a ``▁``
    config_path: Path | None = None  # the tokenizer_config.json EOS was read from

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added, special strings not parsed."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special ids rendered as their strings)."""

    @abstractmethod
    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """``decode`` of each id list (releases the GIL, like ``encode_batch``)."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` if it is one whole entry of the vocabulary, else None."""

    @abstractmethod
    def special_ids(self) -> set[int]:
        """Every id the tokenizer marks special: BOS, EOS, pad, unk, control and added special
        tokens."""

    @abstractmethod
    def pieces(self) -> list[str]:
        """The surface form of every id below ``base_vocab_size``, in id order.

        Models use it to derive per-id features (NedoLM's morph classes) from the vocabulary.
        """

    @property
    def name(self) -> str:
        return self.path.name


class HFTokenizer(TextTokenizer):
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    kind = "tokenizers"

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerError(
                f"{path}: reading tokenizer.json needs the 'tokenizers' package "
                "(pip install 'nedolm-data[tokenizers]')"
            ) from exc
        self.path = Path(path)
        try:
            text = read_tokenizer_bytes(self.path).decode("utf-8")
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{path}: not a loadable tokenizer.json: {exc}") from exc
        doc = json.loads(text)
        self.unk_id = self._model_unk_id(doc.get("model") or {})
        self._tok.encode_special_tokens = True  # typed "</s>" is text, not a control token
        self.lossless = (
            reversible_pipeline(doc) and self.decode_batch(self.encode_batch([PROBE]))[0] == PROBE
        )
        self.base_vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.config_path = self.path.with_name(HF_TOKENIZER_CONFIG)
        if self.path.name != HF_TOKENIZER_FILE or not self.config_path.is_file():
            self.config_path = None
        eos = self._configured_eos() if self.config_path else None
        eos = eos if eos is not None else _first_id(self._tok.token_to_id, _EOS_CANDIDATES)
        if eos is None:
            raise TokenizerError(f"{path}: no end-of-sequence token among {_EOS_CANDIDATES}")
        self.eos_id = eos
        self.pad_id = _first_id(self._tok.token_to_id, _PAD_CANDIDATES)

    def _model_unk_id(self, model: dict) -> int | None:
        """Unigram models name their unk by id, BPE and WordPiece by token (None: no unk)."""
        if isinstance(model.get("unk_id"), int):
            return model["unk_id"]
        token = model.get("unk_token")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    def _configured_eos(self) -> int | None:
        """The id of tokenizer_config.json's ``eos_token`` (None when it names none)."""
        assert self.config_path is not None
        try:
            eos = json.loads(self.config_path.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise TokenizerError(f"{self.config_path}: not a readable JSON object: {exc}") from exc
        if isinstance(eos, dict):  # AddedToken form: {"content": "</s>", ...}
            eos = eos.get("content")
        if eos is None:
            return None
        eos_id = self._tok.token_to_id(str(eos))
        if eos_id is None:
            raise TokenizerError(
                f"{self.config_path}: eos_token {eos!r} is not in the vocabulary of {self.path}"
            )
        return eos_id

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self._tok.decode_batch([list(i) for i in ids], skip_special_tokens=False)

    def special_ids(self) -> set[int]:
        added = self._tok.get_added_tokens_decoder()
        return {i for i, token in added.items() if token.special} | {self.eos_id}

    def pieces(self) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in range(self.base_vocab_size)]


class SentencePieceTokenizer(TextTokenizer):
    """A SentencePiece model, ``.gz`` too (control symbols are never produced from text)."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        try:
            import sentencepiece
        except ImportError as exc:
            raise TokenizerError(
                f"{path}: reading a SentencePiece model needs the 'sentencepiece' package "
                "(pip install 'nedolm-data[sentencepiece]')"
            ) from exc
        self.path = Path(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(
                model_proto=read_tokenizer_bytes(self.path)
            )
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"{path}: not a loadable SentencePiece model: {exc}") from exc
        self.base_vocab_size = self._sp.get_piece_size()
        if self._sp.eos_id() < 0:
            raise TokenizerError(f"{path}: the SentencePiece model defines no EOS id")
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.unk_id = self._sp.unk_id() if self._sp.unk_id() >= 0 else None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self._sp.decode([list(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)  # unknown pieces map to the unk id
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def special_ids(self) -> set[int]:
        sp = self._sp
        return {
            i
            for i in range(self.base_vocab_size)
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
        }

    def pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self.base_vocab_size)]


def _first_id(lookup: Callable[[str], int | None], candidates: Sequence[str]) -> int | None:
    for token in candidates:
        token_id = lookup(token)
        if token_id is not None:
            return token_id
    return None


def load_tokenizer(path: Path) -> TextTokenizer:
    """A directory (a Hugging Face model's) → its ``tokenizer.json``; ``*.json`` /
    ``*.json.gz`` → ``tokenizers``; anything else → SentencePiece."""
    path = Path(path)
    if path.is_dir():
        path = path / HF_TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found")
    if path.name.endswith((".json", ".json.gz")):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def _existing_or_next(token_id: int | None, free_ids: Iterator[int]) -> int:
    return next(free_ids) if token_id is None else token_id


def copy_tokenizer_files(tokenizer: TextTokenizer, out_dir: Path) -> None:
    """Copy the tokenizer file (and the tokenizer_config.json it read EOS from) into out_dir."""
    shutil.copyfile(tokenizer.path, out_dir / tokenizer.name)
    if tokenizer.config_path is not None:
        shutil.copyfile(tokenizer.config_path, out_dir / tokenizer.config_path.name)


def content_forbidden_ids(tokenizer: TextTokenizer | None, specials: SpecialTokens) -> set[int]:
    """Ids that must never occur inside message content: the corpus's EOS, pad and control ids
    plus the tokenizer's special ids (but ``<unk>``, which only stands for characters it cannot
    encode; without the tokenizer, the corpus's ids alone)."""
    corpus_ids = {
        specials.eos_id,
        specials.pad_id,
        specials.message_start_id,
        specials.message_end_id,
    }
    if tokenizer is None:
        return corpus_ids
    return corpus_ids | (tokenizer.special_ids() - {tokenizer.unk_id})


def build_special_tokens(tokenizer: TextTokenizer, tokenizer_file: str) -> SpecialTokens:
    """The corpus's ids (SPEC §2) for ``tokenizer``; ``tokenizer_file`` is its path in DATA_DIR.

    Every role of the registry gets its header ids; ``registered_special_tokens`` narrows them to
    the roles a built corpus uses before SPECIAL_TOKENS.json is written.

    Control ids follow the base vocabulary (32000, 32001 for NedoLM's tokenizer) unless the
    tokenizer already holds the control tokens, whose ids are then kept. The pad id is the
    tokenizer's own if distinct from EOS, else the next free id, so padding is never EOS (EOS
    starts a new attention segment) and never a control token.
    """
    base = tokenizer.base_vocab_size
    free_ids = iter(range(base, base + 3))
    start_id, end_id = (
        _existing_or_next(tokenizer.token_to_id(token), free_ids)
        for token in (MESSAGE_START_TOKEN, MESSAGE_END_TOKEN)
    )
    pad_id = tokenizer.pad_id
    if pad_id is None or pad_id == tokenizer.eos_id:
        pad_id = next(free_ids)
    headers = tokenizer.encode_batch([role_header_text(word) for word in ROLE_HEADERS.values()])
    for role, ids in zip(ROLE_HEADERS, headers, strict=True):
        if not ids:
            raise TokenizerError(f"{tokenizer.path}: the {role} header encodes to no tokens")
    return SpecialTokens(
        schema=SPECIAL_TOKENS_SCHEMA,
        eos_id=tokenizer.eos_id,
        pad_id=pad_id,
        message_start_id=start_id,
        message_end_id=end_id,
        vocab_size=max(start_id, end_id, pad_id, tokenizer.eos_id) + 1,
        control_tokens=[
            ControlToken(id=start_id, token=MESSAGE_START_TOKEN),
            ControlToken(id=end_id, token=MESSAGE_END_TOKEN),
        ],
        roles=dict(ROLE_HEADERS),
        role_header_token_ids=dict(zip(ROLE_HEADERS, headers, strict=True)),
        tokenizer=TokenizerInfo(
            name=tokenizer.name,
            file=tokenizer_file,
            kind=tokenizer.kind,
            sha256=file_sha256(tokenizer.path),
            base_vocab_size=base,
        ),
    )


def registered_special_tokens(specials: SpecialTokens, role_codes: set[int]) -> SpecialTokens:
    """``specials`` registering only the base roles and the roles in ``role_codes``
    (``records.registered_roles``): a corpus without tool messages keeps the seed's registry."""
    roles = registered_roles(role_codes)
    headers = {name: specials.role_header_token_ids[name] for name in roles}
    return msgspec.structs.replace(specials, roles=roles, role_header_token_ids=headers)
