"""The batch-size scaling study: five objectives x global batch sizes x seeds.

    python bench/batch_scaling.py --out work_dirs/batch_scaling --lr-rule 2048=constant
    python bench/batch_scaling.py --out W --phase train --jobs 2           # the runs only
    python bench/batch_scaling.py --out W --phase report --page-dir docs/results

Run from the folder that holds the synthetic benchmark's ``data/synthetic``
(``mmgoal make-synthetic --out data/synthetic``). First one start per seed,
``OUT/start/seed<k>`` (``configs/goal/batch_scaling/start.yaml``: the sweep's dual
encoder trained with InfoNCE at batch 128). Then each start is fine-tuned under
``configs/goal/batch_scaling/<objective>.yaml`` at every batch size, into
``OUT/<objective>/b<batch>/seed<k>``, with the learning rate of the square-root rule,
``--base-lr`` x sqrt(batch / ``--base-batch``); every size sees the same samples (the
configs' 5 epochs). InfoNCE goes on from the temperature its start learnt (the
fine-tune loads the model only), and GOAL ``cir x sig_ms`` gets the measured ``lam``
of its batch size: the midpoint of the starts' median positive and hardest-negative
score in batches of that size. Before the grid, InfoNCE is fine-tuned at the larger
sizes with the other two rules (the base rate unchanged, and the linear rule) for seed
0, into ``OUT/lr_rule/<rule>/b<batch>``: the check of the rule the grid uses.
``--lr-rule 2048=constant`` gives the grid another rule at a size (the published
study's, chosen by that check: docs/results/batch_scaling.md); the check then runs
the other two there.

A finished run (its report.json) is not trained again, so the command resumes an
interrupted study; ``--jobs`` runs that many trainings at once, each on one thread
(OMP_NUM_THREADS=1), and each run's wall and CPU seconds and peak resident memory
are written to ``<run>.time.txt`` (GNU time) beside its log, ``<run>.log``.

The ``report`` phase measures each run's median positive and hardest-negative score
in batches of its own training size (its best checkpoint on the training split),
tabulates each batch size with ``mmgoal compare-runs`` (InfoNCE is the control of the
paired differences) and draws two plots: test rsum against batch size (mean over
seeds, the seeds' range shaded) and the median hardest-negative score against batch
size. It writes ``batch_scaling_tables.md``, ``batch_scaling_rsum.png`` and
``batch_scaling_negatives.png`` into ``--page-dir`` (default: OUT).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "goal" / "batch_scaling"
OBJECTIVES = {"infonce": "InfoNCE", "triplet": "TripletLoss (hardest negative)",
              "siglip": "SigLIP", "goal_nca_con": "GOAL nca x con",
              "goal_cir_sig_ms": "GOAL cir x sig_ms (measured lam)"}
MMGOAL = [sys.executable, "-m", "mmgoal"]
GNU_TIME = Path("/usr/bin/time")  # each run's CPU seconds and peak memory


RULES = ("constant", "sqrt", "linear")


def learning_rate(batch: int, base_lr: float, base_batch: int, rule: str = "sqrt") -> float:
    """The learning rate of ``rule`` (``sqrt``, ``linear`` or ``constant``) at ``batch``."""
    ratio = batch / base_batch
    factor = {"sqrt": math.sqrt(ratio), "linear": ratio, "constant": 1.0}[rule]
    return base_lr * factor


def train(config: Path, work_dir: Path, options: list[str]) -> str:
    """One run (skipped when finished); a line saying what happened."""
    if (work_dir / "report.json").is_file():
        return f"{work_dir}: finished before"
    work_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [str(GNU_TIME), "-o", f"{work_dir}.time.txt", "-f",
               "wall_s %e\nuser_s %U\nsystem_s %S\nmax_rss_kib %M", *MMGOAL, "train",
               str(config), "--work-dir", str(work_dir), "--auto-resume", "--cfg-options",
               *options]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(f"{work_dir}.log", "a") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return f"{work_dir}: {'done' if done.returncode == 0 else f'FAILED (rc {done.returncode})'}"


def run_all(runs: list[tuple[Path, Path, list[str]]], jobs: int) -> None:
    start = time.time()
    with ThreadPoolExecutor(jobs) as pool:
        for index, line in enumerate(pool.map(lambda run: train(*run), runs), 1):
            print(f"[{index}/{len(runs)}, {time.time() - start:.0f} s] {line}", flush=True)


def learnt_temperature(start: Path) -> float:
    """The temperature the start's InfoNCE had learnt at its last logged step."""
    records = [json.loads(line) for line in (start / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return next(r["temperature"] for r in reversed(records)
                if r.get("type") == "train" and "temperature" in r)


def fine_tune(args: argparse.Namespace, config: str, work_dir: Path, batch: int, lr: float,
              seed: int, *extra: str) -> tuple[Path, Path, list[str]]:
    """A fine-tune of seed ``seed``'s start; InfoNCE goes on from the start's temperature
    (``load_from`` loads the model, not the objective's state)."""
    best = args.out / "start" / f"seed{seed}" / "checkpoints" / "best.pt"
    if config == "infonce":
        extra = (f"objective.temperature={learnt_temperature(best.parents[1]):.6g}", *extra)
    return (CONFIGS / f"{config}.yaml", work_dir,
            [f"load_from={best}", f"data.train.batch_size={batch}", f"optimizer.lr={lr:.6g}",
             f"train.seed={seed}", *extra])


def measured_lam(args: argparse.Namespace) -> dict[int, float]:
    """Per batch size: the midpoint of the starts' median positive and hardest-negative
    score in batches of that size, averaged over the seeds, to 2 decimals."""
    lam = {}
    for batch in args.batches:
        stats = [measure_scores(args.out / "start" / f"seed{seed}", batch, args.train_shards,
                                args.pairs) for seed in range(args.seeds)]
        lam[batch] = round(statistics.mean(
            (s["positive_median"] + s["negative_median"]) / 2 for s in stats), 2)
    return lam


def grid_rule(args: argparse.Namespace, batch: int) -> str:
    """The learning-rate rule of the grid's runs at ``batch``: ``--lr-rule``'s, else sqrt."""
    return args.lr_rule.get(batch, "sqrt")


def parse_rules(specs: list[str]) -> dict[int, str]:
    """``["2048=constant"]`` -> ``{2048: "constant"}``."""
    rules = {}
    for spec in specs:
        batch, _, rule = spec.partition("=")
        if not batch.isdigit() or rule not in RULES:
            raise SystemExit(f"--lr-rule {spec!r}: give BATCH=RULE, RULE one of {RULES}")
        rules[int(batch)] = rule
    return rules


def run_grid(args: argparse.Namespace) -> None:
    """The starts, then the learning-rate check, then the grid seed by seed."""
    run_all([(CONFIGS / "start.yaml", args.out / "start" / f"seed{seed}",
              [f"train.seed={seed}"]) for seed in range(args.seeds)], args.jobs)
    lam = measured_lam(args)
    print(f"measured lam per batch size: {lam}", flush=True)
    runs = [fine_tune(args, "infonce", args.out / "lr_rule" / rule / f"b{batch}", batch,
                      learning_rate(batch, args.base_lr, args.base_batch, rule), 0)
            for batch in args.batches if batch != args.base_batch
            for rule in RULES if rule != grid_rule(args, batch)]
    for seed in range(args.seeds):
        for batch in args.batches:
            lr = learning_rate(batch, args.base_lr, args.base_batch, grid_rule(args, batch))
            for name in args.objectives:
                extra = [f"objective.pair.lam={lam[batch]}"] if name == "goal_cir_sig_ms" \
                    else []
                runs.append(fine_tune(args, name, args.out / name / f"b{batch}" / f"seed{seed}",
                                      batch, lr, seed, *extra))
    run_all(runs, args.jobs)


def seed_runs(out: Path, name: str, batch: int) -> list[Path]:
    """The finished runs of one cell."""
    return sorted(d for d in (out / name / f"b{batch}").glob("seed*")
                  if (d / "report.json").is_file())


def measure_scores(run: Path, batch: int, shards: str, pairs: int) -> dict:
    """The run's median positive and hardest-negative score in training batches of
    ``batch`` (its best checkpoint on ``shards``), kept in ``<run>.scores_b<batch>.json``."""
    from mmgoal.cli.score_stats import score_stats

    cached = Path(f"{run}.scores_b{batch}.json")
    if cached.is_file():
        return json.loads(cached.read_text())
    stats = score_stats(run, "train", pairs, shards=[shards], batch_size=batch)
    cached.write_text(json.dumps(stats))
    return stats


def cost(run: Path) -> dict[str, float] | None:
    """GNU time's record of a run: wall and CPU seconds, peak resident MiB; None while the
    run is going (or where it was killed: GNU time writes at the end)."""
    record = Path(f"{run}.time.txt")
    fields = dict(line.split() for line in record.read_text().splitlines()
                  if len(line.split()) == 2) if record.is_file() else {}
    if "max_rss_kib" not in fields:
        return None
    return {"wall_s": float(fields["wall_s"]),
            "cpu_s": float(fields["user_s"]) + float(fields["system_s"]),
            "rss_mib": float(fields["max_rss_kib"]) / 1024}


def spread(values: list[float]) -> str:
    """``mean ± std`` as ``mmgoal compare-runs`` writes it; ``-`` for no values."""
    from mmgoal.cli.compare_runs import mean_std

    return mean_std(values) if values else "-"


def rsum(run: Path) -> float:
    return json.loads((run / "report.json").read_text())["test"]["rsum"]


def seed_of(run: Path) -> int:
    return int(run.name.removeprefix("seed"))


def paired_to_infonce(cells: dict) -> dict:
    """Per cell ``(objective, batch)``: each run's rsum minus InfoNCE's of the same batch
    size and seed (none where InfoNCE has no such run)."""
    control = {b: {seed_of(r): rsum(r) for r in runs} for (name, b), runs in cells.items()
               if name == "infonce"}
    return {(name, b): [rsum(r) - control[b][seed_of(r)] for r in runs
                        if seed_of(r) in control.get(b, {})]
            for (name, b), runs in cells.items()}


def report(args: argparse.Namespace) -> str:
    """The Markdown tables; the plots are drawn beside them."""
    from mmgoal.cli.compare_runs import compare, read_run

    out, batches, names = args.out, args.batches, args.objectives
    cells = {(name, b): seed_runs(out, name, b) for name in names for b in batches}
    scores = {run: measure_scores(run, b, args.train_shards, args.pairs)
              for (name, b), runs in cells.items() for run in runs}
    lines = ["## The learning-rate rule (InfoNCE, seed 0: test rsum)", "",
             "| rule | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for rule in RULES:
        row = []
        for b in batches:
            run = out / "infonce" / f"b{b}" / "seed0" if rule == grid_rule(args, b) or \
                b == args.base_batch else out / "lr_rule" / rule / f"b{b}"
            lr = learning_rate(b, args.base_lr, args.base_batch, rule)
            grid = " (the grid's)" if rule == grid_rule(args, b) and b != args.base_batch else ""
            row.append(f"{rsum(run):.1f} (lr {lr:.3g}){grid}" if (run / "report.json").is_file()
                       else "-")
        lines.append(f"| {rule} | " + " | ".join(row) + " |")
    paired = paired_to_infonce(cells)
    lines += ["", "## Test rsum (mean ± std over seeds) and the paired difference to "
              "InfoNCE", "", "| objective | " + " | ".join(
                  f"batch {b} | Δ vs InfoNCE (ahead)" for b in batches) + " |",
              "|---|" + "---|---|" * len(batches)]
    for name in names:
        row = []
        for b in batches:
            runs, deltas = cells[name, b], paired[name, b]
            ahead = f" ({sum(d > 1e-6 for d in deltas)}/{len(deltas)})" if deltas else ""
            row += [f"{spread([rsum(r) for r in runs])} (n={len(runs)})",
                    "" if name == "infonce" else spread(deltas) + ahead]
        lines.append(f"| {OBJECTIVES[name]} | " + " | ".join(row) + " |")
    lines += ["", f"## Median scores in training batches of the run's size (best checkpoint, "
              f"{args.pairs} training pairs): positive / hardest negative, mean over seeds", "",
              "| objective | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    for name in names:
        row = []
        for b in batches:
            runs = cells[name, b]
            row.append(" / ".join(f"{statistics.mean(scores[r][k] for r in runs):.2f}"
                                  for k in ("positive_median", "negative_median"))
                       if runs else "-")
        lines.append(f"| {OBJECTIVES[name]} | " + " | ".join(row) + " |")
    lines += ["", "## What a run costs (mean over seeds): wall s / CPU s / peak resident MiB",
              "", "| objective | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    for name in names:
        row = []
        for b in batches:
            costs = [c for c in map(cost, cells[name, b]) if c is not None]
            row.append(" / ".join(f"{statistics.mean(c[k] for c in costs):.0f}"
                                  for k in ("wall_s", "cpu_s", "rss_mib")) if costs else "-")
        lines.append(f"| {OBJECTIVES[name]} | " + " | ".join(row) + " |")
    total = sum(c["cpu_s"] for t in out.rglob("*.time.txt")
                if (c := cost(Path(str(t).removesuffix(".time.txt")))) is not None)
    lines += ["", f"CPU time of the whole study (the starts, the learning-rate check and the "
              f"grid): {total / 3600:.2f} h.", ""]
    for b in batches:
        groups = [(OBJECTIVES[n], [read_run(r) for r in cells[n, b]]) for n in names
                  if cells[n, b]]
        if groups:
            lines += [f"## Batch {b}: `mmgoal compare-runs`", "", compare(groups)]
    draw(args, {"rsum": {cell: [rsum(r) for r in runs] for cell, runs in cells.items()},
                "paired": {cell: deltas for cell, deltas in paired.items()
                           if cell[0] != "infonce"},
                **{key: {cell: [scores[r][key] for r in runs] for cell, runs in cells.items()}
                   for key in ("negative_median", "positive_median")}})
    return "\n".join(lines)


def draw(args: argparse.Namespace, values: dict[str, dict]) -> None:
    """Against batch size, one line per objective (mean over seeds; the seeds' range
    shaded): test rsum beside its paired difference to InfoNCE, and the median
    hardest-negative and positive scores. ``values``: measure -> cell -> the runs' values."""
    from mmgoal.extras import pyplot
    from mmgoal.files import save_figure

    plt = pyplot("the batch-scaling plots")
    panels = {"batch_scaling_rsum.png": [("test rsum", ["rsum"]),
                                         ("test rsum minus InfoNCE's (same seed)", ["paired"])],
              "batch_scaling_negatives.png": [(
                  "median score in batches of the training size\n"
                  "(solid: hardest negative, dashed: positive)",
                  ["negative_median", "positive_median"])]}
    rules = ", ".join(f"{b}: {'base' if b == args.base_batch else grid_rule(args, b)}"
                      for b in args.batches)
    for path, specs in panels.items():
        figure, all_axes = plt.subplots(1, len(specs), figsize=(6.4 * len(specs), 4.4),
                                        squeeze=False)
        for axes, (ylabel, keys) in zip(all_axes[0], specs):
            for index, name in enumerate(args.objectives):
                for key, style in zip(keys, ("-", "--")):
                    points = [(b, values[key][name, b]) for b in args.batches
                              if values[key].get((name, b))]
                    if not points:
                        continue
                    xs = [b for b, _ in points]
                    axes.plot(xs, [statistics.mean(v) for _, v in points], style, marker="o",
                              color=f"C{index}", label=OBJECTIVES[name] if style == "-" else None)
                    axes.fill_between(xs, [min(v) for _, v in points],
                                      [max(v) for _, v in points], color=f"C{index}", alpha=0.15)
            axes.set_xscale("log", base=2)
            axes.set_xticks(args.batches, [str(b) for b in args.batches])
            axes.set_xlabel(f"global batch size (same epochs; lr rule {rules})")
            axes.set_ylabel(ylabel)
            axes.grid(alpha=0.3)
            axes.legend(fontsize=8)
        figure.tight_layout()
        save_figure(figure, (args.page_dir or args.out) / path, dpi=110)
        plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("work_dirs/batch_scaling"))
    parser.add_argument("--phase", choices=("all", "train", "report"), default="all")
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES),
                        choices=list(OBJECTIVES))
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--base-lr", type=float, default=1e-4)
    parser.add_argument("--base-batch", type=int, default=128)
    parser.add_argument("--lr-rule", nargs="+", default=[], metavar="BATCH=RULE",
                        help="the grid's rule at that batch size instead of sqrt (constant, "
                             "sqrt, linear); the learning-rate check then runs the other two")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once")
    parser.add_argument("--page-dir", type=Path, help="where the tables and plots go")
    parser.add_argument("--train-shards", default="data/synthetic/train-{000000..000009}.tar",
                        help="the training split the scores are measured on")
    parser.add_argument("--pairs", type=int, default=4096,
                        help="pairs the score medians are measured on")
    args = parser.parse_args(argv)
    args.lr_rule = parse_rules(args.lr_rule)
    if args.phase in ("all", "train"):
        if not GNU_TIME.is_file():
            raise SystemExit(f"the runs are timed with GNU time, and {GNU_TIME} is missing: "
                             f"install it (apt-get install time)")
        run_grid(args)
    if args.phase in ("all", "report"):
        tables = report(args)
        page_dir = args.page_dir or args.out
        page_dir.mkdir(parents=True, exist_ok=True)
        (page_dir / "batch_scaling_tables.md").write_text(tables)
        print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
