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
