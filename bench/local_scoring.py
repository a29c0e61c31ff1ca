"""Local against replicated scoring: each rank's objective time and peak memory.

    python bench/local_scoring.py                          # n 1024 4096, 2 and 4 ranks
    python bench/local_scoring.py --sizes 1024 4096 8192 --worlds 2 4

For a global batch of ``n`` pairs on ``N`` gloo ranks (one thread each), every rank
holds ``n / N`` random unit features per tower and runs mmgoal's training step on them
(``TrainingStep``: the gather, the scoring, the objective, the backward into the
features) with ``train.scoring: replicated`` (the baseline: every rank scores the whole
``n x n`` matrix) and ``local`` (a rank scores its ``n / N`` rows and gets its columns by
one all-to-all; docs/distributed.md, "Local scoring"). Printed per objective and size:
each rank's CPU time of a step (``time.process_time``, best of ``--repeats``, the mean
over ranks: the ranks share this machine's cores, so wall time would count their
waiting) and the rise of its peak resident memory over the step (each mode in processes
of its own), with the ratios local / replicated (goal: at most 0.6 at 2 ranks, 0.35 at
4). For InfoNCE, also against open_clip's own ``ClipLoss(local_loss=True,
gather_with_grad=True)`` on the same features (each rank's image and text features
against every rank's, gathered with gradients: two ``B x n`` logit matrices a rank), its
``logit_scale`` learnable as InfoNCE's temperature is, with the ratio mmgoal local /
open_clip.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import joined, run_ranks  # noqa: E402  (bench/ranks.py)

# the objectives measured, by the name printed
CONFIGS = {"InfoNCELoss": {"type": "InfoNCELoss"}, "TripletLoss": {"type": "TripletLoss"},
           "SigLIPLoss": {"type": "SigLIPLoss"},
           "cir x sig_ms": {"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"},
           "MultiSimilarityLoss": {"type": "MultiSimilarityLoss"}}


class GivenFeatures(torch.nn.Module):
    """A model whose towers hand back the batch's features: the step's work is the
    scoring and the objective alone."""

    def encode_image(self, batch):
        return batch["image_features"]

    def encode_text(self, batch):
        return batch["text_features"]

    def similarity(self, images, texts):
        return images @ texts.T


def worker(rank: int, port: int, args: tuple, queue) -> None:
    objective_name, n, world, dim, mode, repeats = args
    from mmgoal.distributed import id_hashes
    from mmgoal.engine.step import TrainingStep
    from mmgoal.registry import OBJECTIVES

    with joined(rank, port, world):
        share = n // world
        generator = torch.Generator().manual_seed(rank)
        ids = list(range(rank * share, (rank + 1) * share))
        if mode == "open_clip":  # its own local loss on features gathered with gradients
            import open_clip

            clip_loss = open_clip.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank,
                                           world_size=world)
            # learnable, as CLIP's and as InfoNCE's temperature here
            logit_scale = torch.nn.Parameter(torch.tensor(1 / 0.07).log())

            def step(batch):
                loss = clip_loss(batch["image_features"], batch["text_features"],
                                 logit_scale.exp())
                return {"loss": loss}
        else:
            step = TrainingStep(GivenFeatures(), OBJECTIVES.build(CONFIGS[objective_name]),
                                scoring=mode)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        best = float("inf")
        for _ in range(repeats):
            batch = {key: F.normalize(torch.randn(share, dim, generator=generator), dim=-1)
                     .requires_grad_() for key in ("image_features", "text_features")}
            batch.update(image_ids=ids, image_groups=id_hashes(ids))
            torch.distributed.barrier()
            start = time.process_time()
            step(batch)["loss"].backward()
            best = min(best, time.process_time() - start)
        rise_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        results = [None] * world
        torch.distributed.all_gather_object(results, (best, rise_mib))
        if rank == 0:
            queue.put(results)


def measure(objective: str, n: int, world: int, dim: int, mode: str, repeats: int
            ) -> tuple[float, float]:
    """(mean CPU seconds, mean peak-memory rise MiB) over the ranks of one launch."""
    results = run_ranks(worker, (objective, n, world, dim, mode, repeats), world)
    return (sum(r[0] for r in results) / world, sum(r[1] for r in results) / world)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--objectives", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-open-clip", dest="open_clip", action="store_false",
                        help="leave out the comparison with open_clip's local loss")
    args = parser.parse_args(argv)
    for world in args.worlds:
        for objective in args.objectives:
            for n in args.sizes:
                replicated = measure(objective, n, world, args.dim, "replicated", args.repeats)
                local = measure(objective, n, world, args.dim, "local", args.repeats)
                print(f"{objective} n={n} {world} ranks: replicated {replicated[0]:.3f} s "
                      f"{replicated[1]:.0f} MiB, local {local[0]:.3f} s {local[1]:.0f} MiB; "
                      f"ratio time {local[0] / replicated[0]:.2f}, memory "
                      f"{local[1] / max(replicated[1], 1e-9):.2f}", flush=True)
                if objective == "InfoNCELoss" and args.open_clip:
                    theirs = measure(objective, n, world, args.dim, "open_clip", args.repeats)
                    print(f"InfoNCELoss n={n} {world} ranks against open_clip's ClipLoss("
                          f"local_loss, gather_with_grad) {theirs[0]:.3f} s "
                          f"{theirs[1]:.0f} MiB: ratio time {local[0] / theirs[0]:.2f}, "
                          f"memory {local[1] / max(theirs[1], 1e-9):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
