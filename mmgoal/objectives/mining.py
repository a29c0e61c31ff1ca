"""Positive masks and hard-negative mining (REFERENCE.md section 2). No gradients."""

from __future__ import annotations

import torch


def diagonal_positives(sims: torch.Tensor) -> torch.Tensor:
    """(n_img, n_txt) bool mask of the diagonal: text ``j`` describes image ``j``."""
    n_img, n_txt = sims.shape
    if n_img != n_txt:
        raise ValueError(
            f"sims is {n_img} x {n_txt}; a non-square score matrix needs an explicit "
            f"positives mask"
        )
    return torch.eye(n_img, dtype=torch.bool, device=sims.device)


def positives_from_groups(image_groups: torch.Tensor, text_groups: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """(n_img, n_txt) bool: image ``i`` and text ``j`` come from the same image id.

    Args:
        image_groups: (n_img,) integer id of each image row.
        text_groups: (n_txt,) id of each text column; defaults to ``image_groups``
            (one caption per image row, as in a training batch).
    """
    text_groups = image_groups if text_groups is None else text_groups
    return image_groups[:, None] == text_groups[None, :]


def check_positives(sims: torch.Tensor, positives: torch.Tensor | None) -> torch.Tensor:
    """The positives mask to use for ``sims``: the diagonal when ``None``, else validated."""
    if positives is None:
        return diagonal_positives(sims)
    if positives.shape != sims.shape:
        raise ValueError(f"positives has shape {tuple(positives.shape)}, sims has "
                         f"{tuple(sims.shape)}; they must match")
    return positives.to(device=sims.device, dtype=torch.bool)


def hardest_negatives(sims: torch.Tensor, positives: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hardest negative of every image row and every text column.

    Args:
        sims: (n_img, n_txt) scores (detached inside).
        positives: (n_img, n_txt) bool.

    Returns:
        text_of_image: (n_img,) index ``n(i)`` of the highest-scoring negative text of row i;
        image_of_text: (n_txt,) index ``m(j)`` of the highest-scoring negative image of column j;
        row_valid: (n_img,) bool, the row has at least one negative;
        col_valid: (n_txt,) bool, the column has at least one negative.
    """
    masked = sims.detach().masked_fill(positives, float("-inf"))
    text_of_image = masked.argmax(dim=1)
    image_of_text = masked.argmax(dim=0)
    negatives = ~positives
    return text_of_image, image_of_text, negatives.any(dim=1), negatives.any(dim=0)
