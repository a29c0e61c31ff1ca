"""A split's shards named by their folder or a glob: the shards found there are read, and
a missing shard's error says what the folder holds."""

import pytest

from mmgoal.config import find_config
from mmgoal.data.remote import expand_shards
from mmgoal.data.synthetic import write_benchmark
from mmgoal.runs.schema import load_run_config


@pytest.fixture
def small_synthetic(tmp_path, monkeypatch):
    """``mmgoal make-synthetic`` of a few images, in data/synthetic of the working folder:
    2 training shards where the shipped config once named 10."""
    monkeypatch.chdir(tmp_path)
    write_benchmark(tmp_path / "data" / "synthetic", {"train": 60, "val": 10, "test": 10},
                    seed=0, image_size=16, shard_size=30, progress=False)
    return tmp_path / "data" / "synthetic"


def test_quickstart_trains_on_the_shards_make_synthetic_wrote(small_synthetic):
    from mmgoal.engine.trainer import Trainer

    cfg = load_run_config(find_config("quickstart"), ["train.progress=false",
                                                      "data.num_workers=0"])
    assert expand_shards(cfg["data"]["train"]["shards"]) == [
        "data/synthetic/train-000000.tar", "data/synthetic/train-000001.tar"]
    trainer = Trainer(cfg, small_synthetic.parent / "run")
    assert trainer.samples_per_epoch == 60  # both shards, as their stats count them


def test_a_folder_names_its_splits_shards(small_synthetic):
    folder = str(small_synthetic)
    cfg = load_run_config(find_config("quickstart"), [f"data.train.shards={folder}",
                                                      f"data.val.shards={folder}/",
                                                      f"data.test.shards={folder}"])
    assert [cfg["data"][split]["shards"] for split in ("train", "val", "test")] == [
        f"{folder}/train-*.tar", f"{folder}/val-*.tar", f"{folder}/test-*.tar"]
    assert len(expand_shards(folder)) == 4  # named alone: every shard there
    # in a list, and as eval's --shards (a loaded model's split)
    cfg = load_run_config(find_config("quickstart"), [f"data.train.shards=[{folder}]"])
    assert cfg["data"]["train"]["shards"] == [f"{folder}/train-*.tar"]
    from mmgoal.runs.loading import LoadedModel

    loaded = LoadedModel(None, None, None, config=cfg, checkpoint=None)
    assert loaded.split("test", [folder])["shards"] == [f"{folder}/test-*.tar"]


def test_a_missing_shard_says_what_its_folder_holds(small_synthetic):
    with pytest.raises(FileNotFoundError) as error:
        expand_shards("data/synthetic/train-{000000..000009}.tar")
    assert str(error.value) == (
        "shard 'data/synthetic/train-000002.tar' does not exist (from "
        "'data/synthetic/train-{000000..000009}.tar'); data/synthetic holds test-000000.tar, "
        "train-000000.tar, train-000001.tar, val-000000.tar: name the folder (data/synthetic) "
        "or a glob (data/synthetic/*.tar) to read the shards that are there")
    with pytest.raises(FileNotFoundError, match="data/elsewhere does not exist: generate"):
        expand_shards("data/elsewhere/train-*.tar")
    with pytest.raises(FileNotFoundError, match="shard 'data/synthetci' does not exist .*; "
                                                "data/synthetci does not exist: name a folder"):
        expand_shards("data/synthetci")  # a folder's name mistyped


@pytest.mark.slow
def test_make_synthetic_then_train_quickstart_with_no_override(tmp_path):
    """What a new user types first, on a small benchmark: every shard make-synthetic wrote
    is found (it once failed on a train-000002.tar the shipped config named)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    mmgoal = [sys.executable, "-m", "mmgoal"]
    subprocess.run([*mmgoal, "make-synthetic", "--out", "data/synthetic", "--train", "24",
                    "--val", "4", "--test", "4", "--shard-size", "8", "--image-size", "16"],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    done = subprocess.run([*mmgoal, "train", "quickstart"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "work_dirs" / "quickstart"
    report = json.loads((run / "report.json").read_text())
    assert report["epochs"] == 14 and "rsum" in report["test"]
    assert "data/synthetic/train-*.tar" in (run / "config.yaml").read_text()
    log = (run / "train.log").read_text()  # the setup's lines to the test table
    assert "(24 samples)" in log and "test metrics of the best epoch" in log  # 3 shards' 24
