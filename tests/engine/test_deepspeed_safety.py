"""A pickle planted in a DeepSpeed checkpoint runs no code on resume (issue 17).

DeepSpeed reads its own files with ``torch.load(weights_only=False)``; the
strategy routes every load weights-only, on both resume paths: the same layout
(DeepSpeed's checkpoint engine) and another ZeRO stage (the universal converter).
Both paths also restore the module's state outside its parameters (here the
running ``lam`` of ``lam: auto``), which DeepSpeed's universal loader leaves out.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from payloads import WritesMarker
from test_distributed import launch, ok, write_config

from mmgoal.engine.strategies.deepspeed import weights_only_loading
from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.runs.run_dir import LATEST, read_pointer

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_deepspeed_loads_are_weights_only_with_its_own_classes_allowed(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    marker = tmp_path / "code-ran"
    # fp16's loss scaler, as ZeRO pickles it into its optimizer states (fp16 trains on GPUs)
    torch.save({"loss_scaler": DynamicLossScaler(2.0**16, scale_window=1000, min_scale=1,
                                                 delayed_shift=2, consecutive_hysteresis=False)},
               tmp_path / "optim_states.pt")
    torch.save({"payload": WritesMarker(marker)}, tmp_path / "planted.pt")
    with weights_only_loading():
        # weights_only=False is what DeepSpeed asks for
        scaler = torch.load(tmp_path / "optim_states.pt", weights_only=False)["loss_scaler"]
        with pytest.raises(ValueError, match=r"planted.pt holds something other than tensors "
                                             r"and plain data \(builtins.exec\)"):
            torch.load(tmp_path / "planted.pt", weights_only=False)
    assert (scaler.cur_scale, scaler.scale_window, scaler.dtype) == (2.0**16, 1000, torch.half)
    assert not marker.exists()
    assert torch.load is torch.serialization.load  # the routing ends with the block


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-epoch (4-step) single-process DeepSpeed ZeRO-2 run on CPU."""
    from mmgoal.data.synthetic import write_benchmark

    root = tmp_path_factory.mktemp("deepspeed_safety")
    write_benchmark(root / "data", {"train": 32, "val": 16, "test": 16}, seed=3, image_size=32,
                    shard_size=8, progress=False)
    config = write_config(root / "run.yaml", root / "data", 8,
                          strategy={"type": "deepspeed", "zero_stage": 2},
                          objective={"_delete_": True, "type": "GoalObjective", "triplet": "cir",
                                     "pair": {"type": "sig_ms", "lam": "auto"}},
                          train={"epochs": 1, "log_every": 1, "progress": False})
    ok(launch("single", config, root / "run"))
    return root, config


def checkpointed_lam(run: Path) -> tuple[int, int, float]:
    """(epoch, step, the running lam) of the run's latest DeepSpeed checkpoint."""
    checkpoints = run / "checkpoints" / "deepspeed"
    folder = checkpoints / read_pointer(checkpoints / LATEST)
    state = load_checkpoint(folder / "trainer_state.pt")
    module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    return state["epoch"], state["step"], float(module["objective.adaptive_lam.lam"])


def resumes_with_its_lam(run: Path, config: Path) -> str:
    """Resume ``run`` for one more epoch; the first step after the checkpoint logs the lam it
    used: the checkpoint's (float32 in the log). Returns the resumed run's stderr."""
    epoch, step, lam = checkpointed_lam(run)
    result = ok(launch("single", config, run, "--resume", "--cfg-options",
                       f"train.epochs={epoch + 1}"))
    logged = {r["step"]: r.get("lam") for r in map(json.loads, open(run / "metrics.jsonl"))
              if r["type"] == "train"}
    assert logged[step + 1] == float(torch.tensor(lam, dtype=torch.float32)) != 0.5
    return result.stderr


def test_a_legitimate_checkpoint_resumes_weights_only(trained):
    root, config = trained
    run = root / "run"
    assert read_pointer(run / "checkpoints" / "deepspeed" / LATEST) == "epoch0001-step000000004"
    resumes_with_its_lam(run, config)
    assert read_pointer(run / "checkpoints" / "deepspeed" / LATEST) == "epoch0002-step000000008"


def test_another_zero_stage_resumes_with_the_state_outside_the_parameters(trained, tmp_path):
    root, config = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run, ignore=shutil.ignore_patterns("*-universal"))
    checkpoints = run / "checkpoints" / "deepspeed"
    trainer_state = checkpoints / read_pointer(checkpoints / LATEST) / "trainer_state.pt"
    save_checkpoint({**load_checkpoint(trainer_state), "zero_stage": 1}, trainer_state)
    assert "universal checkpoint" in resumes_with_its_lam(run, config)


@pytest.mark.parametrize("written_by_zero_stage", [2, 1], ids=["same-layout", "universal"])
def test_a_planted_pickle_is_refused_and_never_runs(trained, tmp_path, written_by_zero_stage):
    root, config = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run, ignore=shutil.ignore_patterns("*-universal"))
    tag = read_pointer(run / "checkpoints" / "deepspeed" / LATEST)
    states = run / "checkpoints" / "deepspeed" / tag / "mp_rank_00_model_states.pt"
    # A checkpoint of another ZeRO stage than the run's resumes through DeepSpeed's converter.
    trainer_state = states.with_name("trainer_state.pt")
    save_checkpoint({**load_checkpoint(trainer_state), "zero_stage": written_by_zero_stage},
                    trainer_state)
    marker = tmp_path / "code-ran"
    planted = torch.load(states, weights_only=True)
    planted["payload"] = WritesMarker(marker)
    torch.save(planted, states)
    torch.load(states, weights_only=False)  # the payload is live: a full unpickler runs it
    assert marker.read_text() == "ran"
    marker.unlink()

    result = launch("single", config, run, "--resume")
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("universal checkpoint" in result.stderr) == (written_by_zero_stage != 2)
    assert not marker.exists()
    assert (f"error: DeepSpeed checkpoint file {states} holds something other than tensors "
            f"and plain data (builtins.exec)") in result.stderr
    assert "Traceback" not in result.stderr
