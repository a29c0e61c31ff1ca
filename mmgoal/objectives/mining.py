"""Positive masks and hard-negative mining (docs/reference/goal.md). No gradients."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmgoal.scoring import HardestNegative, MatrixScorer, ScoreTiles, Statistic
from mmgoal.structures import ObjectiveInputs, check_inputs


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
    """(n_img, n_txt) bool: image ``i`` and text ``j`` have the same id; ``text_groups``
    defaults to ``image_groups`` (one caption per image row, as in a training batch)."""
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
    """A whole-matrix objective's ``(scores, positives mask)``, the mask checked as
    ``check_positives``."""
    check_inputs(inputs, "an objective on the whole score matrix", "scores")
    return inputs.scores, check_positives(inputs.scores, inputs.positives)


def score_tiles(inputs: ObjectiveInputs) -> ScoreTiles:
    """The scores an objective computes on: the trainer's :class:`~mmgoal.scoring.ScoreTiles`,
    else the whole matrix ``inputs.scores`` (its positives checked as ``check_positives``)
    in tiles of it."""
    check_inputs(inputs, "an objective")
    if inputs.tiles is not None:
        return inputs.tiles
    check_inputs(inputs, "an objective", "scores")
    scores = inputs.scores
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        shape = f" of shape {tuple(scores.shape)}" if hasattr(scores, "shape") else ""
        raise ValueError(f"ObjectiveInputs.scores must be a (n_images, n_texts) tensor, got "
                         f"{type(scores).__name__}{shape}")
    positives = check_positives(scores, inputs.positives)
    return ScoreTiles(MatrixScorer(scores), *scores.shape, positives=positives)


class Triplets(NamedTuple):
    """The hardest-negative triplet of every positive pair of one direction's anchors, as
    positions in the batch: image ``images[k]`` and text ``texts[k]`` are a positive pair,
    ``negatives[k]`` the anchor's highest-scoring negative (a text for ``i2t``, whose
    anchors are images; an image for ``t2i``); ``valid[k]``: the anchor has a negative."""

    direction: str
    images: torch.Tensor
    texts: torch.Tensor
    negatives: torch.Tensor
    valid: torch.Tensor

    @property
    def anchors(self) -> torch.Tensor:
        return self.images if self.direction == "i2t" else self.texts

    def negative_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, texts)`` of the mined negative pairs."""
        return ((self.images, self.negatives) if self.direction == "i2t"
                else (self.negatives, self.texts))


def mine_triplets(tiles: ScoreTiles, hardest: HardestNegative | None = None,
                  *statistics: Statistic) -> tuple[Triplets, Triplets]:
    """The triplets of this rank's images (``i2t``) and of its own texts (``t2i``), their
    negatives the anchors' hardest (``hardest``, reduced here with ``statistics`` in the same
    pass over the tiles unless given already reduced)."""
    if hardest is None:
        hardest = HardestNegative()
        tiles.statistics(hardest, *statistics)
    local = tiles.positive_rows - tiles.rows.start
    i2t = Triplets("i2t", tiles.positive_rows, tiles.positive_cols,
                   hardest.row_index[local], torch.isfinite(hardest.row_value[local]))
    texts = tiles.own_positive_cols
    t2i = Triplets("t2i", tiles.own_positive_rows, texts, hardest.col_index[texts],
                   torch.isfinite(hardest.col_value[texts]))
    return i2t, t2i


def hardest_negatives(sims: torch.Tensor, positives: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hardest negative of every image row and text column of ``sims`` (n_img, n_txt):
    ``n(i)`` (n_img,), ``m(j)`` (n_txt,), and whether each row and column has a negative."""
    hardest = HardestNegative()
    ScoreTiles(MatrixScorer(sims.detach()), *sims.shape, positives=positives.bool()
               ).statistics(hardest)
    return (hardest.row_index, hardest.col_index, torch.isfinite(hardest.row_value),
            torch.isfinite(hardest.col_value))


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

