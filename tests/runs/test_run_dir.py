"""A run directory: never a new run over an old one; a resume keeps the run's config."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from mmgoal.files import LinkedPathError
from mmgoal.runs.run_dir import (
    CHANGES_FILE,
    LOCK_FILE,
    RunFolderLocked,
    epoch_checkpoints,
    has_checkpoint,
    prepare_work_dir,
    prune_epoch_checkpoints,
    record_changes,
    resume_changes,
    run_lock,
    stored_config,
    weights_file,
)


def test_a_run_is_never_started_over_another(tmp_path):
    run = tmp_path / "run"
    prepare_work_dir(run, resume=False)  # new: fine
    (run / "checkpoints").mkdir(parents=True)
    prepare_work_dir(run, resume=False)  # an empty checkpoints folder is no run
    (run / "checkpoints" / "last.pt").write_bytes(b"x")
    (run / "config.yaml").write_text("train: {epochs: 16}\n")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds a run \(config.yaml, checkpoints/last.pt\); "
                                         r"continue it with --resume, start afresh with "
                                         r"--overwrite"):
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


def test_overwrite_deletes_what_the_run_wrote_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    (checkpoints / "deepspeed" / "epoch0000-step000000004").mkdir(parents=True)
    for name in ("best.pt", "last.pt", ".last.pt.tmp-4242", "best.pt.test.json",
                 "model.safetensors", "notes.txt", "epoch_3.pt", "epoch_03.pt"):
        (checkpoints / name).write_text("x")
    (run / "curves").mkdir()  # a TensorBoard log_dir outside tensorboard/
    (run / "curves" / "events.out.tfevents.1.host").write_text("x")
    (run / "tensorboard").mkdir()  # the default place, holding a file of the user's too
    (run / "tensorboard" / "events.out.tfevents.2.host").write_text("x")
    (run / "tensorboard" / "my_notes.md").write_text("x")
    (run / "wandb" / "offline-run-20261201_000000-abc123").mkdir(parents=True)
    (run / "wandb" / "offline-run-20261201_000000-other").mkdir(parents=True)
    (run / "wandb_id").write_text("abc123\n")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text(yaml.safe_dump({"loggers": [
        {"type": "TensorBoardLogger", "log_dir": "curves"}, {"type": "WandbLogger"},
        {"type": "TensorBoardLogger"}]}))
    deleted = prepare_work_dir(run, resume=False, overwrite=True)
    assert deleted == ["config.yaml", "metrics.jsonl", "checkpoints/best.pt",
                       "checkpoints/last.pt", "checkpoints/deepspeed",
                       "checkpoints/epoch_3.pt", "checkpoints/.last.pt.tmp-4242", "curves",
                       "wandb_id",
                       "wandb/offline-run-20261201_000000-abc123",
                       "tensorboard/events.out.tfevents.2.host"]
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert left == ["checkpoints", "checkpoints/best.pt.test.json",
                    "checkpoints/epoch_03.pt", "checkpoints/model.safetensors",
                    "checkpoints/notes.txt", "tensorboard", "tensorboard/my_notes.md", "wandb",
                    "wandb/offline-run-20261201_000000-other"]


def test_epoch_checkpoints_are_mmgoals_names_only_and_count_as_resumable(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("epoch_10.pt", "epoch_9.pt", "epoch_2.pt", "epoch_01.pt", "epoch_x.pt",
                 "epoch_3.pt.bak", "epoch_-1.pt"):
        (checkpoints / name).write_text("x")
    (checkpoints / "epoch_11.pt").symlink_to(checkpoints / "epoch_10.pt")  # not mmgoal's
    (checkpoints / "epoch_12.pt").mkdir()
    assert [(e, p.name) for e, p in epoch_checkpoints(checkpoints)] == [
        (2, "epoch_2.pt"), (9, "epoch_9.pt"), (10, "epoch_10.pt")]  # by epoch, not by name
    assert has_checkpoint(checkpoints)  # --auto-resume finds them without last.pt
    assert weights_file(tmp_path / "run", "latest") == checkpoints / "epoch_10.pt"
    (checkpoints / "last.pt").write_text("x")
    assert weights_file(tmp_path / "run", "latest") == checkpoints / "last.pt"
    assert [p.name for p in prune_epoch_checkpoints(checkpoints, 2)] == ["epoch_2.pt"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "epoch_-1.pt", "epoch_01.pt", "epoch_10.pt", "epoch_11.pt", "epoch_12.pt",
        "epoch_3.pt.bak", "epoch_9.pt", "epoch_x.pt", "last.pt"]
    with pytest.raises(LinkedPathError, match="epoch_11.pt is a symbolic link"):
        prepare_work_dir(tmp_path / "run", resume=True)  # a resume would write through it


def test_a_second_process_on_a_run_folder_is_refused_with_the_holders_name(tmp_path, capsys):
    from script_modules import ROOT, load_tool

    run = tmp_path / "run"
    held, release = threading.Event(), threading.Event()

    def hold():  # another open of the lock file: flock sets it against this one too
        with run_lock(run):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        with pytest.raises(RunFolderLocked, match=rf"--work-dir {run} is in use by pid "
                                                  rf"{os.getpid()} on {socket.gethostname()} "
                                                  rf"since .*: two processes writing one run"):
            with run_lock(run):
                pass
        finetune = load_tool("train")
        config = str(ROOT / "configs" / "quickstart.yaml")
        assert finetune.main([config, "--work-dir", str(run)]) == 2
        assert f"is in use by pid {os.getpid()}" in capsys.readouterr().err
        # --auto-resume waits for the holder (a requeued job beside the one it replaces)
        start = time.monotonic()
        assert finetune.main([config, "--work-dir", str(run), "--auto-resume",
                              "--lock-wait", "1"]) == 2
        assert time.monotonic() - start >= 1
        assert "(waited 1 s)" in capsys.readouterr().err
        threading.Timer(0.5, release.set).start()  # ... and goes on once it lets go
        with run_lock(run, wait_seconds=20):
            assert f"pid {os.getpid()}" in (run / LOCK_FILE).read_text()
    finally:
        release.set()
        holder.join()
    assert not (run / "config.yaml").exists()  # the refused runs wrote nothing


def test_a_killed_runs_lock_file_locks_nothing(tmp_path):
    run = tmp_path / "run"
    code = ("import sys, time, fcntl\n"
            f"stream = open({str(run / LOCK_FILE)!r}, 'a+')\n"
            "fcntl.flock(stream, fcntl.LOCK_EX)\n"
            "stream.write('pid 1 on elsewhere'); stream.flush()\n"
            "print('held', flush=True); time.sleep(60)\n")
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderLocked, match="in use by pid 1 on elsewhere"):
            with run_lock(run):
                pass
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the file stays
        holder.wait()
    assert (run / LOCK_FILE).read_text() == "pid 1 on elsewhere"
    with run_lock(run):  # the OS released the lock with the process
        assert f"pid {os.getpid()}" in (run / LOCK_FILE).read_text()
