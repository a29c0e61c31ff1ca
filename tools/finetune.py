"""Train a model from a config, evaluate it every epoch, report test metrics.

    python tools/finetune.py configs/quickstart.yaml
    python tools/finetune.py configs/quickstart.yaml --cfg-options train.epochs=2 optimizer.lr=1e-3
    python tools/finetune.py configs/quickstart.yaml --work-dir work_dirs/run1 --resume
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mmgoal.config import load_config  # noqa: E402
from mmgoal.engine.trainer import Trainer, check_data_paths, metrics_table  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="YAML config")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. train.epochs=2 data.train.batch_size=64")
    parser.add_argument("--work-dir", help="run directory (default: work_dirs/<config name>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from <work-dir>/checkpoints/last.pt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        cfg = load_config(args.config, args.cfg_options)
        check_data_paths(cfg)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    work_dir = Path(args.work_dir or Path("work_dirs") / Path(args.config).stem)
    trainer = Trainer(cfg, work_dir, resume=args.resume)
    report = trainer.fit()
    if report.get("interrupted"):
        print(f"interrupted at epoch {report['epoch']}, step {report['step']}; resume with "
              f"--resume --work-dir {work_dir}")
        return 130
    if "test" in report:
        print(f"test metrics of the best epoch ({report['best']['epoch']}), "
              f"{report['train_seconds']:.0f}s of training:")
        print(metrics_table(report["test"]))
    print(f"run directory: {work_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
