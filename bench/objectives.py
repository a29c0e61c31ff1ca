"""Forward+backward time and peak memory of every GOAL combination vs VSE++'s autograd code.

    python bench/objectives.py [--batches 128 1024 4096] [--threads 1 2] [--repeats 10]

Every combination on the score tiles of the same n L2-normalised embedding pairs (d 64),
scores computed inside; baseline: VSE++'s autograd hardest-negative triplet code on the
same embeddings (``S = im @ s.T``, the masked maxima, the hinges; bench/tiles.py's
anchor). Each measurement runs in a fresh process so that its peak resident memory
(``ru_maxrss``) minus the memory held before the objective runs is that objective's own
peak. Prints, per batch size, the median time of each combination and its ratio to the
baseline, and the ratio of peak memory, then one line with the range of the time ratios
and the largest memory ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BASELINE = "VSE++"
TRIPLETS = ("con", "nca", "cir")
PAIRS = ("con", "lin", "sig", "lin_ms", "sig_ms")


def measure(name: str, batch: int, repeats: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)

    from tiles import anchor_step  # bench/tiles.py: VSE++'s autograd code

    from mmgoal.registry import OBJECTIVES
    from mmgoal.scoring import DotScorer, ScoreTiles
    from mmgoal.structures import ObjectiveInputs

    torch.manual_seed(0)
    images = F.normalize(torch.randn(batch, 64), dim=-1).requires_grad_()
    texts = F.normalize(torch.randn(batch, 64), dim=-1).requires_grad_()
    if name == BASELINE:
        step = anchor_step("TripletLoss", images, texts)
    else:
        objective = OBJECTIVES.build({"type": "GoalObjective",
                                      **dict(zip(("triplet", "pair"), name.split("x")))})

        def step() -> None:
            tiles = ScoreTiles(DotScorer(images, texts), batch, batch, torch.arange(batch))
            objective(ObjectiveInputs(None, tiles=tiles))["goal_loss"].backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        images.grad = texts.grad = None
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    times = sorted(times[1:])
    return {"seconds": times[len(times) // 2], "peak_kib": max(peak, 1)}


def run_worker(name: str, batch: int, repeats: int, threads: int) -> dict:
    result = subprocess.run([sys.executable, __file__, "--worker", name, str(batch),
                             "--repeats", str(repeats), "--threads", str(threads)],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="torch threads of each measurement (default 1 and 2)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args.repeats,
                                 args.threads[0])))
        return
    names = [f"{t}x{p}" for t, p in itertools.product(TRIPLETS, PAIRS)]
    for batch, threads in itertools.product(args.batches, args.threads):
        base = run_worker(BASELINE, batch, args.repeats, threads)
        print(f"\nbatch {batch}, {threads} thread(s): baseline {BASELINE}'s autograd code "
              f"{base['seconds'] * 1e3:.2f} ms, peak {base['peak_kib'] / 1024:.1f} MiB")
        print(f"{'combination':<14} {'ms':>9} {'time ratio':>11} {'memory ratio':>13}")
        times, memory = {}, {}
        for name in names:
            r = run_worker(name, batch, args.repeats, threads)
            times[name], memory[name] = (r["seconds"] / base["seconds"],
                                         r["peak_kib"] / base["peak_kib"])
            print(f"{name:<14} {r['seconds'] * 1e3:>9.2f} {times[name]:>11.2f} "
                  f"{memory[name]:>13.2f}", flush=True)
        fastest, slowest = min(times, key=times.get), max(times, key=times.get)
        print(f"objectives batch {batch}, {threads} thread(s): time ratio to {BASELINE}'s "
              f"autograd code from {times[fastest]:.2f} ({fastest}) to {times[slowest]:.2f} "
              f"({slowest}), memory ratio up to {max(memory.values()):.2f}")


if __name__ == "__main__":
    main()
