import json
import math
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from fault_hooks import InfRunningVariances

from mmgoal.engine.hooks import Hook
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import HOOKS, OBJECTIVES
from mmgoal.runs.checkpoint import (
    NonFiniteStateError,
    load_checkpoint,
    nonfinite_tensors,
    save_checkpoint,
)
from mmgoal.runs.schema import resolve_config


def tiny_config(out, epochs=2, **train):
    return {
        "model": {
            "type": "DualEncoder", "embed_dim": 16,
            "image_encoder": {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                              "model_kwargs": {"widths": [8, 16]}},
            "text_encoder": {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 16,
                             "bidirectional": True, "pooling": "mean"},
        },
        "objective": {"type": "TripletLoss", "margin": 0.2, "max_violation": True},
        "optimizer": {"type": "AdamW", "lr": 3e-3},
        "schedule": {"type": "cosine", "warmup_steps": 2},
        "data": {
            "image_size": 32, "num_workers": 0,
            "tokenizer": {"type": "WordTokenizer"},
            "train": {"type": "ShardDataset", "shards": str(out / "train-{000000..000002}.tar"),
                      "batch_size": 16, "shuffle_buffer": 32},
            "val": {"shards": str(out / "val-000000.tar")},
            "test": {"shards": str(out / "test-{000000..000001}.tar")},
        },
        "train": {"epochs": epochs, "progress": False, "log_every": 2, **train},
        "hooks": [{"type": "ObjectiveWarmup", "epochs": 1,
                   "attributes": {"max_violation": False}}],
    }


class StopAfterSteps(Hook):
    """Acts as if SIGTERM arrived after ``steps`` steps."""

    def __init__(self, steps):
        self.steps = steps

    def after_step(self, trainer, outputs):
        if trainer.step == self.steps:
            trainer.signals.handle(signal.SIGTERM, None)


@pytest.fixture
def stop_hook():
    HOOKS.register("StopAfterSteps", force=True)(StopAfterSteps)
    yield
    HOOKS._entries.pop("StopAfterSteps")


class RecordEpochWeights(Hook):
    """Keeps a copy of the model's weights at each epoch's end (what its checkpoint will hold)
    and the epoch checkpoints the folder holds then."""

    def __init__(self):
        self.weights, self.kept = {}, {}

    def after_epoch(self, trainer, metrics):
        self.weights[trainer.epoch] = {k: v.detach().clone()
                                       for k, v in trainer.model.state_dict().items()}
        self.kept[trainer.epoch] = sorted(p.name for p in trainer.checkpoint_dir.iterdir()
                                          if p.name.startswith("epoch_"))


@pytest.fixture
def record_hook():
    HOOKS.register("RecordEpochWeights", force=True)(RecordEpochWeights)
    yield
    HOOKS._entries.pop("RecordEpochWeights")


@pytest.fixture
def inf_hook():
    HOOKS.register("InfRunningVariances", force=True)(InfRunningVariances)
    yield
    HOOKS._entries.pop("InfRunningVariances")


def strict_json(line: str) -> dict:
    """``json.loads`` that rejects the NaN/Infinity tokens JSON does not have."""
    def reject(token):
        raise ValueError(f"{token} is not JSON")

    return json.loads(line, parse_constant=reject)


def test_a_resume_that_splits_the_batch_otherwise_trains_the_epochs_steps(tiny_benchmark,
                                                                           tmp_path, stop_hook):
    """data.train.batch_size and train.accumulate_steps may change on resume (their product
    may not): the epoch's steps done are counted in the new micro-batches."""
    out, _ = tiny_benchmark
    cfg = tiny_config(out, accumulate_steps=2)
    cfg["data"]["train"]["batch_size"] = 8
    cfg["hooks"].append({"type": "StopAfterSteps", "steps": 3})
    assert Trainer(cfg, tmp_path / "run").fit()["step"] == 3
    cfg = tiny_config(out)  # 16 pairs a step in one micro-batch
    resumed = Trainer(cfg, tmp_path / "run", resume=True)
    assert (resumed.step, resumed.batch_in_epoch) == (3, 3)
    assert resumed.fit()["steps"] == 12  # 6 an epoch, as the run started


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [3, 8])
def test_interrupted_run_resumes_to_the_same_weights(tiny_benchmark, tmp_path, stop_hook, stop_at):
    out, _ = tiny_benchmark
    cfg = tiny_config(out)
    full = Trainer(cfg, tmp_path / "full").fit()

    interrupted_cfg = tiny_config(out)
    interrupted_cfg["hooks"].append({"type": "StopAfterSteps", "steps": stop_at})
    report = Trainer(interrupted_cfg, tmp_path / "cut").fit()
    assert report == {"interrupted": True, "epoch": stop_at // 6, "step": stop_at}
    assert not (tmp_path / "cut" / "report.json").exists()
    cut_seconds = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")["train_seconds"]
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as log:  # a step logged after the
        log.write(json.dumps({"type": "train", "step": 99}) + "\n")  # checkpoint, then killed
    resumed = Trainer(cfg, tmp_path / "cut", resume=True)
    assert resumed.step == stop_at and resumed.batch_in_epoch == stop_at % 6
    resumed_report = resumed.fit()

    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 12
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert resumed_report["test"] == full["test"]
    # the log holds every step once, the run's own config is kept, the time adds up
    steps = [strict_json(line)["step"] for line in open(tmp_path / "cut" / "metrics.jsonl")
             if strict_json(line)["type"] == "train"]
    assert steps == [2, 4, 6, 8, 10, 12]
    kept = yaml.safe_load((tmp_path / "cut" / "config.yaml").read_text())
    assert {"type": "StopAfterSteps", "steps": stop_at} in kept["hooks"]
    assert resumed_report["train_seconds"] > cut_seconds > 0  # the first segment counts


@pytest.mark.slow
def test_lam_auto_is_logged_every_step_and_resumes_exactly(tiny_benchmark, tmp_path, stop_hook):
    out, _ = tiny_benchmark

    def config(*hooks):
        cfg = tiny_config(out, epochs=1, log_every=1)
        cfg["objective"] = {"type": "GoalObjective", "triplet": "cir",
                            "pair": {"type": "sig_ms", "lam": "auto", "lam_momentum": 0.5}}
        cfg["hooks"] = list(hooks)
        return cfg

    def lams(run):
        return [r["lam"] for r in map(strict_json, open(run / "metrics.jsonl"))
                if r["type"] == "train"]

    Trainer(config(), tmp_path / "full").fit()
    Trainer(config({"type": "StopAfterSteps", "steps": 3}), tmp_path / "cut").fit()
    Trainer(config(), tmp_path / "cut", resume=True).fit()
    full, cut = lams(tmp_path / "full"), lams(tmp_path / "cut")
    assert len(full) == 6 and full[0] == 0.5 and len(set(full)) == 6  # lam_init, then moving
    assert cut == full
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")
    assert a["objective"]["adaptive_lam.updates"] == 6
    assert a["objective"]["adaptive_lam.lam"] == b["objective"]["adaptive_lam.lam"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


@pytest.mark.slow
def test_run_directory_contents(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    report = Trainer(tiny_config(out), tmp_path / "run").fit()
    run = tmp_path / "run"
    saved_config = yaml.safe_load((run / "config.yaml").read_text())
    assert saved_config == resolve_config(tiny_config(out))
    # every default written out, the given values kept
    assert saved_config["train"]["accumulate_steps"] == 1 and saved_config["train"]["epochs"] == 2
    assert saved_config["data"]["val"]["folds"] == 1
    assert saved_config["strategy"] == {"type": "torch"}
    saved = json.loads((run / "report.json").read_text())
    assert saved["test"] == report["test"]
    assert {"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "i2t_medr",
            "t2i_medr", "i2t_meanr", "t2i_meanr", "rsum"} <= set(saved["test"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds.count("val") == 2 and kinds.count("test") == 1 and kinds.count("train") == 6
    assert all("loss" in r and "lr" in r for r in records if r["type"] == "train")
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    val_rsums = [r["rsum"] for r in records if r["type"] == "val"]
    assert best["metrics"]["rsum"] == max(val_rsums)
    assert report["best"]["epoch"] == val_rsums.index(max(val_rsums))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_keep_epochs_keeps_the_last_epochs_and_resume_takes_the_newest_by_progress(
        tiny_benchmark, tmp_path, record_hook, stop_hook, caplog):
    import logging
    import shutil

    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=3, keep_epochs=2, samples_per_epoch=16)  # 2 steps an epoch
    cfg["data"]["train"]["batch_size"], cfg["data"]["test"] = 8, None
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    theirs = ["epoch_00.pt", "epoch_1.pt.bak", "my_epoch_0.pt"]  # not names mmgoal writes
    for name in theirs:
        (checkpoints / name).write_text("mine")
    trainer = Trainer({**cfg, "hooks": [*cfg["hooks"], {"type": "RecordEpochWeights"}]}, run)
    trainer.fit()
    recorded = trainer.hooks[-1]
    assert recorded.kept[1] == ["epoch_0.pt", "epoch_00.pt", "epoch_1.pt.bak"]  # written...
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(  # ...and deleted at epoch 2
        ["best.pt", "last.pt", "epoch_1.pt", "epoch_2.pt", *theirs])
    assert all((checkpoints / name).read_text() == "mine" for name in theirs)
    for epoch in (1, 2):  # epoch_<E>.pt: the end of epoch E (0-based), resumable
        kept = load_checkpoint(checkpoints / f"epoch_{epoch}.pt")
        assert kept["epoch"] == epoch + 1 and kept["step"] == 2 * (epoch + 1)
        assert same_weights(kept["model"], recorded.weights[epoch])
        assert "optimizer" in kept and "rng" in kept
    assert not same_weights(recorded.weights[1], recorded.weights[2])
    assert (checkpoints / "last.pt").read_bytes() == (checkpoints / "epoch_2.pt").read_bytes()

    # a last.pt newer than the epoch checkpoints (a step into epoch 3) is the one resumed
    longer = {**cfg, "train": {**cfg["train"], "epochs": 4}}
    stopped = {**longer, "hooks": [*longer["hooks"], {"type": "StopAfterSteps", "steps": 7}]}
    assert Trainer(stopped, run, resume=True).fit()["interrupted"]
    assert Trainer(longer, run, resume=True).step == 7
    # a last.pt older than the newest epoch checkpoint, though written after it, is not
    shutil.copyfile(checkpoints / "epoch_1.pt", checkpoints / "last.pt")
    with caplog.at_level(logging.INFO):
        resumed = Trainer(longer, run, resume=True)
    assert (resumed.epoch, resumed.step) == (3, 6)
    assert same_weights(resumed.model.state_dict(), recorded.weights[2])
    assert "epoch_2.pt (the end of epoch 2, step 6) is the newest checkpoint; last.pt is " \
           "older (epoch 2, step 4)" in caplog.text
    # without last.pt, the newest epoch checkpoint continues the run
    (checkpoints / "last.pt").unlink()
    resumed = Trainer(longer, run, resume=True)
    assert (resumed.epoch, resumed.step) == (3, 6)
    report = resumed.fit()
    assert (report["epochs"], report["steps"]) == (4, 8)
    assert sorted(p.name for p in checkpoints.glob("epoch_?.pt")) == ["epoch_2.pt", "epoch_3.pt"]

    # what a checkpoint holds is its progress, not its name: a copy of epoch_2.pt named
    # epoch_9.pt neither rolls the run back nor outlives the real epoch checkpoints
    shutil.copyfile(checkpoints / "epoch_2.pt", checkpoints / "epoch_9.pt")
    # killed while copying last.pt to epoch_3.pt: its temporary file (of a dead process) is
    # removed when the run resumes, and the lost copy said
    gone = subprocess.Popen(["true"])
    gone.wait()
    (checkpoints / "epoch_3.pt").rename(checkpoints / f".epoch_3.pt.tmp-{gone.pid}")
    five = {**cfg, "train": {**cfg["train"], "epochs": 5}}
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resumed = Trainer(five, run, resume=True)
        assert (resumed.epoch, resumed.step) == (4, 8)
        resumed.fit()
    assert sorted(p.name for p in checkpoints.glob("epoch_?.pt")) == ["epoch_2.pt", "epoch_4.pt"]
    assert not list(checkpoints.glob(".*.tmp-*"))
    assert (f"{checkpoints / 'epoch_9.pt'} holds the end of epoch 2 (step 6), not of epoch 9 "
            f"as its name says") in caplog.text
    assert (f"train.keep_epochs: epoch_3.pt was being written when the run was stopped, so "
            f"the end of that epoch is not kept (its unfinished copy, .epoch_3.pt.tmp-"
            f"{gone.pid}, is removed)") in caplog.text


def test_keep_epochs_is_refused_where_the_strategy_keeps_one_checkpoint(tiny_benchmark,
                                                                        tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, keep_epochs=2)
    cfg["strategy"] = {"type": "deepspeed"}
    with pytest.raises(ValueError, match="train.keep_epochs: 2 keeps epoch checkpoints of the "
                                         "torch and accelerate strategies .copies of last.pt.; "
                                         "DeepSpeedStrategy keeps its newest checkpoint only"):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_nonfinite_losses_are_skipped_then_stop_the_run(tiny_benchmark, tmp_path):
    @OBJECTIVES.register("NaNObjective", force=True)
    class NaNObjective(torch.nn.Module):
        def forward(self, inputs):
            return {"nan_loss": inputs.scores.sum() * float("nan")}

    out, _ = tiny_benchmark
    cfg = tiny_config(out, max_nonfinite_steps=3)
    cfg["objective"] = {"type": "NaNObjective"}
    cfg["hooks"] = []
    trainer = Trainer(cfg, tmp_path / "nan")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        with pytest.raises(FloatingPointError, match="3 non-finite losses in a row"):
            trainer.fit()
    finally:
        OBJECTIVES._entries.pop("NaNObjective")
    after = trainer.model.state_dict()
    # skipped steps do not touch the weights (BN running stats aside)
    assert all(torch.equal(before[k], after[k]) for k in before if "running" not in k
               and "num_batches" not in k)
    # the NaN loss of the logged step 2 is null: every line is strict JSON
    records = [strict_json(line) for line in (tmp_path / "nan" / "metrics.jsonl").open()]
    assert [(r["step"], r["loss"], r["nan_loss"]) for r in records] == [(2, None, None)]


def test_nonfinite_state_is_never_checkpointed_nor_evaluated(tiny_benchmark, tmp_path,
                                                             inf_hook):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, checkpoint_every_steps=2)
    cfg["hooks"] = [{"type": "InfRunningVariances", "steps": 3}]
    trainer = Trainer(cfg, tmp_path / "steps")
    with pytest.raises(NonFiniteStateError, match=r"NaN or inf in 4 tensors \(image_encoder\.\S+"
                       r"running_var, .* and 1 more\) at step 4 .*the last good checkpoint in "
                       r"\S+checkpoints is intact: lower the learning rate"):
        trainer.fit()
    last = load_checkpoint(tmp_path / "steps" / "checkpoints" / "last.pt")
    assert last["step"] == 2 and nonfinite_tensors(last["model"]) == []
    with pytest.raises(NonFiniteStateError):
        trainer.save_weights("best.pt")
    assert sorted(p.name for p in (tmp_path / "steps" / "checkpoints").iterdir()) == ["last.pt"]
    # at the end of the epoch (6 steps): stopped before validation scores NaN
    cfg = tiny_config(out, epochs=1)
    cfg["hooks"] = [{"type": "InfRunningVariances", "steps": 6}]
    with pytest.raises(NonFiniteStateError, match="at step 6 .*no checkpoint was written before"):
        Trainer(cfg, tmp_path / "epoch").fit()
    assert not any((tmp_path / "epoch" / "checkpoints").iterdir())
    assert [r["type"] for r in map(strict_json, (tmp_path / "epoch" / "metrics.jsonl").open())
            ] == ["train"] * 3


def test_a_skipped_step_that_left_inf_behind_stops_the_run_at_once(tiny_benchmark, tmp_path,
                                                                   inf_hook):
    @OBJECTIVES.register("NaNObjective", force=True)
    class NaNObjective(torch.nn.Module):
        def forward(self, inputs):
            return {"nan_loss": inputs.scores.sum() * float("nan")}

    out, _ = tiny_benchmark
    cfg = tiny_config(out, max_nonfinite_steps=5)
    cfg["objective"] = {"type": "NaNObjective"}
    cfg["hooks"] = [{"type": "InfRunningVariances", "steps": 1}]
    try:
        with pytest.raises(NonFiniteStateError, match="in 4 tensors .* at step 1 "):
            Trainer(cfg, tmp_path / "nan").fit()
    finally:
        OBJECTIVES._entries.pop("NaNObjective")


def test_nonfinite_gradients_under_a_finite_loss_are_skipped_too(tiny_benchmark, tmp_path):
    class NaNGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    @OBJECTIVES.register("NaNGradientObjective", force=True)
    class NaNGradientObjective(torch.nn.Module):
        def forward(self, inputs):
            return {"bad_loss": NaNGradient.apply(inputs.scores).sum()}

    out, _ = tiny_benchmark
    cfg = tiny_config(out, max_nonfinite_steps=2)
    cfg["objective"] = {"type": "NaNGradientObjective"}
    cfg["hooks"] = []
    trainer = Trainer(cfg, tmp_path / "nan_grad")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        with pytest.raises(FloatingPointError, match="2 non-finite losses in a row"):
            trainer.fit()
    finally:
        OBJECTIVES._entries.pop("NaNGradientObjective")
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "running" not in k
               and "num_batches" not in k)


def test_config_mistakes_are_reported(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_config(out)
    cfg["trian"] = {}
    with pytest.raises(ValueError, match="unknown key.*'trian' .did you mean 'train'.* in 'the top "
                                         "level'"):
        Trainer(cfg, tmp_path / "a")
    cfg = tiny_config(out, epoch=3)
    with pytest.raises(ValueError, match="unknown key.*epoch.*in 'train'"):
        Trainer(cfg, tmp_path / "b")
    cfg = tiny_config(out)
    cfg["schedule"]["warmup"] = 3
    with pytest.raises(ValueError, match="schedule 'cosine' got unknown config key.*'warmup' "
                                         ".did you mean 'warmup_steps'"):
        Trainer(cfg, tmp_path / "d")
    cfg = tiny_config(out)
    cfg["data"]["val"]["fold"] = 5
    with pytest.raises(ValueError, match="unknown key.*'fold' .*in 'data.val'"):
        Trainer(cfg, tmp_path / "e")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(tiny_config(out), tmp_path / "c", resume=True)


def test_checkpoints_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1, "w": torch.ones(2)}, path)

    def dies_midway(obj, target):
        Path(target).write_bytes(b"partial")
        raise KeyboardInterrupt  # killed while saving

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"step": 2, "w": torch.zeros(2)}, path)
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot be read"):
        load_checkpoint(tmp_path / "bad.pt")


@pytest.mark.slow
@pytest.mark.parametrize("triplet,pair", [(t, p) for t in ("con", "nca", "cir")
                                          for p in ("con", "lin", "sig", "lin_ms", "sig_ms")])
def test_goal_quickstart_trains_any_combination(tiny_benchmark, tmp_path, triplet, pair):
    from pathlib import Path

    from mmgoal.config import load_config

    out, _ = tiny_benchmark
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "goal" / "quickstart_goal.yaml", [
        f"objective.triplet={triplet}", f"objective.pair={pair}",
        f"data.train.shards={out}/train-{{000000..000002}}.tar", "data.train.batch_size=16",
        f"data.val.shards={out}/val-000000.tar",
        f"data.test.shards={out}/test-{{000000..000001}}.tar",
        "data.image_size=32", "data.num_workers=0", "train.epochs=2", "hooks.0.epochs=1",
        "model.embed_dim=16", "model.image_encoder.model_kwargs.widths=[8, 16]",
        "model.text_encoder.hidden_size=16", "model.text_encoder.word_dim=8",
    ])
    cfg["train"]["progress"] = False
    cfg["train"]["log_every"] = 1
    trainer = Trainer(cfg, tmp_path / "run")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    report = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    goal_steps = [r for r in records if r["type"] == "train" and "goal_loss" in r]
    assert len(goal_steps) == 6  # epoch 0 is the warm-up with the triplet loss
    assert all(r["epoch"] == 1 for r in goal_steps)
    assert all(math.isfinite(r["goal_loss"]) for r in goal_steps)
    after = trainer.model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert report["test"]["rsum"] > 0


@pytest.mark.slow
def test_eval_before_training_logs_the_loaded_model_once_as_epoch_minus_one(
        tiny_benchmark, tmp_path, stop_hook, caplog):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, eval_before_training=True)
    cfg["hooks"].append({"type": "StopAfterSteps", "steps": 2})
    # group 0 (the image encoder's) is slowed: the logged lr is still the base group's
    cfg["optimizer"].update(paramwise={"image_encoder": {"lr_mult": 0.5}},
                            no_decay=["bias", "norm"])
    trainer = Trainer(cfg, tmp_path / "run")
    initial = trainer.evaluate("val")
    with caplog.at_level("INFO", logger="mmgoal.engine.trainer"):
        assert trainer.fit()["interrupted"]
    assert "epoch -1 val (before training): " in caplog.text
    resumed = Trainer(cfg, tmp_path / "run", resume=True)
    report = resumed.fit()  # from step 2: not evaluated again
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[0] == {"type": "val", "epoch": -1, "step": 0, **initial}
    assert [(r["epoch"], r["step"]) for r in records if r["type"] == "val"] == [(-1, 0), (0, 6)]
    # best.pt is about trained epochs: the only one, whatever the loaded model scored
    epoch_0 = records[-2]
    assert report["best"] == {"rsum": epoch_0["rsum"], "epoch": 0}
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")["epoch"] == 0
    assert [r["lr"] for r in records if r["type"] == "train"] == pytest.approx(
        [3e-3 * resumed.schedule.factor(r["step"] - 1) for r in records if r["type"] == "train"])


def strict_loads(text: str):
    """``json.loads`` as strict parsers read JSON: no NaN, no Infinity."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_run_without_validation_writes_json_every_parser_reads(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1)
    cfg["data"]["val"] = None
    run = tmp_path / "run"
    report = Trainer(cfg, run).fit()
    assert report["best"] == {"rsum": -math.inf, "epoch": -1}  # in Python: no epoch validated
    saved = strict_loads((run / "report.json").read_text())
    assert saved["best"] == {"rsum": None, "epoch": -1}
    assert saved["test"]["rsum"] == report["test"]["rsum"]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        strict_loads(line)


def test_a_finished_run_resumed_says_there_is_nothing_to_train(tiny_quickstart_run, tmp_path,
                                                               caplog):
    import logging
    import shutil

    source, _ = tiny_quickstart_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    cfg = resolve_config(yaml.safe_load((run / "config.yaml").read_text()))
    metrics = (run / "metrics.jsonl").read_text()
    with caplog.at_level(logging.WARNING):
        report = Trainer(cfg, run, resume=True).fit()
    assert "the run has trained 1 epoch(s) and train.epochs is 1: nothing is left to train " \
           "(train on with --cfg-options train.epochs=N, N > 1); its report stands" in caplog.text
    assert report == json.loads((run / "report.json").read_text())
    assert (run / "metrics.jsonl").read_text() == metrics  # no second test record
    cfg["train"]["epochs"] = 0  # below the epochs reached: the same, said the same way
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Trainer(cfg, run, resume=True).fit()
    assert "the run has trained 1 epoch(s) and train.epochs is 0" in caplog.text


def test_a_run_writes_a_text_log_with_a_line_every_log_every_steps(tiny_quickstart_run):
    import re

    run, _ = tiny_quickstart_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    text = (run / "train.log").read_text()
    steps = re.findall(r"INFO epoch (\d+) step (\d+)/(\d+) loss ([\d.]+) lr ([\d.e+-]+) "
                       r"samples/s ([\d.]+) eta (\d+:\d\d:\d\d)\n", text)
    assert [(int(e), int(s)) for e, s, *_ in steps] == [(r["epoch"], r["step"]) for r in train]
    assert {int(total) for _, _, total, *_ in steps} == {train[-1]["total_steps"]}
    assert [float(loss) for _, _, _, loss, *_ in steps] == pytest.approx(
        [r["loss"] for r in train], abs=1e-4)
    assert steps[-1][-1] == "0:00:00"  # the last step: nothing left
    assert "INFO epoch 0 val: " in text  # the run's own log lines, as open_clip's out.log
