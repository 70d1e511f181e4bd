"""How much of its input a build loses, said out loud: a one-line warning past DROP_WARNING and
the refusal past ``--max-drop-fraction`` (a build that silently drops half its records trains
on a different corpus than the user thinks).

Two shares are measured: of the input records, and of the assistant target tokens of the
records that were tokenized (a record refused before tokenizing, e.g. malformed JSON, has no
known target count). Drops that the user asked for (``--dedup``) and conversations a mixture
leaves out are choices, not losses, and count in neither.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from nedolm.data.advice import drop_hint
from nedolm.data.build_options import BuildError
from nedolm.data.contract import SourceEntry
from nedolm.data.sources import DUPLICATE_CONVERSATION

DROP_WARNING = 0.05
"""``prepare`` warns when more than this share of the records or of the targets is dropped."""


@dataclass(frozen=True)
class DropShare:
    """What a build dropped against what it read."""

    records: int
    dropped_records: int
    target_tokens: int  # assistant targets of the tokenized records, kept or dropped
    dropped_target_tokens: int
    reasons: dict[str, int]  # the counted reasons, most records first

    @property
    def record_fraction(self) -> float:
        return self.dropped_records / self.records if self.records else 0.0

    @property
    def token_fraction(self) -> float:
        return self.dropped_target_tokens / self.target_tokens if self.target_tokens else 0.0

    @property
    def worst(self) -> float:
        return max(self.record_fraction, self.token_fraction)

    def describe(self, seq_len: int, longest: dict[str, int]) -> str:
        """``dropped 48.0% of the records (...) and ... of the assistant tokens; mostly REASON
        (N): what it is and the fix``; ``longest`` as ``BuildReport.drop_longest``."""
        reason, count = next(iter(self.reasons.items()))
        return (
            f"dropped {self.record_fraction:.1%} of the records ({self.dropped_records} of"
            f" {self.records}) and {self.token_fraction:.1%} of the assistant tokens; mostly"
            f" {reason} ({count}): {drop_hint(reason, seq_len, longest.get(reason))}"
        )


def drop_share(
    sources: Sequence[SourceEntry], kept_target_tokens: int, dropped_target_tokens: int
) -> DropShare:
    """The share of ``sources``' records and targets lost (see the module docstring)."""
    reasons: Counter[str] = Counter()
    for source in sources:
        reasons.update(source.dropped)
    reasons.pop(DUPLICATE_CONVERSATION, None)
    return DropShare(
        records=sum(s.records for s in sources),
        dropped_records=sum(reasons.values()),
        target_tokens=kept_target_tokens + dropped_target_tokens,
        dropped_target_tokens=dropped_target_tokens,
        reasons=dict(reasons.most_common()),
    )


def drop_warning(share: DropShare, seq_len: int, longest: dict[str, int]) -> str | None:
    """One line when either share passes DROP_WARNING, else None."""
    if share.worst <= DROP_WARNING:
        return None
    return (
        f"warning: {share.describe(seq_len, longest)}; --max-drop-fraction F makes such a"
        " build fail"
    )


def check_drop_fraction(
    share: DropShare, limit: float | None, seq_len: int, longest: dict[str, int]
) -> None:
    """Refuse a build that lost more than ``limit`` of its records or targets.

    Raises:
        BuildError: naming both shares, the main reason and its fix.
    """
    if limit is None or share.worst <= limit:
        return
    raise BuildError(
        f"{share.describe(seq_len, longest)}; more than --max-drop-fraction {limit:g},"
        " so no corpus was written"
    )
