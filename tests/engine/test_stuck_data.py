"""A run whose data never comes stops: a clear error for shards without a decodable image,
and a prompt, checkpointed stop for a signal while the reader is stuck (issue 17)."""

import contextlib
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

from mmgoal.data.pipeline import ShardDataset, UnreadableShardsError
from mmgoal.data.shards import ShardWriter
from mmgoal.engine.signals import WorkerRelease, start_data_worker
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import DATASETS
from mmgoal.runs.checkpoint import load_checkpoint


class Hang(BaseException):
    """A test ran past its time (a BaseException: the data handlers skip any Exception)."""


@contextlib.contextmanager
def fails_after(seconds):
    """A hang fails the test instead of stalling the test run."""
    def timeout(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


ROOT = Path(__file__).resolve().parents[2]


def write_undecodable_shards(folder):
    """Two shards of 8 samples with sound tars and captions, every image unreadable."""
    with ShardWriter(folder, "train", max_count=8) as writer:
        for key in range(16):
            writer.write({"__key__": f"{key:04d}", "jpg": b"\xff\xd8 not a JPEG",
                          "json": json.dumps({"image_id": key, "captions": ["a red square"]})})
    return str(folder / "train-{000000..000001}.tar")


@pytest.mark.parametrize("workers", [0, 1])
def test_shards_without_a_decodable_image_stop_the_run(tmp_path, workers):
    cfg = tiny_config(tmp_path, epochs=1)
    cfg["data"].update(num_workers=workers, val=None, test=None)
    cfg["data"]["train"]["shards"] = shards = write_undecodable_shards(tmp_path)
    trainer = Trainer(cfg, tmp_path / "run")
    with fails_after(30), pytest.raises(UnreadableShardsError) as error:
        trainer.fit()
    assert (f"rank 0 worker 0 read a whole pass of its training shards without a readable "
            f"sample: no sample of {shards} could be decoded (") in str(error.value)
    assert "CorruptSampleError, the last: sample '00" in str(error.value)
    assert "unreadable image" in str(error.value)


class StuckAfterBatches(torch.utils.data.IterableDataset):
    """``batches`` training batches of ``shards``, then a reader stuck for ever (a hung
    file system) that has touched ``marker``."""

    def __init__(self, shards, batch_size, batches, marker, tokenizer, transform, seed):
        super().__init__()
        self.shard_data = ShardDataset(shards, batch_size, tokenizer, transform,
                                       shuffle_buffer=32, seed=seed)
        self.batch_size, self.batches, self.marker = batch_size, batches, Path(marker)

    def num_samples(self):
        return self.shard_data.num_samples()

    def set_epoch(self, epoch):
        self.shard_data.set_epoch(epoch)

    def __iter__(self):
        yield from itertools.islice(self.shard_data, self.batches)
        self.marker.touch()
        threading.Event().wait()


def signal_once_there(path, signum):
    """Send ``signum`` to this process (from a thread) once ``path`` exists."""
    def wait_then_signal():
        while not path.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait_then_signal, daemon=True).start()


@pytest.fixture
def stuck_data():
    DATASETS.register("StuckAfterBatches", force=True)(StuckAfterBatches)
    yield
    DATASETS._entries.pop("StuckAfterBatches")


@pytest.mark.parametrize("batches,accumulate,workers", [(0, 1, 0), (3, 1, 0), (3, 2, 0),
                                                       (0, 1, 1)])
def test_a_stop_signal_while_the_data_is_stuck_stops_the_run(tiny_benchmark, tmp_path, caplog,
                                                            stuck_data, batches, accumulate,
                                                            workers):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, accumulate_steps=accumulate)
    cfg["data"]["num_workers"] = workers
    cfg["data"]["train"] = {"type": "StuckAfterBatches", "batches": batches, "batch_size": 16,
                            "shards": str(out / "train-{000000..000002}.tar"),
                            "marker": str(tmp_path / "stuck")}
    trainer = Trainer(cfg, tmp_path / "run")
    signal_once_there(tmp_path / "stuck", signal.SIGTERM)
    with fails_after(30):
        report = trainer.fit()
    steps = batches // accumulate  # a window cut short is not a step
    assert report == {"interrupted": True, "epoch": 0, "step": steps}
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    if batches:
        state = load_checkpoint(checkpoint)
        assert state["step"] == steps and state["batch_in_epoch"] == steps * accumulate
        assert (f"received SIGTERM while waiting for data: stopped at epoch 0, step {steps} "
                f"with a checkpoint") in caplog.text
    else:
        assert not checkpoint.exists()
        assert "before the first step: no checkpoint written" in caplog.text


@pytest.mark.slow
def test_finetune_exits_with_the_error_when_no_image_decodes(tmp_path):
    """The tool's process ends too: a data worker left alive by the error's traceback
    ignores SIGTERM and would block the exit."""
    cfg = tiny_config(tmp_path, epochs=1)
    cfg["data"].update(num_workers=1, val=None, test=None)
    cfg["data"]["train"]["shards"] = shards = write_undecodable_shards(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "tools/finetune.py", str(tmp_path / "run.yaml"),
                             "--work-dir", str(tmp_path / "run")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr.split("error: ")[-1]
    assert f"no sample of {shards} could be decoded" in result.stderr.strip().splitlines()[-1]


def test_the_workers_are_released_after_epochs_whose_workers_ended():
    # A multiprocessing.Event here hung the end of every run with data workers: its set()
    # waits for each process that ever waited on it, and an epoch's workers end with it.
    release = WorkerRelease()
    loader = torch.utils.data.DataLoader(
        range(4), batch_size=2, num_workers=1,
        worker_init_fn=functools.partial(start_data_worker, release))
    for _ in range(2):
        assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    released = threading.Event()
    threading.Thread(target=lambda: (release.set(), released.set()), daemon=True).start()
    assert released.wait(10), "setting the release flag blocked"
    # a worker alive when it is set ends at once (its loader would wait 5 s, then kill it)
    release.clear()
    worker = torch.multiprocessing.get_context("spawn").Process(
        target=_start_data_worker_and_sleep, args=(release,))
    worker.start()
    try:
        time.sleep(1.0)
        assert worker.is_alive()
        release.set()
        # generous: a spawned process imports torch first, which takes long on a busy machine;
        # without the release it would sleep for 10 minutes
        worker.join(120)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()


def _start_data_worker_and_sleep(release) -> None:
    start_data_worker(release, 0)
    time.sleep(600)  # a read that never returns
