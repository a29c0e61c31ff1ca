"""The COCO protocols (ECCV Caption, CxC) from a 5K x 25K score matrix: mmgoal's
``protocol_metrics`` (top-k lists per query from the matrix, in blocks) against the way users
compute them by hand: rankings exported from the matrix, then the ``eccv_caption`` package.

    python bench/protocols.py [--repeats 3] [--dim 64]

The matrix is a random dual encoder's over the COCO 5K test ids (captions near their image,
so the metrics are neither 0 nor 100). Both sides compute ECCV's mAP@R, R-P, R@1 and CxC's
R@1/5/10 in both directions; the metrics are checked equal, then the times compared.
"""

from __future__ import annotations

import argparse
import random
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    from mmgoal.evaluation.protocols import load_reference, protocol_metrics, protocol_rankings

    with warnings.catch_warnings():  # it warns that ujson is not installed
        warnings.simplefilter("ignore")
        from eccv_caption import Metrics
    reference = load_reference(("eccv", "cxc"))
    rng = random.Random(0)
    images, captions = list(reference.image_ids), list(reference.caption_ids)
    rng.shuffle(images)
    rng.shuffle(captions)
    row = {image: r for r, image in enumerate(images)}
    text_to_image = [row[reference.caption_image[c]] for c in captions]
    g = torch.Generator().manual_seed(0)
    image_emb = torch.randn(len(images), args.dim, generator=g)
    text_emb = torch.randn(len(captions), args.dim, generator=g) \
        + 0.5 * image_emb[torch.tensor(text_to_image)]
    sims = image_emb @ text_emb.T
    protocols = ["eccv", "cxc"]
    package = Metrics()
    ours_s, theirs_s = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ours = protocol_metrics(sims, images, captions, text_to_image, protocols)
        ours_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ranked = protocol_rankings(sims, images, captions, text_to_image, protocols)
        theirs = package.compute_all_metrics(
            ranked["i2t"], ranked["t2i"], target_metrics=(
                "eccv_r1", "eccv_map_at_r", "eccv_rprecision", "cxc_recalls"), Ks=(1, 5, 10))
        theirs_s.append(time.perf_counter() - start)
    for key, value in ours.items():
        protocol, direction, name = key.split("_", 2)
        assert abs(value - 100 * theirs[f"{protocol}_{name}"][direction]) < 1e-9, key
    print(f"ECCV mAP@R i2t {ours['eccv_i2t_map_at_r']:.2f} t2i {ours['eccv_t2i_map_at_r']:.2f}, "
          f"CxC R@1 i2t {ours['cxc_i2t_r1']:.2f} t2i {ours['cxc_t2i_r1']:.2f} (equal on both "
          f"sides)")
    print(f"rankings + eccv_caption (baseline): {min(theirs_s):.2f} s; mmgoal protocol_metrics: "
          f"{min(ours_s):.2f} s (best of {args.repeats}, {torch.get_num_threads()} threads)")
    print(f"ratio mmgoal / baseline: {min(ours_s) / min(theirs_s):.2f}")


if __name__ == "__main__":
    main()
