"""A stop signal during a validation ends it at its next batch; --resume validates again
without reading the epoch's data and goes on as a run never stopped (issue 39, item 20)."""

import json
import multiprocessing
import os
import shutil
import signal

import pytest
import torch

# same folder: pytest puts it on sys.path; stop_hook is a fixture
from test_trainer import stop_hook, tiny_config  # noqa: F401

from mmgoal.engine.trainer import Trainer
from mmgoal.evaluation import gallery
from mmgoal.runs.checkpoint import load_checkpoint

VAL_BATCHES = 4  # the tiny benchmark's 32 val images, 8 a batch


def config(out, epochs, workers, **train):
    cfg = tiny_config(out, epochs=epochs, **train)
    cfg["data"].update(num_workers=workers, eval_batch_size=8)
    return cfg


def with_bars(cfg):
    """``cfg`` with progress bars, as a run in a terminal has them (a bar's iteration, unlike
    a disabled one's, does not close the reader it wraps when it is left)."""
    cfg["train"]["progress"] = True
    return cfg


class GalleryReads:
    """Stands in for encode_gallery's reader: counts the batches each gallery read yields,
    and with ``sigterm_next`` sends SIGTERM to this process with the next read's first batch
    (as a scheduler's SIGTERM at the start of a validation)."""

    def __init__(self, read):
        self.read = read
        self.batches: list[int] = []
        self.sigterm_next = False

    def __call__(self, *args, **kwargs):
        self.batches.append(0)
        for item in self.read(*args, **kwargs):
            if self.sigterm_next:
                self.sigterm_next = False
                os.kill(os.getpid(), signal.SIGTERM)
            self.batches[-1] += 1
            yield item


@pytest.fixture
def reads(monkeypatch):
    """``(gallery reads, the epoch of every training batch read)``."""
    gallery_reads = GalleryReads(gallery.iter_eval_batches)
    monkeypatch.setattr(gallery, "iter_eval_batches", gallery_reads)
    training_epochs: list[int] = []
    loader = Trainer._loader

    def counted_loader(trainer):
        for batch in loader(trainer):
            training_epochs.append(trainer.epoch)
            yield batch

    monkeypatch.setattr(Trainer, "_loader", counted_loader)
    return gallery_reads, training_epochs


@pytest.fixture
def children_at_stop(monkeypatch):
    """The processes alive while the trainer handles the stop (the stopped validation's
    traceback, which holds its reader, still alive)."""
    alive: list = []
    handle = Trainer._stop_during_validation

    def recording(trainer):
        alive.extend(multiprocessing.active_children())
        handle(trainer)

    monkeypatch.setattr(Trainer, "_stop_during_validation", recording)
    return alive


def records(run, kind):
    """The ``kind`` records of the run's metrics.jsonl (none before it has one)."""
    log = run / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def assert_resumed_as_never_stopped(full_run, full_report, run, report):
    assert records(run, "val") == records(full_run, "val")
    assert records(run, "test") == records(full_run, "test")
    assert report["best"] == full_report["best"] and report["test"] == full_report["test"]
    best = full_run / "checkpoints" / "best.pt", run / "checkpoints" / "best.pt"
    assert load_checkpoint(best[1])["epoch"] == load_checkpoint(best[0])["epoch"]
    a = load_checkpoint(full_run / "checkpoints" / "last.pt")
    b = load_checkpoint(run / "checkpoints" / "last.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    # the same random state: what the stopped validation drew (its DataLoader seed) was given back
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
    assert a["rng"][0]["python"] == b["rng"][0]["python"]


@pytest.mark.slow
def test_a_stop_during_validation_drops_it_and_resume_validates_again(
        tiny_benchmark, tmp_path, reads, children_at_stop, caplog):
    out, _ = tiny_benchmark
    gallery_reads, training_epochs = reads
    full_report = Trainer(config(out, 2, workers=1), tmp_path / "full").fit()
    assert gallery_reads.batches == [VAL_BATCHES] * 2 + [5]  # val, val, test (40 images)

    run = tmp_path / "cut"
    gallery_reads.batches, training_epochs[:] = [], []
    trainer = Trainer(with_bars(config(out, 2, workers=1)), run)
    before = set(multiprocessing.active_children())
    gallery_reads.sigterm_next = True  # with epoch 0's validation's first batch
    with caplog.at_level("WARNING", logger="mmgoal.engine.trainer"):
        assert trainer.fit() == {"interrupted": True, "epoch": 0, "step": 6}
    assert gallery_reads.batches == [1]  # it read one of its 4 batches and ended
    assert set(children_at_stop) <= before  # its DataLoader worker ended with it
    assert trainer.model.training  # the validation gave the model its mode back
    assert ("received SIGTERM during epoch 0's validation: dropped it and stopped at epoch 0, "
            "step 6 with a checkpoint; --resume validates again and continues") in caplog.text
    assert records(run, "val") == [] and not (run / "checkpoints" / "best.pt").exists()
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"], state["epoch_steps_done"]) == (0, 6, True)

    training_epochs[:] = []
    report = Trainer(config(out, 2, workers=1), run, resume=True).fit()
    assert training_epochs == [1] * 6  # epoch 0's batches were not read again
    assert_resumed_as_never_stopped(tmp_path / "full", full_report, run, report)


@pytest.mark.slow
def test_a_stop_during_the_validation_before_training_resumes_at_step_0(
        tiny_benchmark, tmp_path, reads, caplog):
    out, _ = tiny_benchmark
    gallery_reads, _ = reads
    cfg = config(out, 1, workers=0, eval_before_training=True)
    full_report = Trainer(cfg, tmp_path / "full").fit()

    run = tmp_path / "cut"
    gallery_reads.sigterm_next = True
    with caplog.at_level("WARNING", logger="mmgoal.engine.trainer"):
        assert Trainer(cfg, run).fit() == {"interrupted": True, "epoch": 0, "step": 0}
    assert ("received SIGTERM during the validation before training: dropped it and stopped "
            "at epoch 0, step 0 with a checkpoint") in caplog.text
    assert records(run, "val") == []
    report = Trainer(cfg, run, resume=True).fit()
    assert [r["epoch"] for r in records(run, "val")] == [-1, 0]
    assert_resumed_as_never_stopped(tmp_path / "full", full_report, run, report)


@pytest.mark.slow
def test_a_stop_during_a_validation_between_steps_resumes_with_it(tiny_benchmark, tmp_path,
                                                                  reads, caplog):
    """train.eval_every_steps: the dropped validation is the resumed run's first work."""
    out, _ = tiny_benchmark
    gallery_reads, training_epochs = reads
    cfg = config(out, 1, workers=0, eval_every_steps=2)
    full_report = Trainer(cfg, tmp_path / "full").fit()
    assert [(r["epoch"], r["step"]) for r in records(tmp_path / "full", "val")] == [
        (0, 2), (0, 4), (0, 6)]

    run = tmp_path / "cut"
    gallery_reads.sigterm_next, training_epochs[:] = True, []
    with caplog.at_level("WARNING", logger="mmgoal.engine.trainer"):
        assert Trainer(cfg, run).fit() == {"interrupted": True, "epoch": 0, "step": 2}
    assert ("received SIGTERM during step 2's validation: dropped it and stopped at epoch 0, "
            "step 2 with a checkpoint") in caplog.text
    assert load_checkpoint(run / "checkpoints" / "last.pt")["validation_due"]
    # resumed without data.val (a key a resume may change): nothing to validate
    unvalidated = shutil.copytree(run, tmp_path / "unvalidated")
    Trainer({**cfg, "data": {**cfg["data"], "val": None}}, unvalidated, resume=True).fit()
    assert records(unvalidated, "val") == [] and len(records(unvalidated, "test")) == 1
    report = Trainer(cfg, run, resume=True).fit()
    assert_resumed_as_never_stopped(tmp_path / "full", full_report, run, report)


class Killed(BaseException):
    """A process killed where it is raised (nothing after it runs, no checkpoint)."""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["validating", "after_its_record", "after_the_test_record"])
def test_a_run_killed_in_a_validation_between_steps_resumes_with_it(tiny_benchmark, tmp_path,
                                                                    monkeypatch, where):
    """train.checkpoint_every_steps writes the checkpoint before the validation it precedes:
    a SIGKILL inside it (or in the test) resumes with it, logged once."""
    from mmgoal.engine.metric_log import MetricLog

    out, _ = tiny_benchmark
    cfg = config(out, 1, workers=0, eval_every_steps=2, checkpoint_every_steps=2)
    full_report = Trainer(cfg, tmp_path / "full").fit()
    name, method = {"validating": (Trainer, "_validate_and_keep"),
                    "after_its_record": (Trainer, "_validate"),
                    "after_the_test_record": (MetricLog, "note")}[where]
    original = getattr(name, method)

    def killed(self, *args, **kwargs):
        if where == "validating" and self.step == 4:
            raise Killed
        result = original(self, *args, **kwargs)
        if where == "after_its_record" and self.step == 4 or "test metrics" in str(args):
            raise Killed
        return result

    run = tmp_path / "cut"
    monkeypatch.setattr(name, method, killed)
    with pytest.raises(Killed):
        Trainer(cfg, run).fit()
    monkeypatch.setattr(name, method, original)
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert (state["step"], state["validation_due"]) == ((6, False) if "test" in where else
                                                        (4, True))
    report = Trainer(cfg, run, resume=True).fit()
    assert_resumed_as_never_stopped(tmp_path / "full", full_report, run, report)


@pytest.mark.slow
@pytest.mark.usefixtures("stop_hook")
def test_a_stop_after_an_epochs_last_step_resumes_at_its_end(tiny_benchmark, tmp_path, reads):
    out, _ = tiny_benchmark
    _, training_epochs = reads
    full_report = Trainer(config(out, 2, workers=0), tmp_path / "full").fit()

    run = tmp_path / "cut"
    cfg = config(out, 2, workers=0)
    cfg["hooks"].append({"type": "StopAfterSteps", "steps": 6})
    assert Trainer(cfg, run).fit() == {"interrupted": True, "epoch": 0, "step": 6}
    training_epochs[:] = []
    report = Trainer(config(out, 2, workers=0), run, resume=True).fit()
    assert training_epochs == [1] * 6  # straight to epoch 0's end: its data is not read again
    assert_resumed_as_never_stopped(tmp_path / "full", full_report, run, report)
