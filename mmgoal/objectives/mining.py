"""Positive masks and hard-negative mining (docs/reference/goal.md). No gradients."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmgoal.structures import ObjectiveInputs, ScoreShare, check_inputs


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


def scores_and_positives(inputs: ObjectiveInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """An objective's ``(scores, positives mask)``, the mask checked as ``check_positives``."""
    check_inputs(inputs, "an objective on the whole score matrix", "scores")
    return inputs.scores, check_positives(inputs.scores, inputs.positives)


def score_share(inputs: ObjectiveInputs) -> ScoreShare:
    """The share of the scores an objective that works on rows computes on: the rank's
    under local scoring, else the whole matrix (its positives checked as
    ``check_positives``)."""
    check_inputs(inputs, "an objective")
    if inputs.share is not None:
        return inputs.share
    check_inputs(inputs, "an objective", "scores")
    return ScoreShare.whole(inputs.scores, check_positives(inputs.scores, inputs.positives))


class DirectionTriplets(NamedTuple):
    """The hardest-negative triplet of every positive of one direction (indices only):
    anchor ``anchors[k]``, its positive ``others[k]`` and its hardest negative
    ``negatives[k]``; ``valid[k]``: the anchor has a negative at all."""

    anchors: torch.Tensor
    others: torch.Tensor
    negatives: torch.Tensor
    valid: torch.Tensor

    def scores(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s_p`` and ``s_n`` (each (n_pos,)) of ``scores``, the block mined, gradient kept."""
        return scores[self.anchors, self.others], scores[self.anchors, self.negatives]


MINING_BLOCK = 1 << 20  # scores copied at a time to mine the hardest negatives (4 MiB)


def hardest_in_rows(scores: torch.Tensor, anchors: torch.Tensor, others: torch.Tensor
                    ) -> torch.Tensor:
    """(n_rows,) the highest-scoring column of every row of ``scores`` that is not one of
    its positives ``(anchors[k], others[k])`` (``anchors`` ascending, as ``nonzero`` gives
    them); detached. A block of rows at a time: no copy of the whole matrix."""
    n_rows, n_cols = scores.shape
    rows = max(MINING_BLOCK // max(n_cols, 1), 1)
    starts = torch.arange(0, n_rows + rows, rows, device=anchors.device)
    bounds = torch.searchsorted(anchors, starts).tolist()  # each block's positives
    hardest = torch.empty(n_rows, dtype=torch.long, device=scores.device)
    for index, start in enumerate(range(0, n_rows, rows)):
        masked = scores[start:start + rows].detach().clone(memory_format=torch.contiguous_format)
        first, last = bounds[index], bounds[index + 1]
        # positives are few: indexed, not a dense fill
        masked[anchors[first:last] - start, others[first:last]] = float("-inf")
        hardest[start:start + rows] = masked.argmax(dim=1)
    return hardest


def mine_direction(scores: torch.Tensor, positives: torch.Tensor) -> DirectionTriplets:
    """The hardest-negative triplets of one direction, in ``positives.nonzero()`` order.

    Args:
        scores: (n_anchors, n_others) scores, anchors along dimension 0 (a
            :meth:`~mmgoal.structures.ScoreShare.directions` block; detached inside).
        positives: same shape, bool.
    """
    anchors, others = positives.nonzero(as_tuple=True)  # row-major: sorted by anchor
    hardest = hardest_in_rows(scores, anchors, others)
    valid = torch.bincount(anchors, minlength=len(scores)) < scores.shape[1]
    return DirectionTriplets(anchors, others, hardest[anchors], valid[anchors])


def hardest_negatives(sims: torch.Tensor, positives: torch.Tensor,
                      positive_index: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hardest negative of every image row and every text column.

    Args:
        sims: (n_img, n_txt) scores (detached inside).
        positives: (n_img, n_txt) bool.
        positive_index: ``positives.nonzero(as_tuple=True)`` when the caller has it.

    Returns:
        text_of_image: (n_img,) index ``n(i)`` of the highest-scoring negative text of row i;
        image_of_text: (n_txt,) index ``m(j)`` of the highest-scoring negative image of column j;
        row_valid: (n_img,) bool, the row has at least one negative;
        col_valid: (n_txt,) bool, the column has at least one negative.
    """
    n_img, n_txt = sims.shape
    if positive_index is None:
        positive_index = positives.nonzero(as_tuple=True)
    rows, cols = positive_index
    by_column, order = torch.sort(cols, stable=True)  # the columns' positives, in order
    return (hardest_in_rows(sims, rows, cols), hardest_in_rows(sims.T, by_column, rows[order]),
            torch.bincount(rows, minlength=n_img) < n_txt,
            torch.bincount(cols, minlength=n_txt) < n_img)


def draw_device(device: torch.device, generator: torch.Generator | None) -> torch.device:
    """Where random draws are made: where ``generator`` lives (a seeded CPU generator gives
    the same draws on any device); without one, on ``device``, so a GPU run copies nothing."""
    return device if generator is None else generator.device


def draw_one_per_row(probs: torch.Tensor, generator: torch.Generator | None = None
                     ) -> torch.Tensor:
    """(n_rows,) one column per row of ``probs`` (n_rows, n_cols), drawn with ``multinomial``
    (:func:`draw_device`)."""
    where = draw_device(probs.device, generator)
    return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(1).to(probs.device)


def row_uniforms(rows: int, device: torch.device, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
    """(rows,) uniform draws in [0, 1) on ``device``, one a row (:func:`draw_device`)."""
    where = draw_device(device, generator)
    return torch.rand(rows, generator=generator, device=where).to(device)
