"""Training curves of one or more runs from their metrics.jsonl, as one picture.

    mmgoal plot-curves work_dirs/quickstart --out curves.png
    mmgoal plot-curves work_dirs/a work_dirs/b --labels triplet goal --out ab.png

Four panels: the training losses (every ``*_loss`` term and their sum) and
the learning rate against the step, the validation rsum and R@1 (both
directions) against the epoch; epoch -1, where a run has it
(``train.eval_before_training``), is the loaded model before any step. Runs are
overlaid, one colour each. Steps whose loss was NaN/inf (written as null) are
left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mmgoal.cli.arguments import INPUT_ERRORS, print_error, tool_parser
from mmgoal.extras import pyplot
from mmgoal.files import MAX_ANNOTATION_BYTES, read_text, save_figure


def read_curves(run: Path) -> dict[str, dict[str, list]]:
    """``{"train": {"step": [...], "loss": [...], "lr": [...], "<term>_loss": [...]},
    "val": {"epoch": [...], "rsum": [...], "i2t_r1": [...], "t2i_r1": [...]}}`` of a run
    directory (or of a metrics.jsonl file); a key missing in a record is None there."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a run directory (its "
                                f"--work-dir) or a metrics.jsonl file")
    records = [json.loads(line) for line in read_text(path, "metrics log", MAX_ANNOTATION_BYTES)
               .splitlines() if line.strip()]
    train = [r for r in records if r.get("type") == "train"]
    val = [r for r in records if r.get("type") == "val"]
    losses = sorted({k for r in train for k in r if k.endswith("_loss")})
    return {"train": {key: [r.get(key) for r in train] for key in ("step", "loss", "lr", *losses)},
            "val": {key: [r.get(key) for r in val]
                    for key in ("epoch", "rsum", "i2t_r1", "t2i_r1")}}


def plot_curves(runs: list[Path], labels: list[str], out: Path) -> None:
    plt = pyplot("mmgoal plot-curves")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (run, label) in enumerate(zip(runs, labels)):
        colour = colours[index % len(colours)]
        curves = read_curves(run)
        train, val = curves["train"], curves["val"]
        for style, key in zip(("-", "--", ":", "-."), [k for k in train if k.endswith("loss")]):
            _line(axes[0, 0], train["step"], train[key], colour, style, f"{label}: {key}")
        _line(axes[0, 1], train["step"], train["lr"], colour, "-", label)
        _line(axes[1, 0], val["epoch"], val["rsum"], colour, "-o", label)
        _line(axes[1, 1], val["epoch"], val["i2t_r1"], colour, "-o", f"{label}: i2t")
        _line(axes[1, 1], val["epoch"], val["t2i_r1"], colour, "--s", f"{label}: t2i")
    for ax, (title, x) in zip(axes.flat, (("training loss", "step"), ("learning rate", "step"),
                                         ("validation rsum", "epoch"),
                                         ("validation R@1", "epoch"))):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    plt.close(fig)


def _line(ax, x: list, y: list, colour: str, style: str, label: str) -> None:
    points = [(a, b) for a, b in zip(x, y) if a is not None and b is not None]
    if points:
        ax.plot(*zip(*points), style, color=colour, label=label, markersize=4)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl)")
    parser.add_argument("--labels", nargs="+", help="a name per run (default: folder names)")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), help="PNG to write")
    args = parser.parse_args(argv)
    labels = args.labels or [run.name if run.is_dir() else run.parent.name for run in args.runs]
    try:
        if len(labels) != len(args.runs):
            raise ValueError(f"--labels names {len(labels)} runs, {len(args.runs)} are given")
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a folder; give a file name such as "
                             f"{args.out / 'curves.png'}")
        plot_curves(args.runs, labels, args.out)
    except INPUT_ERRORS as error:
        return print_error(error)
    print(f"curves of {len(args.runs)} run(s) written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
