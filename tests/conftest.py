import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_benchmark(tmp_path_factory):
    """A small synthetic benchmark: 96 train, 32 val, 40 test images in shards of 32."""
    from mmgoal.data.synthetic import write_benchmark

    out = tmp_path_factory.mktemp("synthetic")
    summary = write_benchmark(out, {"train": 96, "val": 32, "test": 40}, seed=3,
                              image_size=32, shard_size=32, progress=False)
    return out, summary


@pytest.fixture(scope="session")
def tiny_quickstart_run(tiny_benchmark, tmp_path_factory):
    """A run directory of the quickstart model shrunk to the tiny benchmark, trained one epoch
    (a few seconds), for tests that use a trained model: ``(run_dir, benchmark_dir)``."""
    from pathlib import Path

    from mmgoal.engine.trainer import Trainer
    from mmgoal.runs.schema import load_run_config

    out, _ = tiny_benchmark
    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(root / "configs" / "quickstart.yaml", [
        "model.embed_dim=16", "model.image_encoder.model_kwargs.widths=[8, 16]",
        "model.text_encoder.word_dim=8", "model.text_encoder.hidden_size=16",
        "data.image_size=32", "data.num_workers=0", "train.epochs=1", "train.progress=False",
        "train.log_every=2",
        "hooks=[]", f"data.train.shards={out}/train-{{000000..000002}}.tar",
        "data.train.batch_size=16", f"data.val.shards={out}/val-000000.tar",
        f"data.test.shards={out}/test-{{000000..000001}}.tar"])
    run = tmp_path_factory.mktemp("quickstart") / "run"
    Trainer(cfg, run).fit()
    return run, out
