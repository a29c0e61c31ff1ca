"""What a converter is pointed at never hangs it, fills memory, leaks a file from outside
the source or is silently reshaped (mmgoal/data/conversion.py, docs/data.md "What a
conversion takes"): special files are skipped and counted, a resumed conversion trusts a
shard only when it is whole, and what a row or column cannot give whole is refused by name."""

import json
import os
import socket
import subprocess
import sys

import pytest
from test_caption_sources import image_bytes, read_back
from test_sources import karpathy, karpathy_source  # noqa: F401 (a fixture)

from mmgoal.data.conversion import convert, stats_path
from mmgoal.registry import SHARD_SOURCES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def photo_folder(folder):
    """Two captioned images, and beside them a link to /dev/zero, a FIFO and a socket named
    as images, each with a caption file."""
    folder.mkdir(parents=True)
    for name in ("a", "b"):
        (folder / f"{name}.png").write_bytes(image_bytes(len(name)))
        (folder / f"{name}.txt").write_text(f"image {name}\n")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    os.mkfifo(folder / "pipe.jpg")
    served = socket.socket(socket.AF_UNIX)
    served.bind(str(folder / "sock.png"))
    for name in ("zero", "pipe", "sock"):
        (folder / f"{name}.txt").write_text("a caption\n")
    return served


def test_make_shards_skips_devices_fifos_and_sockets_and_names_them(tmp_path):
    served = photo_folder(tmp_path / "photos")
    out = tmp_path / "out"
    # a process of its own, bounded: the code this replaced read /dev/zero until memory ran
    # out, and blocked for ever on the FIFO (--allow-outside: the link to /dev/zero leads
    # outside the folder, which alone would skip it)
    result = subprocess.run(
        [sys.executable, "-m", "mmgoal", "make-shards", "folder", "--train",
         str(tmp_path / "photos"), "--allow-outside", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})
    served.close()
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())["splits"]["train"]
    assert summary["samples"] == 2 and summary["skipped"] == {"not a regular file": 3}
    for name, kind in (("pipe.jpg", "a FIFO (named pipe)"), ("sock.png", "a socket"),
                       ("zero.jpg", "a character device")):
        assert (f"not a regular file: image {tmp_path / 'photos' / name} is {kind}, not a "
                f"file; mmgoal reads no devices, FIFOs or sockets") in " ".join(
                    summary["examples"]), name
    assert "3 not a regular file" in result.stdout


def test_a_csv_row_pointing_at_a_device_or_outside_the_root_is_skipped(tmp_path):
    root = tmp_path / "csv"
    root.mkdir()
    (root / "a.png").write_bytes(image_bytes(1))
    secret = tmp_path / "private" / "secret.png"
    secret.parent.mkdir()
    secret.write_bytes(image_bytes(2))
    (root / "train.csv").write_text("filepath\ttitle\na.png\tmine\n/dev/zero\tzeros\n"
                                    "../private/secret.png\tyours\n")
    source = SHARD_SOURCES.build({"type": "csv", "train": str(root / "train.csv")})
    summary = convert(source, tmp_path / "out", progress=False)["splits"]["train"]
    assert summary["skipped"] == {"outside the source folder": 2}
    assert read_back(tmp_path / "out", "train") == {"a.png": ["mine"]}
    # --allow-outside takes the file outside, never the device
    source = SHARD_SOURCES.build({"type": "csv", "train": str(root / "train.csv"),
                                  "allow_outside": True})
    summary = convert(source, tmp_path / "anywhere", progress=False)["splits"]["train"]
    assert summary["skipped"] == {"not a regular file": 1}
    assert read_back(tmp_path / "anywhere", "train") == {"a.png": ["mine"],
                                                          "../private/secret.png": ["yours"]}


def test_a_folder_link_to_a_file_outside_it_is_skipped(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (tmp_path / "secret.png").write_bytes(image_bytes(1))
    (tmp_path / "secret.txt").write_text("my own words\n")
    (photos / "a.png").write_bytes(image_bytes(2))
    (photos / "a.txt").symlink_to(tmp_path / "secret.txt")  # a caption file of yours
    (photos / "b.png").symlink_to(tmp_path / "secret.png")
    (photos / "b.txt").write_text("b\n")
    summary = convert(SHARD_SOURCES.build({"type": "folder", "train": str(photos)}),
                      tmp_path / "out", progress=False)["splits"]["train"]
    assert summary["samples"] == 0 and summary["skipped"] == {"outside the source folder": 2}


def test_a_csv_row_with_more_fields_than_the_header_is_refused_by_line(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes(1))
    (tmp_path / "b.png").write_bytes(image_bytes(2))
    (tmp_path / "train.csv").write_text("filepath;title\na.png;a dog; a cat; and a bird\n"
                                        "b.png;\"a dog; a cat\"\na.png;one dog;\n")
    source = SHARD_SOURCES.build({"type": "csv", "train": str(tmp_path / "train.csv"),
                                  "separator": ";"})
    summary = convert(source, tmp_path / "out", progress=False)["splits"]["train"]
    # the quoted caption is whole; a trailing empty field drops nothing
    assert read_back(tmp_path / "out", "train") == {"b.png": ["a dog; a cat"],
                                                    "a.png": ["one dog"]}
    assert summary["skipped"] == {"more fields than the header": 1}
    assert summary["examples"] == [
        f"more fields than the header: {tmp_path / 'train.csv'} line 2: 4 fields, the header "
        f"2 (quote a field holding ';'): a.png;a dog; a cat; and a bird"]


def hf_saved(tmp_path, **columns):
    datasets = pytest.importorskip("datasets")
    rows = len(next(iter(columns.values())))
    images = [{"bytes": image_bytes(index), "path": f"{index}.png"} for index in range(rows)]
    dataset = datasets.Dataset.from_dict({"image": images, **columns}).cast_column(
        "image", datasets.Image())
    dataset.save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved")


def test_hf_columns_that_are_not_captions_or_ids_are_refused_by_name(tmp_path):
    saved = hf_saved(tmp_path, struct=[{"secret": "s", "other": "o"}], number=[7],
                     ids=[[1, 2]], caption=["a caption"])
    for options, message in [
            ({"caption_key": "struct"}, r"the caption column 'struct' \(--caption-key\) holds "
                                        r"\{'secret': Value\('string'\).*not text"),
            ({"caption_key": "number"}, r"the caption column 'number' \(--caption-key\) holds "
                                        r"Value\('int64'\), not text"),
            ({"id_key": "ids"}, r"the id column 'ids' \(--id-key\) holds List\(Value\('int64'\)"
                                r"\), not one value per row")]:
        with pytest.raises(ValueError, match=rf"split 'train': {message}"):
            SHARD_SOURCES.build({"type": "hf", "dataset": saved, **options})


def test_hf_rows_with_a_null_id_are_refused_not_joined(tmp_path):
    saved = hf_saved(tmp_path, caption=["first", "second", "third"], image_id=[None, None, 5])
    source = SHARD_SOURCES.build({"type": "hf", "dataset": saved, "id_key": "image_id"})
    summary = convert(source, tmp_path / "out", progress=False)["splits"]["train"]
    assert read_back(tmp_path / "out", "train") == {5: ["third"]}
    assert summary["skipped"] == {"no image id": 2}
    assert f"no image id: {saved} train row 1: its 'image_id' (--id-key) is null" in \
        summary["examples"]


def test_a_caption_that_is_not_text_is_skipped_with_its_row_and_column():
    from mmgoal.data.caption_sources import caption_list
    from mmgoal.data.conversion import SkippedItem

    assert caption_list([" a ", None, "", "b"], "x") == ["a", "b"]
    for value in ({"secret": "s"}, 7, ["a", 3]):
        with pytest.raises(SkippedItem, match=rf"^caption not text: d row 3 column 'c': a "
                                              rf"{type(value).__name__} "):
            caption_list(value, "d row 3 column 'c'")


def test_resume_writes_again_a_shard_cut_short_or_deleted(karpathy, tmp_path,  # noqa: F811
                                                         caplog):
    json_path, root, _, _ = karpathy
    whole = tmp_path / "whole"
    convert(karpathy_source(json_path, root), whole, shard_size=2, progress=False)
    out = tmp_path / "out"
    convert(karpathy_source(json_path, root), out, shard_size=2, progress=False)
    cut, deleted, garbled = (out / "train-000000.tar", out / "test-000000.tar",
                             out / "val-000000.tar")
    cut.write_bytes(cut.read_bytes()[:1500])
    deleted.unlink()  # its stats stay behind
    stats_path(out, "val", 0).write_text("{not json")
    kept = out / "restval-000000.tar"
    identity = (kept.stat().st_ino, kept.stat().st_mtime_ns)
    summary = convert(karpathy_source(json_path, root), out, shard_size=2, resume=True,
                      progress=False)
    for path in whole.glob("*.tar"):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert (kept.stat().st_ino, kept.stat().st_mtime_ns) == identity  # finished: left alone
    assert summary == json.loads((whole / "summary.json").read_text())
    assert garbled.is_file()
    said = caplog.text
    assert f"{cut} is 1,500 bytes where its stats say " in said
    assert f"{deleted} is missing where its stats say " in said
    assert f"{stats_path(out, 'val', 0)} cannot be read (" in said


def test_a_dangling_out_link_is_a_sentence(tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=rf"--out {tmp_path / 'out'} is a symbolic link "
                                                rf"to {tmp_path / 'nowhere'}, which does not "
                                                rf"exist"):
        convert(None, tmp_path / "out", progress=False)  # refused before the source is read
