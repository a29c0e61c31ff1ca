"""Mixtures of shard sources: proportions, seeding, per-source counts."""

import itertools
import json

import pytest
from test_pipeline import png  # same folder: pytest puts it on sys.path

from mmgoal.data.pipeline import MixtureDataset
from mmgoal.data.shards import ShardWriter
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms


def write_source(folder, prefix, first_id, caption, count=40):
    with ShardWriter(folder, prefix, max_count=10) as writer:
        for key in range(count):
            writer.write({"__key__": f"{prefix}{key}", "png": png((key, 0, 0)),
                          "json": json.dumps({"image_id": first_id + key,
                                              "captions": [caption]}).encode()})
    return str(folder / f"{prefix}-*.tar")


@pytest.fixture
def sources(tmp_path):
    return [{"name": "scenes", "weight": 3, "shards": write_source(tmp_path, "a", 0, "a red"),
             "shuffle_buffer": 8},
            {"name": "web", "weight": 1, "shards": write_source(tmp_path, "b", 1000, "a blue"),
             "shuffle_buffer": 8}]


def mixture(sources, **kwargs):
    return MixtureDataset(sources, batch_size=16, tokenizer=WordTokenizer(vocab=["a", "red",
                                                                                 "blue"]),
                          transform=build_transforms(None, 8), **kwargs)


def test_sources_are_drawn_in_proportion_to_their_weights(sources):
    data = mixture(sources)
    batches = list(itertools.islice(data, 250))  # 4000 samples: 0.007 standard deviation
    ids = [i for b in batches for i in b["image_ids"]]
    share = sum(i < 1000 for i in ids) / len(ids)
    assert abs(share - 0.75) < 0.025
    for batch in batches:  # the counts the trainer logs are the batch's own
        assert batch["source_counts"] == {"scenes": sum(i < 1000 for i in batch["image_ids"]),
                                          "web": sum(i >= 1000 for i in batch["image_ids"])}
        assert all((i < 1000) == (c == "a red") for i, c in zip(batch["image_ids"],
                                                                 batch["captions"]))
    assert data.num_samples() == 80
    again = mixture(sources)
    assert [b["image_ids"] for b in itertools.islice(again, 5)] == [
        b["image_ids"] for b in batches[:5]]
    again.set_epoch(1)
    assert [b["image_ids"] for b in itertools.islice(again, 5)] != [
        b["image_ids"] for b in batches[:5]]


def test_mixture_mistakes(sources):
    with pytest.raises(ValueError, match="weight must be positive"):
        mixture([{**sources[0], "weight": 0}])
    with pytest.raises(ValueError, match="names must differ"):
        mixture([sources[0], {**sources[1], "name": "scenes"}])
    with pytest.raises(ValueError, match="at least one source"):
        mixture([])
    with pytest.raises(TypeError, match="'shard' \\(did you mean 'shards'\\?\\)"):
        mixture([{"name": "x", "shard": "a-*.tar"}])
