"""Binary shard format: round trips, header refusal, shard discovery, pickling."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from nedolm.data.format import (
    HEADER_BYTES,
    ArrayWriter,
    Shard,
    ShardFormatError,
    discover_shards,
    read_array,
    read_special_tokens,
    shard_file_name,
    write_array,
)
from nedolm.data.records import INDEX_DTYPE, SEGMENT_DTYPE


def _segments(n: int) -> np.ndarray:
    seg = np.zeros(n, dtype=SEGMENT_DTYPE)
    seg["start"] = np.arange(n) * 7
    seg["length"] = 7
    seg["header_len"] = 3
    seg["role"] = np.arange(n) % 3
    seg["trainable"] = seg["role"] == 2
    return seg


def _index(n: int) -> np.ndarray:
    idx = np.zeros(n, dtype=INDEX_DTYPE)
    idx["doc_key"] = np.arange(n, dtype=np.uint64) * (2**40 + 1)
    idx["token_start"] = np.arange(n) * 10
    idx["token_len"] = 10
    return idx


@pytest.mark.parametrize(
    ("kind", "array"),
    [
        ("tokens", np.arange(1000, dtype="<u2")),
        ("tokens", np.array([0, 2**31, 2**32 - 1], dtype="<u4")),
        ("segments", _segments(5)),
        ("index", _index(4)),
        ("tokens", np.zeros(0, dtype="<u2")),
    ],
)
def test_round_trip_is_exact_and_file_size_is_header_plus_data(tmp_path, kind, array):
    path = tmp_path / f"x.{kind}.bin"
    write_array(path, kind, array)
    back = read_array(path, kind)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)
    assert path.stat().st_size == HEADER_BYTES + array.nbytes
    # the data section is the raw little-endian array: an independent read agrees
    raw = np.frombuffer(path.read_bytes()[HEADER_BYTES:], dtype=array.dtype)
    np.testing.assert_array_equal(raw, array)


def test_reader_is_a_read_only_memmap(tmp_path):
    path = tmp_path / "t.bin"
    write_array(path, "tokens", np.arange(10, dtype="<u2"))
    view = read_array(path, "tokens")
    assert isinstance(view, np.memmap)
    with pytest.raises(ValueError):
        view[0] = 1


def test_streaming_writer_appends_chunks(tmp_path):
    path = tmp_path / "t.bin"
    with ArrayWriter(path, "tokens", np.dtype("<u4")) as writer:
        for i in range(3):
            writer.write(np.full(i + 1, i, dtype="<u4"))
    np.testing.assert_array_equal(read_array(path, "tokens"), [0, 1, 1, 2, 2, 2])


def test_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "t.bin"
    with pytest.raises(RuntimeError), ArrayWriter(path, "tokens", np.dtype("<u2")) as writer:
        writer.write(np.arange(3, dtype="<u2"))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_wrong_dtype(tmp_path):
    with pytest.raises(ValueError, match="float32"):
        write_array(tmp_path / "t.bin", "tokens", np.zeros(3, dtype=np.float32))
    writer = ArrayWriter(tmp_path / "u.bin", "tokens", np.dtype("<u2"))
    with pytest.raises(ValueError, match="int64"):
        writer.write(np.zeros(3, dtype=np.int64))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "sft-00000-of-00001.tokens.bin"
    write_array(path, "tokens", np.arange(100, dtype="<u2"))
    return path


def test_truncated_file_is_refused_by_name(token_file):
    data = token_file.read_bytes()
    token_file.write_bytes(data[:-1])
    with pytest.raises(ShardFormatError, match=r"sft-00000-of-00001\.tokens\.bin.*truncated"):
        read_array(token_file, "tokens")
    token_file.write_bytes(data[:10])
    with pytest.raises(ShardFormatError, match="shorter than"):
        read_array(token_file, "tokens")


def test_trailing_bytes_are_refused(token_file):
    token_file.write_bytes(token_file.read_bytes() + b"\0\0")
    with pytest.raises(ShardFormatError, match="trailing"):
        read_array(token_file, "tokens")


def test_wrong_kind_is_refused(token_file):
    with pytest.raises(ShardFormatError, match="not a segments file"):
        read_array(token_file, "segments")


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "foreign.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ShardFormatError, match=r"foreign\.bin: magic"):
        read_array(path, "tokens")


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (8, "<H", 2, "format version 2"),
        (10, "<H", 16, "dtype code 16"),
        (12, "<I", 4, "record size"),
    ],
)
def test_corrupt_header_fields_are_refused(token_file, offset, fmt, value, message):
    data = bytearray(token_file.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    token_file.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=message):
        read_array(token_file, "tokens")


def _write_shard(shards_dir, sid, total, n_docs=2):
    shard = Shard.in_dir(shards_dir, sid, total)
    write_array(shard.token_path, "tokens", np.arange(20, dtype="<u2"))
    write_array(shard.segments_path, "segments", _segments(n_docs))
    write_array(shard.index_path, "index", _index(n_docs))
    return shard


def test_discover_shards_sorted_and_lazy(tmp_path):
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    for sid in (2, 0, 1):
        _write_shard(shards_dir, sid, 3)
    found = discover_shards(tmp_path)
    assert [s.shard_id for s in found] == [0, 1, 2]
    assert found[1].token_path.name == "sft-00001-of-00003.tokens.bin"
    assert "tokens" not in found[0].__dict__  # nothing mapped until used
    np.testing.assert_array_equal(found[0].index, _index(2))


def test_shard_pickles_without_its_arrays(tmp_path):
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    shard = _write_shard(shards_dir, 0, 1)
    assert len(shard.tokens) == 20  # mapped and cached in this process
    blob = pickle.dumps(shard)
    assert len(blob) < 1000
    clone = pickle.loads(blob)
    assert clone == shard
    np.testing.assert_array_equal(clone.tokens, shard.tokens)


def _incomplete(d):
    _write_shard(d, 0, 2)
    _write_shard(d, 1, 2).index_path.unlink()


def _gap(d):
    _write_shard(d, 0, 2)


def _mixed_totals(d):
    _write_shard(d, 0, 1)
    _write_shard(d, 1, 2)


def _junk(d):
    _write_shard(d, 0, 1)
    (d / "junk.bin").write_bytes(b"")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (_incomplete, r"shard 1 is incomplete, missing sft-00001-of-00002\.index\.bin"),
        (_gap, r"missing \[1\]"),
        (_mixed_totals, "disagree on the total"),
        (_junk, r"junk\.bin: not a shard file name"),
        (lambda d: None, "no shard files"),
    ],
)
def test_discover_shards_refuses_broken_sets(tmp_path, setup, message):
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    setup(shards_dir)
    with pytest.raises(ShardFormatError, match=message):
        discover_shards(tmp_path)


def test_missing_shards_dir(tmp_path):
    with pytest.raises(ShardFormatError, match="no shards directory"):
        discover_shards(tmp_path)


def test_shard_file_name():
    assert shard_file_name(53, 64, "segments") == "sft-00053-of-00064.segments.bin"


def test_special_tokens_errors_name_the_file(tmp_path):
    with pytest.raises(ShardFormatError, match=r"SPECIAL_TOKENS\.json: missing"):
        read_special_tokens(tmp_path)
    (tmp_path / "SPECIAL_TOKENS.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ShardFormatError, match="not valid JSON"):
        read_special_tokens(tmp_path)
    (tmp_path / "SPECIAL_TOKENS.json").write_text('{"schema": "x"}', encoding="utf-8")
    with pytest.raises(ShardFormatError, match="missing required field"):
        read_special_tokens(tmp_path)
