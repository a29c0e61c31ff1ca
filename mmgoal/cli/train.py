"""Train a model from a config, evaluate it every epoch, report test metrics.

    mmgoal train configs/quickstart.yaml
    mmgoal train configs/quickstart.yaml --cfg-options train.epochs=2 optimizer.lr=1e-3
    mmgoal train quickstart --train-data data/synthetic --lr 1e-3 --epochs 2
    mmgoal train configs/quickstart.yaml --work-dir work_dirs/run1 --resume
    mmgoal train --resume work_dirs/run1                  # the run's own config.yaml
    mmgoal train configs/quickstart.yaml --print-config   # every key, defaults included
    torchrun --nproc_per_node 2 -m mmgoal train configs/quickstart.yaml
    deepspeed --num_gpus 2 --module mmgoal train configs/quickstart.yaml --deepspeed [ds.json]
    mmgoal train configs/gpu/quickstart_bf16.yaml         # a GPU, bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import yaml

from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    TRAIN_SHORTCUTS,
    add_offline_option,
    add_shortcuts,
    apply_loading_options,
    config_argument,
    print_error,
    shortcut_overrides,
    tool_parser,
)
from mmgoal.config import load_config
from mmgoal.runs.run_dir import CHECKPOINTS, CONFIG_FILE, LAST, stored_config
from mmgoal.runs.schema import RunConfig, with_overrides


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser(__doc__)
    parser.add_argument("config", nargs="?",
                        help="YAML config (a shipped config's name too); with --resume RUN, "
                             "default: RUN/config.yaml")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. train.epochs=2 data.train.batch_size=64")
    parser.add_argument("--work-dir", help="run directory (default: work_dirs/<config name>)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (bases merged, every default filled in, "
                             "overrides applied) and exit; its custom_imports are not imported "
                             "unless --trust-custom-imports (training always imports them)")
    parser.add_argument("--trust-custom-imports", action="store_true",
                        help="with --print-config: import the config's custom_imports")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="RUN",
                        help="continue from the latest checkpoint of a run folder: RUN, or "
                             "'latest' / no value: <work-dir>'s; without a config, the run's "
                             "own (config.yaml with what earlier resumes changed); a config "
                             "given may differ from it only in what may change on resume "
                             "(epochs, logging, evaluation, batch split), recorded in "
                             "config_changes.jsonl")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a --work-dir that holds a run, deleting its "
                             "checkpoints, config, metrics and report")
    parser.add_argument("--auto-resume", action="store_true",
                        help="--resume when <work-dir> has a checkpoint, else start afresh "
                             "(for jobs that a scheduler requeues)")
    parser.add_argument("--lock-wait", type=float, metavar="SECONDS",
                        help="how long to wait for another process that holds <work-dir> "
                             "(its run lock) before refusing; default 300 with --auto-resume "
                             "(a requeued job beside the one it replaces, still writing its "
                             "last checkpoint), else 0")
    parser.add_argument("--deepspeed", nargs="?", const=True, metavar="DS_CONFIG.json",
                        help="train with DeepSpeed (strategy: deepspeed), optionally with a "
                             "DeepSpeed JSON merged over the config's settings")
    # The deepspeed launcher passes --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    add_offline_option(parser)
    add_shortcuts(parser, TRAIN_SHORTCUTS)
    args = parser.parse_args(argv)
    args.run_config = None  # a run folder whose config the run goes on with
    if args.resume not in (None, "latest"):  # a run folder: its config and its place
        args.resume = run_folder(parser, Path(args.resume))
        if args.work_dir and Path(args.work_dir) != Path(args.resume):
            parser.error(f"--resume {args.resume} resumes that run folder; --work-dir "
                         f"{args.work_dir} names another: give one of them")
        args.work_dir = args.resume
    if args.config is None and args.resume is not None and args.work_dir:
        args.run_config = args.work_dir
        args.config = str(Path(args.work_dir) / CONFIG_FILE)
    if args.config is None:
        parser.error("the config is required (or --resume RUN, which reads RUN/config.yaml)")
    return args


def run_folder(parser: argparse.ArgumentParser, path: Path) -> str:
    """``--resume``'s run folder; open_clip's habit, the checkpoint file, names its run's."""
    if path.is_file():
        if path.name == LAST and path.parent.name == CHECKPOINTS:
            return str(path.parent.parent)
        parser.error(f"--resume takes a run folder (the run goes on from its "
                     f"{CHECKPOINTS}/{LAST}); {path} is a file")
    return str(path)


def with_deepspeed(cfg: dict, deepspeed: bool | str) -> dict:
    """``--deepspeed [JSON]``: the config's strategy becomes DeepSpeed (keeping its settings)."""
    strategy = dict(cfg.get("strategy") or {})
    if strategy.get("type") != "deepspeed":
        strategy = {"type": "deepspeed"}
    if isinstance(deepspeed, str):
        strategy["config"] = deepspeed
    return {**cfg, "strategy": strategy}


def last_line(error: Exception) -> str:
    """The error's own message: a DataLoader worker's error, re-raised in the main process,
    carries the worker's traceback before it."""
    line = str(error).strip().splitlines()[-1]
    name = type(error).__name__
    return line.split(": ", 1)[1] if line.split(": ", 1)[0].endswith(name) else line


def setup_logging() -> None:
    from mmgoal.distributed import launched_rank, launched_world_size

    rank = launched_rank()
    prefix = f"[rank {rank}] " if launched_world_size() > 1 else ""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s {prefix}%(message)s",
                        datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # torch is imported past this line: --help does without it
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(run)(args)  # torchrun shows every failing rank's traceback


def run(args: argparse.Namespace) -> int:
    """``mmgoal train`` with its parsed ``args``."""
    apply_loading_options(args)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    setup_logging()
    try:
        if args.run_config:  # config.yaml with the changes resumes recorded since
            cfg = stored_config(args.run_config)
            if cfg is None:
                raise FileNotFoundError(f"{args.run_config} holds no {CONFIG_FILE}: give the "
                                        f"run's config")
        else:
            args.config = config_argument(args.config)
            cfg = load_config(args.config)
        if args.deepspeed:  # first: the overrides may set DeepSpeed's own options
            if isinstance(args.deepspeed, str):  # a JSON file, or one shipped with mmgoal
                args.deepspeed = config_argument(args.deepspeed)
            cfg = with_deepspeed(cfg, args.deepspeed)
        # printing a config (maybe one you received) imports nothing it names, unless asked
        overrides = [*shortcut_overrides(args, TRAIN_SHORTCUTS, cfg), *args.cfg_options]
        config = with_overrides(cfg, overrides, beside=Path(args.config).parent,
                                trust_custom_imports=args.trust_custom_imports
                                or not args.print_config, source=f"config {args.config}",
                                typed=True)
    except INPUT_ERRORS as error:
        return print_error(error)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    return train(args, config, Path(args.work_dir or Path("work_dirs") / Path(args.config).stem))


def train(args: argparse.Namespace, config: RunConfig, work_dir: Path) -> int:
    """Start or resume the run in ``work_dir`` (:func:`~mmgoal.runs.start.started_run`) and
    train it to the end."""
    from mmgoal.data.pipeline import IncompleteSplitError, UnreadableShardsError
    from mmgoal.distributed import launched_rank
    from mmgoal.engine.loggers import LoggerError
    from mmgoal.engine.trainer import Trainer
    from mmgoal.evaluation.retrieval import metrics_table
    from mmgoal.runs.checkpoint import CheckpointWriteError
    from mmgoal.runs.start import started_run

    wait = args.lock_wait if args.lock_wait is not None else 300.0 if args.auto_resume else 0.0
    with contextlib.ExitStack() as held:
        try:
            # rank 0 holds the folder's lock for the whole run, and alone decides on it
            start = held.enter_context(started_run(
                work_dir, config.to_dict(), bool(args.resume), args.auto_resume, args.overwrite,
                wait,
                main_rank=launched_rank() == 0))
            trainer = Trainer(config, work_dir, resume=start.resume)
        # ImportError: a missing extra; LoggerError: a logger that cannot write where told
        except (*INPUT_ERRORS, LoggerError) as error:
            return print_error(error)
        if trainer.is_main:
            start.record(trainer.epoch, trainer.step)
        with trainer:  # closes the strategy (the process group) when the run ends
            try:
                report = trainer.fit()
            except IncompleteSplitError as error:  # every rank read the split, every one failed
                if trainer.is_main:
                    print_error(f"{last_line(error)}\nThe run stopped with its checkpoint; once "
                                f"the split reads whole, --resume {work_dir} "
                                f"evaluates again and goes on.")
                return 1
            except (FloatingPointError, UnreadableShardsError, LoggerError,
                    CheckpointWriteError) as error:
                # a divergence stops every rank with one message; unreadable shards are a
                # rank's own; a logger (W&B without a login) stops rank 0, before training; a
                # checkpoint that cannot be written (a full disk) leaves the previous one
                if trainer.is_main or isinstance(error, UnreadableShardsError):
                    print_error(last_line(error))
                return 1
    if not trainer.is_main:
        return 130 if report.get("interrupted") else 0
    if report.get("interrupted"):
        print(f"interrupted at epoch {report['epoch']}, step {report['step']}; resume with "
              f"--resume {work_dir}")
        return 130
    if "test" in report:
        print(f"test metrics of the best epoch ({report['best']['epoch']}), "
              f"{report['train_seconds']:.0f}s of training:")
        print(metrics_table(report["test"]))
    print(f"run directory: {work_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
