"""Gradient caching against plain steps: the peak memory and the time of a training step.

    python bench/grad_cache.py                      # batch 2048, chunk 128, 32-px images
    python bench/grad_cache.py --batch 1024 --chunk 64 --repeats 1

The quickstart dual encoder (``configs/quickstart.yaml``: a 4-stage CNN, with group norm
here, and a bidirectional GRU, 512-d) with GOAL ``cir x sig_ms``, on random images and captions,
one process and one thread. Each mode runs in a process of its own (so each peak is
its own): the forward and backward of mmgoal's ``TrainingStep`` (no optimizer), the
best of ``--repeats`` steps after one untimed step:

- ``plain small``: a plain step of ``--chunk`` pairs, the memory baseline: what a batch
  of one chunk needs;
- ``plain``: a plain step of ``--batch`` pairs, the time baseline (its whole graph alive
  at once);
- ``cached``: ``--batch`` pairs under ``train.grad_cache_chunk: --chunk``
  (docs/distributed.md, "Gradient caching"): encoded chunk by chunk without a graph,
  the objective on the whole batch, each chunk encoded again and back-propagated.

Printed: each mode's CPU seconds (``time.process_time``) and the rise of its peak
resident memory over its steps (from when the model and the batch are built), then the
ratios (goals: the cached step's peak at most 1.5x the small plain step's, its time at
most 1.4x the plain step's).
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from pathlib import Path

import torch
from ranks import joined, run_ranks  # bench/ranks.py

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
WORDS = ("a an the red green blue yellow small large circle square star cross triangle left "
         "right of above below next to two three shapes on background").split()
MODES = ("plain small", "plain", "cached")


def worker(rank: int, port: int, args: tuple, queue) -> None:
    mode, batch_size, chunk, image_size, repeats = args
    with joined(rank, port, 1):
        from mmgoal.config import load_config
        from mmgoal.data.pipeline import image_id_groups
        from mmgoal.data.tokenizers import WordTokenizer
        from mmgoal.engine.step import TrainingStep
        from mmgoal.registry import MODELS, OBJECTIVES

        cfg = load_config(CONFIG)
        cfg["model"]["image_encoder"]["model_kwargs"]["norm"] = "group"  # no BatchNorm
        tokenizer = WordTokenizer().fit([" ".join(WORDS)])
        torch.manual_seed(0)
        model = MODELS.build(cfg["model"], tokenizer=tokenizer)
        objective = OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir",
                                      "pair": "sig_ms"})
        size = chunk if mode == "plain small" else batch_size
        step = TrainingStep(model, objective,
                            grad_cache_chunk=chunk if mode == "cached" else None).train()
        rng = random.Random(0)

        def batch() -> dict:
            ids = list(range(size))
            captions = [" ".join(rng.choices(WORDS, k=rng.randint(4, 14))) for _ in ids]
            return {"images": torch.randn(size, 3, image_size, image_size),
                    **tokenizer(captions), "image_ids": ids, "image_groups": image_id_groups(ids),
                    "skipped": 0}

        def run(data: dict) -> None:
            if mode != "cached":
                step(data)["loss"].backward()
                return
            _, cache = step.cache_gradients(data)
            for index in range(len(cache.chunks)):
                step(data, replay=(cache, index))["loss"].backward()

        data = batch()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # model and data built
        best = float("inf")
        for repeat in range(repeats + 1):  # the first untimed: first-call allocations
            if not repeat:
                run(data)
                step.zero_grad(set_to_none=True)
                continue
            start = time.process_time()
            run(data)
            best = min(best, time.process_time() - start)
            step.zero_grad(set_to_none=True)
        rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        queue.put((best, rise))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    results = {}
    for mode in MODES:
        results[mode] = run_ranks(worker, (mode, args.batch, args.chunk, args.image_size,
                                           args.repeats), 1)
        size = args.chunk if mode == "plain small" else args.batch
        print(f"{mode} ({size} pairs): {results[mode][0]:.2f} s, peak +{results[mode][1]:.0f} "
              f"MiB", flush=True)
    cached, plain, small = results["cached"], results["plain"], results["plain small"]
    print(f"grad_cache batch {args.batch} chunk {args.chunk}: ratio time "
          f"{cached[0] / plain[0]:.2f} (to the plain step of {args.batch}), peak memory "
          f"{cached[1] / max(small[1], 1e-9):.2f} (to the plain step of {args.chunk}; "
          f"{cached[1] / max(plain[1], 1e-9):.2f} to that of {args.batch})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
