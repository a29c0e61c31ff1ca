"""The feature gather on 2 ranks: mmgoal's (reduce-scatter backward, one shape exchange)
against the previous one (all-reduce backward, a shape exchange per tensor).

    python bench/gather.py [--per-rank 64] [--regions 36] [--words 20] [--dim 1024] [--steps 20]
    python bench/gather.py --backend nccl      # 2 GPUs, one per rank (bench/gpu_check.py)

Two CPU processes (gloo, ``OMP_NUM_THREADS=1`` each; with ``--backend nccl``, one
GPU each) gather SCAN-sized features
of a training batch, as ``train.gather_features: true`` does: image features
(pooled embedding, ``--regions`` region tokens) and text features (pooled
embedding, word tokens and mask, rank 1's captions 3 words longer than rank 0's,
so the words are padded), score the global batch against itself with a token
product, and run the backward. Each timed step, from a barrier to a barrier, is
the gather, the product and the backward; the two implementations alternate step
by step on the same features after 3 warm-up steps each. The baseline is the
gather mmgoal had before (in this script, ``previous_gather_features``): every
tensor's shapes all-gathered first, the backward an all-reduce of the whole
global gradient, each rank keeping its own slice.

Prints the median ms/step of each, the bytes each rank sends per step as ring
collectives send them (``CountingBytes``: an all-reduce sends twice what a
reduce-scatter of the same gradient sends), and, on lines starting with
``gather``, the ratios mmgoal / previous.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from ranks import joined, run_ranks  # bench/ranks.py
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
IMPLEMENTATIONS = ("previous", "mmgoal")


class _PreviousAllGather(torch.autograd.Function):
    """The gather mmgoal had before: its backward all-reduces the whole gradient."""

    @staticmethod
    def forward(ctx, local):
        ctx.rank, ctx.size = dist.get_rank(), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size]


def previous_gather(local, pad_dim=None):
    shape = torch.tensor(local.shape, dtype=torch.long)
    shapes = [torch.empty_like(shape) for _ in range(WORLD)]
    dist.all_gather(shapes, shape)
    if pad_dim is not None:
        width = max(int(s[pad_dim]) for s in shapes)
        if local.shape[pad_dim] < width:
            pad = [0, 0] * (local.dim() - pad_dim - 1) + [0, width - local.shape[pad_dim]]
            local = torch.nn.functional.pad(local, pad)
    if local.dtype == torch.bool:
        return _PreviousAllGather.apply(local.to(torch.uint8)).bool()
    return _PreviousAllGather.apply(local)


def previous_gather_features(features):
    values = {}
    for field in dataclasses.fields(features):
        value = getattr(features, field.name)
        if isinstance(value, torch.Tensor):
            token_like = value.dim() >= 3 or (value.dim() == 2 and value.dtype == torch.bool)
            value = previous_gather(value, pad_dim=1 if token_like else None)
        values[field.name] = value
    return type(features)(**values)


class CountingBytes(TorchDispatchMode):
    """Adds up the bytes each rank sends in the collectives while installed (the
    ``dist`` calls of the previous gather, torch's functional collectives of mmgoal's),
    as a ring algorithm sends them (NCCL's and gloo's large-message algorithms): an
    all-gather of ``n`` bytes per rank sends ``(W - 1) n``, a reduce-scatter of an
    ``N``-byte input ``(W - 1) / W N``, an all-reduce of ``N`` bytes ``2 (W - 1) / W N``."""

    NAMES = ("all_gather", "all_reduce")
    SENT = {"all_gather": WORLD - 1, "all_gather_into_tensor": WORLD - 1,
            "reduce_scatter_tensor": (WORLD - 1) / WORLD, "all_reduce": 2 * (WORLD - 1) / WORLD}

    def __init__(self):
        super().__init__()
        self.bytes = 0.0
        self.originals = {name: getattr(dist, name) for name in self.NAMES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.removesuffix(".default")
        if func.namespace == "_c10d_functional" and name in self.SENT:
            self.bytes += self.SENT[name] * args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))

    def _wrap(self, name):
        original = self.originals[name]

        def call(*args, **kwargs):
            tensor = args[0] if name == "all_reduce" else args[1]  # the input
            self.bytes += self.SENT[name] * tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return call

    def __enter__(self):
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)
        return super().__exit__(*exc)


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    with joined(rank, port, WORLD, args.backend):
        from mmgoal.distributed import gather
        from mmgoal.structures import ImageFeatures, TextFeatures

        gathers = {"previous": previous_gather_features, "mmgoal": gather}
        torch.manual_seed(rank)
        words = args.words + 3 * rank
        regions = torch.randn(args.per_rank, args.regions, args.dim, device=device,
                              requires_grad=True)
        word_tokens = torch.randn(args.per_rank, words, args.dim, device=device,
                                  requires_grad=True)
        times = {name: [] for name in IMPLEMENTATIONS}
        moved = {}
        for index in range(3 + args.steps):
            for name in IMPLEMENTATIONS if index % 2 else IMPLEMENTATIONS[::-1]:
                dist.barrier()
                start = time.perf_counter()
                with CountingBytes() as counter:
                    images = gathers[name](ImageFeatures(regions.mean(1), tokens=regions))
                    texts = gathers[name](TextFeatures(
                        word_tokens.mean(1), tokens=word_tokens,
                        mask=torch.ones(args.per_rank, words, dtype=torch.bool,
                                        device=device)))
                    # a token product of the global batch (SCAN's score is one of these)
                    scores = torch.einsum("ird,jwd->ij", images.tokens, texts.tokens)
                    (scores.sum() + (images.embedding @ texts.embedding.T).sum()).backward()
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if index >= 3:
                    times[name].append(time.perf_counter() - start)
                moved[name] = counter.bytes
                regions.grad = word_tokens.grad = None
        if rank == 0:
            queue.put((times, moved))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-rank", type=int, default=64, help="batch size of each rank")
    parser.add_argument("--regions", type=int, default=36, help="image tokens per image")
    parser.add_argument("--words", type=int, default=20, help="words of rank 0's captions")
    parser.add_argument("--dim", type=int, default=1024, help="feature size (SCAN: 1024)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: one GPU per rank (needs 2)")
    args = parser.parse_args()
    times, moved = run_ranks(worker, args, WORLD)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    ranks = "GPU ranks (nccl)" if args.backend == "nccl" else "CPU ranks (gloo, 1 thread each)"
    print(f"torch {torch.__version__}, {WORLD} {ranks}, "
          f"{args.per_rank} pairs per rank, {args.regions} regions, {args.words}/"
          f"{args.words + 3} words, dim {args.dim}, median of {args.steps} steps")
    for name in IMPLEMENTATIONS:
        print(f"  {name:<8} gather + token product + backward: {ms[name]:7.1f} ms/step, "
              f"{moved[name] / 2**20:7.1f} MiB sent per rank")
    print(f"gather mmgoal/previous, step time ratio {ms['mmgoal'] / ms['previous']:.3f} "
          f"({ms['mmgoal']:.1f} vs {ms['previous']:.1f} ms/step)")
    print(f"gather mmgoal/previous, bytes sent ratio {moved['mmgoal'] / moved['previous']:.3f} "
          f"({moved['mmgoal'] / 2**20:.1f} vs {moved['previous'] / 2**20:.1f} MiB per rank)")


if __name__ == "__main__":
    main()
