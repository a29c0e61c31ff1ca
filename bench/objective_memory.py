"""Peak memory and time of the objectives in row blocks against their autograd formulas.

    python bench/objective_memory.py                 # n = 16,384, one process
    python bench/objective_memory.py --n 4096 --threads 1

Baseline, per objective, on the same (n, n) float32 scores of one process: the
objective's plain autograd formula, as a training loop writes it (InfoNCE as open_clip's
``ClipLoss``: ``cross_entropy`` of the scaled logits both ways; SigLIP as open_clip's
``SigLipLoss``: ``logsigmoid`` of the signed logits; the hardest-negative triplet loss as
VSE++ writes it: a masked copy, its maximum, the hinges of every pair; the triplet loss
over all negatives and multi-similarity as their row formulas on ``S`` and ``S.T``).
Each measurement runs in a fresh process: its peak resident memory (``ru_maxrss``) less
what the process held once the scores were made is the forward and backward's own peak,
printed in MiB and in score matrices (the gradient itself is one). A zeroed tensor whose
pages are never written costs no resident memory on a CPU but a whole allocation on a GPU,
so a second pass counts what torch allocates (:class:`MatrixSizedTensors`: the peak of
the live tensors of at least a quarter matrix, in matrices). Prints each objective's
mmgoal and baseline peaks and time, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import weakref

OBJECTIVES = {
    "InfoNCELoss": {"type": "InfoNCELoss", "learnable": False},
    "SigLIPLoss": {"type": "SigLIPLoss", "learnable": False},
    "TripletLoss": {"type": "TripletLoss"},
    "TripletLoss(all)": {"type": "TripletLoss", "max_violation": False},
    "MultiSimilarityLoss": {"type": "MultiSimilarityLoss"},
    "GoalObjective(cir x sig_ms)": {"type": "GoalObjective", "triplet": "cir",
                                    "pair": "sig_ms"},
}


def matrix_sized_tensors(nbytes: int, unit: int):
    """A ``TorchDispatchMode`` that keeps the peak of the bytes held by the tensors of at
    least ``nbytes`` that ops create while it is on (views and in-place results left out),
    in units of ``unit`` bytes (``.peak``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class MatrixSizedTensors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live, self.peak, self.held = 0.0, 0.0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):
                return out  # a view or an in-place result: no new memory
            for tensor in tree_flatten(out)[0]:
                if not hasattr(tensor, "untyped_storage"):
                    continue
                storage = tensor.untyped_storage()
                if storage.nbytes() < nbytes or storage.data_ptr() in self.held:
                    continue
                self.held[storage.data_ptr()] = storage.nbytes() / unit
                self.live += self.held[storage.data_ptr()]
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._freed, storage.data_ptr())
            return out

        def _freed(self, key) -> None:
            self.live -= self.held.pop(key)

    return MatrixSizedTensors()


def formula(name: str):
    """The autograd formula of an objective: (scores, positives) -> loss."""
    import torch
    import torch.nn.functional as F

    from mmgoal.objectives.classic import multi_similarity_rows
    from mmgoal.objectives.triplet import sum_of_hinges

    def infonce(s, p):
        logits, labels = s / 0.07, torch.arange(len(s))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    def siglip(s, p):
        signs = 2 * torch.eye(len(s)) - 1
        return -F.logsigmoid(signs * (10.0 * s - 10.0)).sum() / len(s)  # t = 10, b = -10

    def hardest(s, p, margin=0.2):
        masked = s.masked_fill(p, float("-inf"))
        diagonal = s.diag()
        return ((margin + masked.amax(1) - diagonal).clamp(min=0).sum()
                + (margin + masked.amax(0) - diagonal).clamp(min=0).sum())

    return {
        "InfoNCELoss": infonce, "SigLIPLoss": siglip, "TripletLoss": hardest,
        "TripletLoss(all)": lambda s, p: (sum_of_hinges(s, p, 0.2).sum()
                                          + sum_of_hinges(s.T, p.T, 0.2).sum()),
        "MultiSimilarityLoss": lambda s, p: (
            multi_similarity_rows(s, p, 2.0, 10.0, 0.5, 0.1).sum()
            + multi_similarity_rows(s.T, p.T, 2.0, 10.0, 0.5, 0.1).sum()),
    }.get(name)


def measure(name: str, side: str, n: int, threads: int) -> dict:
    import torch

    from mmgoal.registry import OBJECTIVES as REGISTRY
    from mmgoal.structures import ObjectiveInputs

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    # made in place: a temporary here would raise the peak that the measurement starts from
    scores = torch.empty(n, n).uniform_(-1, 1, generator=generator).requires_grad_()
    positives = torch.eye(n, dtype=torch.bool)
    objective = REGISTRY.build(OBJECTIVES[name]) if side == "mmgoal" else formula(name)

    def forward_backward() -> float:
        if side == "mmgoal":
            out = objective(ObjectiveInputs(scores, positives=positives))
            loss = sum(v for k, v in out.items() if k.endswith("_loss"))
        else:
            loss = objective(scores, positives)
        loss.backward()
        scores.grad = None
        return float(loss)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loss = forward_backward()
    seconds = time.perf_counter() - start
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    with matrix_sized_tensors(n * n, 4 * n * n) as counter:
        forward_backward()
    return {"seconds": seconds, "peak_mib": rise / 1024, "allocated": counter.peak,
            "loss": loss}


def run_worker(name: str, side: str, n: int, threads: int) -> dict:
    result = subprocess.run([sys.executable, __file__, "--worker", name, side, "--n", str(n),
                             "--threads", str(threads)], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16384, help="batch (default 16,384)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--objectives", nargs="+", choices=list(OBJECTIVES),
                        default=list(OBJECTIVES), metavar="NAME",
                        help=f"what to measure (default all: {', '.join(OBJECTIVES)})")
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(*args.worker, args.n, args.threads)))
        return
    matrix_mib = args.n * args.n * 4 / 2**20
    print(f"n = {args.n:,}, {args.threads} thread(s); a score matrix is {matrix_mib:,.0f} MiB")
    print("resident: peak RSS rise in MiB (in matrices); allocated: peak of torch's live "
          "matrix-sized tensors, in matrices")
    print(f"{'objective':<28} {'mmgoal resident':>17} {'allocated':>9} "
          f"{'autograd resident':>19} {'allocated':>9} {'ratio resident':>14} "
          f"{'allocated':>9} {'time':>6}")
    ratios: dict[str, list[float]] = {"allocated": [], "resident": [], "time": []}
    for name in args.objectives:
        ours = run_worker(name, "mmgoal", args.n, args.threads)
        mine = (f"{name:<28} {ours['peak_mib']:>9,.0f} ({ours['peak_mib'] / matrix_mib:>4.2f}) "
                f"{ours['allocated']:>9.2f}")
        if formula(name) is None:  # GOAL has no loss to differentiate
            print(f"{mine} {'-':>19} {'-':>9} {'-':>14} {'-':>9} {'-':>6}  "
                  f"({ours['seconds']:.2f} s)", flush=True)
            continue
        base = run_worker(name, "autograd", args.n, args.threads)
        print(f"{mine} {base['peak_mib']:>11,.0f} ({base['peak_mib'] / matrix_mib:>4.2f}) "
              f"{base['allocated']:>9.2f} {ours['peak_mib'] / base['peak_mib']:>14.2f} "
              f"{ours['allocated'] / base['allocated']:>9.2f} "
              f"{ours['seconds'] / base['seconds']:>6.2f}", flush=True)
        ratios["allocated"].append(ours["allocated"] / base["allocated"])
        ratios["resident"].append(ours["peak_mib"] / base["peak_mib"])
        ratios["time"].append(ours["seconds"] / base["seconds"])
    if ratios["time"]:
        print(f"objective memory at n = {args.n:,}, ratio to the autograd formulas: "
              + ", ".join(f"{key} {min(v):.2f}-{max(v):.2f}" for key, v in ratios.items()))


if __name__ == "__main__":
    main()
