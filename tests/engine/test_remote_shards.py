"""Shards over HTTP and through pipe: commands train and evaluate as local ones; a flaky
store is retried (mmgoal/data/remote.py).

The store is a server on 127.0.0.1 (tests/hub_server.py) serving the tiny benchmark's
shards, which can cut a shard short once or never answer.
"""

import itertools
import json
import logging
import time

import pytest
import torch
from hub_server import serving
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

import mmgoal
from mmgoal.data.pipeline import (
    EvalReader,
    ShardDataset,
    UnreadableShardsError,
    expand_shards,
    iter_eval_batches,
)
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms
from mmgoal.engine.trainer import Trainer
from mmgoal.evaluation.gallery import evaluate_retrieval

TRAIN = "train-{000000..000002}.tar"


@pytest.fixture(scope="module")
def store(tiny_benchmark):
    """The tiny benchmark's shards served over HTTP, with a sizes.json beside them."""
    out, summary = tiny_benchmark
    sizes = {shard: dataset(str(out / shard)).num_samples()
             for split in summary["splits"].values() for shard in split["shards"]}
    (out / "sizes.json").write_text(json.dumps(sizes))
    with serving() as server:
        server.folder = out
        yield server, out


def dataset(shards, **options):
    """The training stream of ``shards``, 8 samples a batch."""
    return ShardDataset(shards, **{"batch_size": 8, "shuffle_buffer": 16, **options},
                        tokenizer=WordTokenizer().fit(["a red circle"]),
                        transform=build_transforms(None, 32))


def batches(data, count):
    return list(itertools.islice(data, count))


def eval_batches(shards):
    return list(iter_eval_batches(EvalReader(shards, 8), build_transforms(None, 32)))


def same_batches(a, b):
    """The same samples in the same order: ids, captions and images."""
    assert [x["image_ids"] for x in a] == [x["image_ids"] for x in b]
    assert [x["captions"] for x in a] == [x["captions"] for x in b]
    assert all(torch.equal(x["images"], y["images"]) for x, y in zip(a, b))


@pytest.mark.parametrize("scheme", ["http", "pipe"])
def test_remote_shards_stream_the_samples_of_the_local_ones(store, scheme):
    server, out = store
    remote = f"{server.url}/files/{TRAIN}" if scheme == "http" \
        else f"pipe:cat {out}/{TRAIN}"
    local = str(out / TRAIN)
    assert len(expand_shards(remote)) == 3
    # evaluation order, and the training stream (shuffled, seeded, endless): sample for sample
    local_eval = eval_batches(local)
    assert sum(len(b["image_ids"]) for b in local_eval) == 96
    same_batches(local_eval, eval_batches(remote))
    same_batches(batches(dataset(local), 30), batches(dataset(remote), 30))
    if scheme == "http":  # its size from sizes.json beside the shards, no shard read: the
        requests = len(server.requests)  # claims are checked against their lengths (HEAD)
        assert dataset(remote).num_samples() == dataset(local).num_samples() == 96
        assert all(path.endswith("/sizes.json") if method == "GET" else method == "HEAD"
                   for method, path in server.requests[requests:])
    else:
        with pytest.raises(ValueError, match=r"are not known without reading the whole data "
                                             r"set: put a sizes.json beside the shards .*, keep "
                                             r"img2dataset's <shard>_stats.json beside them, or "
                                             r"set train.samples_per_epoch"):
            dataset(remote).num_samples()


def test_training_and_evaluation_over_http_give_the_local_metrics(store, tmp_path):
    server, out = store
    local = tiny_config(out, epochs=1)
    remote = tiny_config(out, epochs=1)
    remote["data"]["train"]["shards"] = f"{server.url}/files/{TRAIN}"
    remote["data"]["val"]["shards"] = f"{server.url}/files/val-000000.tar"
    remote["data"]["test"]["shards"] = f"pipe:cat {out}/test-{{000000..000001}}.tar"
    reports = [Trainer(cfg, tmp_path / name).fit() for name, cfg in
               (("local", local), ("remote", remote))]
    for key in ("test", "best", "steps"):
        assert reports[0][key] == reports[1][key], key
    losses = [[json.loads(line).get("loss") for line in
               (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
              for name in ("local", "remote")]
    assert losses[0] == losses[1]
    model = mmgoal.load(tmp_path / "local", device="cpu")
    metrics = [evaluate_retrieval(model.model, shards, model.transform, model.tokenizer,
                                  progress=False)
               for shards in (str(out / "test-{000000..000001}.tar"),
                              f"{server.url}/files/test-{{000000..000001}}.tar")]
    assert metrics[0] == metrics[1]


@pytest.mark.parametrize("ranges", [True, False])
def test_a_shard_that_breaks_once_is_resumed_where_it_broke(store, caplog, ranges, monkeypatch):
    server, out = store
    monkeypatch.setattr(server, "ranges", ranges)
    url, path = f"{server.url}/files/train-000001.tar", "/files/train-000001.tar"
    half = (out / "train-000001.tar").stat().st_size // 2
    server.cut_once[path] = half
    server.ranges_served.clear()
    with caplog.at_level(logging.WARNING):  # one pass: the shard's 32 samples in order
        data = dataset(url, retries=2, shuffle_buffer=1)
        got = batches(data, 4)
    local = batches(dataset(str(out / "train-000001.tar"), shuffle_buffer=1), 4)
    same_batches(local, got)
    assert len({i for b in got for i in b["image_ids"]}) == 32  # nothing lost, nothing twice
    assert data.counter.total == 0
    assert f"shard {url}: read failed at byte" in caplog.text and "retry 1 of 2" in caplog.text
    # resumed at the byte where it broke (or, without Range, read again and skipped to it)
    assert server.ranges_served == ([(path, half)] if ranges else [])


def test_a_shard_that_never_answers_is_bounded_and_said(store, caplog):
    server, out = store
    server.hang.add("/files/never.tar")
    hanging = f"{server.url}/files/never.tar"
    start, requests = time.monotonic(), len(server.requests)
    val = str(out / "val-000000.tar")
    with caplog.at_level(logging.WARNING):  # two passes and more of the two shards
        data = dataset([hanging, val], retries=1, timeout=0.5, shuffle_buffer=1)
        got = batches(data, 9)
    # each pass: two half-second waits and a pause for the hanging shard, not an hour
    assert time.monotonic() - start < 30
    ids = [i for b in got for i in b["image_ids"]]
    assert sorted(ids[:32]) == sorted(ids[32:64]) == sorted(i for b in eval_batches(val)
                                                            for i in b["image_ids"])
    reads = server.requests[requests:].count(("GET", "/files/never.tar"))
    assert data.counter.counts["ShardReadError"] * 2 == reads >= 4  # 2 attempts, then skipped
    assert (f"shard {hanging} could not be read after 2 attempt(s), at byte 0: no data for "
            f"0.5 s") in data.counter.summary()
    # training on it alone: a pass without a readable sample stops the reader, with the why
    with pytest.raises(UnreadableShardsError, match="no data for 0.5 s"):
        batches(dataset(hanging, retries=0, timeout=0.5), 1)


def test_a_failing_command_and_img2dataset_stats_say_what_they_say(store, tmp_path):
    server, out = store
    failing = dataset("pipe:cat /nowhere/train-000000.tar", retries=0)
    with pytest.raises(UnreadableShardsError, match="the command exited with status 1"):
        batches(failing, 1)
    assert failing.counter.counts["ShardReadError"] == 1
    # img2dataset writes <shard>_stats.json beside each shard: its successes are the size
    (out / "train-000000_stats.json").write_text(json.dumps({"successes": 32, "failed": 3}))
    sizes = out / "sizes.json"
    saved = sizes.read_text()
    sizes.unlink()
    try:
        assert dataset(f"{server.url}/files/train-000000.tar").num_samples() == 32
    finally:
        sizes.write_text(saved)
        (out / "train-000000_stats.json").unlink()
