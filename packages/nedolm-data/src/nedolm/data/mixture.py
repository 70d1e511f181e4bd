"""Data mixtures: how many conversations each weighted input gives the corpus, and which.

A weight is a share of the corpus's training conversations, as in ``datasets``'
``interleave_datasets(probabilities=...)`` or LLaMA-Factory's ``interleave_probs``: with
weights ``w_i`` the corpus holds ``T * w_i / sum(w)`` conversations of input ``i``, where ``T``
is ``--mix-total`` or, by default, the number of usable conversations of all weighted inputs
together (those the build would keep without a mixture). The shares are rounded by largest
remainder: every input gets the floor of its share, and the conversations still missing to
``T`` go one each to the inputs with the largest fractional parts (ties: the earlier input),
so the counts sum to ``T`` exactly. Weights are read as the decimals they were written in
(``0.7`` is 7/10), so the rounding never depends on binary floating point.

An input asked for ``n`` of its ``K`` usable conversations gives each of them ``n // K``
copies and one more copy to ``n % K`` of them drawn without replacement by
``numpy.random.default_rng([seed, input])``: down-sampling keeps ``n`` whole conversations,
up-sampling repeats whole conversations, never a part of one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from nedolm.data.build_options import BuildError


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """Conversations per input: ``total`` split by ``weights``, largest remainder."""
    exact = [Fraction(repr(w)) for w in weights]
    whole = sum(exact)
    shares = [total * w / whole for w in exact]
    counts = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def copies_per_conversation(usable: int, wanted: int, seed: int, source: int) -> np.ndarray:
    """How often each of an input's ``usable`` conversations (in input order) is written so
    that they make ``wanted`` (0: left out).

    Raises:
        BuildError: ``wanted`` conversations from an input that has none.
    """
    if usable == 0 and wanted > 0:
        raise BuildError(f"no usable conversation, but the mixture wants {wanted} of it")
    if usable == 0:
        return np.zeros(0, np.int64)
    copies = np.full(usable, wanted // usable, np.int64)
    extra = np.random.default_rng([seed, source]).permutation(usable)[: wanted % usable]
    copies[extra] += 1
    return copies


def copy_key(doc_key: int, copy: int) -> int:
    """The document key of the ``copy``-th extra copy of a repeated conversation (keys stay
    unique in the corpus; copy 0 keeps the record's own key)."""
    digest = hashlib.blake2b(f"{doc_key}\0copy {copy}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
