"""Exact resume: stop after k batches, restore from the trainer's state dict, compare the rest."""

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from nedolm.data.loader import LoaderStateError, build_sft_loader
from nedolm.data.packing import discover_sft_shards
from nedolm.data.synthetic import random_conversations, write_corpus

SEQ_LEN = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data_dir = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(5)
    write_corpus(data_dir, [random_conversations(rng, 25, 15) for _ in range(2)])
    return data_dir


def trainer_state(batches: list[dict]) -> dict[int, list[int]]:
    """What the trainer keeps: the last state row per worker, saved as JSON."""
    state = {}
    for batch in batches:
        row = batch["state"][-1].tolist()
        state[int(row[0])] = [int(v) for v in row]
    return json.loads(json.dumps(state))  # keys become strings, as after a checkpoint


@pytest.mark.parametrize(
    ("world_size", "num_workers", "micro_batch"),
    [(1, 0, 3), (2, 2, 2), (3, 1, 4), (1, 2, 5)],
)
def test_resume_continues_the_exact_stream(
    corpus: Path, world_size: int, num_workers: int, micro_batch: int
) -> None:
    shards = discover_sft_shards(corpus, SEQ_LEN)
    rng = np.random.default_rng(world_size * 100 + num_workers * 10 + micro_batch)
    rank = int(rng.integers(world_size))
    settings = dict(
        rank=rank, world_size=world_size, num_workers=num_workers, seed=42, shards=shards
    )
    loader, dataset = build_sft_loader(corpus, SEQ_LEN, micro_batch, **settings)
    per_epoch = -(-dataset.windows_per_epoch // micro_batch)
    k = int(rng.integers(1, 2 * per_epoch))
    m = per_epoch + 2  # the remainder always crosses an epoch boundary
    full = list(islice(loader, k + m))
    assert int(full[-1]["state"][-1, 1]) > int(full[k]["state"][0, 1]), "no epoch boundary"

    resumed_loader, _ = build_sft_loader(
        corpus, SEQ_LEN, micro_batch, resume_state=trainer_state(full[:k]), **settings
    )
    resumed = list(islice(resumed_loader, m))
    for expected, got in zip(full[k:], resumed, strict=True):
        for key in ("tokens", "trainable_mask", "trainable_tokens", "state"):
            assert got[key].equal(expected[key]), key


def test_resume_state_from_other_settings_is_refused(corpus: Path, tmp_path: Path) -> None:
    shards = discover_sft_shards(corpus, SEQ_LEN)
    loader, _ = build_sft_loader(corpus, SEQ_LEN, 2, world_size=2, num_workers=0, shards=shards)
    state = trainer_state(list(islice(loader, 3)))

    def resume(**changes: object) -> None:
        args = dict(world_size=2, num_workers=0, shards=shards, seq_len=SEQ_LEN)
        args |= changes
        build_sft_loader(corpus, micro_batch_size=2, resume_state=state, **args)

    resume()  # the original settings resume
    with pytest.raises(LoaderStateError, match="saved with seq_len=48, this loader has 32"):
        resume(seq_len=32, shards=discover_sft_shards(corpus, 32))
    with pytest.raises(LoaderStateError, match="world_size=2, this loader has 4"):
        resume(world_size=4)
    with pytest.raises(LoaderStateError, match="num_workers=0, this loader has 2"):
        resume(num_workers=2)
    with pytest.raises(LoaderStateError, match="seed=0, this loader has 1"):
        resume(seed=1)
    with pytest.raises(LoaderStateError, match="not one of rank 1's workers"):
        resume(rank=1)
    other = tmp_path / "other"
    write_corpus(other, [random_conversations(np.random.default_rng(9), 25, 15)])
    with pytest.raises(LoaderStateError, match="corpus plan fingerprint"):
        build_sft_loader(other, SEQ_LEN, 2, world_size=2, resume_state=state)
    with pytest.raises(LoaderStateError, match="has 3 columns"):
        resume_bad = {0: [0, 0, 1]}
        build_sft_loader(corpus, SEQ_LEN, 2, world_size=2, shards=shards, resume_state=resume_bad)
    (row,) = state.values()
    with pytest.raises(LoaderStateError, match="inconsistent"):
        build_sft_loader(
            corpus, SEQ_LEN, 2, world_size=2, shards=shards,
            resume_state={0: [0, row[1], row[2] + 1, *row[3:]]},
        )  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_owns_its_state_dict(corpus: Path, num_workers: int) -> None:
    """``state_dict`` after k batches is the trainer's view of them; ``load_state_dict`` on a
    fresh loader continues with batch k, and is refused once a loader has started."""
    settings = dict(world_size=1, num_workers=num_workers, seed=7)
    loader, _ = build_sft_loader(corpus, SEQ_LEN, 3, **settings)
    assert loader.state_dict() == {}
    stream = iter(loader)
    first = [next(stream) for _ in range(5)]
    state = loader.state_dict()
    assert state == trainer_state(first)
    expected = [next(stream) for _ in range(3)]
    resumed, _ = build_sft_loader(corpus, SEQ_LEN, 3, **settings)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    for want, got in zip(expected, islice(resumed, 3), strict=True):
        assert got["tokens"].equal(want["tokens"]) and got["state"].equal(want["state"])
    with pytest.raises(RuntimeError, match="before iterating"):
        resumed.load_state_dict(state)
