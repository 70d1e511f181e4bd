"""nedolm.data: chat JSONL -> verified binary shards, their contract, planner, verifier and loader.

The core needs numpy and msgspec only; importing this package never imports torch. The loader
names (``build_sft_loader``, ``SFTLoader``, ``LoaderStateError``) come from
``nedolm.data.loader`` on first access and need the ``torch`` extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nedolm.data.builder import BuildError, BuildOptions, BuildReport, build_corpus
from nedolm.data.contract import (
    DatasetContractError,
    ManifestEntry,
    PackingAudit,
    ShardManifest,
    VerifyReport,
    validate_dataset_contract,
)
from nedolm.data.format import (
    Shard,
    ShardFormatError,
    SpecialTokens,
    discover_shards,
    read_special_tokens,
)
from nedolm.data.packing import (
    PackingCounts,
    PackingError,
    PlannedShard,
    discover_sft_shards,
    plan_shard,
)
from nedolm.data.roles import RoleError, validate_roles
from nedolm.data.sources import InputError, RecordPolicy
from nedolm.data.stats import corpus_stats, packing_quality
from nedolm.data.summary import corpus_summary
from nedolm.data.tokenizer import TextTokenizer, TokenizerError, load_tokenizer
from nedolm.data.verify import VerifyResult, check_corpus, verify_corpus

if TYPE_CHECKING:
    from nedolm.data.loader import LoaderStateError, SFTLoader, build_sft_loader

_TORCH_NAMES = {
    "LoaderStateError": "nedolm.data.loader",
    "SFTLoader": "nedolm.data.loader",
    "build_sft_loader": "nedolm.data.loader",
}
"""Public names whose module imports torch: resolved on first access (PEP 562)."""

__all__ = [
    "BuildError",
    "BuildOptions",
    "BuildReport",
    "DatasetContractError",
    "InputError",
    "LoaderStateError",
    "ManifestEntry",
    "PackingAudit",
    "PackingCounts",
    "PackingError",
    "PlannedShard",
    "RecordPolicy",
    "RoleError",
    "SFTLoader",
    "Shard",
    "ShardFormatError",
    "ShardManifest",
    "SpecialTokens",
    "TextTokenizer",
    "TokenizerError",
    "VerifyReport",
    "VerifyResult",
    "build_corpus",
    "build_sft_loader",
    "check_corpus",
    "corpus_stats",
    "corpus_summary",
    "discover_sft_shards",
    "discover_shards",
    "load_tokenizer",
    "packing_quality",
    "plan_shard",
    "read_special_tokens",
    "validate_dataset_contract",
    "validate_roles",
    "verify_corpus",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        value = getattr(importlib.import_module(_TORCH_NAMES[name]), name)
        globals()[name] = value  # resolve once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
