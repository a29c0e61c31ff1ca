"""Train every GOAL triplet x pair combination (and hyperparameter grid point), tabulate R@1.

    mmgoal sweep configs/goal/sweep_synthetic.yaml --seeds 3 --out work_dirs/sweep
    mmgoal sweep configs/goal/sweep_synthetic.yaml --triplet nca cir --pair con sig_ms \\
        --grid objective.triplet.tau=1,5,10,30 --seeds 3 --out work_dirs/sweep_tau

Each run (``OUT/<triplet>x<pair>/<grid point>/seed<k>``, resumed or reused when the sweep
starts again) sets the config's ``GoalObjective`` to the combination, the grid's
``objective.triplet.<option>`` / ``objective.pair.<option>`` as that weight's options;
``OUT/runs.json`` holds every run, ``OUT/table.md`` the GOAL paper's Table 3 layout, and
``{seed}`` in ``load_from`` becomes each run's seed (docs/objectives.md, "Sweeps").
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import signal
import statistics
import sys
import time
from pathlib import Path

from mmgoal import strict_json
from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    add_offline_option,
    apply_loading_options,
    config_argument,
    print_error,
    tool_parser,
)
from mmgoal.config import config_changes, describe_changes, parse_value
from mmgoal.files import read_text, write_text
from mmgoal.registry import OBJECTIVES
from mmgoal.runs.run_dir import stored_config
from mmgoal.runs.schema import check_data_paths, load_run_config, resolve_config

TRIPLETS = ("con", "nca", "cir")
PAIRS = ("con", "lin", "sig", "lin_ms", "sig_ms")


def parse_grid(items: list[str]) -> list[tuple[str, list]]:
    """``["objective.triplet.tau=1,5"]`` -> ``[("objective.triplet.tau", [1, 5])]``."""
    grid = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--grid {item!r} must look like key.subkey=v1,v2,...")
        section, _, name = key.partition(".")
        if section == "objective" and name not in ("triplet", "pair", "reduction") and (
                "." not in name):
            raise ValueError(f"--grid {key}: GOAL weight options go with their weight: "
                             f"--grid objective.triplet.{name}=... or objective.pair.{name}=...")
        grid.append((key, [parse_value(v) for v in values.split(",")]))
    return grid


def grid_points(grid: list[tuple[str, list]]) -> list[dict]:
    keys = [k for k, _ in grid]
    return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in grid))]


def slug(point: dict) -> str:
    return "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()) or "default"


def setting_overrides(triplet: str, pair: str, point: dict) -> list[str]:
    """The overrides of one combination and grid point: weight options join their weight."""
    weights = {"triplet": {"type": triplet}, "pair": {"type": pair}}
    others = []
    for key, value in point.items():
        slot, _, option = key.removeprefix("objective.").partition(".")
        if key.startswith("objective.") and slot in weights and option:
            weights[slot][option] = value
        else:
            others.append(f"{key}={value}")
    return [f"objective.{slot}={spec!r}" for slot, spec in weights.items()] + others


def check_settings(config: str, cfg_options: list[str], triplets: list[str], pairs: list[str],
                   points: list[dict]) -> None:
    """Build every combination's objective once, so a bad option stops the sweep before training."""
    for triplet, pair, point in itertools.product(triplets, pairs, points):
        cfg = load_run_config(config, [*cfg_options, *setting_overrides(triplet, pair, point)])
        if cfg.get("objective", {}).get("type") != "GoalObjective":
            raise ValueError(f"{config}: the sweep needs objective.type GoalObjective")
        try:
            OBJECTIVES.build(cfg["objective"])
        except (ValueError, KeyError) as error:
            raise ValueError(f"{triplet}x{pair} {slug(point)}: {error}") from error


def seeded_config(config: str, overrides: list[str], seed: int) -> dict:
    """The run config of one seed: ``train.seed`` set, ``{seed}`` in ``load_from`` filled in."""
    cfg = load_run_config(config, [*overrides, f"train.seed={seed}"])
    if isinstance(cfg.get("load_from"), str):
        cfg["load_from"] = cfg["load_from"].replace("{seed}", str(seed))
    return cfg


def check_load_from(config: str, cfg_options: list[str], seeds: int) -> None:
    """Every seed's ``load_from`` exists, so a missing checkpoint stops the sweep before
    anything trains instead of ending it at that seed."""
    for seed in range(seeds):
        path = seeded_config(config, cfg_options, seed).get("load_from")
        if path and not Path(path).exists():
            raise FileNotFoundError(f"load_from {path} (seed {seed}) does not exist; train "
                                    f"that seed's run first or give another load_from")


def run_one(config: str, overrides: list[str], seed: int, work_dir: Path) -> dict:
    """Train (or resume, or reuse) one run, its folder locked; returns its report.

    A finished run is reused only when it was trained with exactly the config asked
    for (:func:`finished_report`); an unfinished one resumes under ``mmgoal train
    --resume``'s rules, and a cell starts as a run of ``mmgoal train`` does
    (:func:`~mmgoal.runs.start.started_run`: it refuses what train refuses).

    Raises:
        ValueError: the folder holds a run of another config, or is in use, or what
            ``started_run`` refuses.
    """
    from mmgoal.engine.trainer import Trainer
    from mmgoal.runs.start import started_run

    cfg = seeded_config(config, overrides, seed)
    cfg.setdefault("train", {})["progress"] = False
    with started_run(work_dir, cfg, auto_resume=True, reuse=finished_report) as start:
        if start.finished is not None:
            return start.finished
        trainer = Trainer(cfg, work_dir, resume=start.resume)
        start.record(trainer.epoch, trainer.step)
        report = trainer.fit()
    if report.get("interrupted"):
        raise KeyboardInterrupt
    return report


def finished_report(work_dir: Path, cfg: dict) -> dict | None:
    """The report of the finished run in ``work_dir`` when it ran exactly ``cfg`` (a sweep
    cell done earlier); None when there is none.

    Raises:
        ValueError: the finished run is of another config, or says not which.
    """
    report_path = work_dir / "report.json"
    if not report_path.is_file():
        return None
    stored = stored_config(work_dir)
    if stored is None:
        raise ValueError(f"{work_dir} holds a report.json but no config.yaml, so whether it "
                         f"ran this config is unknown and its result is not reused: give the "
                         f"sweep another --out, or remove that run folder")
    differ = config_changes(resolve_config(stored), cfg)
    if differ:
        raise ValueError(f"{work_dir} holds a finished run of another config "
                         f"({describe_changes(differ, 5)}); its result is not reused for this "
                         f"one: give the sweep another --out, or remove that run folder")
    return json.loads(read_text(report_path, "run report"))


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def summarise(runs: list[dict], triplets: list[str], pairs: list[str]) -> str:
    """The Markdown table: best grid point per cell by mean validation rsum."""
    lines = ["| pair \\ triplet | " + " | ".join(triplets) + " |",
             "|---|" + "---|" * len(triplets)]
    best_cells = {}
    for triplet, pair in itertools.product(triplets, pairs):
        by_point: dict[str, list[dict]] = {}
        for run in runs:
            if run["triplet"] == triplet and run["pair"] == pair:
                by_point.setdefault(run["point"], []).append(run)
        if not by_point:
            continue
        point, chosen = max(by_point.items(),
                            key=lambda kv: statistics.mean(r["val_rsum"] for r in kv[1]))
        best_cells[(triplet, pair)] = (point, chosen)
    for pair in pairs:
        cells = []
        for triplet in triplets:
            if (triplet, pair) not in best_cells:
                cells.append("")
                continue
            point, chosen = best_cells[(triplet, pair)]
            i2t = mean_std([r["test"]["i2t_r1"] for r in chosen])
            t2i = mean_std([r["test"]["t2i_r1"] for r in chosen])
            rsum = statistics.mean(r["test"]["rsum"] for r in chosen)
            where = "" if point == "default" else f" ({point})"
            cells.append(f"{i2t} / {t2i} [rsum {rsum:.1f}, n={len(chosen)}]{where}")
        lines.append(f"| {pair} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("config", help="a config whose objective is a GoalObjective")
    parser.add_argument("--triplet", nargs="+", default=list(TRIPLETS), choices=TRIPLETS)
    parser.add_argument("--pair", nargs="+", default=list(PAIRS), choices=PAIRS)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per setting")
    parser.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                        help="extra hyperparameter grid, e.g. objective.triplet.tau=1,5,10,30")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="work_dirs/sweep", help="sweep directory")
    add_offline_option(parser)
    args = parser.parse_args(argv)
    apply_loading_options(args)
    logging.basicConfig(level=logging.WARNING)
    try:
        args.config = config_argument(args.config)
        points = grid_points(parse_grid(args.grid))
        check_data_paths(load_run_config(args.config, args.cfg_options))
        check_settings(args.config, args.cfg_options, args.triplet, args.pair, points)
        check_load_from(args.config, args.cfg_options, args.seeds)
    except INPUT_ERRORS as error:
        return print_error(error)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # SIGINT and SIGTERM between runs stop the sweep (inside a run, the trainer's own
    # handlers stop it after a step, with a checkpoint); once it stops, more are ignored
    interrupts = Interrupts()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupts)
    try:
        return sweep(args, points, out, argv)
    except KeyboardInterrupt:
        interrupts.stopping = True
        for sig in (signal.SIGINT, signal.SIGTERM):  # also while the interpreter exits
            signal.signal(sig, signal.SIG_IGN)
        print(f"interrupted; the same command continues the sweep (finished runs are reused, "
              f"the interrupted one resumes from its checkpoint): {out}", file=sys.stderr)
        return 130


class Interrupts:
    """A SIGINT/SIGTERM handler: the first signal interrupts, those after ``stopping`` are
    ignored (a second Ctrl-C while the sweep is already stopping is no traceback)."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame) -> None:
        if not self.stopping:
            raise KeyboardInterrupt


def sweep(args: argparse.Namespace, points: list[dict], out: Path,
          argv: list[str] | None) -> int:
    """Train every setting in turn (see the module docstring); returns the exit status."""
    settings = list(itertools.product(args.triplet, args.pair, points, range(args.seeds)))
    runs = []
    start = time.perf_counter()
    for index, (triplet, pair, point, seed) in enumerate(settings, 1):
        overrides = [*args.cfg_options, *setting_overrides(triplet, pair, point)]
        work_dir = out / f"{triplet}x{pair}" / slug(point) / f"seed{seed}"
        try:
            report = run_one(args.config, overrides, seed, work_dir)
        except ValueError as error:  # a bad grid key, reported once
            return print_error(error)
        runs.append({"triplet": triplet, "pair": pair, "point": slug(point),
                     "hyperparameters": point, "seed": seed,
                     # null in report.json where no epoch validated
                     "val_rsum": -math.inf if report["best"].get("rsum") is None
                     else report["best"]["rsum"], "test": report["test"],
                     "train_seconds": report["train_seconds"], "dir": str(work_dir)})
        write_text(out / "runs.json", strict_json.dumps(runs, indent=2))
        print(f"[{index}/{len(settings)}] {triplet}x{pair} {slug(point)} seed {seed}: "
              f"test R@1 {report['test']['i2t_r1']:.1f}/{report['test']['t2i_r1']:.1f}, "
              f"rsum {report['test']['rsum']:.1f} ({time.perf_counter() - start:.0f}s)",
              flush=True)
    command = "mmgoal sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    table = summarise(runs, args.triplet, args.pair)
    header = (f"Test R@1 image-to-text / text-to-image (mean ± std over {args.seeds} seeds); "
              f"best grid point per cell by mean validation rsum.\n\n`{command}`\n\n")
    write_text(out / "table.md", header + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
