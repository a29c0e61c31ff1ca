"""VSE++ triplet ranking loss (Faghri et al., BMVC 2018, eq. 4-5)."""

from __future__ import annotations

import torch

from mmgoal.objectives.hard_negative import HardNegativeLoss
from mmgoal.objectives.mining import scores_and_positives
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


def sum_of_hinges(sims: torch.Tensor, positives: torch.Tensor, margin: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hinges summed over every negative (VSE0), per positive pair and direction.

    For a positive ``(i, j)``: image-to-text ``sum_k [m + S[i, k] - S[i, j]]_+``
    over the negatives ``k`` of row ``i``; text-to-image ``sum_k [m + S[k, j] -
    S[i, j]]_+`` over the negatives of column ``j``.

    Args:
        sims: (n_img, n_txt) scores; positives: (n_img, n_txt) bool.

    Returns:
        i2t, t2i: (n_pos,) in ``positives.nonzero()`` order.
    """
    rows, cols = positives.nonzero(as_tuple=True)
    s_pos = sims[rows, cols][:, None]
    negatives = ~positives
    i2t = ((margin + sims[rows] - s_pos).clamp(min=0) * negatives[rows]).sum(1)
    t2i = ((margin + sims[:, cols].T - s_pos).clamp(min=0) * negatives[:, cols].T).sum(1)
    return i2t, t2i


@OBJECTIVES.register()
class TripletLoss(HardNegativeLoss):
    """Bidirectional triplet ranking loss with the hardest or all negatives.

    Args:
        margin: hinge margin (0.2 in VSE++/SCAN).
        max_violation: hardest negative only (VSE++) instead of the sum over
            all negatives (VSE0).
        reduction: ``sum`` over positive pairs (VSE++ convention) or ``mean``.

    Returns (from ``forward``): ``triplet_loss``.
    """

    name = "triplet"

    def __init__(self, margin: float = 0.2, max_violation: bool = True,
                 reduction: str = "sum") -> None:
        super().__init__(reduction)
        self.margin = margin
        self.max_violation = max_violation

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return (self.margin + s_n - s_p).clamp(min=0)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        if self.max_violation:
            return super().forward(inputs)
        sims, positives = scores_and_positives(inputs)
        i2t, t2i = sum_of_hinges(sims, positives, self.margin)
        loss = i2t.sum() + t2i.sum()
        if self.reduction == "mean":
            loss = loss / max(len(i2t), 1)
        return {"triplet_loss": loss}
