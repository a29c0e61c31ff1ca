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
