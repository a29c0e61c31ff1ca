"""VSE++ triplet ranking loss (Faghri et al., BMVC 2018, eq. 4-5)."""

from __future__ import annotations

import torch

from mmgoal.objectives.blocks import BLOCK_ROWS, RowTerm, check_block_rows, in_row_blocks
from mmgoal.objectives.hard_negative import HardNegativeLoss
from mmgoal.objectives.mining import score_share
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


def sum_of_hinges(scores: torch.Tensor, positives: torch.Tensor, margin: float
                  ) -> torch.Tensor:
    """Hinges summed over every negative (VSE0), per positive pair of one direction.

    For a positive ``(a, p)`` of anchor ``a``: ``sum_k [m + S[a, k] - S[a, p]]_+`` over
    the negatives ``k`` of the anchor (row ``a`` of an image-to-text block, column ``a``
    of the matrix in a text-to-image one).

    Args:
        scores: (n_anchors, n_others) scores, anchors along dimension 0 (a
            :meth:`~mmgoal.structures.ScoreShare.directions` block); positives: same
            shape, bool.

    Returns:
        (n_pos,) in ``positives.nonzero()`` order.
    """
    anchors, others = positives.nonzero(as_tuple=True)
    s_pos = scores[anchors, others][:, None]
    return ((margin + scores[anchors] - s_pos).clamp(min=0) * ~positives[anchors]).sum(1)


class _HingeTerms(RowTerm):
    """:func:`sum_of_hinges` of a block of anchors, over ``divisor``."""

    def __init__(self, margin: float, divisor: int) -> None:
        self.margin, self.divisor = margin, divisor

    def loss(self, direction, scores, positives):
        return sum_of_hinges(scores, positives, self.margin).sum() / self.divisor, None


@OBJECTIVES.register()
class TripletLoss(HardNegativeLoss):
    """Bidirectional triplet ranking loss with the hardest or all negatives.

    Args:
        margin: hinge margin (0.2 in VSE++/SCAN).
        max_violation: hardest negative only (VSE++) instead of the sum over
            all negatives (VSE0).
        reduction: ``sum`` over positive pairs (VSE++ convention) or ``mean``.
        block_rows: anchors whose hinges over all negatives are computed at once
            (``max_violation: false``; docs/objectives.md).

    Returns (from ``forward``): ``triplet_loss``.
    """

    name = "triplet"

    def __init__(self, margin: float = 0.2, max_violation: bool = True,
                 reduction: str = "sum", block_rows: int = BLOCK_ROWS) -> None:
        super().__init__(reduction)
        self.block_rows = check_block_rows(block_rows)
        self.margin = margin
        self.max_violation = max_violation

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return (self.margin + s_n - s_p).clamp(min=0)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        if self.max_violation:
            return super().forward(inputs)
        share = score_share(inputs)
        divisor = max(share.positive_count, 1) if self.reduction == "mean" else 1
        loss = in_row_blocks(_HingeTerms(self.margin, divisor), share, block=self.block_rows)
        return {"triplet_loss": loss}
