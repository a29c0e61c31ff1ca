"""Evaluate a checkpoint on a split: R@1/5/10, median/mean rank, rsum; a table and JSON.

    python tools/evaluate.py configs/quickstart.yaml work_dirs/quickstart/checkpoints/best.pt
    python tools/evaluate.py CONFIG CKPT --split val --folds 5 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mmgoal.config import load_config  # noqa: E402
from mmgoal.data.transforms import build_transforms  # noqa: E402
from mmgoal.engine.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402
from mmgoal.engine.trainer import metrics_table  # noqa: E402
from mmgoal.evaluation.gallery import evaluate_retrieval  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="the YAML config the checkpoint was trained with")
    parser.add_argument("checkpoint", help="a checkpoint (best.pt, last.pt)")
    parser.add_argument("--split", default="test", choices=("val", "test"))
    parser.add_argument("--folds", type=int, default=None,
                        help="average over N consecutive image folds (5 for COCO 1K)")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="JSON file for the metrics "
                                      "(default: <checkpoint>.<split>.json)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.cfg_options)
        state = load_checkpoint(args.checkpoint)
        split_cfg = cfg["data"].get(args.split)
        if not split_cfg:
            raise ValueError(f"the config has no data.{args.split} section")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model, tokenizer = model_from_checkpoint(cfg, state)
    data_cfg = cfg["data"]
    transform = build_transforms(data_cfg.get("eval_transforms"), data_cfg.get("image_size", 64))
    folds = args.folds or split_cfg.get("folds", 1)
    metrics = evaluate_retrieval(model, split_cfg["shards"], transform, tokenizer,
                                 batch_size=data_cfg.get("eval_batch_size", 256), folds=folds)
    print(f"{args.split} ({folds} fold{'s' if folds > 1 else ''}), {args.checkpoint}:")
    print(metrics_table(metrics))
    out = Path(args.out or f"{args.checkpoint}.{args.split}.json")
    out.write_text(json.dumps({"split": args.split, "folds": folds,
                               "checkpoint": str(args.checkpoint), "metrics": metrics}, indent=2))
    print(f"metrics written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
