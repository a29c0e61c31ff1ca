"""SCAN + GOAL training: its peak memory's rise with the batch, one process and 2 ranks.

    python bench/scan_train.py                      # batches 64 and 512, one process
    python bench/scan_train.py --ranks 2            # global batches 128 and 512, 2 ranks
    python bench/scan_train.py --tree /tmp/old      # the same, of another clone's code

``configs/scan/scan_goal_synthetic.yaml`` (SCAN t2i, GOAL ``cir x sig_ms`` on its cross
attention, no warm-up) trains ``--steps`` steps on synthetic shards (64 px) through the
trainer, in a fresh process per measurement; printed: the peak resident memory's rise
over the trainer's own build (``ru_maxrss``, after the model, data and optimizer are
made), the seconds a step and, between the first batch and the last, the ratio of the
rises. With ``--ranks``, each gloo rank (one thread) runs its share of the global batch
(``train.scoring: local``) and the largest rank's rise is printed beside one process's
rise at the same global batch. ``--tree`` runs another clone's mmgoal (an older commit)
on the same shards: the baseline of a change.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/scan/scan_goal_synthetic.yaml"


def train(shards: str, batch: int, steps: int, out: str) -> dict:
    """The trainer's steps at ``batch`` a rank; the peak RSS rise over its build."""
    import torch

    from mmgoal.engine.trainer import Trainer
    from mmgoal.runs.schema import load_run_config

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    cfg = load_run_config(ROOT / CONFIG, [
        f"data.train.shards={shards}/train-*.tar", "data.val=null", "data.test=null",
        f"data.train.batch_size={batch}", f"train.samples_per_epoch={batch * steps}",
        "train.epochs=1", "train.progress=false", "train.log_every=1", "hooks=[]",
        "data.num_workers=0", "data.image_size=64", "loggers=[]"])
    trainer = Trainer(cfg, Path(out))
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    trainer.fit()
    seconds = (time.perf_counter() - start) / steps
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - built
    return {"rise_mib": rise / 1024, "seconds": seconds}


def worker(argv: list[str]) -> None:
    shards, batch, steps, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    print(json.dumps(train(shards, batch, steps, out)))


def measure(tree: Path, shards: str, batch: int, steps: int, ranks: int) -> dict:
    """One process's (or each rank's) measurement, in fresh processes of ``tree``'s code."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as out:
        if ranks == 1:
            result = subprocess.run([sys.executable, __file__, "--worker", shards, str(batch),
                                     str(steps), f"{out}/run"], capture_output=True,
                                    text=True, env=env, cwd=tree)
            if result.returncode:
                raise RuntimeError(result.stderr[-3000:])
            return json.loads(result.stdout.strip().splitlines()[-1])
        env.update(OMP_NUM_THREADS="1", BENCH_THREADS="1")
        script = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                  f"from scan_train import train; "
                  f"print('RESULT', json.dumps(train({shards!r}, {batch // ranks}, {steps}, "
                  f"{out!r} + '/run')))")
        Path(out, "rank.py").write_text(script)
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", str(ranks), f"{out}/rank.py"],
                                capture_output=True, text=True, env=env, cwd=tree)
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        found = [json.loads(line.split("RESULT", 1)[1]) for line in result.stdout.splitlines()
                 if line.startswith("RESULT")]
        return {"rise_mib": max(f["rise_mib"] for f in found),
                "seconds": max(f["seconds"] for f in found)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", help="global batches (default: 64 "
                        "512; with --ranks, 128 512)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the clone whose mmgoal runs")
    args = parser.parse_args()
    batches = args.batches or ([64, 512] if args.ranks == 1 else [128, 512])
    from mmgoal.data.synthetic import write_benchmark

    with tempfile.TemporaryDirectory() as shards:
        write_benchmark(shards, {"train": max(batches) * args.steps, "val": 8, "test": 8},
                        seed=0, image_size=64, shard_size=256, progress=False)
        print(f"{CONFIG} of {args.tree}, {args.steps} steps")
        rises = []
        for batch in batches:
            result = measure(args.tree, shards, batch, args.steps, 1)
            line = (f"batch {batch}: one process rises {result['rise_mib']:,.0f} MiB, "
                    f"{result['seconds']:.2f} s a step")
            if args.ranks > 1:
                ranked = measure(args.tree, shards, batch, args.steps, args.ranks)
                line += (f"; {args.ranks} ranks: a rank rises {ranked['rise_mib']:,.0f} MiB, "
                         f"{ranked['seconds']:.2f} s a step, memory ratio "
                         f"{ranked['rise_mib'] / result['rise_mib']:.2f}")
            print(line, flush=True)
            rises.append(result["rise_mib"])
        print(f"rise from batch {batches[0]} to {batches[-1]}: {rises[-1] - rises[0]:,.0f} MiB "
              f"(one process)")


if __name__ == "__main__":
    main()
