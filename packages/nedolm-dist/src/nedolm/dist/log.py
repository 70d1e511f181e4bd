"""Rank-aware logging: INFO from rank 0 only, warnings and errors from every rank, except a
warning every rank logs alike (``extra=ON_MAIN_RANK``), which rank 0 alone prints."""

from __future__ import annotations

import logging
from typing import Final

from nedolm.dist.group import get_rank

_MAIN_RANK_ONLY = "main_rank_only"
ON_MAIN_RANK: Final = {_MAIN_RANK_ONLY: True}
"""``extra=`` for a warning every rank reaches alike (a fact of the config, not of the rank):
a job on 64 ranks prints it once, not 64 times."""


class MainRankFilter(logging.Filter):
    """Drop records below WARNING, and those marked ``ON_MAIN_RANK``, on non-zero ranks; tag
    every record with ``rank``.

    Attach it to a *handler* (logger filters do not see records propagated from child
    loggers); formats may then use ``%(rank)s``. Replaces ``if rank == 0: log(...)``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.rank = rank
        if rank == 0:
            return True
        return record.levelno >= logging.WARNING and not getattr(record, _MAIN_RANK_ONLY, False)
