"""One key rule for every reader of shards: a shard whose samples sit in folders inside
the tar (``a/0001.png``, ``b/0001.png``) is the same samples to every command."""

import io
import json

import pytest
from PIL import Image

from mmgoal.cli.inspect_shards import inspect
from mmgoal.cli.plot_attention import nth_sample
from mmgoal.data.classification import ClassificationSet, LabelledImages
from mmgoal.data.pipeline import (
    ShardDataset,
    SkipCounter,
    decoded_samples,
    iter_batches,
    iter_eval_batches,
    read_captions,
    shard_keys,
)
from mmgoal.data.remote import iter_samples
from mmgoal.data.shards import ShardWriter
from mmgoal.data.sources import EntitiesSource
from mmgoal.data.tars import sample_keys, sample_member
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms

# Two samples share the file name 0001 in different folders; a basename rule made them one
KEYS = ["a/0001", "b/0001", "0002"]


def png(shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (shade, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def shard(tmp_path):
    with ShardWriter(tmp_path, "folders", max_count=10) as writer:
        for image_id, key in enumerate(KEYS):
            writer.write({"__key__": key, "png": png(40 * image_id), "cls": str(image_id % 2),
                          "json": json.dumps({"image_id": image_id,
                                              "captions": [f"caption {image_id}"]}).encode()})
    return str(tmp_path / "folders-000000.tar")


def never(error):
    raise error


def test_the_key_rule():
    assert sample_member("a/b/0001.seg.PNG") == ("a/b/0001", "seg.png")
    assert sample_member("0001.json") == ("0001", "json")
    assert sample_member("README") is None and sample_member("__cache__/0001.json") is None


def test_every_reader_of_shards_sees_the_same_samples(shard, tmp_path):
    assert sample_keys(shard) == KEYS
    assert shard_keys(shard) == frozenset(KEYS)
    # evaluation, vocabulary fitting, search and plot-attention, inspect-shards
    assert [s["__key__"] for s in iter_samples(shard, never)] == KEYS
    assert [s["key"] for s in decoded_samples(shard, SkipCounter())] == KEYS
    assert nth_sample(shard, 1)["key"] == "b/0001"
    assert read_captions(shard) == ["caption 0", "caption 1", "caption 2"]
    batches = list(iter_eval_batches(shard, build_transforms(None, 8)))
    assert [i for batch in batches for i in batch["image_ids"]] == [0, 1, 2]
    report = inspect([shard], progress=False)
    assert report["samples"] == 3 and report["problems"] == 0
    # zero-shot classification from shards
    cset = ClassificationSet(tmp_path, classnames=["zero", "one"], templates=["{c}"],
                             shards=[shard])
    labelled = iter_batches(LabelledImages(cset, build_transforms(None, 8)), batch_size=8)
    assert [label for batch in labelled for label in batch["labels"].tolist()] == [0, 1, 0]
    # training: one pass holds the three samples
    tokenizer = WordTokenizer(vocab=["caption", "0", "1", "2"])
    data = ShardDataset(shard, batch_size=3, tokenizer=tokenizer,
                        transform=build_transforms(None, 8), shuffle_buffer=1)
    assert data.num_samples() == 3
    assert sorted(next(iter(data))["image_ids"]) == [0, 1, 2]
    # make-shards entities: a plan per sample, each sample's members found by its key
    root = tmp_path / "entities"
    (root / "Sentences").mkdir(parents=True)
    (root / "Annotations").mkdir()
    source = EntitiesSource(shard, str(root))
    plan = source.plan(source.splits()[0], 100)
    assert [key for _, key in plan[0]] == KEYS
    assert [source.sample("folders", item)["png"] for item in plan[0]] == [
        png(0), png(40), png(80)]
