"""Data sets in the papers' formats arrive in shards unchanged (tools/make_shards.py)."""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmgoal.data.conversion import convert
from mmgoal.data.pipeline import EvalReader, iter_eval_batches
from mmgoal.data.shards import ShardWriter
from mmgoal.data.synthetic import iter_scenes, scene_sample, write_flickr_entities
from mmgoal.data.transforms import build_transforms
from mmgoal.registry import SHARD_SOURCES


def shard_samples(folder: Path, pattern: str = "*.tar") -> dict[str, dict[str, bytes]]:
    """Every sample of the shards in ``folder``, by key."""
    samples: dict[str, dict[str, bytes]] = {}
    for path in sorted(folder.glob(pattern)):
        with tarfile.open(path) as archive:
            for member in archive:
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {})[ext] = archive.extractfile(member).read()
    return samples


def jpeg(colour, size) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture
def karpathy(tmp_path):
    """A COCO-style Karpathy JSON over real JPEG files, one missing, one corrupt."""
    root = tmp_path / "coco"
    images, files = [], {}
    for index in range(9):
        folder = "val2014" if index % 2 else "train2014"
        name = f"COCO_{folder}_{index:012d}.jpg"
        split = ["train", "restval", "val", "test"][index % 4]
        images.append({"filepath": folder, "filename": name, "split": split, "cocoid": 100 + index,
                       "imgid": index,
                       "sentences": [{"raw": f"A photo number {index}, caption {k}. ",
                                      "tokens": []} for k in range(5)]})
        if index == 7:
            continue  # missing on disk
        (root / folder).mkdir(parents=True, exist_ok=True)
        data = b"\xff\xd8 not really a jpeg" if index == 5 else jpeg(
            (20 * index, 100, 200), (40 + 8 * index, 30 + 4 * index))
        (root / folder / name).write_bytes(data)
        files[100 + index] = data
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": images,
                                                           "dataset": "coco"}))
    return tmp_path / "dataset_coco.json", root, images, files


def karpathy_source(json_path, root, **options):
    return SHARD_SOURCES.build({"type": "karpathy", "json": str(json_path),
                                "image_root": str(root), **options})


def test_karpathy_images_and_captions_arrive_unchanged(karpathy, tmp_path):
    json_path, root, images, files = karpathy
    summary = convert(karpathy_source(json_path, root), tmp_path / "out", shard_size=2,
                      progress=False)
    samples = shard_samples(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == [
        "restval-000000.tar", "test-000000.tar", "train-000000.tar", "train-000001.tar",
        "val-000000.tar"]
    good = [i for i in images if i["cocoid"] not in (105, 107)]
    assert sorted(samples) == sorted(str(i["cocoid"]) for i in good)
    for image in good:
        sample = samples[str(image["cocoid"])]
        meta = json.loads(sample["json"])
        assert sample["jpg"] == files[image["cocoid"]]  # the file's bytes, not re-encoded
        assert meta["captions"] == [s["raw"] for s in image["sentences"]]
        assert meta["image_id"] == image["cocoid"] and meta["split"] == image["split"]
        assert (meta["width"], meta["height"]) == Image.open(io.BytesIO(sample["jpg"])).size
    assert summary["splits"]["restval"]["skipped"] == {"unreadable image": 1}
    assert summary["splits"]["test"]["skipped"] == {"missing image": 1}
    assert summary["splits"]["train"] == {"shards": 2, "samples": 3, "captions": 15,
                                          "skipped": {}, "examples": []}
    assert "COCO_val2014_000000000007.jpg" in summary["splits"]["test"]["examples"][0]
    # the shards read back through the evaluation pipeline, captions and all
    batches = list(iter_eval_batches(EvalReader(str(tmp_path / "out" / "train-*.tar"), 8),
                                     build_transforms(None, 16)))
    assert [i for b in batches for i in b["image_ids"]] == [100, 104, 108]


def test_karpathy_resizes_and_flickr_ids_come_from_file_names(karpathy, tmp_path):
    json_path, root, images, _ = karpathy
    for image in images:  # Flickr30K: no cocoid, no filepath
        del image["cocoid"]
    data = json.loads(json_path.read_text())
    data["images"] = [{**i, "filename": f"{i['filepath']}/{i['filename']}"} for i in images]
    for image in data["images"]:
        del image["filepath"]
    json_path.write_text(json.dumps(data))
    convert(karpathy_source(json_path, root, max_size=32), tmp_path / "out", progress=False)
    samples = shard_samples(tmp_path / "out")
    assert "COCO_train2014_000000000008" in samples
    for sample in samples.values():
        image = Image.open(io.BytesIO(sample["jpg"]))
        meta = json.loads(sample["json"])
        assert max(image.size) <= 32 and (meta["width"], meta["height"]) == image.size
        assert meta["image_id"] == Path(meta["filename"]).stem


class Interrupting:
    """A source that dies (like a killed process) after ``calls`` samples."""

    def __init__(self, source, calls):
        self.source, self.calls = source, calls

    def __getattr__(self, name):
        return getattr(self.source, name)

    def sample(self, split, item):
        self.calls -= 1
        if self.calls < 0:
            raise KeyboardInterrupt
        return self.source.sample(split, item)


def test_an_interrupted_conversion_resumed_equals_an_uninterrupted_one(karpathy, tmp_path):
    json_path, root, _, _ = karpathy
    # two worker processes for the uninterrupted run: the same bytes as one process
    convert(karpathy_source(json_path, root), tmp_path / "whole", shard_size=2, workers=2,
            progress=False)
    source = karpathy_source(json_path, root)
    with pytest.raises(KeyboardInterrupt):
        convert(Interrupting(source, 4), tmp_path / "cut", shard_size=2, progress=False)
    assert not list((tmp_path / "cut").glob("*.tmp"))  # no half-written shard left
    written = sorted(p.name for p in (tmp_path / "cut").glob("*.tar"))
    assert 0 < len(written) < 6
    with pytest.raises(FileExistsError, match="--resume"):
        convert(source, tmp_path / "cut", shard_size=2, progress=False)
    summary = convert(source, tmp_path / "cut", shard_size=2, resume=True, progress=False)
    whole = sorted((tmp_path / "whole").glob("*.tar"))
    assert [p.name for p in whole] == sorted(p.name for p in (tmp_path / "cut").glob("*.tar"))
    for path in whole:
        assert path.read_bytes() == (tmp_path / "cut" / path.name).read_bytes(), path.name
    assert summary == json.loads((tmp_path / "whole" / "summary.json").read_text())


def test_resume_refuses_options_other_than_the_first_runs(karpathy, tmp_path):
    json_path, root, _, _ = karpathy
    options = {"source": "karpathy", "json": str(json_path), "image_root": str(root)}
    source = karpathy_source(json_path, root)
    with pytest.raises(KeyboardInterrupt):
        convert(Interrupting(source, 4), tmp_path / "cut", shard_size=2, progress=False,
                options=options)
    recorded = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert recorded == {"options": {**options, "shard_size": 2}, "splits": {}}
    # Old shards of 2 and new ones of 3 would hold some images twice and miss others.
    with pytest.raises(ValueError, match=r"shard_size: 2 then, 3 now") as error:
        convert(source, tmp_path / "cut", shard_size=3, resume=True, progress=False,
                options=options)
    assert "max_size" not in str(error.value)
    with pytest.raises(ValueError, match=r"max_size: absent then, 32 now"):
        convert(source, tmp_path / "cut", shard_size=2, resume=True, progress=False,
                options={**options, "max_size": 32})
    summary = convert(source, tmp_path / "cut", shard_size=2, resume=True, progress=False,
                      options=options)
    assert summary["options"]["shard_size"] == 2
    assert sum(split["samples"] for split in summary["splits"].values()) == 7


def test_karpathy_entries_listed_twice_are_converted_once(karpathy, tmp_path, caplog):
    json_path, root, images, _ = karpathy
    data = json.loads(json_path.read_text())
    data["images"] += [images[0], {**images[4], "split": "test"}]  # a train image in test too
    json_path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="mmgoal.data.sources"):
        summary = convert(karpathy_source(json_path, root), tmp_path / "out", progress=False)
    assert "lists 2 images more than once" in caplog.text and "104" in caplog.text
    batches = iter_eval_batches(EvalReader(str(tmp_path / "out" / "*.tar"), 8),
                                build_transforms(None, 16))
    ids = [image_id for batch in batches for image_id in batch["image_ids"]]
    assert sorted(ids) == [100, 101, 102, 103, 104, 106, 108]
    assert summary["splits"]["train"]["samples"] == 3 and summary["splits"]["test"][
        "samples"] == 1


def test_a_file_name_with_dots_reads_back_through_the_pipeline(tmp_path):
    (tmp_path / "images").mkdir()
    images = []
    for index, name in enumerate(["img.with.dots.png", "img_with_dots.png"]):
        buffer = io.BytesIO()
        Image.new("RGB", (12 + index, 10), (0, 90 * index, 200)).save(buffer, format="PNG")
        (tmp_path / "images" / name).write_bytes(buffer.getvalue())
        images.append({"filename": name, "split": "test", "sentences": [
            {"raw": f"picture {index} caption {k}"} for k in range(2)]})
    (tmp_path / "f30k.json").write_text(json.dumps({"images": images}))
    summary = convert(karpathy_source(tmp_path / "f30k.json", tmp_path / "images"),
                      tmp_path / "out", progress=False)
    assert summary["splits"]["test"]["samples"] == 2
    keys = sorted(shard_samples(tmp_path / "out"))
    assert len(keys) == 2 and "img_with_dots" in keys and not any("." in k for k in keys)
    batches = list(iter_eval_batches(EvalReader(str(tmp_path / "out" / "test-*.tar"), 8),
                                     build_transforms(None, 16)))
    assert batches[0]["image_ids"] == ["img.with.dots", "img_with_dots"]
    assert batches[0]["captions"] == [[f"picture {i} caption {k}" for k in range(2)]
                                      for i in range(2)]
    assert batches[0]["images"].shape == (2, 3, 16, 16)


@pytest.fixture
def precomputed(tmp_path):
    """SCAN-style features: train with one row per image, test with one per caption."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "precomp"
    folder.mkdir()
    arrays = {}
    for split, images, per_caption in (("train", 4, False), ("test", 3, True)):
        feats = rng.standard_normal((images, 6, 8)).astype(np.float32)
        np.save(folder / f"{split}_ims.npy", np.repeat(feats, 5, axis=0) if per_caption
                else feats)
        boxes = rng.uniform(0, 50, (images, 6, 4)).astype(np.float32)
        np.save(folder / f"{split}_ims_bbx.npy", boxes)
        np.save(folder / f"{split}_ims_size.npy", np.tile([[100, 80]], (images, 1)))
        captions = [f"{split} image {i} caption {k}" for i in range(images) for k in range(5)]
        (folder / f"{split}_caps.txt").write_text("\n".join(captions[:-2]) + "\n")
        (folder / f"{split}_ids.txt").write_text("\n".join(str(500 + i) for i in range(images)))
        arrays[split] = (feats, boxes, captions)
    return folder, arrays


def test_precomputed_feature_rows_and_boxes_arrive_unchanged(precomputed, tmp_path):
    folder, arrays = precomputed
    source = SHARD_SOURCES.build({"type": "precomputed", "data_dir": str(folder)})
    summary = convert(source, tmp_path / "out", shard_size=2, progress=False)
    samples = shard_samples(tmp_path / "out")
    for split, (feats, boxes, captions) in arrays.items():
        for index in range(len(feats) - 1):  # the last image lacks 2 caption lines
            sample = samples[f"{split}-{index:07d}"]
            np.testing.assert_array_equal(np.load(io.BytesIO(sample["regions.npy"])),
                                          feats[index])
            np.testing.assert_array_equal(np.load(io.BytesIO(sample["boxes.npy"])),
                                          boxes[index])
            meta = json.loads(sample["json"])
            assert meta["captions"] == captions[5 * index:5 * index + 5]
            assert meta["image_id"] == str(500 + index)
        assert summary["splits"][split]["skipped"] == {"missing captions": 1}
    batch = next(iter_eval_batches(EvalReader(str(tmp_path / "out" / "train-*.tar"), 8), None))
    np.testing.assert_array_equal(batch["regions"][1].numpy(), arrays["train"][0][1])
    # boxes become fractions of the image size the _ims_size file gave
    np.testing.assert_allclose(batch["boxes"][0].numpy(),
                               arrays["train"][1][0] / np.float32([100, 80, 100, 80]))
    with pytest.raises(FileNotFoundError, match="lacks .*dev.*found captions for test, train"):
        SHARD_SOURCES.build({"type": "precomputed", "data_dir": str(folder), "splits": "dev"})
    # SCAN's split names become mmgoal's: e.g. COCO's testall (5K) -> test
    renamed = SHARD_SOURCES.build({"type": "precomputed", "data_dir": str(folder),
                                   "splits": "test", "names": "test=val"})
    convert(renamed, tmp_path / "renamed", progress=False)
    again = shard_samples(tmp_path / "renamed")
    assert sorted(again) == ["val-0000000", "val-0000001"]
    assert again["val-0000001"]["regions.npy"] == samples["test-0000001"]["regions.npy"]


def test_entities_join_flickr30k_entities_files_into_existing_shards(tmp_path):
    scenes = list(iter_scenes("test", 6, seed=2, image_size=48))
    originals = {}
    with ShardWriter(tmp_path / "plain", "test", max_count=4) as writer:
        for scene in scenes:
            sample = scene_sample(scene, "test")
            meta = json.loads(sample["json"])
            originals[sample["__key__"]] = meta.pop("entities")
            writer.write({**sample, "json": json.dumps(meta).encode()})
    write_flickr_entities(scenes[:5], tmp_path / "entities")  # the last image has no files
    source = SHARD_SOURCES.build({"type": "entities", "shards": str(tmp_path / "plain/*.tar"),
                                  "entities_root": str(tmp_path / "entities")})
    convert(source, tmp_path / "joined", progress=False)
    assert sorted(p.name for p in (tmp_path / "joined").glob("*.tar")) == [
        "test-000000.tar", "test-000001.tar"]
    plain, joined = shard_samples(tmp_path / "plain"), shard_samples(tmp_path / "joined")
    assert plain.keys() == joined.keys()
    for key, sample in joined.items():
        assert sample["png"] == plain[key]["png"]
        meta = json.loads(sample["json"])
        if key == f"{scenes[-1].image_id:09d}":
            assert "entities" not in meta
            continue
        assert len(meta["entities"]) == len(originals[key])
        for got, want in zip(meta["entities"], originals[key]):
            for field in ("caption", "first_word", "entity_id", "type"):
                assert str(got[field]) == str(want[field]), field
            assert got["phrase"].lower() == want["phrase"]  # the sentence keeps its capitals
            # the annotation files hold whole pixels
            np.testing.assert_allclose(got["boxes"], want["boxes"], atol=0.5)


def test_coco_caption_ids_match_by_image_and_text(karpathy, tmp_path, caplog):
    """--coco-captions: each Karpathy sentence gets its annotation's id, by its image and its
    text (case, spaces, then punctuation ignored); a sentence an image has twice gets both
    annotations in order; the same sentence on two images gets each image's own; a sentence
    without an annotation gets null. The ids reach the gallery beside their captions."""
    from mmgoal.cli.make_shards import main as make_shards
    from mmgoal.evaluation.gallery import Gallery, _add_samples

    json_path, root, images, _ = karpathy
    entries = json.loads(json_path.read_text())["images"]
    for entry in entries:  # image 100 says "a dog on a bench." twice; image 102 once
        if entry["cocoid"] in (100, 102):
            entry["sentences"][0]["raw"] = "A dog on a bench. "
        if entry["cocoid"] == 100:
            entry["sentences"][1]["raw"] = "a dog  on a bench."
    json_path.write_text(json.dumps({"images": entries}))
    annotations = []
    for entry in entries:
        for k, sentence in enumerate(entry["sentences"]):
            if entry["cocoid"] == 104 and k == 4:
                continue  # no annotation for this one
            text = sentence["raw"].strip()
            if entry["cocoid"] == 106 and k == 2:
                text = text.upper().replace(",", " ,")  # punctuation spaced out, upper case
            annotations.append({"image_id": entry["cocoid"], "id": 1000 * entry["cocoid"] + k,
                                "caption": text})
    annotations.reverse()  # file order is not sentence order ...
    # ... but an image's two identical annotations keep theirs: 100000 before 100001
    first, second = (next(i for i, a in enumerate(annotations) if a["id"] == n)
                     for n in (100000, 100001))
    annotations[first], annotations[second] = annotations[second], annotations[first]
    (tmp_path / "captions_val2014.json").write_text(json.dumps({"annotations": annotations}))
    assert make_shards(["karpathy", "--out", str(tmp_path / "out"), "--no-progress",
                        "--json", str(json_path), "--image-root", str(root),
                        "--coco-captions", str(tmp_path / "captions_val2014.json")]) == 0
    assert "1 of 45 sentences match no COCO caption annotation" in caplog.text
    metas = {int(k): json.loads(s["json"]) for k, s in shard_samples(tmp_path / "out").items()}
    expected = {i: [1000 * i + k for k in range(5)] for i in metas}
    expected[104][4] = None
    assert {i: m["caption_ids"] for i, m in metas.items()} == expected
    # through the evaluation pipeline into a gallery: ids beside their captions, and an
    # image whose sample comes twice keeps each text once, with its first id
    batches = list(iter_eval_batches(EvalReader(str(tmp_path / "out" / "*.tar"), 16),
                                     build_transforms(None, 16)))
    batch = {key: value * 2 if isinstance(value, list) else value
             for key, value in batches[0].items() if key != "images"}
    gallery = Gallery(None, None, None, 0)
    _add_samples(gallery, batch, {}, [])
    assert gallery.duplicates == len(metas)  # every sample came twice: nothing new
    assert gallery.caption_ids == [i for ids in batches[0]["caption_ids"] for i in ids]
    assert len(gallery.captions) == 5 * len(metas)
    with pytest.raises(FileNotFoundError, match="captions_train2014.json do not exist"):
        karpathy_source(json_path, root, coco_captions=str(tmp_path / "captions_train2014.json"))


def test_precomputed_captions_get_coco_ids_by_their_ids_file(precomputed, tmp_path):
    folder, arrays = precomputed
    _, _, captions = arrays["test"]
    annotations = [{"image_id": 500 + i, "id": 10 * i + k, "caption": captions[5 * i + k]}
                   for i in range(3) for k in range(5) if (i, k) != (1, 3)]
    (tmp_path / "captions.json").write_text(json.dumps({"annotations": annotations}))
    source = SHARD_SOURCES.build({"type": "precomputed", "data_dir": str(folder), "splits": "test",
                                  "coco_captions": str(tmp_path / "captions.json")})
    assert source.caption_ids["test"] == [[0, 1, 2, 3, 4], [10, 11, 12, None, 14],
                                          [20, 21, 22]]  # its last two lines are missing
    (folder / "test_ids.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"test_ids\.txt is missing"):
        SHARD_SOURCES.build({"type": "precomputed", "data_dir": str(folder), "splits": "test",
                             "coco_captions": str(tmp_path / "captions.json")})
