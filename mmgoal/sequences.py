"""Padded sequences: masks from lengths, and packing the kept elements to the front."""

from __future__ import annotations

import torch


def length_mask(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """(B,) lengths -> (B, max_length) bool, True at real elements."""
    return torch.arange(max_length, device=lengths.device)[None] < lengths[:, None]


def pack_kept(values: torch.Tensor, keep: torch.Tensor,
              fill: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the kept elements of every row to its front, in their order; pad with ``fill``.

    Args:
        values: (B, L) or (B, L, D).
        keep: (B, L) bool.

    Returns:
        values (B, L') with L' the most elements any row keeps, lengths (B,).
    """
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    index = order if values.dim() == 2 else order[..., None].expand_as(values)
    lengths = keep.sum(1)
    packed = values.gather(1, index)[:, :int(lengths.max())]
    real = length_mask(lengths, packed.shape[1])
    return packed.masked_fill(~(real if values.dim() == 2 else real[..., None]), fill), lengths
