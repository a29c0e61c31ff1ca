"""VSE++ triplet ranking loss (Faghri et al., BMVC 2018, eq. 4-5)."""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.objectives.mining import check_positives, hardest_negatives
from mmgoal.registry import OBJECTIVES


def triplet_hinges(sims: torch.Tensor, positives: torch.Tensor, margin: float,
                   max_violation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Hinge costs of every positive pair, in both directions.

    For a positive ``(i, j)``: image-to-text ``[m + S[i, k] - S[i, j]]_+`` over
    the negatives ``k`` of row ``i``; text-to-image ``[m + S[k, j] - S[i, j]]_+``
    over the negatives ``k`` of column ``j``. ``max_violation`` keeps only the
    hardest negative (VSE++), otherwise the hinges are summed (VSE0).

    Args:
        sims: (n_img, n_txt) scores.
        positives: (n_img, n_txt) bool.

    Returns:
        i2t, t2i: (n_pos,) cost of each positive pair (in ``positives.nonzero()`` order).
    """
    rows, cols = positives.nonzero(as_tuple=True)
    s_pos = sims[rows, cols]
    if max_violation:
        text_of_image, image_of_text, row_valid, col_valid = hardest_negatives(sims, positives)
        i2t = (margin + sims[rows, text_of_image[rows]] - s_pos).clamp(min=0) * row_valid[rows]
        t2i = (margin + sims[image_of_text[cols], cols] - s_pos).clamp(min=0) * col_valid[cols]
        return i2t, t2i
    negatives = ~positives
    i2t = ((margin + sims[rows] - s_pos[:, None]).clamp(min=0) * negatives[rows]).sum(1)
    t2i = ((margin + sims[:, cols].T - s_pos[:, None]).clamp(min=0) * negatives[:, cols].T).sum(1)
    return i2t, t2i


@OBJECTIVES.register()
class TripletLoss(nn.Module):
    """Bidirectional triplet ranking loss with hardest or all negatives.

    Args:
        margin: hinge margin (0.2 in VSE++/SCAN).
        max_violation: hardest negative only (VSE++) instead of the sum over negatives.
        reduction: ``sum`` over positive pairs (VSE++ convention) or ``mean``.

    Returns (from ``forward``): ``triplet_loss`` and the logged, detached
    ``active_fraction`` (share of hinges above zero).
    """

    def __init__(self, margin: float = 0.2, max_violation: bool = True,
                 reduction: str = "sum") -> None:
        super().__init__()
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.margin = margin
        self.max_violation = max_violation
        self.reduction = reduction

    def forward(self, sims: torch.Tensor, positives: torch.Tensor | None = None,
                **extras) -> dict[str, torch.Tensor]:
        positives = check_positives(sims, positives)
        i2t, t2i = triplet_hinges(sims, positives, self.margin, self.max_violation)
        loss = i2t.sum() + t2i.sum()
        if self.reduction == "mean":
            loss = loss / max(int(positives.sum()), 1)
        active = torch.cat([i2t, t2i]).detach().gt(0).float().mean()
        return {"triplet_loss": loss, "active_fraction": active}
