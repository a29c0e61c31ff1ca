"""NaN/inf on one rank stops every rank, before any checkpoint holds it (issue 17)."""

import pytest
from test_distributed import PER_RANK, launch, write_config

from mmgoal.runs.checkpoint import load_checkpoint, nonfinite_tensors
from mmgoal.runs.run_dir import LATEST, read_pointer

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from mmgoal.data.synthetic import write_benchmark

    root = tmp_path_factory.mktemp("nonfinite")
    write_benchmark(root, {"train": 160, "val": 32, "test": 40}, seed=3, image_size=32,
                    shard_size=40, progress=False)
    return root


@pytest.mark.parametrize("extra", [[], ["--deepspeed"]], ids=["ddp", "deepspeed"])
def test_inf_on_one_rank_stops_every_rank_with_the_last_good_checkpoint(data, tmp_path, extra):
    config = write_config(tmp_path / "inf.yaml", data, PER_RANK,
                          hooks=[{"type": "InfOnRankAt", "step": 3}],
                          train={"epochs": 1, "log_every": 5, "progress": False,
                                 "checkpoint_every_steps": 2})
    run = tmp_path / "run"
    result = launch("torchrun", config, run, *extra)
    # no rank's traceback (torchrun prints its own for any rank's non-zero exit status)
    assert result.returncode != 0 and "NonFiniteStateError" not in result.stderr
    assert 'mmgoal/engine' not in result.stderr, result.stderr[-3000:]
    # rank 1's skipped step is checked on every rank; rank 0 prints the error
    assert result.stderr.count("error: the model holds NaN or inf in 1 tensor "
                               "(image_encoder.model.features.0.weight) at step 3") == 1
    assert "the last good checkpoint in" in result.stderr
    tag = read_pointer(run / "checkpoints" / "deepspeed" / LATEST)
    last = (run / "checkpoints" / "deepspeed" / tag / "weights.pt" if tag
            else run / "checkpoints" / "last.pt")
    state = load_checkpoint(last)
    assert state["step"] == 2 and nonfinite_tensors(state["model"]) == []
