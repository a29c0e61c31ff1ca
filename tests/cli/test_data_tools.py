"""tools/make_shards.py and tools/inspect_shards.py from the command line."""

import io
import json
import tarfile

import pytest
import yaml
from PIL import Image
from script_modules import load_tool
from test_cli import run_tool, tiny_overrides

from mmgoal.data.shards import ShardWriter


def jpeg(size) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_make_shards_then_inspect_them(tmp_path):
    (tmp_path / "images").mkdir()
    images = []
    for index in range(4):
        name = f"{1000 + index}.jpg"
        if index != 3:  # the last one is missing
            (tmp_path / "images" / name).write_bytes(jpeg((20 + index, 10)))
        images.append({"filename": name, "split": "test" if index else "train", "imgid": index,
                       "sentences": [{"raw": f"a red box {k}"} for k in range(5)]})
    (tmp_path / "f30k.json").write_text(json.dumps({"images": images}))
    out = tmp_path / "shards"
    result = run_tool("tools/make_shards.py", "karpathy", "--json", tmp_path / "f30k.json",
                      "--image-root", tmp_path / "images", "--out", out, "--shard-size", "2",
                      "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "test: 2 samples, 10 captions in 1 shards; skipped 1 missing image" in result.stdout
    assert "train: 1 samples, 5 captions in 1 shards" in result.stdout
    assert json.loads((out / "summary.json").read_text())["options"]["shard_size"] == 2
    # shards of 2 and of 3 images in one folder would hold some images twice
    result = run_tool("tools/make_shards.py", "karpathy", "--json", tmp_path / "f30k.json",
                      "--image-root", tmp_path / "images", "--out", out, "--shard-size", "3",
                      "--resume", "--no-progress")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "shard_size: 2 then, 3 now" in result.stderr
    result = run_tool("tools/make_shards.py", "karpathy", "--jsn", "x", "--out", out)
    assert result.returncode == 2 and "takes no option '--jsn'" in result.stderr
    assert "--json, --image-root, --max-size, --jpeg-quality" in result.stderr

    result = run_tool("tools/inspect_shards.py", str(out / "*.tar"), "--no-progress",
                      "--json", tmp_path / "report.json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["samples"], report["captions"], report["problems"]) == (3, 15, 0)
    assert report["image_width"] == {"min": 20, "median": 21.0, "mean": 21.0, "max": 22}
    assert report["caption_words"]["mean"] == 4 and report["keys"] == {"jpg": 3, "json": 3}
    assert "no problems" in result.stdout


def test_make_shards_help_lists_the_options_of_every_source():
    result = run_tool("tools/make_shards.py", "--help")
    assert result.returncode == 0, result.stderr
    assert "karpathy: --json --image-root [--max-size] [--jpeg-quality]" in result.stdout
    assert "entities: --shards --entities-root" in result.stdout
    assert "precomputed: --data-dir [--splits]" in result.stdout
    assert ("csv: [--train] [--val] [--test] [--img-key] [--caption-key] [--separator] "
            "[--image-root]") in result.stdout
    assert "folder: [--train] [--val] [--test] [--allow-outside] [--max-size]" in result.stdout
    assert "hf: --dataset [--image-key] [--caption-key] [--id-key] [--splits]" in result.stdout


def test_make_shards_csv_then_train_on_the_shards(tmp_path):
    """open_clip's CSV files -> mmgoal make-shards csv -> shards the quickstart model trains
    and is tested on, as on the synthetic benchmark's (tiny_overrides' layout: 3 train
    shards, 1 val, 2 test)."""
    make_shards, train = load_tool("make-shards"), load_tool("train")
    (tmp_path / "images").mkdir()
    colours = {"red": (220, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 230),
               "yellow": (230, 220, 30)}
    files = {}
    for split, count in (("train", 12), ("val", 4), ("test", 8)):
        lines = ["filepath\ttitle"]
        for index in range(count):
            name, (colour, rgb) = f"images/{split}{index}.png", list(colours.items())[index % 4]
            Image.new("RGB", (32, 32), rgb).save(tmp_path / name)
            lines += [f"{name}\ta {colour} square", f"{name}\t{colour}, picture {index}"]
        files[split] = tmp_path / f"{split}.csv"
        files[split].write_text("\n".join(lines) + "\n")
    out = tmp_path / "shards"
    assert make_shards.main(["csv", "--out", str(out), "--shard-size", "4", "--no-progress",
                             *(str(a) for split, path in files.items()
                               for a in (f"--{split}", path))]) == 0
    splits = json.loads((out / "summary.json").read_text())["splits"]
    assert {split: (row["samples"], row["captions"], row["shards"])
            for split, row in splits.items()} == {"train": (12, 24, 3), "val": (4, 8, 1),
                                                  "test": (8, 16, 2)}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_overrides("quickstart.yaml", out, train={
        "epochs": 1, "progress": False})))
    work = tmp_path / "run"
    assert train.main([str(config), "--work-dir", str(work), "--cfg-options",
                       "data.train.batch_size=4"]) == 0
    report = json.loads((work / "report.json").read_text())
    assert (report["epochs"], report["steps"], report["skipped_samples"]) == (1, 3, 0)
    assert [name for name, *_ in report["test_set"]] == ["test-000000.tar", "test-000001.tar"]
    assert 0 <= report["test"]["i2t_r1"] <= report["test"]["i2t_r10"] <= 100
    assert report["test"]["rsum"] == sum(report["test"][f"{d}_r{k}"] for d in ("i2t", "t2i")
                                         for k in (1, 5, 10))


def test_inspect_reports_every_kind_of_problem(tmp_path):
    def meta(image_id, captions):
        return json.dumps({"image_id": image_id, "captions": captions}).encode()

    with ShardWriter(tmp_path, "bad", max_count=10) as writer:
        writer.write({"__key__": "a", "jpg": jpeg((8, 8)), "json": meta(1, ["a box"])})
        writer.write({"__key__": "b", "jpg": b"garbage", "json": meta(2, ["a box"])})
        writer.write({"__key__": "c", "jpg": jpeg((8, 8)), "json": meta(3, [])})
        writer.write({"__key__": "d", "json": meta(4, ["no image here"])})
        writer.write({"__key__": "e", "jpg": jpeg((8, 8)), "json": meta(1, ["same id as a"])})
    with ShardWriter(tmp_path, "more", max_count=10) as writer:
        writer.write({"__key__": "f", "jpg": jpeg((8, 8)), "json": meta(3, ["id of c"])})
    good = (tmp_path / "bad-000000.tar").read_bytes()
    (tmp_path / "cut-000000.tar").write_bytes(good[:len(good) // 2])
    result = run_tool("tools/inspect_shards.py", str(tmp_path / "*.tar"), "--no-progress")
    assert result.returncode == 1
    for problem in ("b: unreadable image", "c: no captions", "d: no image",
                    "image id '1' appears 2 times", "cut-000000.tar: damaged tar after",
                    "more-000000.tar: image id '3' is also in"):
        assert problem in result.stdout, problem
    with tarfile.open(tmp_path / "bad-000000.tar") as archive:
        assert len(archive.getnames()) == 9


def test_inspect_fails_an_empty_set_and_explains_bad_arguments(tmp_path, capsys):
    inspect_shards = load_tool("inspect-shards")
    with tarfile.open(tmp_path / "empty-000000.tar", "w"):
        pass
    assert inspect_shards.main([str(tmp_path / "*.tar"), "--no-progress"]) == 1
    assert "empty-000000.tar: no samples" in capsys.readouterr().out
    for argv, message in (
            ([str(tmp_path)], f"{tmp_path} is a folder; give its shards, e.g. "
                              f"'{tmp_path / '*.tar'}'"),
            ([str(tmp_path / "*.tar"), "--json", str(tmp_path)], "--json"),
            ([str(tmp_path / "*.tar"), "--json", str(tmp_path / "no" / "r.json")],
             "does not exist"),
            ([str(tmp_path / "empty-{000000..000001.tar")], "Unbalanced braces")):
        assert inspect_shards.main([*argv, "--no-progress"]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_a_sources_help_gives_its_options_descriptions_and_defaults(capsys):
    from mmgoal.cli import make_shards

    with pytest.raises(SystemExit) as stop:
        make_shards.main(["csv", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0 and shown.startswith("usage: mmgoal make-shards csv --out OUT")
    assert "--img-key IMG_KEY open_clip's --csv-img-key" in shown
    assert "(default: 'filepath')" in shown and "(default: 'title')" in shown
    assert "--image-root IMAGE_ROOT where relative image paths start" in shown
    with pytest.raises(SystemExit):
        make_shards.main(["karpathy", "-h"])
    assert "--json JSON" in capsys.readouterr().out
