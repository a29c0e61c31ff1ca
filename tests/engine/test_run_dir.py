"""A run directory: never a new run over an old one; a resume keeps the run's config."""

import json

import pytest
import yaml

from mmgoal.runs.run_dir import (
    CHANGES_FILE,
    prepare_work_dir,
    record_changes,
    resume_changes,
    stored_config,
)


def test_a_run_is_never_started_over_another(tmp_path):
    run = tmp_path / "run"
    prepare_work_dir(run, resume=False)  # new: fine
    (run / "checkpoints").mkdir(parents=True)
    prepare_work_dir(run, resume=False)  # an empty checkpoints folder is no run
    (run / "checkpoints" / "last.pt").write_bytes(b"x")
    (run / "config.yaml").write_text("train: {epochs: 16}\n")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds a run \(config.yaml, checkpoints\); continue "
                                         r"it with --resume, start afresh with --overwrite"):
        prepare_work_dir(run, resume=False)
    prepare_work_dir(run, resume=True)
    prepare_work_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # only the run's files go
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; give a run directory"):
        prepare_work_dir(tmp_path / "file", resume=True)


def test_a_resume_may_change_only_what_may_change_and_records_it(tmp_path):
    stored = {"model": {"type": "M", "dim": 16}, "train": {"epochs": 4, "seed": 0},
              "data": {"train": {"batch_size": 8, "shards": "a.tar"}}, "hooks": []}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(stored))
    assert resume_changes(tmp_path, stored) == {}
    longer = {**stored, "train": {"epochs": 8, "seed": 0},
              "data": {"train": {"batch_size": 4, "shards": "a.tar"}}}
    changes = resume_changes(tmp_path, longer)
    assert changes == {"data.train.batch_size": [8, 4], "train.epochs": [4, 8]}
    other = {**stored, "model": {"type": "M", "dim": 32}, "train": {"epochs": 8, "seed": 1},
             "hooks": [{"type": "H"}]}
    with pytest.raises(ValueError, match=r"must keep: hooks: \[\] -> \[\{'type': 'H'\}\]; "
                                         r"model.dim: 16 -> 32; train.seed: 0 -> 1\. Resume"):
        resume_changes(tmp_path, other)
    record_changes(tmp_path, changes, epoch=4, step=40)
    record = json.loads((tmp_path / CHANGES_FILE).read_text())
    assert record["step"] == 40 and record["changes"] == changes
    # a later resume starts from the config as changed; config.yaml itself is kept
    assert stored_config(tmp_path)["train"]["epochs"] == 8
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == stored
    assert resume_changes(tmp_path, longer) == {}
