"""Processes: which rank this is, and gathering features across ranks.

Below the engine, the objectives and the evaluation, which all ask it (the layering:
docs/architecture.md). ``torch.distributed`` itself is joined by the strategy
(:mod:`mmgoal.engine.strategies.base`); these functions work in one process too.

Gathering features across ranks so objectives see the global batch:

Every rank all-gathers the features of all ranks and computes the objective on
the global score matrix, so hardest negatives are mined and weights normalised
over the whole batch (open_clip's gather). The gather's backward sums the
gradients that every rank computed for each slice and hands each rank the sum
for its own slice (``torch.distributed.nn.all_gather``'s rule). With every rank
computing the same global loss ``L``, rank ``r``'s encoder gradient is ``world x
dL/dtheta`` through its slice, and the data-parallel average of those is exactly
one process's gradient of ``L``; a parameter used after the gather (a learnable
temperature, fusion layers) gets ``dL/dtheta`` on every rank, whose average is
again exact. No loss rescaling is needed.

A per-rank (local) loss ``L_r``, computed on rank ``r``'s own pairs (ITM's
``pairs: local``, MLM, box grounding, CCR/CCS), may still reach other ranks'
rows through the gathered features (ITM's negatives): the gather's backward
sums ``dL_s/d(slice r)`` over the ranks ``s`` into rank ``r``'s slice, and a
parameter used after the gather gets ``dL_r/dtheta`` on rank ``r``; the
data-parallel average of either is ``d(mean_r L_r)/dtheta``. So a run trains on
the global loss terms plus the mean over ranks of the local ones, again without
rescaling; a local term is the global one exactly when it is a mean over the
same number of items on every rank (ITM with every row holding a negative).
The trainer logs rank 0's outputs: the local terms as rank 0 computed them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllGather(torch.autograd.Function):
    """all_gather whose backward sums every rank's gradient of each slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        rank, world = world_info()
        ctx.rank, ctx.size = rank, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size]


def _same_shapes(local: torch.Tensor) -> list[torch.Size]:
    shape = torch.tensor(local.shape, dtype=torch.long, device=local.device)
    shapes = [torch.empty_like(shape) for _ in range(world_info()[1])]
    dist.all_gather(shapes, shape)
    return [torch.Size(s.tolist()) for s in shapes]


def gather_with_grad(local: torch.Tensor, pad_dim: int | None = None) -> torch.Tensor:
    """(B, ...) per rank -> (world * B, ...) in rank order, differentiable (see the module doc).

    Args:
        local: this rank's rows; every rank must have the same number of rows
            (training batches drop their last partial batch for that reason).
        pad_dim: a dimension whose size may differ across ranks (token counts);
            it is zero-padded to the largest size before gathering.
    """
    rank, world = world_info()
    if world == 1:
        return local
    shapes = _same_shapes(local)
    if pad_dim is not None:
        width = max(s[pad_dim] for s in shapes)
        if local.shape[pad_dim] < width:
            pad = [0, 0] * (local.dim() - pad_dim - 1) + [0, width - local.shape[pad_dim]]
            local = torch.nn.functional.pad(local, pad)
        shapes = [s[:pad_dim] + s[pad_dim + 1:] for s in shapes]
        mine = local.shape[:pad_dim] + local.shape[pad_dim + 1:]
    else:
        mine = local.shape
    if any(s != mine for s in shapes):
        raise RuntimeError(f"gather_with_grad needs the same shape on every rank, got "
                           f"{[tuple(s) for s in shapes]}; drop partial batches")
    if local.dtype == torch.bool:  # gloo cannot gather bool
        return _AllGather.apply(local.to(torch.uint8)).bool()
    return _AllGather.apply(local)


@torch.no_grad()
def gather_varying_length(local: torch.Tensor) -> torch.Tensor:
    """(n_r,) per rank -> (n_0 + n_1 + ...,): every rank's values in rank order, on every rank.

    The lengths may differ across ranks (statistics of a batch, such as one score per
    positive pair); each rank's values are padded to the longest for the collective
    and cut back after. No gradient.
    """
    if world_info()[1] == 1:
        return local
    lengths = [shape[0] for shape in _same_shapes(local)]
    if not max(lengths):
        return local
    padded = local.new_zeros(max(lengths))
    padded[:len(local)] = local
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    return torch.cat([part[:length] for part, length in zip(parts, lengths)])


def gather_features(features: Any) -> Any:
    """A feature object (tensor or ``ImageFeatures``-like dataclass) gathered over ranks.

    Every tensor field is gathered along the batch; fields of rank 3 or more
    (tokens) and masks are padded along dimension 1 to the longest rank.
    """
    if world_info()[1] == 1:
        return features
    if isinstance(features, torch.Tensor):
        return gather_with_grad(features, pad_dim=1 if features.dim() >= 2 else None)
    if not dataclasses.is_dataclass(features):
        raise TypeError(f"cannot gather features of type {type(features).__name__}; give "
                        f"tensors or a dataclass of tensors (ImageFeatures, TextFeatures)")
    gathered = {}
    for field in dataclasses.fields(features):
        value = getattr(features, field.name)
        if isinstance(value, torch.Tensor):
            token_like = value.dim() >= 3 or (value.dim() == 2 and value.dtype == torch.bool)
            value = gather_with_grad(value, pad_dim=1 if token_like else None)
        gathered[field.name] = value
    return type(features)(**gathered)


def id_hashes(image_ids: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B,) int64 stable hashes of image ids: equal ids, equal numbers, on every rank."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(),
                                        "little", signed=True) for i in image_ids],
                        dtype=torch.long, device=device)


def gather_groups(image_ids: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """(world * B,) group numbers of the global batch on ``device`` (NCCL gathers on the
    GPU): positives are equal image ids."""
    return gather_with_grad(id_hashes(image_ids, device))
