"""Generate the synthetic-scenes retrieval benchmark as WebDataset shards.

    mmgoal make-synthetic --out data/synthetic
    mmgoal make-synthetic --out data/tiny --train 200 --val 50 --test 100 --flickr-entities
    mmgoal make-synthetic --classification shape --out data/synthetic_shapes --test 600

``--classification shape|colour`` writes a zero-shot classification set instead: one-object
scenes whose shape (6 classes) or colour (8) is the class, in CLIP_benchmark's WebDataset
layout (``--layout folder``: an image folder), for ``mmgoal eval --zeroshot`` and
``evaluation.zeroshot`` (docs/models.md, "Fine-tune without forgetting").
"""

from __future__ import annotations

import time
from typing import get_args

from mmgoal.cli.arguments import tool_parser
from mmgoal.data.classification import (
    SyntheticLayout,
    SyntheticTask,
    write_synthetic_classification,
)
from mmgoal.data.synthetic import write_benchmark


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--out", required=True, help="folder for the shards")
    parser.add_argument("--train", type=int, default=5000, help="training images")
    parser.add_argument("--val", type=int, default=500, help="validation images")
    parser.add_argument("--test", type=int, default=1000, help="test images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=500, help="images per shard")
    parser.add_argument("--flickr-entities", action="store_true",
                        help="also write Sentences/ and Annotations/ (Flickr30K Entities layout)")
    parser.add_argument("--classification", choices=get_args(SyntheticTask),
                        help="write a zero-shot classification set of --test images instead, "
                             "the class being each one-object scene's shape or colour")
    parser.add_argument("--layout", choices=get_args(SyntheticLayout), default="wds",
                        help="with --classification: CLIP_benchmark's WebDataset layout "
                             "(default) or an image folder")
    args = parser.parse_args(argv)
    for name in ("train", "val", "test", "image_size", "shard_size"):
        if getattr(args, name) < (0 if name in ("train", "val", "test") else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    start = time.perf_counter()
    if args.classification:
        cset = write_synthetic_classification(
            args.out, args.classification, args.test, args.seed, args.image_size,
            args.shard_size, layout=args.layout)
        print(f"{args.classification}: {args.test} images of {len(cset.classnames)} classes "
              f"({', '.join(cset.classnames)}) in {args.out} ({args.layout} layout); done in "
              f"{time.perf_counter() - start:.1f}s")
        return
    counts = {s: getattr(args, s) for s in ("train", "val", "test") if getattr(args, s) > 0}
    summary = write_benchmark(args.out, counts, seed=args.seed, image_size=args.image_size,
                              shard_size=args.shard_size, flickr_entities=args.flickr_entities)
    for split, info in summary["splits"].items():
        print(f"{split:>5}: {info['images']} images, {info['captions']} captions, "
              f"{len(info['shards'])} shard(s) {args.out}/{info['pattern']}")
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
