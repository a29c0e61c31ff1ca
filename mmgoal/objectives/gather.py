"""Gathering features across ranks so objectives see the global batch.

open_clip's local-loss pattern: every rank all-gathers the features of all
ranks, puts its own (gradient-carrying) tensor back in its slot, and computes
the objective on the global score matrix. Each rank then back-propagates only
into its own slice; summed over ranks (``all_reduce`` of the parameter
gradients) that is exactly the gradient of one process holding the whole
batch. Data-parallel wrappers average instead of summing, hence
:func:`global_loss_scale`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """(B, ...) per rank -> (world * B, ...) in rank order; only the local slice has a gradient.

    Every rank must pass the same shape (training batches drop their last
    partial batch for that reason).
    """
    rank, world = world_info()
    if world == 1:
        return local
    shape = torch.tensor(local.shape, device=local.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    if any(not torch.equal(s, shape) for s in shapes):
        raise RuntimeError(f"gather_with_grad needs the same shape on every rank, got "
                           f"{[tuple(s.tolist()) for s in shapes]}; drop partial batches")
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous())
    parts[rank] = local
    return torch.cat(parts)


def global_loss_scale() -> int:
    """Factor for a loss on gathered features under gradient averaging (DDP, DeepSpeed).

    Averaging the ranks' gradients divides their sum by the world size; the sum
    is the single-process gradient, so the loss is multiplied back.
    """
    return world_info()[1]
