"""Training step time of ITC + ITM on 2 ranks: ITM on each rank's own pairs vs on the global batch.

    python bench/itm.py [--per-rank 32] [--image-size 64] [--steps 10] [--warmup 2]

Two CPU processes (gloo, ``OMP_NUM_THREADS=1`` each) train the tiny X-VLM of
``configs/xvlm/xvlm_tiny_synthetic.yaml`` (ViT 4 x 128 on 8-pixel patches, BERT
4 x 128 whose last 2 layers fuse the image) in torch DDP as the trainer wraps
it (unused-parameter search on: the ViT's head norm is unused), with its
objective, ``ObjectiveSum(InfoNCELoss, ITMLoss)``, on random images and
captions, features gathered over the ranks (as ``train.gather_features: true``).
Each timed step is the forward and backward of ``TrainingStep`` (DDP's gradient
all-reduce included, no optimizer), from a barrier to a barrier, so the slowest
rank counts. The two ``ITMLoss`` modes alternate step by step on the same
batches, after ``--warmup`` steps of each:

- ``global`` (the old behaviour): every rank runs the fusion layers on all
  ``3 x 2 x per-rank`` pairs of the global batch;
- ``local`` (the default): each rank on its own ``3 x per-rank`` pairs.

Prints the median ms/step of each and, on a line starting with ``itm``, the
ratio local / global.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import joined, run_ranks  # bench/ranks.py

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "xvlm" / "xvlm_tiny_synthetic.yaml"
WORDS = ("a an the red green blue yellow small large circle square star cross triangle left "
         "right of above below next to two three shapes on background").split()
MODES = ("global", "local")
WORLD = 2


def captions(count: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 14))) for _ in range(count)]


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    with joined(rank, port, WORLD):
        from mmgoal.config import load_config
        from mmgoal.data.pipeline import image_id_groups
        from mmgoal.data.tokenizers import WordTokenizer
        from mmgoal.engine.step import TrainingStep
        from mmgoal.objectives.itm import ITMLoss
        from mmgoal.registry import MODELS, OBJECTIVES

        cfg = load_config(CONFIG)
        cfg["model"]["vision"]["model_kwargs"]["img_size"] = args.image_size
        tokenizer = WordTokenizer().fit([" ".join(WORDS)])
        torch.manual_seed(0)  # the same weights on both ranks
        model = MODELS.build(cfg["model"], tokenizer=tokenizer)
        objective = OBJECTIVES.build(cfg["objective"])
        itm = next(t for t in objective.terms if isinstance(t, ITMLoss))
        step = TrainingStep(model, objective).train()
        # The ViT's head norm gets no gradient: the trainer's DDP then keeps searching
        # for unused parameters (strategy.find_unused_parameters: auto), and so does this.
        ddp = torch.nn.parallel.DistributedDataParallel(step, find_unused_parameters=True)
        rng = random.Random(rank)
        torch.manual_seed(1 + rank)  # per rank: dropout and ITM draws, as in training
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for index in range(args.warmup + args.steps):
            images = torch.randn(args.per_rank, 3, args.image_size, args.image_size)
            ids = [f"{rank}-{index}-{i}" for i in range(args.per_rank)]
            batch = {"images": images, **tokenizer(captions(args.per_rank, rng)),
                     "image_ids": ids, "image_groups": image_id_groups(ids)}
            order = MODES if index % 2 else MODES[::-1]
            for mode in order:
                dist.barrier()
                itm.pairs = mode
                start = time.perf_counter()
                ddp(batch)["loss"].backward()
                dist.barrier()
                if index >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
                step.zero_grad(set_to_none=True)
        if rank == 0:
            queue.put(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-rank", type=int, default=32, help="batch size of each rank")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each mode")
    args = parser.parse_args()
    times = run_ranks(worker, args, WORLD)
    ms = {mode: statistics.median(values) * 1e3 for mode, values in times.items()}
    print(f"torch {torch.__version__}, {WORLD} CPU ranks (gloo, 1 thread each), tiny X-VLM "
          f"({CONFIG.name}), {args.per_rank} pairs per rank, {args.image_size} px, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    for mode in MODES:
        pairs = 3 * args.per_rank * (WORLD if mode == "global" else 1)
        print(f"  ITM pairs {mode:<6} ({pairs:>3} fused pairs per rank): "
              f"{ms[mode]:8.1f} ms/step")
    print(f"itm local/global pairs, step time ratio {ms['local'] / ms['global']:.3f} "
          f"({ms['local']:.1f} vs {ms['global']:.1f} ms/step, {WORLD} ranks x "
          f"{args.per_rank})")


if __name__ == "__main__":
    main()
