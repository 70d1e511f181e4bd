"""Rank-aware logging: INFO from rank 0 only, warnings and errors from every rank."""

from __future__ import annotations

import logging

from nedolm.dist.group import get_rank


class MainRankFilter(logging.Filter):
    """Drop records below WARNING on non-zero ranks and tag every record with ``rank``.

    Attach it to a *handler* (logger filters do not see records propagated from child
    loggers); formats may then use ``%(rank)s``. Replaces ``if rank == 0: log(...)``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.rank = rank
        return rank == 0 or record.levelno >= logging.WARNING
