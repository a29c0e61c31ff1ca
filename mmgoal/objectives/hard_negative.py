"""Base of the losses computed on hardest-negative triplets in both directions."""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.objectives.blocks import take_scores
from mmgoal.objectives.mining import mine_direction, score_share
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

    It works on rows (:class:`~mmgoal.structures.ScoreShare`): each direction's triplets
    are its anchors', so under local scoring a rank computes those of its images and its
    texts, and the parts of every rank sum to the one-process loss.
    """

    name = "loss"
    works_on_rows = True

    def __init__(self, reduction: str = "sum") -> None:
        super().__init__()
        self.reduction = check_reduction(reduction)

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        """(N,) scores of positives and mined negatives -> (N,) losses."""
        raise NotImplementedError

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        share = score_share(inputs)
        triplets = {direction: mine_direction(scores, positives)
                    for direction, scores, positives in share.directions()}
        taken = take_scores(share, {direction: [(t.anchors, t.others), (t.anchors, t.negatives)]
                                    for direction, t in triplets.items()})
        loss = share.rows.new_zeros(())
        for direction, (s_p, s_n) in taken.items():
            loss = loss + (self.triplet_loss(s_p, s_n) * triplets[direction].valid).sum()
        if self.reduction == "mean":
            loss = loss / max(share.positive_count, 1)
        return {f"{self.name}_loss": loss}
