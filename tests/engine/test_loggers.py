"""Loggers: TensorBoard and W&B receive the records of metrics.jsonl, on rank 0 only."""

import json
import math
import sys
from pathlib import Path

import pytest
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

from mmgoal.engine.hooks import Hook
from mmgoal.engine.loggers import Logger, LoggerError, WandbLogger, scalars
from mmgoal.engine.metric_log import MetricLog
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import HOOKS, LOGGERS, UnknownNameError
from mmgoal.runs.schema import with_overrides

WANDB_ENV = {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}
LOGGED = {"train": ["loss", "lr", "samples_per_s", "skipped_samples", "triplet_loss"],
          "val": ["rsum", "i2t_r1", "t2i_r10"], "test": ["rsum", "i2t_r1"]}


def wandb_history(run_dir: Path) -> list[dict]:
    """The ``wandb.log`` rows of an offline run, read from its ``.wandb`` file: a LevelDB-style
    log of ``wandb.proto.wandb_internal_pb2.Record`` messages (what ``wandb sync`` uploads) in
    32 KiB blocks, after a 7-byte ``:W&B`` header; each piece of a record has a 7-byte header
    (crc32, length, kind: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = run_dir.glob("*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    rows, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        piece, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            record = Record.FromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def logged_run(tiny_benchmark, tmp_path_factory):
    """One epoch of 6 steps, logged every step to TensorBoard and to an offline W&B run."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out, _ = tiny_benchmark
    run = tmp_path_factory.mktemp("logged") / "run"
    cfg = tiny_config(out, epochs=1, log_every=1)
    cfg["loggers"] = [{"type": "TensorBoardLogger"},
                      {"type": "WandbLogger", "mode": "offline", "project": "test",
                       "tags": ["tiny"]}]
    with pytest.MonkeyPatch.context() as env:
        for name, value in WANDB_ENV.items():
            env.setenv(name, value)
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(run.parent / name.lower()))
        Trainer(cfg, run).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, records


def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Tag -> (step, value) of the metrics.jsonl records, for the keys of LOGGED."""
    return {f"{kind}/{key}": [(r["step"], r[key]) for r in records if r["type"] == kind]
            for kind, keys in LOGGED.items() for key in keys}


@pytest.mark.slow
def test_tensorboard_holds_the_values_of_metrics_jsonl(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, records = logged_run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/rsum", "test/rsum"} <= set(tags)
    assert not any(tag.endswith(("/step", "/epoch", "/type")) for tag in tags)
    expected = expected_scalars(records)
    assert [step for step, _ in expected["train/loss"]] == [1, 2, 3, 4, 5, 6]
    for tag, points in expected.items():
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        assert [step for step, _ in logged] == [step for step, _ in points], tag
        # event files hold float32
        assert [value for _, value in logged] == pytest.approx(
            [value for _, value in points], rel=1e-6), tag
    (config,) = events.Tensors("config/text_summary")
    assert "TensorBoardLogger" in config.tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_values_and_the_config(logged_run):
    run, records = logged_run
    (offline,) = (run / "wandb").glob("offline-run-*")
    run_id = (run / "wandb_id").read_text().strip()
    assert offline.name.endswith(run_id)
    history = wandb_history(offline)
    for tag, points in expected_scalars(records).items():
        logged = [(row["_step"], row[tag]) for row in history if tag in row]
        assert logged == points, tag
    # val and test rows join the train row of their step
    assert history[-1]["_step"] == 6 and {"train/loss", "val/rsum", "test/rsum"} <= set(
        history[-1])


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    """Killed at step 5 after a checkpoint at step 3: steps 4 and 5 are trained again."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for start, steps, scale in ((0, range(1, 6), 1.0), (3, range(4, 7), 10.0)):
        tensorboard = LOGGERS.build({"type": "TensorBoardLogger"})
        tensorboard.open(tmp_path, {"train": {"epochs": 1}}, step=start)
        for step in steps:
            tensorboard.log({"type": "train", "epoch": 0, "step": step, "loss": step * scale})
        tensorboard.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert [e.step for e in events.Tensors("config/text_summary")] == [0, 3]


def test_a_resumed_wandb_run_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in WANDB_ENV.items():
        monkeypatch.setenv(name, value)
    ids = []
    for _ in range(2):
        wandb_logger = LOGGERS.build({"type": "WandbLogger", "mode": "offline"})
        wandb_logger.open(tmp_path, {"train": {"epochs": 1}}, step=0)
        ids.append(wandb_logger.run.id)
        wandb_logger.close()
    assert ids[0] == ids[1] == (tmp_path / WandbLogger.ID_FILE).read_text().strip()


def test_wandb_without_a_login_says_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in WANDB_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("HOME", "WANDB_CONFIG_DIR", "NETRC"):  # no stored key either
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    wandb_logger = LOGGERS.build({"type": "WandbLogger", "mode": "online"})
    with pytest.raises(LoggerError, match=r"WandbLogger could not start a W&B run \(.*\); log in "
                                          r"with `wandb login`, or set mode: offline"):
        wandb_logger.open(tmp_path, {}, step=0)
    wandb_logger.close()  # nothing started: nothing to close


def test_scalars_are_the_finite_numbers_by_record_type():
    record = {"type": "train", "step": 7, "epoch": 1, "loss": float("nan"), "lr": 1e-3,
              "skipped_samples": 2, "nonfinite": True, "note": "x", "gap": None,
              "rsum": math.inf}
    assert scalars(record) == {"train/lr": 1e-3, "train/skipped_samples": 2.0}


class RecordingLogger(Logger):
    """Remembers what the trainer called."""

    calls: list = []

    def open(self, work_dir, config, step):
        self.calls.append(("open", Path(work_dir).name, step))

    def log_scalars(self, values, step):
        self.calls.append(("log", step, sorted(values)))

    def close(self):
        self.calls.append(("close",))


class FailAtStep(Hook):
    def after_step(self, trainer, outputs):
        if trainer.step == 2:
            raise RuntimeError("a failure in the second step")


@pytest.fixture
def recording():
    LOGGERS.register("RecordingLogger", force=True)(RecordingLogger)
    HOOKS.register("FailAtStep", force=True)(FailAtStep)
    RecordingLogger.calls = []
    yield RecordingLogger.calls
    LOGGERS._entries.pop("RecordingLogger")
    HOOKS._entries.pop("FailAtStep")


def test_loggers_are_closed_when_a_run_fails(tiny_benchmark, tmp_path, recording):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, log_every=1)
    cfg["hooks"] = [{"type": "FailAtStep"}]
    cfg["loggers"] = [{"type": "RecordingLogger"}]
    with pytest.raises(RuntimeError, match="a failure in the second step"):
        Trainer(cfg, tmp_path / "run").fit()
    assert [call[0] for call in recording] == ["open", "log", "close"]
    assert recording[0] == ("open", "run", 0) and recording[1][1] == 1
    assert "train/loss" in recording[1][2]


def test_only_rank_0_logs(tmp_path):
    sink = RecordingLogger()
    RecordingLogger.calls = []
    log = MetricLog(tmp_path / "metrics.jsonl", enabled=False, loggers=[sink])
    log.open({}, step=0)
    log.write({"type": "train", "step": 1, "loss": 0.5})
    log.close()
    assert log.loggers == [] and RecordingLogger.calls == []
    assert not (tmp_path / "metrics.jsonl").exists()


def test_config_mistakes_in_loggers_are_reported(tiny_benchmark, tmp_path, monkeypatch):
    out, _ = tiny_benchmark
    cfg = tiny_config(out)
    with pytest.raises(UnknownNameError, match=r"'TensorBordLogger' is not in the logger "
                                               r"registry. Did you mean 'TensorBoardLogger'"):
        with_overrides({**cfg, "loggers": [{"type": "TensorBordLogger"}]})
    with pytest.raises(ValueError, match=r"loggers.0: logger 'TensorBoardLogger' got unknown "
                                         r"config key\(s\) 'logdir' \(did you mean 'log_dir'\?\); "
                                         r"it accepts: log_dir, flush_secs"):
        with_overrides({**cfg, "loggers": [{"type": "TensorBoardLogger", "logdir": "tb"}]})
    # --cfg-options: a whole list, or an option of an entry
    resolved = with_overrides(cfg, ["loggers=[{'type': 'TensorBoardLogger'}]",
                                    "loggers.0.flush_secs=5"])
    assert resolved["loggers"] == [{"type": "TensorBoardLogger", "flush_secs": 5}]
    with pytest.raises(ValueError, match=r"no key 'flush_sec' under loggers.0. Did you mean "
                                         r"'flush_secs'"):
        with_overrides(resolved, ["loggers.0.flush_sec=5"])
    # a bad value or a missing package stops the trainer before anything is built
    with pytest.raises(ValueError, match=r"logger 'WandbLogger': mode must be online, offline, "
                                         r"disabled or null, got 'ofline' \(did you mean "
                                         r"offline\?\)"):
        Trainer({**cfg, "loggers": [{"type": "WandbLogger", "mode": "ofline"}]}, tmp_path / "a")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"loggers: \[\{type: TensorBoardLogger\}\] needs "
                                          r"tensorboard.*pip install 'mmgoal\[tracking\]'"):
        Trainer({**cfg, "loggers": [{"type": "TensorBoardLogger"}]}, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_log_dir_that_is_a_file_stops_the_run_before_it_writes_anything(tiny_benchmark,
                                                                         tmp_path):
    out, _ = tiny_benchmark
    run = tmp_path / "run"
    run.mkdir()
    (run / "curves").write_text("a file of the user's")
    cfg = {**tiny_config(out), "loggers": [{"type": "TensorBoardLogger", "log_dir": "curves"}]}
    with pytest.raises(LoggerError, match=rf"TensorBoardLogger log_dir {run / 'curves'} is a "
                                          rf"file, not a folder; give another log_dir"):
        Trainer(cfg, run)
    assert not (run / "config.yaml").exists()  # the folder holds no half-started run
    assert (run / "curves").read_text() == "a file of the user's"
