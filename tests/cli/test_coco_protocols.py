"""mmgoal eval on a COCO-id fixture (the 5K test ids, tiny images, made-up captions): the
COCO, ECCV Caption and CxC metrics it prints and writes equal the eccv_caption package's on
the rankings it writes; a gallery without COCO ids asked for eccv stops with a message."""

import io
import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from script_modules import load_tool

from mmgoal.data.pipeline import read_captions
from mmgoal.data.shards import ShardWriter
from mmgoal.evaluation.protocols import load_reference


def png(rng) -> bytes:
    pixels = np.asarray(rng.integers(0, 256, (16, 16, 3)), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def coco_fixture(folder, words, shard_size=1000):
    """Shards of the 5,000 COCO 5K test images with their test caption ids: random 16 px
    images, captions of 4-9 random words (each one different), in a shuffled order."""
    reference = load_reference(("eccv", "cxc"))
    captions_of: dict[int, list[int]] = {}
    for caption in reference.caption_ids:
        captions_of.setdefault(reference.caption_image[caption], []).append(caption)
    rng = np.random.default_rng(0)
    shuffle = random.Random(0)
    images = list(reference.image_ids)
    shuffle.shuffle(images)
    with ShardWriter(folder, "test", max_count=shard_size) as writer:
        for image in images:
            ids = captions_of[image]
            texts = [" ".join(shuffle.choices(words, k=shuffle.randint(4, 9))) + f" {i}"
                     for i in ids]
            writer.write({"__key__": str(image), "png": png(rng), "json": json.dumps(
                {"image_id": image, "captions": texts, "caption_ids": ids}).encode()})
    return str(folder / "test-{000000..000004}.tar")


@pytest.mark.slow
def test_eval_reports_eccv_and_cxc_equal_to_the_package(tiny_quickstart_run, tmp_path, capsys):
    source, benchmark = tiny_quickstart_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    words = sorted({w for c in read_captions(str(benchmark / "train-*.tar")) for w in c.split()})
    shards = coco_fixture(tmp_path / "coco", words)
    evaluate = load_tool("eval")
    out, rankings = tmp_path / "metrics.json", tmp_path / "rankings.json"
    assert evaluate.main([str(run), "--device", "cpu", "--cfg-options",
                          f"data.test.shards={shards}", "--protocols", "coco", "eccv", "cxc",
                          "--rankings", str(rankings), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads(out.read_text())["metrics"]
    for title in ("ECCV Caption   mAP@R     R-P     R@1", "CxC     R@1     R@5    R@10"):
        assert title in printed
    assert f"{metrics['eccv_t2i_map_at_r']:.2f}" in printed
    ranked = json.loads(rankings.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from eccv_caption import Metrics
    i2t, t2i = ({int(k): v for k, v in ranked[d].items()} for d in ("i2t", "t2i"))
    theirs = Metrics().compute_all_metrics(
        i2t, t2i,
        target_metrics=("eccv_r1", "eccv_map_at_r", "eccv_rprecision", "coco_5k_recalls",
                        "cxc_recalls"), Ks=(1, 5, 10))
    for direction in ("i2t", "t2i"):
        for name in ("map_at_r", "rprecision", "r1"):
            assert metrics[f"eccv_{direction}_{name}"] == pytest.approx(
                100 * theirs[f"eccv_{name}"][direction], abs=1e-9)
        for k in (1, 5, 10):
            assert metrics[f"cxc_{direction}_r{k}"] == pytest.approx(
                100 * theirs[f"cxc_r{k}"][direction], abs=1e-9)
            assert metrics[f"{direction}_r{k}"] == pytest.approx(
                100 * theirs[f"coco_5k_r{k}"][direction], abs=1e-9)
    # the synthetic benchmark, which has no COCO ids: a message, no numbers
    assert evaluate.main([str(run), "--device", "cpu", "--protocols", "eccv",
                          "--out", str(tmp_path / "synthetic.json")]) == 2
    error = capsys.readouterr().err
    assert "its captions have no COCO caption ids" in error
    assert "it is not the COCO 5K test split (Karpathy's): it lacks 5000" in error
    assert "--coco-captions captions_val2014.json" in error


def test_train_stops_before_its_epochs_when_the_test_shards_lack_coco_ids(tiny_benchmark,
                                                                         tmp_path, capsys):
    import yaml

    from mmgoal.runs.schema import check_test_shards

    out, _ = tiny_benchmark
    test = {"shards": str(out / "test-{000000..000001}.tar")}
    with pytest.raises(ValueError, match=r"test-000000\.tar has none: make the shards with "
                                         r"mmgoal make-shards karpathy \.\.\. --coco-captions"):
        check_test_shards({"data": {"test": test}, "evaluation": {"protocols": ["coco", "cxc"]}})
    check_test_shards({"data": {"test": test}})  # [coco]: nothing to check
    shards = coco_fixture(tmp_path / "coco", ["a", "dog"], shard_size=5000)
    check_test_shards({"data": {"test": {"shards": shards.replace("{000000..000004}",
                                                                  "000000")}},
                       "evaluation": {"protocols": ["eccv"]}})
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "_base_": str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"),
        "data": {"train": {"shards": str(out / "train-000000.tar")}, "val": None,
                 "test": test},
        "evaluation": {"protocols": ["coco", "eccv"]}}))
    assert load_tool("train").main([str(config), "--work-dir", str(tmp_path / "run")]) == 2
    assert "--coco-captions" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
