"""Base of the losses computed on hardest-negative triplets in both directions."""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.objectives.mining import mine_triplets, scores_and_positives
from mmgoal.structures import ObjectiveInputs

REDUCTIONS = ("sum", "mean")


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    return reduction


class HardNegativeLoss(nn.Module):
    """A per-triplet loss ``triplet_loss(s_p, s_n)`` summed over both directions.

    Every positive ``(i, j)`` gives an image-to-text triplet (negative: the
    hardest text of row ``i``) and a text-to-image triplet (negative: the
    hardest image of column ``j``); positives are never negatives. ``sum``
    adds the triplet losses; ``mean`` divides by the number of positives.
    Subclasses set ``name`` (the output key is ``{name}_loss``).
    """

    name = "loss"

    def __init__(self, reduction: str = "sum") -> None:
        super().__init__()
        self.reduction = check_reduction(reduction)

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        """(N,) scores of positives and mined negatives -> (N,) losses."""
        raise NotImplementedError

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        sims, positives = scores_and_positives(inputs)
        triplets = mine_triplets(sims, positives)
        s_p, s_n_i2t, s_n_t2i = triplets.scores(sims)
        per_triplet = torch.cat([self.triplet_loss(s_p, s_n_i2t) * triplets.i2t_valid,
                                 self.triplet_loss(s_p, s_n_t2i) * triplets.t2i_valid])
        loss = per_triplet.sum()
        if self.reduction == "mean":
            loss = loss / max(len(s_p), 1)
        return {f"{self.name}_loss": loss}
