"""What the trainer says of its evaluation splits (issue 39, items 11 and 16): a validation
that cannot read its split whole stops the run with a checkpoint, which --resume validates
again; an evaluation shard that is a training shard, or shares its samples, is warned of."""

import json
import logging
import shutil

import pytest

# same folder: pytest puts it on sys.path
from test_trainer import tiny_config

from mmgoal.data.pipeline import IncompleteSplitError
from mmgoal.engine.trainer import Trainer
from mmgoal.runs.checkpoint import load_checkpoint


def test_a_validation_that_cannot_read_its_split_whole_stops_with_a_checkpoint(
        tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    val = tmp_path / "val-000000.tar"
    data = bytearray((out / "val-000000.tar").read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)  # headers zeroed mid-file
    val.write_bytes(bytes(data))
    cfg = tiny_config(out, epochs=1)
    cfg["data"]["val"]["shards"] = str(val)
    run = tmp_path / "run"
    with pytest.raises(IncompleteSplitError, match=rf"shard {val} is damaged after \d+ "
                                                   rf"samples: .* An evaluation reads its "
                                                   rf"split whole"):
        Trainer(cfg, run).fit()
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    # the epoch's steps are in it, its end is not: no val record, no best.pt
    assert state["epoch_steps_done"] and state["epoch"] == 0
    assert not (run / "checkpoints" / "best.pt").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any(r["type"] == "val" for r in records)
    # the shard repaired, --resume validates and finishes the run
    shutil.copyfile(out / "val-000000.tar", val)
    report = Trainer(cfg, run, resume=True).fit()
    assert report["best"]["epoch"] == 0 and "test" in report
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["type"] == "val"] == [0]


def test_evaluation_shards_shared_with_training_are_warned_of(tiny_benchmark, tmp_path, caplog):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1)
    copy = tmp_path / "copy.tar"
    shutil.copyfile(out / "train-000001.tar", copy)
    cfg["data"]["val"]["shards"] = str(copy)  # the same bytes under another name
    cfg["data"]["test"]["shards"] = [str(out / "test-000000.tar"), str(out / "train-000002.tar")]
    with caplog.at_level(logging.WARNING):
        Trainer(cfg, tmp_path / "run")
    assert (f"data.val's shard {copy} is the training shard {out / 'train-000001.tar'}: its "
            f"metrics measure samples the model trained on, not a test") in caplog.text
    assert (f"data.test's shard {out / 'train-000002.tar'} is the training shard "
            f"{out / 'train-000002.tar'}") in caplog.text
    caplog.clear()
    # the same samples in another shard: their keys
    part = tmp_path / "part.tar"
    with open(out / "train-000000.tar", "rb") as whole:
        part.write_bytes(whole.read(len((out / "train-000000.tar").read_bytes()) // 2))
    cfg["data"]["val"]["shards"] = str(part)
    cfg["data"]["test"]["shards"] = str(out / "test-000000.tar")
    with caplog.at_level(logging.WARNING):
        Trainer(cfg, tmp_path / "run2")
    assert "data.val shares " in caplog.text and " sample keys with the training split (" \
        in caplog.text
    assert "data.test" not in caplog.text  # the real test split shares nothing
