"""The role audit: messages per role and the assistant-only target rule, read from segments.

One pass over a segments array answers both questions every reader of a corpus asks: how many
messages of each role it holds, and whether only assistant messages are trainable. The
verifier turns the violations into failed checks, ``validate_roles`` (the trainer's start
check) into a ``RoleError``, and ``corpus_summary`` only reports the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nedolm.data.packing import PlannedShard
from nedolm.data.records import BASE_ROLES, ROLE_ASSISTANT, ROLE_NAMES


class RoleError(ValueError):
    """A segment record with an unknown role code or a trainable non-assistant message."""


@dataclass(frozen=True)
class RoleAudit:
    """Role counts of one segments array, and the first record breaking each rule (or None)."""

    messages_by_role: dict[str, int]
    trainable: int  # messages with a non-zero trainable flag, whatever their role
    assistant_trainable: int
    assistant_context: int
    first_unknown_role: int | None  # record with a role code outside ROLE_NAMES
    first_bad_flag: int | None  # record whose trainable flag is neither 0 nor 1
    first_trainable_non_assistant: int | None

    def violations(self, segments: np.ndarray, where: str) -> dict[str, str]:
        """Broken rule -> a line naming ``where`` and the first record that breaks it.

        Rules: ``unknown_role``, ``bad_flag`` (trainable neither 0 nor 1) and
        ``trainable_non_assistant``; an empty dict means the segments obey the role contract.
        """
        roles, flags = segments["role"], segments["trainable"]
        problems = {}
        if self.first_unknown_role is not None:
            record = self.first_unknown_role
            problems["unknown_role"] = (
                f"{where}: record {record} has unknown role code {roles[record]} "
                f"(known: {dict(enumerate(ROLE_NAMES))})"
            )
        if self.first_bad_flag is not None:
            record = self.first_bad_flag
            problems["bad_flag"] = (
                f"{where}: record {record} has trainable flag {flags[record]}, not 0/1"
            )
        if self.first_trainable_non_assistant is not None:
            record = self.first_trainable_non_assistant
            problems["trainable_non_assistant"] = (
                f"{where}: record {record} is a trainable {_role_name(roles[record])} message; "
                "only assistant messages are targets"
            )
        return problems


def audit_roles(segments: np.ndarray) -> RoleAudit:
    """Count roles and find rule breakers in one vectorised pass over ``segments``."""
    roles, flags = segments["role"], segments["trainable"]
    trainable = flags != 0
    assistant = roles == ROLE_ASSISTANT
    per_code = np.bincount(roles, minlength=len(ROLE_NAMES))
    return RoleAudit(
        messages_by_role={name: int(per_code[code]) for code, name in enumerate(ROLE_NAMES)},
        trainable=int(np.count_nonzero(trainable)),
        assistant_trainable=int(np.count_nonzero(assistant & trainable)),
        assistant_context=int(np.count_nonzero(assistant & ~trainable)),
        first_unknown_role=_first(roles >= len(ROLE_NAMES)),
        first_bad_flag=_first(flags > 1),
        first_trainable_non_assistant=_first(trainable & ~assistant),
    )


def role_totals(audits: Sequence[RoleAudit]) -> dict[str, int]:
    """Summed counts: messages per role name, plus trainable and context-only assistant ones.

    The base roles are always counted; another role (``tool``) only when it has messages, so a
    corpus without them reports exactly the seed's keys.
    """
    counts = dict.fromkeys(BASE_ROLES, 0) | {"assistant_trainable": 0, "assistant_context": 0}
    for audit in audits:
        for name, count in audit.messages_by_role.items():
            if count or name in BASE_ROLES:
                counts[name] = counts.get(name, 0) + count
        counts["assistant_trainable"] += audit.assistant_trainable
        counts["assistant_context"] += audit.assistant_context
    return counts


def _role_name(code: int) -> str:
    return ROLE_NAMES[code] if code < len(ROLE_NAMES) else f"role-{code}"


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def validate_roles(shards: Sequence[PlannedShard]) -> dict[str, int]:
    """The trainer's role check: summed counts of :func:`role_totals`, or the first broken rule.

    Raises:
        RoleError: an unknown role code, a trainable flag other than 0/1, or a trainable
            message that is not an assistant's (names the segments file and the record).
    """
    audits = []
    for planned in shards:
        segments = planned.shard.segments
        audit = audit_roles(segments)
        problems = audit.violations(segments, str(planned.shard.segments_path))
        if problems:
            raise RoleError(next(iter(problems.values())))
        audits.append(audit)
    return role_totals(audits)
