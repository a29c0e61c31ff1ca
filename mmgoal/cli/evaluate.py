"""Evaluate a checkpoint on a split: R@1/5/10, median/mean rank, rsum; a table and JSON.

    mmgoal eval work_dirs/quickstart        # a run: its best checkpoint
    mmgoal eval work_dirs/quickstart/checkpoints/best.pt   # or an export
    # CONFIG before the checkpoint builds with that config instead of the saved one
    mmgoal eval configs/quickstart.yaml CKPT --split val --folds 5 --out m.json
    # SCAN's ensemble: the mean of the score matrices of several checkpoints (each
    # built from the config saved inside it)
    mmgoal eval configs/scan/scan_t2i_avg_f30k.yaml T2I.pt --ensemble I2T.pt
    # attention precision / recall / F1 against entity boxes (the shards' own, or
    # Flickr30K Entities files joined by image id), with the PR curve as PNG
    mmgoal eval CONFIG CKPT --attention [--entities DIR] [--curve pr.png]
    # a cross encoder: ITC for the gallery, the top K of every query re-scored by ITM
    mmgoal eval configs/xvlm/xvlm_tiny_synthetic.yaml CKPT --rerank-k 16
    # encoding and scoring run on the GPU when there is one (--device cpu to stay on the CPU)
    mmgoal eval CONFIG CKPT --device cuda:1
    # zero-shot: a config alone, with the pretrained weights its model names (a CLIP tag)
    mmgoal eval configs/clip/clip_vit_b_32_coco.yaml --out zero_shot.json
    # COCO 5K test as the field reports it: ECCV Caption mAP@R / R-P / R@1 and CxC R@K
    # beside COCO's R@K (shards with COCO ids; pip install 'mmgoal[coco]'), and the
    # rankings the eccv_caption package reads
    mmgoal eval CONFIG CKPT --protocols coco eccv cxc --rankings rankings.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmgoal import strict_json
from mmgoal.cli.arguments import (
    EVAL_SHORTCUTS,
    INPUT_ERRORS,
    add_data_options,
    add_device_option,
    add_loading_options,
    add_shortcuts,
    apply_loading_options,
    check_out_file,
    config_argument,
    names_shipped_config,
    print_error,
    shortcut_overrides,
    tool_parser,
)
from mmgoal.extras import pyplot
from mmgoal.files import read_text, save_figure, write_text
from mmgoal.runs.schema import PROTOCOLS

if TYPE_CHECKING:  # torch is imported once the arguments are read: --help does without it
    import torch

    from mmgoal.runs.loading import LoadedModel


def plot_curve(report, path: Path, title: str) -> None:
    """The attention precision-recall curve over the T_att sweep (needs the plot extra)."""
    plt = pyplot("the attention precision-recall curve")
    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.plot(report.recall, report.precision, "o-")
    for t, r, p in zip(report.thresholds, report.recall, report.precision):
        ax.annotate(f"{t:g}", (r, p), fontsize=7, xytext=(3, 3), textcoords="offset points")
    best = report.best
    ax.plot([best["recall"]], [best["precision"]], "r*", markersize=12,
            label=f"best F1 {best['f1']:.3f} (T_att {best['t_att']:g})")
    ax.set_xlabel("attention recall")
    ax.set_ylabel("attention precision")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("paths", nargs="+", metavar="[CONFIG] CHECKPOINT",
                        help="a checkpoint (best.pt, last.pt, an export) or a run directory "
                             "(its best checkpoint, else its latest), built with the config "
                             "saved inside it or with CONFIG given before it; a CONFIG alone "
                             "evaluates the pretrained weights its model names (zero-shot)")
    parser.add_argument("--split", default="test", choices=("val", "test"))
    parser.add_argument("--folds", type=int, default=None,
                        help="average over N consecutive image folds (5 for COCO 1K)")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ensemble", nargs="+", default=[], metavar="CKPT",
                        help="more checkpoints whose score matrices are averaged with the "
                             "first; each is built from the config saved inside it")
    parser.add_argument("--rerank-k", type=int, default=None,
                        help="re-rank the top K ITC candidates of every query by ITM (cross "
                             "encoders; 0 = off; default: evaluation.rerank_k of the config)")
    parser.add_argument("--attention", action="store_true",
                        help="also report attention precision/recall/F1 (cross-attention "
                             "models; entity boxes from the shards or --entities)")
    parser.add_argument("--entities", help="a Flickr30K Entities folder (Sentences/, "
                                           "Annotations/), joined to the shards by image id")
    parser.add_argument("--t-iou", type=float, default=0.4, help="IoU for a relevant region")
    parser.add_argument("--t-att", type=float, nargs=3, default=(0.0, 0.1, 0.01),
                        metavar=("FIRST", "LAST", "STEP"),
                        help="the T_att sweep (default 0 0.1 0.01, the paper's; with few "
                             "regions per image the best F1 may lie beyond 0.1)")
    parser.add_argument("--curve", help="PNG for the attention PR curve "
                                        "(default: <checkpoint>.<split>.attention.png)")
    parser.add_argument("--protocols", nargs="+", default=None, choices=PROTOCOLS,
                        help="what to report (default: evaluation.protocols of the config, "
                             "[coco]); eccv, cxc and pm need a COCO 5K test gallery with "
                             "COCO ids (docs/reference/retrieval.md)")
    parser.add_argument("--pm-dir", help="the folder of PM-COCO's pm_*.json (protocol pm; "
                                         "default: evaluation.pm_dir)")
    parser.add_argument("--rankings", help="JSON file for every COCO 5K test query's top "
                                           "items by COCO id, as eccv_caption's Metrics reads "
                                           "them ({\"i2t\": {image: [captions]}, \"t2i\": ...})")
    parser.add_argument("--zeroshot", metavar="DIR",
                        help="also classify the images of this zero-shot classification set "
                             "(CLIP_benchmark's WebDataset layout or an image folder: "
                             "docs/models.md): top-1, top-5, mean per-class recall")
    parser.add_argument("--zeroshot-split", default="test",
                        help="the split of --zeroshot to classify (default test)")
    parser.add_argument("--no-retrieval", action="store_true",
                        help="only the zero-shot classification, no retrieval split")
    parser.add_argument("--out", help="JSON file for the metrics (default: a run directory's "
                                      "eval_<what>.json, beside its config.yaml; "
                                      "<checkpoint>.<what>.json for a checkpoint file or "
                                      "an export; none for a config alone); <what> is the "
                                      "split for the run's own split, else it names the "
                                      "--shards and the --zeroshot set (result_name)")
    add_device_option(parser)
    add_data_options(parser)
    add_loading_options(parser)
    add_shortcuts(parser, EVAL_SHORTCUTS, recorded=False)
    args = parser.parse_args(argv)
    args.cfg_options = [*shortcut_overrides(args, EVAL_SHORTCUTS, {}), *args.cfg_options]
    from mmgoal.data.pipeline import IncompleteSplitError

    apply_loading_options(args)
    if args.no_retrieval and not args.zeroshot:
        parser.error("--no-retrieval leaves nothing to evaluate without --zeroshot DIR")
    if len(args.paths) > 2:
        parser.error(f"give [CONFIG] CHECKPOINT, got {len(args.paths)} paths; more checkpoints "
                     f"go after --ensemble")
    args.config, args.checkpoint = ([None] + args.paths)[-2:]
    if args.config is None and (Path(args.checkpoint).suffix in (".yaml", ".yml")
                                or names_shipped_config(args.checkpoint)):
        args.config, args.checkpoint = args.checkpoint, None  # zero-shot: a config alone
    try:
        if args.config is not None:
            args.config = config_argument(args.config)
        return run(args)
    except IncompleteSplitError as error:  # a shard failed: no metrics over part of the split
        return print_error(error, status=1)
    except INPUT_ERRORS as error:  # ImportError: custom_imports
        return print_error(error)


EVAL_TIMEOUT_MINUTES = 60.0  # a rank waits this long for the others' shares


def is_evaluation(out: Path) -> bool:
    """Whether ``out`` is an earlier evaluation's JSON (small: a checkpoint is not read)."""
    if out.stat().st_size >= 2**24:
        return False
    try:
        previous = json.loads(read_text(out, "results file"))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(previous, dict) and {"split", "metrics"} <= set(previous)


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that is a folder, or a file other than an earlier evaluation's JSON
    (a run's own checkpoint, its config or report, any other file)."""
    check_out_file(out, is_evaluation, "an earlier evaluation's JSON", "test.json")


def run(args: argparse.Namespace) -> int:
    """Evaluate as ``args`` say; under a launcher (``torchrun ... -m mmgoal eval``) every
    rank takes its share of the gallery and rank 0 alone prints and writes."""
    from mmgoal.devices import resolve_device
    from mmgoal.distributed import init_process_group, leave_process_group

    if args.out:
        check_out(Path(args.out))  # before the evaluation's minutes, not after
    if args.entities and not Path(args.entities, "Sentences").is_dir():
        raise FileNotFoundError(f"--entities {args.entities}: no Sentences/ folder there")
    device = resolve_device(args.device, name="--device")
    init_process_group(EVAL_TIMEOUT_MINUTES, device)  # one process: nothing to join
    try:
        return evaluate_on(args, device)
    finally:
        leave_process_group(wait=False)


def evaluate_on(args: argparse.Namespace, device: torch.device) -> int:
    from mmgoal.data.classification import read_classification_set
    from mmgoal.distributed import world_info
    from mmgoal.evaluation.request import AttentionRequest, evaluate, request_for
    from mmgoal.evaluation.retrieval import metrics_table
    from mmgoal.evaluation.zeroshot import format_zeroshot
    from mmgoal.runs.loading import load_for_evaluation, load_zero_shot

    main_rank = world_info()[0] == 0
    say = print if main_rank else lambda *args, **kwargs: None  # rank 0 reports
    trust = args.trust_custom_imports
    if args.checkpoint is None:
        first, source = load_zero_shot(args.config, args.cfg_options, device,
                                       trust_custom_imports=trust)
        say(f"zero-shot: {args.config} with the weights its model sections name ({source}), "
            f"no checkpoint")
    else:
        first = load_for_evaluation(args.checkpoint, args.config, args.cfg_options, device,
                                    trust_custom_imports=trust)
    # every ensemble member is built from the config saved inside its checkpoint
    members = [first] + [load_for_evaluation(path, device=device, trust_custom_imports=trust)
                         for path in args.ensemble]
    scoring = {key: value for key, value in (("rerank_k", args.rerank_k),
                                             ("protocols", args.protocols),
                                             ("pm_dir", args.pm_dir)) if value is not None}
    request = request_for(
        first, None if args.no_retrieval else args.split, args.shards, args.trust_data_paths,
        read_classification_set(args.zeroshot, args.zeroshot_split) if args.zeroshot else None,
        scoring, args.folds, rankings=bool(args.rankings), across_ranks=True)
    what = result_name(args, first)  # before the minutes
    if request.split is not None and args.attention:
        start, stop, step = args.t_att
        request.attention = AttentionRequest(
            [round(start + k * step, 6) for k in range(int(round((stop - start) / step)) + 1)],
            args.t_iou, args.entities)
    evaluation = evaluate(members, request)
    metrics = evaluation.metrics
    if args.zeroshot and main_rank:  # rank 0 classified the set
        say(format_zeroshot(metrics))
    # where the default outputs go: a run directory's own folder, else beside the file
    beside = (Path(args.checkpoint) / f"eval_{what}" if args.checkpoint is not None
              and Path(args.checkpoint, "checkpoints").is_dir() else None)
    # a run directory's checkpoint file; zero-shot: the config
    checkpoint = str(first.checkpoint or args.config)
    beside = str(beside or f"{checkpoint}.{what}")
    zeroshot = zeroshot_set(args.zeroshot, args.zeroshot_split) if args.zeroshot else None
    if request.split is None:  # zero-shot classification alone
        return write_result({"split": zeroshot["split"], "checkpoint": checkpoint,
                             "zeroshot": zeroshot, "metrics": metrics},
                            args.out, beside, first.checkpoint is not None, main_rank)
    folds = request.folds
    name = checkpoint + "".join(f" + {p}" for p in args.ensemble)
    say(f"{args.split} ({folds} fold{'s' if folds > 1 else ''}), {name}:")
    say(metrics_table(metrics))
    if "itc_rsum" in metrics:
        say(f"  (ITM re-ranking of the top {request.scoring.rerank_k}; ITC alone: R@1 "
            f"{metrics['itc_i2t_r1']:.2f} / {metrics['itc_t2i_r1']:.2f}, "
            f"rsum {metrics['itc_rsum']:.2f})")
    result = {"split": args.split, "shards": request.split.shards, "folds": folds,
              "checkpoint": checkpoint, "ensemble": list(args.ensemble),
              "protocols": request.scoring.protocols, "metrics": metrics}
    if zeroshot is not None:
        result["zeroshot"] = zeroshot
    rankings = evaluation.rankings
    if rankings is not None and main_rank:
        write_text(args.rankings, strict_json.dumps(rankings))
        say(f"rankings of {len(rankings['i2t'])} images and {len(rankings['t2i'])} captions "
            f"written to {args.rankings}")
    report = evaluation.attention
    if report is not None:  # rank 0's
        best = report.best
        say(f"attention ({report.phrases} phrases, T_IoU {args.t_iou}): best F1 "
            f"{best['f1']:.4f} at T_att {best['t_att']:g} (precision {best['precision']:.4f},"
            f" recall {best['recall']:.4f})")
        curve = Path(args.curve or f"{beside}.attention.png")
        try:
            plot_curve(report, curve, f"attention PR, {Path(checkpoint).parent.parent.name}")
            say(f"PR curve written to {curve}")
        except ImportError as error:  # the metrics need no matplotlib: report and go on
            say(f"no PR curve: {error}", file=sys.stderr)
        result["attention"] = report.as_dict()
    return write_result(result, args.out, beside, first.checkpoint is not None, main_rank)


def zeroshot_set(root: str, split: str) -> dict:
    """What a result records of the classification set: its ``root`` and the split read
    (None for an image folder without split folders, which is read whole)."""
    return {"root": root, "split": split if Path(root, split).is_dir() else None}


def data_label(place: str, identity: object) -> str:
    """``<place>-<8 hex digits>``: a file-name part for evaluated data, ``place`` for people
    and the hash of ``identity`` telling apart two sets in one place."""
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", place).strip("-.")[:40] or "data"
    return f"{readable}-{digest}"


def shards_label(first: str, listing: list[list]) -> str:
    """:func:`data_label` of shards: their folder's name (that of ``first``, the first
    shard's path) and their names' common start (``coco_test`` for
    ``data/coco/test-{000000..000004}.tar``), hashed with their ``listing``
    (:func:`~mmgoal.data.remote.shard_listing`, what report.json records of a test set),
    so the same files read from anywhere get the same name."""
    folder = os.path.basename(os.path.dirname(first))
    stems = [name.split(".")[0] for name, *_ in listing]  # test-000000.tar: test-000000
    stem = re.sub(r"[-_0-9]+$", "", os.path.commonprefix(stems))
    return data_label("_".join(part for part in (folder, stem) if part), listing)


def is_own_split(listing: list[list], section: Mapping[str, Any] | None) -> bool:
    """Whether the shards of ``listing`` (:func:`~mmgoal.data.remote.shard_listing`) are the
    files of the config's ``section`` (``data.<split>``; None where it has none): its
    shards read from elsewhere."""
    from mmgoal.data.remote import same_shards, shard_listing

    if section is None:
        return False
    try:  # no pipe: command runs, no URL is fetched
        return same_shards(listing, shard_listing(section["shards"]))
    except (OSError, ValueError):  # the run's data is gone or moved: another set
        return False


def result_name(args: argparse.Namespace, loaded: LoadedModel) -> str:
    """What an evaluation's default file is named after (``eval_<name>.json``): the split
    (``test``) where the run's own split is evaluated (its config's shards, or ``--shards``
    naming the same files), else the split and :func:`shards_label` (of ``--shards``, or
    of the shards ``--cfg-options`` set); then, with ``--zeroshot``, ``zeroshot_`` and the
    set's :func:`data_label`. The results of different data never share a name, so none
    overwrites another."""
    from mmgoal.data.remote import expand_shards, shard_listing, split_folder

    parts = []
    section = loaded.config["data"].get(args.split)
    shards = None if args.shards is None else split_folder(args.shards, args.split)
    if shards is None and section and {"data", f"data.{args.split}",
                                       f"data.{args.split}.shards"} & set(loaded.given_keys):
        shards, section = section["shards"], None  # the caller's: another set
    if not args.no_retrieval:
        paths = None if shards is None else expand_shards(shards)
        listing = None if paths is None else shard_listing(paths)  # each file read once
        parts.append(args.split if listing is None or is_own_split(listing, section)
                     else f"{args.split}_{shards_label(paths[0], listing)}")
    if args.zeroshot:
        root = Path(args.zeroshot).resolve()
        parts.append("zeroshot_" + data_label(f"{root.name}_{args.zeroshot_split}",
                                              [str(root), args.zeroshot_split]))
    return "_".join(parts)


def write_result(result: dict, out: str | None, beside: str, from_checkpoint: bool,
                 main_rank: bool) -> int:
    """Rank 0 writes ``result`` to ``out`` or beside the checkpoint (nothing beside a
    config alone: not ``from_checkpoint``)."""
    if (not from_checkpoint and not out) or not main_rank:
        return 0
    path = Path(out or f"{beside}.json")
    check_out(path)
    write_text(path, strict_json.dumps(result, indent=2))
    print(f"metrics written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
