"""Training curves of one or more runs from their metrics.jsonl, as one picture.

    mmgoal plot-curves work_dirs/quickstart            # work_dirs/quickstart/curves.png
    mmgoal plot-curves work_dirs/a work_dirs/b --labels triplet goal --out ab.png

The panels: the training losses (every ``*_loss`` term and their sum) and the
learning rate against the step, the validation rsum and R@1 (both directions)
against the epoch (the step where a run validates several times an epoch,
``train.eval_every_steps``); where the log has them, the zero-shot top-1 of every
validation (``evaluation.zeroshot``) likewise, and GOAL's score
statistics (the median positive and hardest-negative scores, and ``lam`` of
``lam: auto``) against the step. Losses whose values are the same at every step
(the total of a single term and that term) are one line, labelled with both
names. Epoch -1, where a run has it (``train.eval_before_training``), is the
loaded model before any step. Runs are overlaid, one colour each. Steps whose
loss was NaN/inf (written as null) are left out. The picture goes to the
first run's folder: ``curves.png`` for one run, ``curves_<label>_<label>.png``
for several (``--out`` elsewhere).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mmgoal.cli.arguments import INPUT_ERRORS, print_error, tool_parser
from mmgoal.cli.compare_runs import SCORE_KEYS
from mmgoal.extras import pyplot
from mmgoal.files import MAX_ANNOTATION_BYTES, read_text, save_figure

LINE_STYLES = ("-", "--", ":", "-.")
# the score statistics GoalObjective logs (mmgoal/objectives/goal.py), as the panel names them
SCORE_NAMES = {key: key.replace("_", " ") for key in SCORE_KEYS}
ZEROSHOT_KEY = "zeroshot_top1"  # evaluation.zeroshot's (mmgoal/evaluation/zeroshot.py)


def read_curves(run: Path) -> dict[str, dict[str, list]]:
    """``{"train": {"step": [...], "loss": [...], "lr": [...], "<term>_loss": [...]},
    "val": {"epoch": [...], "step": [...], "rsum": [...], "i2t_r1": [...], "t2i_r1": [...]}}``
    of a run directory (or of a metrics.jsonl file), with ``positive_median``, ``negative_median``
    and ``lam`` in "train" and ``zeroshot_top1`` in "val" where a record has them; a key
    missing in a record is None there."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a run directory (its "
                                f"--work-dir) or a metrics.jsonl file")
    records = [json.loads(line) for line in read_text(path, "metrics log", MAX_ANNOTATION_BYTES)
               .splitlines() if line.strip()]
    train = [r for r in records if r.get("type") == "train"]
    val = [r for r in records if r.get("type") == "val"]
    losses = sorted({k for r in train for k in r if k.endswith("_loss")})
    scores = [k for k in SCORE_KEYS if any(k in r for r in train)]
    zeroshot = [ZEROSHOT_KEY] if any(ZEROSHOT_KEY in r for r in val) else []
    return {"train": {key: [r.get(key) for r in train]
                      for key in ("step", "loss", "lr", *losses, *scores)},
            "val": {key: [r.get(key) for r in val]
                    for key in ("epoch", "step", "rsum", "i2t_r1", "t2i_r1", *zeroshot)}}


@dataclass
class Series:
    """One line: ``run`` (the index of its run: its colour), ``label``, its points and style."""

    run: int
    label: str
    x: list
    y: list
    style: str


@dataclass
class Panel:
    """One plot of the picture: its title, the name of its x axis and its lines."""

    title: str
    x_label: str
    series: list[Series] = field(default_factory=list)


def same_values(a: list, b: list) -> bool:
    """Whether two logged curves are one line: null at the same steps, equal elsewhere up to
    float32 rounding (the total is summed in the objective's dtype)."""
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or math.isclose(x, y, rel_tol=1e-6))
        for x, y in zip(a, b))


def distinct_losses(train: dict[str, list]) -> list[list[str]]:
    """The loss keys of ``train`` (as :func:`read_curves` gives them) in groups of equal
    values, in order: each group is drawn as one line (``[["loss", "goal_loss"]]`` for a
    single term, whose total is that term)."""
    groups: list[list[str]] = []
    for key in (k for k in train if k.endswith("loss")):
        same = next((g for g in groups if same_values(train[g[0]], train[key])), None)
        if same is None:
            groups.append([key])
        else:
            same.append(key)
    return groups


def chosen_panels(runs: list[tuple[str, dict[str, dict[str, list]]]]) -> list[Panel]:
    """The panels of ``runs`` (``(label, read_curves(run))`` each) and their lines: the four
    always, the zero-shot and GOAL score panels where a run logged their keys."""
    loss = Panel("training loss", "step")
    lr = Panel("learning rate", "step")
    # validations every N steps (several an epoch): drawn by step, else by epoch
    by = "step" if any(len(set(c["val"]["epoch"])) < len(c["val"]["epoch"])
                       for _, c in runs) else "epoch"
    rsum = Panel("validation rsum", by)
    recall = Panel("validation R@1", by)
    zeroshot = Panel("zero-shot top-1 (%)", by)
    scores = Panel("GOAL scores: medians and lam", "step")
    for run, (label, curves) in enumerate(runs):
        train, val = curves["train"], curves["val"]
        at = val[by]  # the validations' x
        for style, keys in zip(itertools.cycle(LINE_STYLES), distinct_losses(train)):
            loss.series.append(Series(run, f"{label}: {' = '.join(keys)}", train["step"],
                                      train[keys[0]], style))
        lr.series.append(Series(run, label, train["step"], train["lr"], "-"))
        rsum.series.append(Series(run, label, at, val["rsum"], "-o"))
        recall.series += [Series(run, f"{label}: i2t", at, val["i2t_r1"], "-o"),
                          Series(run, f"{label}: t2i", at, val["t2i_r1"], "--s")]
        if ZEROSHOT_KEY in val:
            zeroshot.series.append(Series(run, label, at, val[ZEROSHOT_KEY], "-o"))
        for style, key in zip(LINE_STYLES, (k for k in SCORE_NAMES if k in train)):
            scores.series.append(Series(run, f"{label}: {SCORE_NAMES[key]}", train["step"],
                                        train[key], style))
    return [loss, lr, rsum, recall] + [p for p in (zeroshot, scores) if p.series]


def plot_curves(runs: list[Path], labels: list[str], out: Path) -> list[Panel]:
    """Draw the runs' panels (:func:`chosen_panels`) into ``out``; return them."""
    panels = chosen_panels([(label, read_curves(run)) for run, label in zip(runs, labels)])
    plt = pyplot("mmgoal plot-curves")
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.5 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        for series in panel.series:
            _line(ax, series, colours[series.run % len(colours)])
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.x_label)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    plt.close(fig)
    return panels


def _line(ax, series: Series, colour: str) -> None:
    points = [(a, b) for a, b in zip(series.x, series.y) if a is not None and b is not None]
    if points:
        ax.plot(*zip(*points), series.style, color=colour, label=series.label, markersize=4)


def default_out(runs: list[Path], labels: list[str]) -> Path:
    """Where the picture goes without ``--out``: the first run's folder (a metrics.jsonl's
    folder), ``curves.png`` for one run, ``curves_<label>_<label>...png`` for several, so a
    comparison never replaces a run's own picture."""
    folder = runs[0] if runs[0].is_dir() else runs[0].parent
    if len(runs) == 1:
        return folder / "curves.png"
    names = [re.sub(r"[^\w.-]+", "-", label) for label in labels]  # a label is no path
    return folder / f"curves_{'_'.join(names)}.png"


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl)")
    parser.add_argument("--labels", nargs="+", help="a name per run (default: folder names)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: in the first run's "
                                                 "folder, curves.png for one run)")
    args = parser.parse_args(argv)
    labels = args.labels or [run.name if run.is_dir() else run.parent.name for run in args.runs]
    try:
        if len(labels) != len(args.runs):
            raise ValueError(f"--labels names {len(labels)} runs, {len(args.runs)} are given")
        out = args.out or default_out(args.runs, labels)
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder; give a file name such as "
                             f"{out / 'curves.png'}")
        plot_curves(args.runs, labels, out)
    except INPUT_ERRORS as error:
        return print_error(error)
    print(f"curves of {len(args.runs)} run(s) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
