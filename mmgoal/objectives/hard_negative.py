"""Base of the losses computed on hardest-negative triplets in both directions."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from mmgoal.objectives.mining import mine_triplets, score_tiles
from mmgoal.structures import ObjectiveInputs

# a loss's total over its terms (triplets, hinges), or their mean
Reduction = Literal["sum", "mean"]


class HardNegativeLoss(nn.Module):
    """A per-triplet loss ``triplet_loss(s_p, s_n)`` summed over both directions' triplets
    (docs/reference/goal.md, "Hard-negative mining"); ``mean`` divides by the number of
    positives. Subclasses set ``name`` (the output key is ``{name}_loss``). Only the O(n)
    mined triplets' pairs are scored with a gradient, so the backward touches no tile.
    """

    name = "loss"
    works_on_tiles = True

    def __init__(self, reduction: Reduction = "sum") -> None:
        super().__init__()
        self.reduction = reduction

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        """(N,) scores of positives and mined negatives -> (N,) losses."""
        raise NotImplementedError

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        tiles = score_tiles(inputs)
        loss = torch.zeros((), dtype=tiles.dtype, device=tiles.device)
        for triplets in mine_triplets(tiles):
            s_p = tiles.pair_scores(triplets.images, triplets.texts)
            s_n = tiles.pair_scores(*triplets.negative_pairs())
            loss = loss + (self.triplet_loss(s_p, s_n) * triplets.valid).sum()
        if self.reduction == "mean":
            loss = loss / max(tiles.positive_count, 1)
        return {f"{self.name}_loss": loss.to(tiles.scorer.dtype)}
