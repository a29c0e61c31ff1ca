"""A shard's tar read as samples, bounded and with its damage said (mmgoal/data/tars.py):
an oversized sample is skipped unread, and a tar that ends before its file does (a
zeroed header, data after the archive, a cut) is counted and named, in training,
evaluation and mmgoal inspect-shards."""

import io
import json
import logging
import tarfile
import tracemalloc

import pytest
from script_modules import load_tool
from test_pipeline import dataset, png, sample

from mmgoal.data.pipeline import (
    EvalReader,
    IncompleteSplitError,
    SkipCounter,
    iter_eval_batches,
)
from mmgoal.data.shards import ShardWriter
from mmgoal.data.tars import MAX_SAMPLE_BYTES, TarDamageError, tar_stream_samples
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms


@pytest.fixture
def tokenizer():
    return WordTokenizer(vocab=["a", "red", "square"])


def shard_of(folder, count, name="s"):
    with ShardWriter(folder, name, max_count=count) as writer:
        for key in range(count):
            writer.write(sample(key, key, ["a red square"]))
    return folder / f"{name}-000000.tar"


def member_offsets(path):
    """Where each member's header starts in a plain tar."""
    with tarfile.open(path) as archive:
        return [member.offset for member in archive.getmembers()]


def eval_ids(path, counter=None, **options):
    return [i for batch in iter_eval_batches(EvalReader(str(path), 16, **options),
                                             build_transforms(None, 8), counter)
            for i in batch["image_ids"]]


def add_member(archive, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def test_a_sample_over_max_sample_bytes_is_skipped_and_counted_unread(tmp_path):
    # 80 MiB of zeros that gzip packs into about 80 KiB: a 'decompression bomb' of a member
    path = tmp_path / "bomb.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=1) as archive:
        add_member(archive, "0.png", png((0, 0, 0)))
        add_member(archive, "0.json", json.dumps({"image_id": 0, "captions": ["a"]}).encode())
        big = [bytes(80 * 2**20), json.dumps({"image_id": 1, "captions": ["b"]}).encode()]
        add_member(archive, "big.png", big[0])
        add_member(archive, "big.json", big[1])
        add_member(archive, "2.png", png((9, 0, 0)))
        add_member(archive, "2.json", json.dumps({"image_id": 2, "captions": ["c"]}).encode())
    assert path.stat().st_size < 2**20 < 80 * 2**20 > MAX_SAMPLE_BYTES
    counter = SkipCounter()
    tracemalloc.start()
    ids = eval_ids(path, counter)  # the default bound, data.max_sample_bytes' (64 MiB)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert ids == [0, 2]
    assert counter.counts == {"OversizedSampleError": 1}
    assert (f"sample 'big' of {path} holds {len(big[0]) + len(big[1]):,} bytes, more than "
            f"data.max_sample_bytes ({MAX_SAMPLE_BYTES:,}); skipped unread"
            in counter.last["OversizedSampleError"])
    assert peak < 16 * 2**20  # the member was never read (the old reader held all 80 MiB)
    # mmgoal inspect-shards reports it, unread too
    tracemalloc.start()
    report = load_tool("inspect-shards").inspect([str(path)], progress=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert report["samples"] == 2 and peak < 16 * 2**20
    assert report["shards"][0]["problems"] == [counter.last["OversizedSampleError"]]
    # a bound of the caller's: every sample over it goes, in training too
    data = dataset(str(path), None, max_sample_bytes=100)
    assert data.max_sample_bytes == 100
    assert eval_ids(path, max_sample_bytes=2**20) == [0, 2]
    assert eval_ids(path, max_sample_bytes=100) == []


def test_a_zeroed_header_mid_file_is_damage_not_the_end(tmp_path, tokenizer, capsys):
    path = shard_of(tmp_path, 64)
    data = bytearray(path.read_bytes())
    start = member_offsets(path)[64]  # sample 32's first header: 2 members per sample
    data[start:start + 512] = bytes(512)
    path.write_bytes(bytes(data))
    # a training (or any counting) reader: the first 32 samples, and the damage counted
    counted = dataset(str(path), tokenizer, batch_size=32)
    batch = next(iter(counted))  # a pass, collated once the next pass began
    assert batch["image_ids"] == list(range(32)) and batch["skipped"] == 1
    assert counted.counter.counts == {"TarDamageError": 1}
    assert (f"shard {path} is damaged after 32 samples: a zero block at byte {start} ends "
            f"its tar, but data follows it" in counted.counter.last["TarDamageError"])
    # an evaluation split is read whole or not at all (issue 39, item 11)
    with pytest.raises(IncompleteSplitError, match=rf"shard {path} is damaged after 32 "
                                                   rf"samples: a zero block at byte {start}.* "
                                                   rf"An evaluation reads its split whole"):
        eval_ids(path)
    # and mmgoal inspect-shards says so (it said "no problems")
    assert load_tool("inspect-shards").main([str(path), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"damaged tar after 32 samples (a zero block at byte {start} ends its tar" in out
    assert "1 problem(s)" in out


class CountingStream(io.RawIOBase):
    """The bytes of a shard followed by endless junk, counting what is read."""

    def __init__(self, data: bytes) -> None:
        self.data, self.read_bytes = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        size = len(buffer)
        start = self.read_bytes
        chunk = self.data[start:start + size]
        chunk += b"\x7f" * (size - len(chunk))  # junk once the shard's bytes are done
        buffer[:size] = chunk
        self.read_bytes += size
        return size


def test_a_valid_tar_followed_by_endless_junk_is_damage_read_boundedly(tmp_path, tokenizer,
                                                                       caplog):
    path = shard_of(tmp_path, 8)
    stream = CountingStream(path.read_bytes())
    found = []
    samples = list(tar_stream_samples(io.BufferedReader(stream), str(path), found.append))
    assert [s["__key__"] for s in samples] == [str(k) for k in range(8)]
    assert [type(e) for e in found] == [TarDamageError]
    assert found[0].samples == 8 and "ends its tar, but data follows it" in found[0].reason
    assert stream.read_bytes < path.stat().st_size + 2**20  # endless junk: not read for ever
    # a reader of the file says so on the console, not only in a count (issue 39, item 14)
    with open(path, "ab") as shard:
        shard.write(b"\x7f" * 3 * 2**20)
    with caplog.at_level(logging.WARNING):
        read = dataset(str(path), tokenizer, batch_size=8)
        assert next(iter(read))["image_ids"] == list(range(8))  # the training stream's pass
    assert read.counter.counts == {"TarDamageError": 1}
    assert (f"skipped a bad sample (TarDamageError): shard {path} is damaged after 8 "
            f"samples: a zero block at byte" in caplog.text)


@pytest.mark.parametrize("cut", ["header", "member", "boundary"])
def test_a_tar_cut_short_is_damage(tmp_path, cut):
    path = shard_of(tmp_path, 8)
    offsets = member_offsets(path)
    end = {"header": offsets[6] + 100, "member": offsets[6] + 530,
           "boundary": offsets[6]}[cut]
    path.write_bytes(path.read_bytes()[:end])
    found = []
    with open(path, "rb") as stream:
        keys = [s["__key__"] for s in tar_stream_samples(stream, str(path), found.append)]
    assert keys == ["0", "1", "2"]
    assert len(found) == 1 and isinstance(found[0], TarDamageError)
    reason = {"header": f"it is cut short inside the header at byte {offsets[6]}",
              "member": "ReadError: unexpected end of data",
              "boundary": f"it ends at byte {offsets[6]} without the tar's end-of-archive "
                          f"marker"}[cut]
    assert reason in found[0].reason
    # the tar's own end padding is no damage
    sound = shard_of(tmp_path / "sound", 8)
    with open(sound, "rb") as stream:
        assert len(list(tar_stream_samples(stream, str(sound), found.append))) == 8
    assert len(found) == 1
