import io
import itertools
import json
import tarfile

import pytest
import torch
from PIL import Image

from mmgoal.data.pipeline import (
    EvalReader,
    ShardDataset,
    SkipCounter,
    UnreadableShardsError,
    expand_shards,
    image_id_groups,
    iter_eval_batches,
    read_captions,
)
from mmgoal.data.shards import ShardWriter
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms


def png(colour):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def sample(key, image_id, captions, image=None):
    return {"__key__": key, "png": image if image is not None else png((key * 10, 0, 0)),
            "json": json.dumps({"image_id": image_id, "captions": captions}).encode()}


@pytest.fixture
def tokenizer():
    return WordTokenizer(vocab=["a", "red", "blue", "square", "circle"])


def dataset(urls, tokenizer, **kwargs):
    """The training stream; a shuffle buffer of 1 keeps each shard's samples in order."""
    defaults = dict(batch_size=100, tokenizer=tokenizer, transform=build_transforms(None, 8),
                    shuffle_buffer=1)
    return ShardDataset(urls, **{**defaults, **kwargs})


def test_corrupt_samples_are_skipped_and_counted(tmp_path, tokenizer, caplog):
    with ShardWriter(tmp_path, "mixed", max_count=10) as writer:
        writer.write(sample(1, 1, ["a red square"]))
        writer.write(sample(2, 2, ["a blue circle"], image=b"not a png at all"))
        writer.write(sample(3, 3, ["a red circle"]))
        writer.write({"__key__": "4", "png": png((0, 0, 0)), "json": b"{broken"})
        writer.write(sample(5, 5, []))  # no caption
        writer.write(sample(6, 6, ["a blue square"]))
    data = dataset(str(tmp_path / "mixed-000000.tar"), tokenizer, batch_size=3)
    batches = list(itertools.islice(data, 2))  # a batch a pass: its three readable samples
    assert [b["image_ids"] for b in batches] == [[1, 3, 6]] * 2
    assert [b["skipped"] for b in batches] == [3, 3]
    assert data.counter.total == 6
    assert data.counter.counts["CorruptSampleError"] == 6
    assert "unreadable image" in caplog.text and "unreadable JSON" in caplog.text


def test_truncated_shard_keeps_the_samples_before_the_damage(tmp_path, tokenizer):
    with ShardWriter(tmp_path, "good", max_count=50) as writer:
        for key in range(20):
            writer.write(sample(key, key, ["a red square"]))
    with ShardWriter(tmp_path, "whole", max_count=50) as writer:
        for key in range(20):
            writer.write(sample(key, 100 + key, ["a red square"]))
    data = (tmp_path / "whole-000000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2])
    ds = dataset([str(tmp_path / "cut.tar"), str(tmp_path / "good-000000.tar")], tokenizer,
                 batch_size=8)
    ids = [i for b in itertools.islice(ds, 10) for i in b["image_ids"]]  # over two passes
    kept = sorted({i for i in ids if i >= 100})
    assert kept == list(range(100, 100 + len(kept))) and 0 < len(kept) < 20  # before the cut
    per_pass = 20 + len(kept)  # the intact shard is read whole, before or after the cut one
    for start in (0, per_pass):
        assert sorted(ids[start:start + per_pass]) == list(range(20)) + kept
    assert ds.counter.counts["TarDamageError"] >= 2  # once a pass


def test_expand_captions_and_image_groups(tmp_path, tokenizer):
    with ShardWriter(tmp_path, "s", max_count=10) as writer:
        writer.write(sample(1, "img-a", ["a red square", "a square"]))
        writer.write(sample(2, "img-b", ["a blue circle"]))
    per_caption = next(iter(dataset(str(tmp_path / "s-000000.tar"), tokenizer, batch_size=3,
                                    expand_captions=True)))
    assert per_caption["captions"] == ["a red square", "a square", "a blue circle"]
    assert per_caption["image_groups"].tolist() == [0, 0, 1]
    assert per_caption["tokens"].tolist() == [[2, 3, 5], [2, 5, 0], [2, 4, 6]]
    assert per_caption["lengths"].tolist() == [3, 2, 3]
    per_image = list(itertools.islice(dataset(str(tmp_path / "s-000000.tar"), tokenizer,
                                              batch_size=2), 10))
    assert all(b["image_ids"] == ["img-a", "img-b"] for b in per_image)
    assert all(b["captions"][1] == "a blue circle" for b in per_image)
    # one caption of the image a pass, drawn at random
    assert {b["captions"][0] for b in per_image} == {"a red square", "a square"}
    assert image_id_groups(["x", 3, "x", 3, 1]).tolist() == [0, 1, 0, 1, 2]
    # an epoch counts captions when they are expanded (the schedule's length depends on it)
    urls = str(tmp_path / "s-000000.tar")
    assert dataset(urls, tokenizer, expand_captions=True).num_samples() == 3
    assert dataset(urls, tokenizer).num_samples() == 2


def test_training_order_is_seeded_by_epoch(tmp_path, tokenizer):
    with ShardWriter(tmp_path, "t", max_count=8) as writer:
        for key in range(40):
            writer.write(sample(key, key, ["a red square", "a blue circle", "a square"]))
    urls = str(tmp_path / "t-{000000..000004}.tar")

    def order(epoch, seed=0, batches=10):
        ds = dataset(urls, tokenizer, batch_size=8, shuffle_buffer=16, seed=seed)
        ds.set_epoch(epoch)
        return [(i, c) for b in itertools.islice(ds, batches)
                for i, c in zip(b["image_ids"], b["captions"])]

    first = order(0)
    assert first == order(0)
    # The stream runs on past the shards (passes in new orders); a shuffle buffer of
    # 16 mixes only the ends of neighbouring passes.
    ids = [i for i, _ in first]
    assert set(ids) == set(range(40)) and max(ids.count(i) for i in ids) <= 3
    assert first != order(1)
    assert first != order(0, seed=1)
    assert ids[:40] != list(range(40))
    assert sum(i in ids[:40] for i in range(40)) >= 30


def test_exact_passes_keep_each_pass_whole(tmp_path, tokenizer):
    with ShardWriter(tmp_path, "t", max_count=8) as writer:
        for key in range(40):
            writer.write(sample(key, key, ["a red square"]))
    urls = str(tmp_path / "t-{000000..000004}.tar")

    def passes(**kwargs):
        ds = dataset(urls, tokenizer, batch_size=8, shuffle_buffer=32, **kwargs)
        ids = [i for b in itertools.islice(ds, 15) for i in b["image_ids"]]
        return [ids[:40], ids[40:80], ids[80:]]

    # exact passes: every 40 samples are the 40 images, each once, in a shuffled order
    exact = passes(exact_passes=True)
    assert all(sorted(one) == list(range(40)) for one in exact)
    assert exact[0] != exact[1] and exact[0] != list(range(40))
    # the default buffer of 32 runs across passes: the first 40 miss images and repeat others
    mixed = passes()
    assert sorted(mixed[0]) != list(range(40))
    assert len(set(mixed[0])) < 40
    with pytest.raises(ValueError, match="exact_passes shuffles each pass .* resampled"):
        dataset(urls, tokenizer, exact_passes=True, resampled=True)


def test_training_stream_needs_a_shard_per_reader_and_a_readable_sample(tmp_path, tokenizer):
    with ShardWriter(tmp_path, "t", max_count=4) as writer:
        for key in range(8):
            writer.write(sample(key, key, ["a red square"]))
    urls = str(tmp_path / "t-{000000..000001}.tar")
    ds = dataset(urls, tokenizer, batch_size=4)
    ds.check_readers(world_size=2, workers=1)
    with pytest.raises(ValueError, match="2 training shard.*2 rank.*x 2 data worker.*resampled"):
        ds.check_readers(world_size=2, workers=2)
    dataset(urls, tokenizer, batch_size=4, resampled=True).check_readers(2, 2)
    # resampled draws shards with replacement and still never runs dry
    drawn = dataset(urls, tokenizer, batch_size=4, resampled=True)
    assert len(list(itertools.islice(drawn, 12))) == 12
    (tmp_path / "bad.tar").write_bytes(b"not a tar file" * 100)
    broken = dataset(str(tmp_path / "bad.tar"), tokenizer, batch_size=4)
    with pytest.raises(RuntimeError, match="whole pass of its training shards without a readable"):
        next(iter(broken))


def test_a_pass_without_a_decodable_image_stops_the_training_stream(tmp_path, tokenizer):
    def shards(name, readable_key):
        with ShardWriter(tmp_path, name, max_count=4) as writer:
            for key in range(8):
                writer.write(sample(key, key, ["a red square"],
                                    image=None if key == readable_key else b"garbage"))
        return str(tmp_path / f"{name}-{{000000..000001}}.tar")

    # One readable image a pass keeps the stream going, although the default
    # shuffle buffer (2000) holds back some 250 passes of these shards.
    one_good = dataset(shards("one", readable_key=5), tokenizer, batch_size=4,
                       shuffle_buffer=2000)
    assert [b["image_ids"] for b in itertools.islice(one_good, 3)] == [[5] * 4] * 3
    # Sound tars and captions, no decodable image: the stream stops after a pass
    # (a resampled one after 16 draws), naming the shards and why samples were skipped.
    none_good = shards("none", readable_key=None)
    for resampled, pass_read in ((False, "read a whole pass of its"), (True, "drew 16 of its")):
        ds = dataset(none_good, tokenizer, batch_size=4, resampled=resampled,
                     shuffle_buffer=16)
        with pytest.raises(UnreadableShardsError) as error:
            next(iter(ds))
        assert str(error.value).startswith(
            f"rank 0 worker 0 {pass_read} training shards without a readable sample: no sample "
            f"of {none_good} could be decoded ({ds.counter.total} samples skipped: "
            f"{ds.counter.total} CorruptSampleError, the last: sample ")
        assert "unreadable image" in str(error.value)
        assert str(error.value).endswith("check the shards with mmgoal inspect-shards")
        assert ds.counter.total >= 16 * 4 if resampled else 8


def test_eval_batches_keep_shard_order_and_all_captions(tiny_benchmark):
    out, summary = tiny_benchmark
    batches = list(iter_eval_batches(EvalReader(str(out / "test-{000000..000001}.tar"), 16),
                                     build_transforms(None, 32)))
    assert [len(b["image_ids"]) for b in batches] == [16, 16, 8]
    ids = [i for b in batches for i in b["image_ids"]]
    assert ids == sorted(ids) and len(ids) == 40
    assert all(len(c) == 5 for b in batches for c in b["captions"])
    assert batches[0]["images"].shape == (16, 3, 32, 32)
    assert len(read_captions(str(out / "test-*.tar"))) == 200


def test_missing_shards_say_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="mmgoal make-synthetic"):
        expand_shards(str(tmp_path / "train-{000000..000002}.tar"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_shards(str(tmp_path / "*.tar"))


def test_shard_writer_leaves_no_partial_shard(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, "x", max_count=2) as writer:
        for key in range(3):
            writer.write(sample(key, key, ["a"]))
        raise RuntimeError("killed while writing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-000000.tar"]
    # an int mtime: no PAX header before each member, which readers would parse too
    with tarfile.open(tmp_path / "x-000000.tar") as archive:
        members = archive.getmembers()
    assert len(members) == 4 and all(m.pax_headers == {} and m.mtime == 0 for m in members)
    with pytest.raises(ValueError, match="__key__"):
        ShardWriter(tmp_path, "y").write({"png": b""})


def test_word_tokenizer():
    tok = WordTokenizer(min_count=2).fit(["A red square.", "a red circle", "a blue square"])
    assert tok.words == ["<pad>", "<unk>", "a", "red", "square"]
    out = tok(["a blue square", ""])
    assert out["tokens"].tolist() == [[2, 1, 4], [1, 0, 0]]
    assert out["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    clone = WordTokenizer()
    clone.load_state_dict(tok.state_dict())
    assert torch.equal(clone(["red square"])["tokens"], tok(["red square"])["tokens"])
    with pytest.raises(RuntimeError, match="no vocabulary"):
        WordTokenizer()(["a"])


def npy(array):
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, dtype=np.float32))
    return buffer.getvalue()


def test_boxes_come_from_boxes_npy_or_entities_and_regions_replace_images(tmp_path, tokenizer):
    meta = {"image_id": 1, "captions": ["a red square"], "entities": [
        {"caption": 0, "phrase": "a red square", "boxes": [[0, 0, 4, 2]]},
        {"caption": 1, "phrase": "a square", "boxes": [[0, 0, 4, 2], [2, 2, 8, 8]]}]}
    with ShardWriter(tmp_path, "boxes", max_count=10) as writer:
        writer.write({"__key__": "1", "png": png((0, 0, 0)), "json": json.dumps(meta).encode()})
        writer.write({"__key__": "2", "png": png((0, 0, 0)),
                      "json": json.dumps({"image_id": 2, "captions": ["a circle"]}).encode(),
                      "boxes.npy": npy([[4, 4, 8, 8]])})
        bad = {**meta, "image_id": 3, "entities": [{"caption": 0, "boxes": [[0, 0, 4]]}]}
        writer.write({"__key__": "3", "png": png((0, 0, 0)), "json": json.dumps(bad).encode()})
    data = dataset(str(tmp_path / "boxes-000000.tar"), tokenizer, batch_size=2)
    batches = list(itertools.islice(data, 2))  # a pass each: samples 1 and 2, 3 skipped
    for batch in batches:
        assert batch["image_ids"] == [1, 2] and batch["box_lengths"].tolist() == [2, 1]
        torch.testing.assert_close(batch["boxes"], torch.tensor(
            [[[0, 0, 0.5, 0.25], [0.25, 0.25, 1, 1]], [[0.5, 0.5, 1, 1], [0, 0, 0, 0]]]))
    # a batch is collated when the sample after it is read: sample 3 has been skipped
    assert [b["skipped"] for b in batches] == [1, 1]
    assert data.counter.total == 2 and "entity boxes must be xyxy" in data.counter.summary()
    # evaluation batches keep every entity, its boxes as fractions of the image
    entities = next(iter_eval_batches(EvalReader(str(tmp_path / "boxes-000000.tar"), 8),
                                      build_transforms(None, 8)))["entities"]
    assert [[e["boxes"] for e in sample] for sample in entities] == [
        [[[0, 0, 0.5, 0.25]], [[0, 0, 0.5, 0.25], [0.25, 0.25, 1, 1]]], []]
    assert entities[0][1]["phrase"] == "a square"

    with ShardWriter(tmp_path, "regions", max_count=10) as writer:
        for key, count in ((1, 3), (2, 2)):
            writer.write({"__key__": str(key), "regions.npy": npy(torch.full((count, 4), key)),
                          "json": json.dumps({"image_id": key, "captions": ["a red circle"],
                                              "width": 100, "height": 50}).encode(),
                          "boxes.npy": npy([[0, 0, 50, 50]] * count)})
        writer.write({"__key__": "3", "json": json.dumps(
            {"image_id": 3, "captions": ["a square"]}).encode()})  # neither image nor regions
        writer.write({"__key__": "4", "png": png((0, 0, 0)), "boxes.npy": npy([[1, 2, 3]]),
                      "json": json.dumps({"image_id": 4, "captions": ["a"]}).encode()})
    data = dataset(str(tmp_path / "regions-000000.tar"), tokenizer, batch_size=2)
    batches = list(itertools.islice(data, 2))
    for batch in batches:
        assert "images" not in batch and batch["region_lengths"].tolist() == [3, 2]
        assert batch["regions"].shape == (2, 3, 4) and batch["regions"][1, 2].abs().sum() == 0
        torch.testing.assert_close(batch["regions"][:, 0, 0], torch.tensor([1.0, 2.0]))
        torch.testing.assert_close(batch["boxes"][0, 0], torch.tensor([0, 0, 0.5, 1.0]))
    assert [b["skipped"] for b in batches] == [2, 2]  # no image nor regions; boxes of 3 numbers
    assert data.counter.counts["CorruptSampleError"] == 4
    evaluation = next(iter_eval_batches(EvalReader(str(tmp_path / "regions-000000.tar"), 8),
                                        build_transforms(None, 8)))
    assert evaluation["region_lengths"].tolist() == [3, 2]


def test_eval_batches_split_over_parts_and_workers_keep_the_order_and_the_skips(tmp_path):
    """A rank's share and a DataLoader's workers decode their own batches only; together
    they are the one-process stream, in its order, each bad sample counted once."""
    with ShardWriter(tmp_path, "mixed", max_count=7) as writer:
        for key in range(1, 21):
            broken = key in (4, 5, 6, 13)  # batch 1 (samples 4, 5, 6) all bad
            writer.write(sample(key, key, [f"caption {key}"],
                                image=b"not a png" if broken else None))
    shards, transform = str(tmp_path / "mixed-*.tar"), build_transforms(None, 8)

    def ids(batches):
        return [b["image_ids"] for b in batches]

    alone_counter = SkipCounter()
    alone = list(iter_eval_batches(EvalReader(shards, 3), transform, alone_counter))
    # batches of 3 samples as the shards hold them, before decoding: batch 1 is empty
    assert ids(alone) == [[1, 2, 3], [7, 8, 9], [10, 11, 12], [14, 15], [16, 17, 18],
                          [19, 20]] and alone_counter.total == 4
    parts = [list(iter_eval_batches(EvalReader(shards, 3), transform, part=(rank, 2)))
             for rank in (0, 1)]
    assert ids(parts[0]) == [[1, 2, 3], [7, 8, 9], [14, 15], [19, 20]]  # batches 0, 2, 4, 6
    assert ids(parts[1]) == [[10, 11, 12], [16, 17, 18]]                # batches (1), 3, 5
    counter = SkipCounter()
    workers = list(iter_eval_batches(EvalReader(shards, 3, num_workers=2), transform, counter))
    assert ids(workers) == ids(alone) and counter.total == 4
    for mine, theirs in zip(workers, alone):
        assert torch.equal(mine["images"], theirs["images"])


def test_a_cut_gzip_shard_is_counted_and_trained_on_up_to_the_damage(tmp_path, tokenizer,
                                                                    caplog, capsys):
    import gzip

    from script_modules import load_tool

    with ShardWriter(tmp_path, "good", max_count=50) as writer:
        for key in range(20):
            writer.write(sample(key, key, ["a red square"]))
    packed = gzip.compress((tmp_path / "good-000000.tar").read_bytes())
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(packed[: len(packed) // 2])  # the gzip stream ends early: EOFError
    counted = dataset([str(cut)], tokenizer, batch_size=4).num_samples()
    assert 0 < counted < 20
    assert f"shard {cut} is damaged" in caplog.text
    # the endless training stream reads it to the damage, pass after pass
    training = dataset([str(cut)], tokenizer, batch_size=1)
    ids = [b["image_ids"][0] for b in itertools.islice(training, 2 * counted + 1)]
    read = ids.index(0, 1)  # the samples of a pass
    assert 0 < read <= counted and ids == [n % read for n in range(len(ids))]
    assert training.counter.counts["TarDamageError"] >= 2
    inspect = load_tool("inspect-shards")
    assert inspect.main([str(cut)]) == 1  # a report of the damage, not a traceback
    assert "cut.tar.gz" in capsys.readouterr().out
