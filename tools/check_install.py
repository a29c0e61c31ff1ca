"""Check an installed mmgoal: it imports, trains and evaluates from a config, and names its extras.

    python tools/check_install.py               # in the environment to check
    cd /tmp && python /path/to/tools/check_install.py --installed

Writes a tiny synthetic benchmark to a temporary folder, trains the quickstart
architecture (shrunk) for one epoch on the CPU with the ``Trainer`` and prints
the test metrics; then lists the optional extras and, for each one that is
missing, checks that what needs it says which extra installs it. ``--installed``
also requires that ``mmgoal`` was imported from an installed package, not from
this source tree. ``make check-install`` runs it that way in a fresh venv where
mmgoal was installed like a pip user's, without extras (``pip install -c
constraints.txt .``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import yaml

import mmgoal
from mmgoal.cli.arguments import add_offline_option, apply_loading_options
from mmgoal.config import load_config
from mmgoal.data.synthetic import write_benchmark
from mmgoal.engine.trainer import Trainer
from mmgoal.evaluation.retrieval import metrics_table
from mmgoal.extras import EXTRAS, pyplot
from mmgoal.registry import LOGGERS, STRATEGIES

ROOT = Path(__file__).resolve().parents[1]


def tiny_quickstart(shards: Path) -> dict:
    """``configs/quickstart.yaml`` shrunk to a few seconds of training on ``shards``."""
    return {
        "_base_": str(ROOT / "configs" / "quickstart.yaml"),
        "model": {"embed_dim": 16, "image_encoder": {"model_kwargs": {"widths": [8, 16]}},
                  "text_encoder": {"word_dim": 8, "hidden_size": 16}},
        "data": {"image_size": 32, "num_workers": 0,
                 "train": {"shards": str(shards / "train-{000000..000001}.tar"),
                           "batch_size": 16},
                 "val": {"shards": str(shards / "val-000000.tar")},
                 "test": {"shards": str(shards / "test-000000.tar")}},
        "train": {"epochs": 1, "progress": False, "device": "cpu"},
    }


def train_tiny_run() -> dict:
    """Train and evaluate the tiny quickstart; its test metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "synthetic"
        write_benchmark(shards, {"train": 64, "val": 32, "test": 32}, seed=0, image_size=32,
                        shard_size=32, progress=False)
        config = Path(tmp) / "tiny.yaml"
        config.write_text(yaml.safe_dump(tiny_quickstart(shards)))
        report = Trainer(load_config(config), Path(tmp) / "run").fit()
    return report["test"]


def missing_extra_messages() -> list[str]:
    """For each optional package that is not installed, the error of what needs it."""
    needs = {"deepspeed": lambda: STRATEGIES.build({"type": "deepspeed"}),
             "accelerate": lambda: STRATEGIES.build({"type": "accelerate"}),
             "matplotlib": lambda: pyplot("tools/plot_weights.py"),
             "tensorboard": lambda: LOGGERS.build({"type": "TensorBoardLogger"}),
             "wandb": lambda: LOGGERS.build({"type": "WandbLogger"})}
    failures = []
    for module, extra in EXTRAS.items():
        if importlib.util.find_spec(module) is not None:
            print(f"  {module:<12} installed")
            continue
        print(f"  {module:<12} not installed (extra {extra!r})")
        if module not in needs:
            continue
        try:
            needs[module]()
        except ImportError as error:
            if f"pip install 'mmgoal[{extra}]'" not in str(error):
                failures.append(f"{module}: the error does not name the extra: {error}")
        else:
            failures.append(f"{module} is not installed, yet what needs it did not fail")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--installed", action="store_true",
                        help="fail unless mmgoal comes from an installed package (not editable)")
    add_offline_option(parser)
    args = parser.parse_args(argv)
    apply_loading_options(args)
    package = Path(mmgoal.__file__).resolve().parent
    print(f"mmgoal {mmgoal.__version__} from {package}")
    if args.installed and package.is_relative_to(ROOT):
        print(f"error: mmgoal was imported from the source tree {ROOT}, not from the installed "
              f"package; run this from another folder", file=sys.stderr)
        return 1
    start = time.perf_counter()
    metrics = train_tiny_run()
    print(f"tiny quickstart, 1 epoch on the CPU ({time.perf_counter() - start:.1f}s), test:")
    print(metrics_table(metrics))
    print("optional extras:")
    failures = missing_extra_messages()
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
