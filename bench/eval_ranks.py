"""Evaluation on 2 ranks against one process: the same gallery, the time it takes.

    python bench/eval_ranks.py [--images 500] [--models quickstart scan]
    python bench/eval_ranks.py --processes [--images 1000]   # whole `mmgoal eval` processes
    python bench/eval_ranks.py --max-block-mb 32 1024 default  # the scoring blocks' bound

A synthetic test gallery (``--images`` 64-px images, 5 captions each) is evaluated
by ``evaluate_retrieval`` for each model (random weights, vocabulary fitted on the
gallery; ``scan``: SCAN's region tokens scored block by block): once in one
process with one thread, once ``across_ranks`` on 2 CPU processes (gloo, one
thread each), each decoding, encoding and scoring its share. Prints the seconds
of each (from a barrier to the metrics, best of ``--repeats``), the ratio, and
whether the metrics are equal.

``--processes`` measures what a user runs instead: each model's config (the
quickstart, configs/scan/scan_synthetic.yaml) is trained for one epoch on 64
pairs, then ``python -m mmgoal eval RUN`` (one thread) and ``torchrun
--nproc_per_node 2 -m mmgoal eval RUN`` (one thread each) are timed as whole
processes, start-up, imports and the checkpoint's load included, and their
metrics files compared. ``--max-block-mb`` sets ``evaluation.max_block_mb``
(default: the config's, else mmgoal's default for the CPU); several values are
measured one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"quickstart": ROOT / "configs/quickstart.yaml",
           "scan": ROOT / "configs/scan/scan_synthetic.yaml"}


def timed_evaluation(name: str, shards: str, repeats: int, across_ranks: bool,
                     max_block_mb: float | None) -> tuple[float, dict]:
    from mmgoal.data.pipeline import EvalReader
    from mmgoal.evaluation.gallery import evaluate_retrieval

    loaded = build(name, shards)
    best, metrics = float("inf"), {}
    for _ in range(repeats):
        if across_ranks:
            dist.barrier()
        start = time.perf_counter()
        metrics = evaluate_retrieval(loaded.model, EvalReader(shards, 100), loaded.transform,
                                     loaded.tokenizer, progress=False, across_ranks=across_ranks,
                                     scoring={"max_block_mb": max_block_mb})
        best = min(best, time.perf_counter() - start)
    return best, metrics


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    with joined(rank, port, WORLD):
        results = {(name, mb): timed_evaluation(name, args.shards, args.repeats, True, mb)
                   for name in args.models for mb in args.max_block_mb}
        if rank == 0:
            queue.put(results)


def in_processes(args: argparse.Namespace, tmp: Path) -> None:
    """Whole ``mmgoal eval`` processes: one, and 2 under torchrun (see the module's text)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    data = {split: str(tmp / f"{split}-*.tar") for split in ("train", "val", "test")}
    print(f"torch {torch.__version__}, {args.images} images x 5 captions, whole processes: "
          f"`mmgoal eval` x 1 thread vs torchrun {WORLD} ranks x 1 thread", flush=True)
    for name in args.models:
        run = tmp / name
        subprocess.run(
            [sys.executable, "-m", "mmgoal", "train", str(CONFIGS[name]), "--work-dir", str(run),
             "--cfg-options", f"data.train.shards={data['train']}",
             f"data.val.shards={data['val']}", f"data.test.shards={data['test']}",
             "data.train.batch_size=32", "data.num_workers=0", "train.epochs=1", "hooks=[]",
             "train.progress=false", "train.eval_before_training=false"],
            env=env, check=True, capture_output=True)
        for mb in args.max_block_mb:
            options = ["--cfg-options", "data.num_workers=0"] + (
                [f"evaluation.max_block_mb={mb}"] if mb is not None else [])
            seconds, metrics = {}, {}
            for launcher in ("one", "torchrun"):
                out = tmp / f"{name}-{mb}-{launcher}.json"
                command = ([sys.executable, "-m", "mmgoal"] if launcher == "one" else
                           [str(Path(sys.executable).parent / "torchrun"), "--standalone",
                            "--nproc_per_node", str(WORLD), "-m", "mmgoal"])
                command += ["eval", str(run), "--split", "test", "--out", str(out), *options]
                best = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    subprocess.run(command, env=env, check=True, capture_output=True)
                    best = min(best, time.perf_counter() - start)
                seconds[launcher] = best
                metrics[launcher] = json.loads(out.read_text())
            equal = metrics["one"]["metrics"] == metrics["torchrun"]["metrics"]
            print(f"eval_ranks {name} (processes, max_block_mb {mb or 'default'}): {WORLD} "
                  f"ranks / 1 process time ratio {seconds['torchrun'] / seconds['one']:.2f} "
                  f"({seconds['torchrun']:.1f} s vs {seconds['one']:.1f} s); metrics "
                  f"{'equal' if equal else 'DIFFER'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--models", nargs="+", default=["quickstart", "scan"])
    parser.add_argument("--repeats", type=int, default=2, help="the best of how many runs")
    parser.add_argument("--processes", action="store_true",
                        help="time whole `mmgoal eval` processes (one, and torchrun's 2)")
    parser.add_argument("--max-block-mb", nargs="+", default=[None],
                        type=lambda v: None if v == "default" else float(v),
                        help="evaluation.max_block_mb values to measure, MiB or 'default' "
                             "(mmgoal's: the default)")
    args = parser.parse_args()
    from mmgoal.data.synthetic import write_benchmark

    with tempfile.TemporaryDirectory() as tmp:
        splits = {"train": 64, "val": 16, "test": args.images} if args.processes else {
            "test": args.images}
        write_benchmark(tmp, splits, seed=0, image_size=64,
                        shard_size=max(args.images // 4, 1), progress=False)
        if args.processes:
            in_processes(args, Path(tmp))
            return
        args.shards = str(Path(tmp) / "test-*.tar")
        ranks = run_ranks(worker, args, WORLD)
        torch.set_num_threads(1)
        print(f"torch {torch.__version__}, {args.images} images x 5 captions, "
              f"1 process x 1 thread vs {WORLD} gloo ranks x 1 thread")
        for name in args.models:
            for mb in args.max_block_mb:
                alone, metrics = timed_evaluation(name, args.shards, args.repeats, False, mb)
                spread, spread_metrics = ranks[(name, mb)]
                equal = "equal" if spread_metrics == metrics else "DIFFER"
                print(f"eval_ranks {name} (max_block_mb {mb or 'default'}): {WORLD} ranks / "
                      f"1 process time ratio {spread / alone:.2f} ({spread:.1f} s vs "
                      f"{alone:.1f} s); metrics {equal} (rsum {metrics['rsum']:.1f})",
                      flush=True)


if __name__ == "__main__":
    main()
