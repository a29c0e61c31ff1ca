"""Shards in the img2dataset / open_clip layout (jpg + txt + json) train and evaluate like ours."""

import io
import json

import numpy as np
import webdataset as wds
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

from mmgoal.data.synthetic import iter_scenes
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.engine.trainer import Trainer


def test_img2dataset_shards_train_the_quickstart_model(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    folder = tmp_path / "laion"
    folder.mkdir()
    captions = []
    for shard in range(2):  # the layout img2dataset writes: jpg + txt + json, 9-digit keys
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as writer:
            for scene in iter_scenes("train", 24, seed=shard, image_size=32):
                key = f"{shard:05d}{scene.image_id % 10000:04d}"
                buffer = io.BytesIO()
                scene.image.save(buffer, format="JPEG")
                captions.append(scene.captions[0])
                writer.write({"__key__": key, "jpg": buffer.getvalue(),
                              "txt": scene.captions[0],
                              "json": {"key": key, "url": f"http://x/{key}.jpg",
                                       "caption": scene.captions[0], "status": "success",
                                       "width": 32, "height": 32}})
    cfg = tiny_config(out, epochs=1)
    cfg["data"]["train"] = {"type": "ShardDataset", "shards": str(folder / "{00000..00001}.tar"),
                            "batch_size": 8, "caption_key": "txt"}
    # evaluated on them too: one caption each from the .txt, image ids from the keys
    cfg["data"]["test"] = {"shards": str(folder / "00001.tar"), "caption_key": "txt"}
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.steps_per_epoch == 48 // 8
    assert trainer.tokenizer.words == WordTokenizer().fit(captions).words  # from the .txt
    report = trainer.fit()
    assert report["steps"] == 6 and report["skipped_samples"] == 0
    assert np.isfinite(report["test"]["rsum"]) and report["test"]["skipped"] == 0
    [[name, size, digest]] = report["test_set"]
    assert (name, size, len(digest)) == ("00001.tar", (folder / "00001.tar").stat().st_size, 16)

    # the same web shards mixed 1:1 with the benchmark's own: counts per source in the log
    cfg = tiny_config(out, epochs=1, samples_per_epoch=48, log_every=2)
    cfg["data"]["train"] = {"type": "MixtureDataset", "batch_size": 8, "sources": [
        {"name": "scenes", "weight": 1, "shards": str(out / "train-{000000..000002}.tar")},
        {"name": "web", "weight": 1, "shards": str(folder / "{00000..00001}.tar"),
         "caption_key": "txt"}]}
    trainer = Trainer(cfg, tmp_path / "mixed")
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "mixed" / "metrics.jsonl")
               .read_text().splitlines() if '"train"' in line]
    for record in records:
        assert record["samples_scenes"] + record["samples_web"] == 8 * record["step"]
    assert 0 < records[-1]["samples_web"] < 48
