"""Generate the synthetic-scenes retrieval benchmark as WebDataset shards.

    mmgoal make-synthetic --out data/synthetic
    mmgoal make-synthetic --out data/tiny --train 200 --val 50 --test 100 --flickr-entities
"""

from __future__ import annotations

import time

from mmgoal.cli.arguments import tool_parser
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
    args = parser.parse_args(argv)
    for name in ("train", "val", "test", "image_size", "shard_size"):
        if getattr(args, name) < (0 if name in ("train", "val", "test") else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    start = time.perf_counter()
    counts = {s: getattr(args, s) for s in ("train", "val", "test") if getattr(args, s) > 0}
    summary = write_benchmark(args.out, counts, seed=args.seed, image_size=args.image_size,
                              shard_size=args.shard_size, flickr_entities=args.flickr_entities)
    for split, info in summary["splits"].items():
        print(f"{split:>5}: {info['images']} images, {info['captions']} captions, "
              f"{len(info['shards'])} shard(s) {args.out}/{info['pattern']}")
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
