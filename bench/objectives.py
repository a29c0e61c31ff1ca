"""Forward+backward time and peak memory of every GOAL combination vs the autograd TripletLoss.

    python bench/objectives.py [--batches 128 1024 4096] [--threads 1 2] [--repeats 10]

Baseline: ``TripletLoss(max_violation=True)`` (plain autograd) on the same
(n, n) float32 scores. Each measurement runs in a fresh process so that its
peak resident memory (``ru_maxrss``) minus the memory held before the objective
runs is that objective's own peak. Prints, per batch size, the median time of
each combination and its ratio to the baseline, and the ratio of peak memory,
then one line with the range of the time ratios and the largest memory ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time

BASELINE = "TripletLoss"
TRIPLETS = ("con", "nca", "cir")
PAIRS = ("con", "lin", "sig", "lin_ms", "sig_ms")


def measure(name: str, batch: int, repeats: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)

    from mmgoal.registry import OBJECTIVES
    from mmgoal.structures import ObjectiveInputs

    torch.manual_seed(0)
    cfg = {"type": "TripletLoss"} if name == BASELINE else {
        "type": "GoalObjective", **dict(zip(("triplet", "pair"), name.split("x")))}
    objective = OBJECTIVES.build(cfg)
    images = F.normalize(torch.randn(batch, 64), dim=-1)
    texts = F.normalize(torch.randn(batch, 64), dim=-1)
    base = images @ texts.T
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        sims = base.clone().requires_grad_()
        start = time.perf_counter()
        out = objective(ObjectiveInputs(sims))
        sum(v for k, v in out.items() if k.endswith("_loss")).backward()
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
        print(f"\nbatch {batch}, {threads} thread(s): baseline autograd {BASELINE} "
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
        print(f"objectives batch {batch}, {threads} thread(s): time ratio to autograd "
              f"{BASELINE} from {times[fastest]:.2f} ({fastest}) to {times[slowest]:.2f} "
              f"({slowest}), memory ratio up to {max(memory.values()):.2f}")


if __name__ == "__main__":
    main()
