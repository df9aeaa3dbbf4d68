"""A shard truncated or overwritten after it was indexed is named, with its real size and the
tensor's real byte range, and never read as if nothing happened (issue 29)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import moectl
from moectl.io.range_read import READ_METHODS, RangeReader, ShardError
from moectl.models.lazy import checkpoint_reader

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck")
    moectl.tiny("olmoe").save_pretrained(path)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("method", READ_METHODS)
def test_short_read_gives_the_real_file_size_not_the_aligned_window(tmp_path, method):
    path = tmp_path / "shard.bin"
    path.write_bytes(os.urandom(1000))
    with RangeReader(method) as io:
        with pytest.raises(ShardError, match=r"shard\.bin: truncated: the shard has 1000 bytes, the read needs bytes 900\.\.1400"):
            io.read(path, [(900, memoryview(bytearray(500)))])
        with pytest.raises(ShardError, match=r"has 1000 bytes, the read needs bytes 5000\.\.5008"):
            io.read(path, [(5000, memoryview(bytearray(8)))])


@pytest.mark.parametrize("method", READ_METHODS)
def test_truncated_shard_names_the_shard_its_size_and_the_tensor(checkpoint, tmp_path, method):
    path = _copy(checkpoint, tmp_path / "ck")
    reader = checkpoint_reader(path, method=method)
    reader.read_expert(0, 0)  # opened and read before the damage
    seg = reader.expert_segments(2, 7)["down_proj"][0]
    os.truncate(seg.file, seg.offset + 10)
    with pytest.raises(ShardError) as err:
        reader.read_expert(2, 7)
    message = str(err.value)
    assert f"{seg.file}: truncated" in message
    assert f"the shard has {seg.offset + 10} bytes" in message
    assert f"tensor {seg.key} is bytes {seg.offset}..{seg.offset + seg.nbytes}" in message
    reader.close()


@pytest.mark.parametrize("opened", [False, True], ids=["before-first-read", "after-first-read"])
def test_shard_overwritten_in_place_at_the_same_size_is_detected(checkpoint, tmp_path, opened):
    path = _copy(checkpoint, tmp_path / "ck")
    reader = checkpoint_reader(path, method="plain")
    if opened:
        reader.read_expert(1, 3)
    seg = reader.expert_segments(1, 3)["gate_up_proj"][0]
    size = seg.file.stat().st_size
    time.sleep(0.05)  # past the file system's timestamp granularity (a few ms on ext4)
    with open(seg.file, "r+b") as f:  # new bytes where expert 3 lies, the same size
        f.seek(seg.offset)
        f.write(os.urandom(seg.nbytes))
    assert seg.file.stat().st_size == size
    with pytest.raises(ShardError, match=rf"{seg.file.name}: the shard was modified in place after it was indexed"):
        reader.read_expert(1, 3)
    reader.close()


def test_shard_replaced_by_rename_still_reads_the_indexed_bytes(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path / "ck")
    reader = checkpoint_reader(path, method="plain")
    before = reader.read_expert(0, 1)
    shard = reader.expert_segments(0, 1)["down_proj"][0].file
    new = tmp_path / "new.safetensors"
    new.write_bytes(os.urandom(shard.stat().st_size))
    os.replace(new, shard)  # the open descriptor keeps the indexed file
    after = reader.read_expert(0, 1)
    assert all(torch.equal(before[k], after[k]) for k in before)
    reader.close()
