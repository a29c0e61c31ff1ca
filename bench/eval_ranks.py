"""Evaluation on 2 ranks against one process: the same gallery, the time it takes.

    python bench/eval_ranks.py [--images 500] [--models quickstart scan]

A synthetic test gallery (``--images`` 64-px images, 5 captions each) is evaluated
by ``evaluate_retrieval`` for each model (random weights, vocabulary fitted on the
gallery; ``scan``: SCAN's region tokens scored block by block): once in one
process with one thread, once ``across_ranks`` on 2 CPU processes (gloo, one
thread each), each decoding, encoding and scoring its share. Prints the seconds
of each (from a barrier to the metrics, best of ``--repeats``), the ratio, and
whether the metrics are equal.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import joined, run_ranks  # bench/ranks.py

sys.path.insert(0, str(Path(__file__).parent))
from eval import build  # noqa: E402  bench/eval.py: a config's model, vocabulary fitted

WORLD = 2


def timed_evaluation(name: str, shards: str, repeats: int, across_ranks: bool
                     ) -> tuple[float, dict]:
    from mmgoal.data.pipeline import EvalReader
    from mmgoal.evaluation.gallery import evaluate_retrieval

    loaded = build(name, shards)
    best, metrics = float("inf"), {}
    for _ in range(repeats):
        if across_ranks:
            dist.barrier()
        start = time.perf_counter()
        metrics = evaluate_retrieval(loaded.model, EvalReader(shards, 100), loaded.transform,
                                     loaded.tokenizer, progress=False, across_ranks=across_ranks)
        best = min(best, time.perf_counter() - start)
    return best, metrics


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    with joined(rank, port, WORLD):
        results = {name: timed_evaluation(name, args.shards, args.repeats, True)
                   for name in args.models}
        if rank == 0:
            queue.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--models", nargs="+", default=["quickstart", "scan"])
    parser.add_argument("--repeats", type=int, default=2, help="the best of how many runs")
    args = parser.parse_args()
    from mmgoal.data.synthetic import write_benchmark

    with tempfile.TemporaryDirectory() as tmp:
        write_benchmark(tmp, {"test": args.images}, seed=0, image_size=64,
                        shard_size=max(args.images // 4, 1), progress=False)
        args.shards = str(Path(tmp) / "test-*.tar")
        ranks = run_ranks(worker, args, WORLD)
        torch.set_num_threads(1)
        print(f"torch {torch.__version__}, {args.images} images x 5 captions, "
              f"1 process x 1 thread vs {WORLD} gloo ranks x 1 thread")
        for name in args.models:
            alone, metrics = timed_evaluation(name, args.shards, args.repeats, False)
            spread, spread_metrics = ranks[name]
            print(f"eval_ranks {name}: {WORLD} ranks / 1 process time ratio "
                  f"{spread / alone:.2f} ({spread:.1f} s vs {alone:.1f} s); metrics "
                  f"{'equal' if spread_metrics == metrics else 'DIFFER'} (rsum "
                  f"{metrics['rsum']:.1f})", flush=True)


if __name__ == "__main__":
    main()
