"""Objectives on score tiles against the anchors: their dense autograd formulas and open_clip.

    python bench/tiles.py                       # memory at n = 4k, 16k, 64k; time at 4k, 16k
    python bench/tiles.py --n 4096 --threads 1
    python bench/tiles.py --ranks 2 4 --n 4096  # each rank's CPU time on gloo ranks

Every objective takes n L2-normalised float32 embedding pairs of d = 128 and computes its
loss and the gradients of both embeddings (forward and backward, scores computed inside
both sides). The anchors, on the same embeddings:

* InfoNCE: open_clip's ``ClipLoss`` (``local_loss=True`` with ``gather_with_grad`` on
  ranks); SigLIP: open_clip's ``SigLipLoss``;
* TripletLoss (hardest negative) and GOAL: VSE++'s autograd hardest-negative code
  (``S = im @ s.T``, the masked maxima, the hinges), which GOAL's speed is measured
  against; the sum of hinges and multi-similarity: their row formulas on ``S``, ``S.T``
  (on ranks, each rank computes them on the gathered global batch).

One process: each measurement runs in a fresh process; the peak resident memory above
what it held once the embeddings were made is the objective's (``ru_maxrss``), and a
second pass counts the peak of torch's live tensors of at least a tile's size (in score
matrices; a tile is 1024 x 4096). A formula that would need more than the machine holds is
not run. Ranks: ``torch.multiprocessing`` gloo ranks on this machine, each timed by its own
CPU time (``time.process_time``), global batch n, n / world pairs a rank.
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
import weakref

DIM = 128
OURS = {
    "InfoNCELoss": {"type": "InfoNCELoss", "learnable": False},
    "SigLIPLoss": {"type": "SigLIPLoss", "learnable": False},
    "TripletLoss": {"type": "TripletLoss"},
    "TripletLoss(all)": {"type": "TripletLoss", "max_violation": False},
    "MultiSimilarityLoss": {"type": "MultiSimilarityLoss"},
    "GOAL cir x sig_ms": {"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"},
    "GOAL nca x con": {"type": "GoalObjective", "triplet": "nca", "pair": "con"},
}
# the anchor of each: open_clip's loss where it has one, else the autograd formula
ANCHOR = {"InfoNCELoss": "open_clip ClipLoss", "SigLIPLoss": "open_clip SigLipLoss",
          "TripletLoss": "VSE++ autograd", "TripletLoss(all)": "autograd formula",
          "MultiSimilarityLoss": "autograd formula", "GOAL cir x sig_ms": "VSE++ autograd",
          "GOAL nca x con": "VSE++ autograd"}
# score matrices a formula holds at its peak (forward and backward), to skip what won't fit
MATRICES = {"open_clip ClipLoss": 6, "open_clip SigLipLoss": 5, "VSE++ autograd": 5,
            "autograd formula": 8}


def matrix_sized_tensors(nbytes: int, unit: int, counted=None):
    """A ``TorchDispatchMode`` that keeps the peak of the bytes held by the tensors of at
    least ``nbytes`` that ops create while it is on (views and in-place results left out),
    in units of ``unit`` bytes (``.peak``); ``counted(tensor)``: which count (all)."""
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
                if storage.nbytes() < nbytes or storage.data_ptr() in self.held or (
                        counted is not None and not counted(tensor)):
                    continue
                self.held[storage.data_ptr()] = storage.nbytes() / unit
                self.live += self.held[storage.data_ptr()]
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._freed, storage.data_ptr())
            return out

        def _freed(self, key) -> None:
            self.live -= self.held.pop(key)

    return MatrixSizedTensors()


def embeddings(n: int, seed: int = 0):
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n, DIM, generator=generator), dim=-1)
    texts = F.normalize(torch.randn(n, DIM, generator=generator), dim=-1)
    return images.requires_grad_(), texts.requires_grad_()


def anchor_step(name: str, images, texts, world: int = 1):
    """The anchor's forward and backward on the embeddings (a rank's, on ranks)."""
    import torch
    import torch.nn.functional as F

    kind = ANCHOR[name]
    if kind.startswith("open_clip"):
        import open_clip

        if kind.endswith("ClipLoss"):
            loss = open_clip.ClipLoss(local_loss=world > 1, gather_with_grad=world > 1,
                                      rank=_rank(), world_size=world)
            scale = torch.tensor(1 / 0.07)
        else:
            from open_clip.loss import SigLipLoss

            loss = SigLipLoss(rank=_rank(), world_size=world)
            scale = torch.tensor(10.0)

        def step():
            args = (images, texts, scale) if kind.endswith("ClipLoss") else \
                (images, texts, scale, torch.tensor(-10.0))
            loss(*args).backward()
        return step
    from mmgoal.objectives.classic import multi_similarity_rows
    from mmgoal.objectives.triplet import sum_of_hinges

    def step():
        mine, theirs = images, texts
        if world > 1:  # every rank scores the gathered global batch, as a loop would
            from mmgoal.distributed import gather

            mine, theirs = gather(images), gather(texts)
        s = mine @ theirs.T
        if name == "TripletLoss(all)":
            p = torch.eye(len(s), dtype=torch.bool)
            value = sum_of_hinges(s, p, 0.2).sum() + sum_of_hinges(s.T, p.T, 0.2).sum()
        elif name == "MultiSimilarityLoss":
            p = torch.eye(len(s), dtype=torch.bool)
            value = (multi_similarity_rows(s, p, 2.0, 10.0, 0.5, 0.1).sum()
                     + multi_similarity_rows(s.T, p.T, 2.0, 10.0, 0.5, 0.1).sum())
        else:  # VSE++'s max-violation hinge (its ContrastiveLoss), both directions
            diagonal = s.diag()
            masked = s.masked_fill(torch.eye(len(s), dtype=torch.bool), float("-inf"))
            value = ((0.2 + masked.amax(1) - diagonal).clamp(min=0).sum()
                     + (0.2 + masked.amax(0) - diagonal).clamp(min=0).sum())
        F.relu(value).backward()
    return step


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def ours_step(name: str, images, texts, world: int = 1):
    """mmgoal's forward and backward on the score tiles (a rank's share, on ranks)."""
    import torch

    from mmgoal.distributed import gather, global_losses
    from mmgoal.registry import OBJECTIVES as REGISTRY
    from mmgoal.scoring import DotScorer, ScoreTiles
    from mmgoal.structures import ObjectiveInputs

    objective = REGISTRY.build(OURS[name])

    def step():
        own, all_images, all_texts = None, images, texts
        if world > 1:
            all_images, all_texts = gather(images), gather(texts)
            own = slice(_rank() * len(images), (_rank() + 1) * len(images))
        n = len(all_images)
        tiles = ScoreTiles(DotScorer(all_images, all_texts), n, n, torch.arange(n), rows=own,
                           own_texts=own)
        outputs = objective(ObjectiveInputs(None, tiles=tiles))
        if world > 1:
            outputs = global_losses(outputs, world)
        sum(v for k, v in outputs.items() if k.endswith("_loss")).backward()
    return step


def beyond_features(n: int):
    """Whether a tensor is something else than O(n) numbers or rows of features (a vector
    of at most a few n values, an (m, d) block of rows with m at most a few n): what a tile
    and its temporaries are."""
    def counted(tensor) -> bool:
        shape = tuple(tensor.shape)
        return not (len(shape) <= 2 and shape[:1] and shape[0] <= 4 * n
                    and (len(shape) == 1 or shape[1] <= DIM))
    return counted


def tile_peak(name: str, n: int, threads: int) -> dict:
    """The peak MiB of the live tensors a step makes beyond the features and the O(n)
    statistics (one tile and its temporaries), and of everything it makes."""
    import torch

    torch.set_num_threads(threads)
    images, texts = embeddings(n)
    step = ours_step(name, images, texts)
    step()
    images.grad = texts.grad = None
    with matrix_sized_tensors(0, 2**20, beyond_features(n)) as beyond, \
            matrix_sized_tensors(0, 2**20) as everything:
        step()
    return {"beyond_mib": beyond.peak, "all_mib": everything.peak}


def measure(name: str, side: str, n: int, threads: int, memory: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    images, texts = embeddings(n)
    step = (ours_step if side == "mmgoal" else anchor_step)(name, images, texts)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    step()
    seconds = [time.perf_counter() - start]
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    for _ in range(0 if memory else 2):  # the median of three where time is measured
        images.grad = texts.grad = None
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    allocated = None
    if memory:
        images.grad = texts.grad = None
        with matrix_sized_tensors(1024 * 4096 * 4 + 1, 4 * n * n) as counter:
            step()
        allocated = counter.peak
    return {"seconds": sorted(seconds)[len(seconds) // 2], "peak_mib": rise / 1024,
            "allocated": allocated}


def fits(name: str, side: str, n: int) -> bool:
    if side == "mmgoal":
        return True
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return MATRICES[ANCHOR[name]] * n * n * 4 < 0.8 * total


def worker(name: str, side: str, n: int, threads: int, memory: bool) -> dict | None:
    if not fits(name, side, n):
        return None
    result = subprocess.run([sys.executable, __file__, "--worker", name, side, "--n", str(n),
                             "--threads", str(threads)] + (["--memory"] if memory else []),
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- ranks
def on_rank(rank: int, world: int, name: str, side: str, n: int, out: str, init: str) -> None:
    import torch
    import torch.distributed as dist

    from mmgoal.distributed import leave_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    images, texts = embeddings(n)
    share = slice(rank * n // world, (rank + 1) * n // world)
    mine = (images[share].detach().requires_grad_(), texts[share].detach().requires_grad_())
    step = (ours_step if side == "mmgoal" else anchor_step)(name, *mine, world)
    step()  # a warm-up
    seconds = []
    for _ in range(3):
        dist.barrier()
        start = time.process_time()
        step()
        seconds.append(time.process_time() - start)
    with open(f"{out}.{rank}", "w") as file:
        file.write(json.dumps(sorted(seconds)[1]))
    leave_process_group()


def rank_seconds(name: str, side: str, n: int, world: int) -> float:
    """The slowest rank's CPU seconds of one step."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "seconds")
        init = f"file://{os.path.join(folder, 'init')}"
        mp.spawn(on_rank, (world, name, side, n, out, init), nprocs=world)
        return max(json.loads(open(f"{out}.{rank}").read()) for rank in range(world))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", help="global batches (default: memory at "
                        "4,096 16,384 65,536; time at 4,096 16,384)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--objectives", nargs="+", choices=list(OURS), default=list(OURS),
                        metavar="NAME", help=f"default all: {', '.join(OURS)}")
    parser.add_argument("--ranks", type=int, nargs="+", metavar="WORLD",
                        help="time each rank's CPU on gloo ranks instead")
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "SIDE"), help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tile-peak", action="store_true",
                        help="only the peak of the tensors made beyond the features and the "
                             "O(n) statistics, at each --n (default 4,096 and 65,536)")
    args = parser.parse_args()
    if args.worker:
        work = tile_peak(args.worker[0], args.n[0], args.threads) if args.tile_peak else \
            measure(*args.worker, args.n[0], args.threads, args.memory)
        print(json.dumps(work))
        return
    if args.tile_peak:
        sizes = args.n or [4096, 65536]
        for name in args.objectives:
            peaks = []
            for n in sizes:
                result = subprocess.run(
                    [sys.executable, __file__, "--worker", name, "mmgoal", "--n", str(n),
                     "--threads", str(args.threads), "--tile-peak"], capture_output=True,
                    text=True, check=True)
                peaks.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"{name:<22} beyond the features and O(n) statistics: "
                  + ", ".join(f"n={n:,} {p['beyond_mib']:.1f} MiB (all {p['all_mib']:.0f})"
                              for n, p in zip(sizes, peaks))
                  + f"; peak ratio {peaks[-1]['beyond_mib'] / peaks[0]['beyond_mib']:.2f}",
                  flush=True)
        return
    if args.ranks:
        sizes = args.n or [4096]
        print(f"each rank's CPU seconds of one step (1 thread a rank), global batch n; the "
              f"anchors: {', '.join(sorted(set(ANCHOR[o] for o in args.objectives)))}")
        for n in sizes:
            for world in args.ranks:
                for name in args.objectives:
                    ours = rank_seconds(name, "mmgoal", n, world)
                    theirs = rank_seconds(name, "anchor", n, world)
                    print(f"{name:<22} n={n:,} {world} ranks: mmgoal {ours:.3f} s, "
                          f"{ANCHOR[name]} {theirs:.3f} s, time ratio {ours / theirs:.2f}",
                          flush=True)
        return
    print(f"d = {DIM}, {args.threads} thread(s); peak resident memory above the embeddings "
          f"(allocated: the peak of torch's live tensors past a tile, in score matrices); "
          f"time: forward and backward, the median of 3, up to n = 16,384")
    for n in args.n or [4096, 16384, 65536]:
        matrix = n * n * 4 / 2**20
        for name in args.objectives:
            ours = worker(name, "mmgoal", n, args.threads, memory=True)
            theirs = worker(name, "anchor", n, args.threads, memory=True)
            line = (f"{name:<22} n={n:,}: mmgoal {ours['peak_mib']:,.0f} MiB (allocated "
                    f"{ours['allocated']:.2f})")
            if theirs is None:
                print(f"{line}; {ANCHOR[name]} does not fit ({MATRICES[ANCHOR[name]]} "
                      f"matrices of {matrix:,.0f} MiB)", flush=True)
                continue
            line += (f", {ANCHOR[name]} {theirs['peak_mib']:,.0f} MiB (allocated "
                     f"{theirs['allocated']:.2f}), memory ratio "
                     f"{ours['peak_mib'] / max(theirs['peak_mib'], 1e-9):.3f}")
            if n <= 16384:
                ours_t = worker(name, "mmgoal", n, args.threads, memory=False)
                theirs_t = worker(name, "anchor", n, args.threads, memory=False)
                line += (f"; {ours_t['seconds']:.3f} s against {theirs_t['seconds']:.3f} s, "
                         f"time ratio {ours_t['seconds'] / theirs_t['seconds']:.2f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
