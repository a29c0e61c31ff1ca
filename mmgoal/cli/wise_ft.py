"""WiSE-FT: retrieval and zero-shot classification between a fine-tune and its start.

    mmgoal wise-ft work_dirs/clip --zeroshot data/shapes --alphas 0 0.25 0.5 0.75 1
    mmgoal export work_dirs/clip --wise-ft 0.5 --format open_clip --out clip_wise/

Each alpha mixes the weights, ``(1 - alpha) x`` the pretrained weights the run started
from ``+ alpha x`` its fine-tuned ones (Wortsman et al., CVPR 2022): 0 is the zero-shot
model, 1 the fine-tune. At each alpha the model is evaluated on the run's retrieval split
(``--split``, or ``--shards``) and, with ``--zeroshot DIR``, on a zero-shot classification
set; the table is printed and written (``wise_ft.json``, ``wise_ft.md``) with its plot
(``wise_ft.png``: zero-shot top-1 against retrieval rsum, one point per alpha) into
``--out`` (default: the run folder's ``wise_ft/``). A run whose config names no
pretrained weights is refused: it has no start to mix with (docs/models.md, "Fine-tune
without forgetting").
"""

from __future__ import annotations

import sys
from pathlib import Path

from mmgoal import strict_json
from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    add_data_options,
    add_device_option,
    add_loading_options,
    apply_loading_options,
    print_error,
    tool_parser,
)
from mmgoal.files import save_figure, write_text

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
COLUMNS = (("rsum", "rsum"), ("i2t_r1", "R@1 i2t"), ("t2i_r1", "R@1 t2i"),
           ("zeroshot_top1", "zero-shot top-1"), ("zeroshot_top5", "top-5"),
           ("zeroshot_mean_per_class_recall", "mean per-class recall"))


def table(rows: list[dict]) -> str:
    """The markdown table of the alphas' metrics (the columns that any row has)."""
    shown = [(key, title) for key, title in COLUMNS if any(key in row for row in rows)]
    lines = ["| alpha | " + " | ".join(title for _, title in shown) + " |",
             "|---" * (len(shown) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['alpha']:g} | " + " | ".join(
            f"{row[key]:.2f}" if key in row else "-" for key, _ in shown) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, title: str) -> None:
    """Zero-shot top-1 against rsum, a point per alpha (rsum against alpha without a
    zero-shot set)."""
    from mmgoal.extras import pyplot

    plt = pyplot("mmgoal wise-ft")
    fig, ax = plt.subplots(figsize=(5, 4))
    zeroshot = all("zeroshot_top1" in row for row in rows)
    has_rsum = all("rsum" in row for row in rows)
    x = [row["rsum"] if has_rsum else row["alpha"] for row in rows]
    y = [row["zeroshot_top1"] if zeroshot else row["rsum"] for row in rows]
    ax.plot(x, y, "-o")
    for row, a, b in zip(rows, x, y):
        ax.annotate(f"{row['alpha']:g}", (a, b), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("retrieval rsum" if has_rsum else "alpha")
    ax.set_ylabel("zero-shot top-1 (%)" if zeroshot else "retrieval rsum")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("source", help="the fine-tuned run (its best checkpoint, else its "
                                       "latest) or a checkpoint file")
    parser.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS),
                        help="the mixing weights of the fine-tune (default 0 0.25 0.5 0.75 1)")
    parser.add_argument("--split", default="test", choices=("val", "test"),
                        help="the retrieval split of the run's config (default test)")
    parser.add_argument("--no-retrieval", action="store_true",
                        help="only the zero-shot classification")
    parser.add_argument("--zeroshot", metavar="DIR",
                        help="a zero-shot classification set (CLIP_benchmark's WebDataset "
                             "layout or an image folder)")
    parser.add_argument("--zeroshot-split", default="test")
    parser.add_argument("--out", type=Path,
                        help="folder for wise_ft.json, .md, .png (default: RUN/wise_ft)")
    add_device_option(parser)
    add_data_options(parser)
    add_loading_options(parser)
    args = parser.parse_args(argv)
    if any(not 0 <= a <= 1 for a in args.alphas):
        parser.error(f"every alpha lies in [0, 1] (0: the pretrained start, 1: the "
                     f"fine-tune), got {args.alphas}")
    if args.no_retrieval and not args.zeroshot:
        parser.error("--no-retrieval leaves nothing to evaluate without --zeroshot DIR")
    apply_loading_options(args)
    try:
        return run(args)
    except INPUT_ERRORS as error:
        return print_error(error)


def run(args) -> int:
    from mmgoal.data.classification import read_classification_set
    from mmgoal.evaluation.request import evaluate, request_for
    from mmgoal.evaluation.wise_ft import WiseFT
    from mmgoal.runs.loading import load_for_evaluation

    loaded = load_for_evaluation(args.source, device=args.device,
                                 trust_custom_imports=args.trust_custom_imports)
    request = request_for(
        loaded, None if args.no_retrieval else args.split, args.shards, args.trust_data_paths,
        read_classification_set(args.zeroshot, args.zeroshot_split) if args.zeroshot else None,
        {"protocols": ["coco"]}, progress=False)
    mix = WiseFT(loaded)  # refuses a run without a pretrained start
    out = args.out or (Path(args.source) / "wise_ft" if Path(args.source).is_dir()
                       else Path(f"{loaded.checkpoint}.wise_ft"))
    rows = []
    for alpha in sorted(set(args.alphas)):
        row = {"alpha": alpha, **evaluate(mix.at(alpha), request).metrics}
        rows.append(row)
        print(f"alpha {alpha:g}: " + ", ".join(f"{title} {row[key]:.2f}"
                                               for key, title in COLUMNS if key in row),
              flush=True)
    text = table(rows)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "wise_ft.json", strict_json.dumps({"source": str(loaded.checkpoint),
                                                        "split": None if request.split is None
                                                        else args.split,
                                                        "zeroshot": args.zeroshot, "rows": rows},
                                                       indent=2))
    write_text(out / "wise_ft.md", text + "\n")
    try:
        plot(rows, out / "wise_ft.png", f"WiSE-FT, {loaded.checkpoint}")
        print(f"table and plot written to {out}")
    except ImportError as error:  # the table needs no matplotlib: report and go on
        print(f"table written to {out}; no plot: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
