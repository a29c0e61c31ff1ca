"""open_clip's CSV files, caption-file folders and Hugging Face datasets arrive in shards
(mmgoal/data/caption_sources.py): images as they were, captions grouped by image, what
cannot be read skipped and counted, and a resumed conversion redoes only what was left."""

import io
import json
import pickle
import sys
from pathlib import Path

import pytest
from PIL import Image
from test_sources import Interrupting, shard_samples

from mmgoal.data.conversion import convert, stats_path
from mmgoal.data.pipeline import EvalReader, iter_eval_batches
from mmgoal.data.transforms import build_transforms
from mmgoal.registry import SHARD_SOURCES


def image_bytes(index: int, format: str = "PNG") -> bytes:
    """A 32 px image of its own colour."""
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32 - index), (30 * index, 255 - 20 * index, 90)).save(
        buffer, format=format)
    return buffer.getvalue()


def read_back(folder: Path, split: str) -> dict:
    """image id -> captions of a split's shards, through the evaluation pipeline."""
    batches = iter_eval_batches(EvalReader(str(folder / f"{split}-*.tar"), 16),
                                build_transforms(None, 16))
    return {image_id: captions for batch in batches
            for image_id, captions in zip(batch["image_ids"], batch["captions"])}


class Counting:
    """A source that records the items it is asked to convert."""

    def __init__(self, source):
        self.source, self.sampled = source, []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def sample(self, split, item):
        self.sampled.append((split, item))
        return self.source.sample(split, item)


def check_resume_redoes_only_unfinished_shards(source, out: Path, shard_size: int,
                                               whole: Path) -> None:
    """Interrupt a conversion of ``source`` after 3 items, resume it: the finished shards are
    left alone, only the others' items are converted, and the result is ``whole``'s."""
    with pytest.raises(KeyboardInterrupt):
        convert(Interrupting(source, 3), out, shard_size=shard_size, progress=False)
    plan = [(split, index, items) for split in source.splits()
            for index, items in enumerate(source.plan(split, shard_size))]
    finished = {(split, index) for split, index, _ in plan
                if stats_path(out, split, index).is_file()}
    assert 0 < len(finished) < len(plan)
    before = {path.name: (path.stat().st_ino, path.stat().st_mtime_ns)
              for path in out.glob("*.tar")}
    counting = Counting(source)
    convert(counting, out, shard_size=shard_size, resume=True, progress=False)
    assert counting.sampled == [(split, item) for split, index, items in plan
                                if (split, index) not in finished for item in items]
    for name, identity in before.items():
        path = out / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity, name
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(p.name for p in whole.glob("*.tar"))
    for path in whole.glob("*.tar"):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def check_a_worker_converts_as_the_parent_does(source) -> None:
    """A worker process gets the source pickled: its samples are the parent's."""
    copy = pickle.loads(pickle.dumps(source))
    for split in source.splits():
        item = source.items(split)[0]
        assert copy.sample(split, item) == source.sample(split, item)


@pytest.fixture
def csv_files(tmp_path):
    """open_clip CSV files (tab-separated): an image with two rows, a corrupt image, a
    missing one, a row without a path, a file name with dots, an absolute path."""
    root = tmp_path / "csv"
    (root / "images").mkdir(parents=True)
    files = {}
    for index, name in enumerate(["a.png", "b.png", "img.with.dots.png", "c.png"]):
        files[f"images/{name}"] = image_bytes(index)
        (root / "images" / name).write_bytes(files[f"images/{name}"])
    (root / "images" / "corrupt.png").write_bytes(b"\x89PNG not really")
    absolute = tmp_path / "elsewhere.jpg"
    absolute.write_bytes(image_bytes(5, "JPEG"))
    files[str(absolute)] = absolute.read_bytes()
    (root / "train.csv").write_text(
        "filepath\ttitle\n"
        "images/a.png\ta red square\n"
        "images/b.png\ta green square\n"
        "images/corrupt.png\ta broken file\n"
        "images/a.png\tthe same square, again\n"
        "images/missing.png\tno such file\n"
        "\ta caption without an image\n"
        "images/img.with.dots.png\tdots in its name\n")
    (root / "test.csv").write_text(f"filepath\ttitle\nimages/c.png\ta blue square\n"
                                   f"{absolute}\tfrom another folder\n")
    return root, files


def test_csv_rows_of_an_image_become_one_sample_with_their_captions(csv_files, tmp_path):
    root, files = csv_files
    source = SHARD_SOURCES.build({"type": "csv", "train": str(root / "train.csv"),
                                  "test": str(root / "test.csv")})
    summary = convert(source, tmp_path / "out", shard_size=2, progress=False)
    assert read_back(tmp_path / "out", "train") == {
        "images/a.png": ["a red square", "the same square, again"],
        "images/b.png": ["a green square"], "images/img.with.dots.png": ["dots in its name"]}
    # an image outside --image-root (the CSV's folder) is skipped unless --allow-outside
    assert read_back(tmp_path / "out", "test") == {"images/c.png": ["a blue square"]}
    assert summary["splits"]["train"]["skipped"] == {"unreadable image": 1, "missing image": 1,
                                                     "no image path": 1}
    absolute = root.parent / "elsewhere.jpg"
    assert summary["splits"]["test"]["skipped"] == {"outside the source folder": 1}
    assert summary["splits"]["test"]["examples"] == [
        f"outside the source folder: {root / absolute} leads to {absolute}, outside {root} "
        f"(--allow-outside takes files from anywhere)"]
    assert f"unreadable image: {root / 'images' / 'corrupt.png'}: unreadable image (not an " \
           f"image format PIL knows)" in summary["splits"]["train"]["examples"]
    source = SHARD_SOURCES.build({"type": "csv", "train": str(root / "train.csv"),
                                  "test": str(root / "test.csv"), "allow_outside": True})
    convert(source, tmp_path / "anywhere", shard_size=2, progress=False)
    assert read_back(tmp_path / "anywhere", "test") == {
        "images/c.png": ["a blue square"], str(absolute): ["from another folder"]}
    for sample in shard_samples(tmp_path / "anywhere").values():  # the bytes as they were
        meta = json.loads(sample["json"])
        extension = "jpg" if meta["image_id"].endswith(".jpg") else "png"
        assert sample[extension] == files[meta["image_id"]]
        assert (meta["width"], meta["height"]) == Image.open(io.BytesIO(sample[extension])).size
    check_a_worker_converts_as_the_parent_does(source)
    check_resume_redoes_only_unfinished_shards(source, tmp_path / "resumed", 2,
                                               tmp_path / "anywhere")


def test_csv_columns_separator_and_image_root_are_options(csv_files, tmp_path):
    root, _ = csv_files
    (root / "pairs.csv").write_text("caption,path\n\"a square, green\",b.png\n")
    source = SHARD_SOURCES.build({"type": "csv", "val": str(root / "pairs.csv"),
                                  "img_key": "path", "caption_key": "caption",
                                  "separator": ",", "image_root": str(root / "images")})
    convert(source, tmp_path / "out", progress=False)
    assert read_back(tmp_path / "out", "val") == {"b.png": ["a square, green"]}


def test_csv_option_errors_name_what_the_file_has(csv_files, tmp_path, capsys):
    from mmgoal.cli.make_shards import main as make_shards

    root, _ = csv_files
    (root / "comma.csv").write_text("filepath,title\nimages/a.png,a red square\n")
    for options, message in (
            (["--train", root / "train.csv", "--img-key", "path"],
             f"{root / 'train.csv'} has no column 'path' (--img-key); its columns are: "
             f"'filepath', 'title'"),
            (["--train", root / "comma.csv"],
             "has no column 'filepath' (--img-key); its columns are: 'filepath,title'; its "
             "header has a comma: is that the separator (--separator)?"),
            (["--train", root / "train.csv", "--separator", "||"],
             "--separator must be one character"),
            ([], "give the CSV file of at least one split: --train, --val, --test"),
            (["--train", root / "nowhere.csv"], "nowhere.csv does not exist"),
            (["--train", root / "images" / "a.png"],
             "a.png cannot be read as a UTF-8 CSV file ('utf-8' codec can't decode")):
        argv = ["csv", "--out", str(tmp_path / "out"), "--no-progress", *map(str, options)]
        assert make_shards(argv) == 2, options
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


@pytest.fixture
def caption_folder(tmp_path):
    """Images with .txt and .json caption files, in a sub-folder too; one without a caption
    file, a corrupt one, a dangling link, a GIF, two images of one name, a hidden file."""
    train = tmp_path / "photos" / "train"
    (train / "sub").mkdir(parents=True)
    files = {}
    for index, name in enumerate(["a.jpg", "sub/b.png", "c.jpg", "img.with.dots.png",
                                  "a.png"]):
        files[name] = image_bytes(index, "JPEG" if name.endswith(".jpg") else "PNG")
        (train / name).write_bytes(files[name])
    (train / "a.txt").write_text("a red square\n\n  a square, red  \n")
    (train / "sub" / "b.json").write_text(json.dumps({"caption": "a green square",
                                                      "url": "http://example.com/b"}))
    (train / "img.with.dots.txt").write_text("dots in its name\n")
    (train / "corrupt.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    (train / "corrupt.txt").write_text("a broken file\n")
    (train / "gone.jpg").symlink_to(tmp_path / "deleted.jpg")
    (train / "gone.txt").write_text("its image is missing\n")
    Image.new("P", (16, 16), 3).save(train / "anim.gif")
    (train / "anim.txt").write_text("a gif\n")
    (train / "empty.png").write_bytes(image_bytes(9))
    (train / "empty.txt").write_text("\n  \n")
    (train / "._a.jpg").write_bytes(b"macOS resource fork")
    test = tmp_path / "photos" / "test"
    test.mkdir()
    (test / "d.png").write_bytes(image_bytes(7))
    (test / "d.json").write_text(json.dumps({"captions": ["a blue square", "blue"]}))
    return tmp_path / "photos", files


def test_folder_images_take_the_captions_of_their_caption_files(caption_folder, tmp_path):
    photos, files = caption_folder
    source = SHARD_SOURCES.build({"type": "folder", "train": str(photos / "train"),
                                  "test": str(photos / "test")})
    summary = convert(source, tmp_path / "out", shard_size=3, progress=False)
    assert read_back(tmp_path / "out", "train") == {
        "a": ["a red square", "a square, red"], "anim": ["a gif"],
        "img.with.dots": ["dots in its name"], "sub/b": ["a green square"]}
    assert read_back(tmp_path / "out", "test") == {"d": ["a blue square", "blue"]}
    assert summary["splits"]["train"]["skipped"] == {
        "no caption file": 1, "unreadable image": 1, "missing image": 1, "no captions": 1,
        "another image has its name": 1}
    samples = {json.loads(s["json"])["image_id"]: s for s in shard_samples(tmp_path / "out")
               .values()}
    assert samples["a"]["jpg"] == files["a.jpg"] and samples["sub/b"]["png"] == files["sub/b.png"]
    # a GIF is no image to the training pipeline: it arrives as a JPEG
    assert Image.open(io.BytesIO(samples["anim"]["jpg"])).format == "JPEG"
    check_a_worker_converts_as_the_parent_does(source)
    check_resume_redoes_only_unfinished_shards(source, tmp_path / "resumed", 3, tmp_path / "out")


def test_folder_errors_say_what_is_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty holds no images \(\.jpg, \.jpeg"):
        SHARD_SOURCES.build({"type": "folder", "train": str(tmp_path / "empty")})
    with pytest.raises(FileNotFoundError, match="image folder .*nowhere is not a folder"):
        SHARD_SOURCES.build({"type": "folder", "val": str(tmp_path / "nowhere")})


@pytest.fixture
def hf_dataset(tmp_path):
    """A DatasetDict saved with save_to_disk: train has an image with two rows (one id), a
    corrupt image and a row without one; validation has a list of captions per row."""
    datasets = pytest.importorskip("datasets")
    files = []
    for index in range(4):
        files.append(tmp_path / f"{index}.png")
        files[-1].write_bytes(image_bytes(index))
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    train = datasets.Dataset.from_dict({
        "image": [str(files[0]), str(files[1]), str(tmp_path / "corrupt.png"), None,
                  str(files[0])],
        "caption": ["a red square", "a green square", "a broken file", "no image",
                    "red, again"],
        "image_id": [10, 11, 12, 13, 10],
        "extra": ["not", "read", "by", "the", "source"]}).cast_column("image", datasets.Image())
    validation = datasets.Dataset.from_dict({
        "image": [str(files[2]), str(files[3])], "caption": [["blue", "a blue square"], []],
        "image_id": [20, 21]}).cast_column("image", datasets.Image())
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(
        str(tmp_path / "saved"))
    return tmp_path / "saved", [f.read_bytes() for f in files]


def test_hf_dataset_rows_arrive_by_image_id(hf_dataset, tmp_path):
    saved, images = hf_dataset
    source = SHARD_SOURCES.build({"type": "hf", "dataset": str(saved), "id_key": "image_id"})
    summary = convert(source, tmp_path / "out", shard_size=2, progress=False)
    assert read_back(tmp_path / "out", "train") == {10: ["a red square", "red, again"],
                                                    11: ["a green square"]}
    # validation -> val (the configs' name); a row without captions is skipped
    assert read_back(tmp_path / "out", "val") == {20: ["blue", "a blue square"]}
    assert summary["splits"]["train"]["skipped"] == {"unreadable image": 1, "missing image": 1}
    assert summary["splits"]["val"]["skipped"] == {"no captions": 1}
    samples = shard_samples(tmp_path / "out")
    assert samples["10"]["png"] == images[0] and samples["20"]["png"] == images[2]
    check_a_worker_converts_as_the_parent_does(source)
    check_resume_redoes_only_unfinished_shards(source, tmp_path / "resumed", 2, tmp_path / "out")
    # without an id column every row is an image; --splits and --names pick and rename
    rows = SHARD_SOURCES.build({"type": "hf", "dataset": str(saved), "splits": "train",
                                "names": "train=test"})
    convert(rows, tmp_path / "rows", progress=False)
    assert read_back(tmp_path / "rows", "test") == {
        "test-0000000": ["a red square"], "test-0000001": ["a green square"],
        "test-0000004": ["red, again"]}


def test_hf_option_errors_name_what_the_dataset_has(hf_dataset, tmp_path):
    saved, _ = hf_dataset
    with pytest.raises(ValueError, match=r"split 'train' has no column 'img' \(--image-key\); "
                                         r"its columns are: image, caption, image_id, extra"):
        SHARD_SOURCES.build({"type": "hf", "dataset": str(saved), "image_key": "img"})
    with pytest.raises(ValueError, match=r"has no split 'test' \(--splits\); its splits are: "
                                         r"train, validation"):
        SHARD_SOURCES.build({"type": "hf", "dataset": str(saved), "splits": "train,test"})
    # offline (HF_HUB_OFFLINE=1 in the tests), a hub id cannot be reached: said, with why
    with pytest.raises(FileNotFoundError, match=r"nobody/nothing is not a local folder, and "
                                                r"datasets\.load_dataset could not load it"):
        SHARD_SOURCES.build({"type": "hf", "dataset": "nobody/nothing"})


def test_hf_without_datasets_names_the_extra(monkeypatch, tmp_path, capsys):
    from mmgoal.cli.make_shards import main as make_shards

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert make_shards(["hf", "--dataset", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert ("error: mmgoal make-shards hf needs datasets, which is not installed; install it "
            "with pip install 'mmgoal[hf]'") in err and "Traceback" not in err
