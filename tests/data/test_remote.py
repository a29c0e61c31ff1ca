"""What a store sends is someone's claim (mmgoal/data/remote.py): a server that drips its
bytes is left, a sizes.json is read bounded and believed only as far as it can be, a
resumed read must be of the same object, and a shard that fails stops an evaluation.

The store is a server on 127.0.0.1 (tests/hub_server.py) serving shards a test writes.
"""

import json
import logging
import time

import pytest
from hub_server import serving
from test_pipeline import dataset, sample

from mmgoal.data import remote
from mmgoal.data.pipeline import (
    EvalReader,
    IncompleteSplitError,
    UnreadableShardsError,
    iter_eval_batches,
)
from mmgoal.data.shards import ShardWriter
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms

TOKENIZER = WordTokenizer(vocab=["a", "red", "square"])


@pytest.fixture
def store(tmp_path):
    """Two shards of 32 samples served at ``/files/s-00000{0,1}.tar``."""
    with ShardWriter(tmp_path, "s", max_count=32) as writer:
        for key in range(64):
            writer.write(sample(key, key, ["a red square"]))
    with serving() as server:
        server.folder = tmp_path
        yield server, tmp_path


def ids(data):
    return [i for batch in data for i in batch["image_ids"]]


def eval_ids(shards):
    return ids(iter_eval_batches(EvalReader(shards, 16), build_transforms(None, 8)))


def test_a_server_that_drips_its_bytes_is_left_not_waited_on(store):
    server, _ = store
    url = f"{server.url}/files/s-000000.tar"
    server.drip["/files/s-000000.tar"] = 0.01  # 100 bytes/s, each read well inside timeout
    start = time.monotonic()
    read = dataset(url, TOKENIZER, retries=0, timeout=0.5)
    with pytest.raises(UnreadableShardsError,  # training on it alone: one pass, nothing read
                       match=r"slower than 1024 bytes/s \(the reader's min_rate\)"):
        next(iter(read))
    assert time.monotonic() - start < 10  # a 20 KB shard at 100 bytes/s: minutes otherwise
    assert read.counter.counts == {"ShardReadError": 1}
    # a sizes.json that drips is not waited on either
    server.drip["/files/sizes.json"] = 0.01
    (store[1] / "sizes.json").write_text(json.dumps({"s-000000.tar": 32}) + " " * 4096)
    with pytest.raises(ValueError, match=rf"{server.url}/files/sizes.json came too slowly "
                                         rf"\(.* slower than 1024 bytes/s"):
        remote.shard_sizes([url], timeout=0.5)


def test_sizes_json_is_read_bounded_and_only_counts_are_believed(store, monkeypatch):
    server, folder = store
    urls = [f"{server.url}/files/s-00000{i}.tar" for i in (0, 1)]
    sizes = folder / "sizes.json"
    where = f"{server.url}/files/sizes.json"
    for value in (-936, True, 64.9, "64abc", None, 1e30):
        sizes.write_text(json.dumps({"s-000000.tar": value, "s-000001.tar": 32}))
        with pytest.raises(ValueError, match=rf"^{where}'s size of s-000000.tar is "
                                             rf".* which is no number of samples: it must be "
                                             rf"a non-negative integer; correct the file"):
            remote.shard_sizes(urls)
    sizes.write_text(json.dumps([32, 32]))
    with pytest.raises(ValueError, match=rf"^{where} holds a JSON list; it must map each "
                                         rf"shard's file name to its samples"):
        remote.shard_sizes(urls)
    sizes.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{where} is not JSON"):
        remote.shard_sizes(urls)
    # a claim the shard's bytes cannot hold: each sample is at least a 512-byte header
    length = (folder / "s-000000.tar").stat().st_size
    sizes.write_text(json.dumps({"s-000000.tar": 10**30, "s-000001.tar": 32}))
    with pytest.raises(ValueError, match=rf"^{where}'s size of s-000000.tar claims "
                                         rf"{10**30:,} samples, but the shard {urls[0]} is "
                                         rf"{length:,} bytes, which hold at most "
                                         rf"{length // 512:,}"):
        remote.shard_sizes(urls)
    sizes.write_text(json.dumps({"s-000000.tar": 32, "s-000001.tar": 32}))
    assert remote.shard_sizes(urls) == [32, 32]
    # an endless body is not read past the bound (it is 64 MiB; lowered here to be quick)
    monkeypatch.setattr(remote, "MAX_JSON_BESIDE", 2**20)
    server.endless["/files/sizes.json"] = b"{" * 65536
    with pytest.raises(ValueError, match=rf"^{where} is larger than 1,048,576 bytes, which "
                                         rf"no sizes.json of shards is"):
        remote.shard_sizes(urls)


def test_a_shard_short_of_its_claimed_size_is_said_with_its_name(store, caplog):
    server, folder = store
    url = f"{server.url}/files/s-000000.tar"
    (folder / "sizes.json").write_text(json.dumps({"s-000000.tar": 100}))
    data = dataset(url, TOKENIZER, batch_size=8, shuffle_buffer=16)
    assert data.num_samples() == 100  # what the file claims, and its bytes allow
    with caplog.at_level(logging.WARNING):
        taken = []
        for batch in data:  # an endless stream: a pass and a bit
            taken += batch["image_ids"]
            if len(taken) >= 40:
                break
    assert (f"shard {url} holds 32 samples, and sizes.json beside it claims 100: an epoch "
            f"planned from it is longer than the data, so samples repeat within it; correct "
            f"sizes.json or set train.samples_per_epoch" in caplog.text)


def test_a_resumed_read_answered_with_another_object_is_read_again(store, caplog):
    server, folder = store
    path = "/files/s-000000.tar"
    url = f"{server.url}{path}"
    original = (folder / "s-000000.tar").read_bytes()
    server.cut_once[path] = len(original) // 2
    # the Range request gets a 200 with a different body: cut at the byte, it would read on
    # as the same tar (31 of 64 images, "skipped: 1")
    with ShardWriter(folder / "other", "o", max_count=32) as writer:
        for key in range(100, 132):
            writer.write(sample(key, key, ["a red square"]))
    server.replaced_on_range[path] = (folder / "other" / "o-000000.tar").read_bytes()
    with caplog.at_level(logging.WARNING):
        read = dataset(url, TOKENIZER, retries=2, batch_size=32)
        got = next(iter(read))["image_ids"]  # the first pass, in the shard's order
    assert got == list(range(32))  # every sample of the shard once, none of the other object
    assert read.counter.total == 0
    assert (f"shard {url} was read again from byte {len(original) // 2}, and the answer is not "
            f"the object the first read began" in caplog.text)
    assert "reading it again from its start" in caplog.text


def test_an_evaluation_split_with_a_failing_shard_gives_no_metrics(store):
    server, _ = store
    good, bad = (f"{server.url}/files/s-00000{i}.tar" for i in (0, 1))
    server.fail["/files/s-000001.tar"] = 404  # a 404 is final: no retries
    with pytest.raises(IncompleteSplitError, match=rf"shard {bad} could not be read after 1 "
                                                   rf"attempt\(s\).* An evaluation reads its "
                                                   rf"split whole"):
        eval_ids([good, bad])
    assert eval_ids([good]) == list(range(32))
