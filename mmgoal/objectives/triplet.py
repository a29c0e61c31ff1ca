"""VSE++ triplet ranking loss (Faghri et al., BMVC 2018, eq. 4-5)."""

from __future__ import annotations

import torch

from mmgoal.objectives.hard_negative import HardNegativeLoss, Reduction
from mmgoal.objectives.mining import score_tiles
from mmgoal.registry import OBJECTIVES
from mmgoal.scoring import ScoreTiles, Statistic, Tile
from mmgoal.structures import ObjectiveInputs


def sum_of_hinges(scores: torch.Tensor, positives: torch.Tensor, margin: float
                  ) -> torch.Tensor:
    """(n_pos,) ``sum_k [m + S[a, k] - S[a, p]]_+`` over the negatives ``k`` of each
    positive ``(a, p)`` (VSE0; in ``positives.nonzero()`` order), anchors along dimension
    0 of ``scores``: the dense formula, the reference of the tiled loss."""
    anchors, others = positives.nonzero(as_tuple=True)
    s_pos = scores[anchors, others][:, None]
    return ((margin + scores[anchors] - s_pos).clamp(min=0) * ~positives[anchors]).sum(1)


class _Hinges(Statistic):
    """The hinges ``[m + S[a, k] - s_p]_+`` of every positive pair's anchor against its
    negatives: their sum (``value``), the active ones of each positive pair (``i2t``: this
    rank's rows' ``(rows, cols, scores)``; ``t2i``: every text's ``(images, texts,
    scores)``, partial over the ranks' rows) and, for the backward, :meth:`weight`."""

    def __init__(self, tiles: ScoreTiles, margin: float, i2t: tuple, t2i: tuple) -> None:
        self.tiles, self.margin, self.i2t, self.t2i = tiles, margin, i2t, t2i

    def start(self, n_rows, n_cols, like):
        self.value = like.new_zeros(())
        self.i2t_counts = like.new_zeros(len(self.i2t[0]))
        self.t2i_counts = like.new_zeros(len(self.t2i[0]))

    def _active(self, tile: Tile) -> tuple[torch.Tensor, slice, torch.Tensor, slice]:
        """The active hinges of the tile's row pairs (k, c) and column pairs (r, k), with
        where those pairs lie in the pair lists."""
        rows, _, s_rows = self.i2t
        images, texts, s_cols = self.t2i
        mine = slice(*torch.searchsorted(rows, rows.new_tensor([tile.rows.start,
                                                                tile.rows.stop])).tolist())
        local = rows[mine] - tile.rows.start
        row_hinges = (tile.scores[local] - s_rows[mine, None]).add_(self.margin)
        row_hinges.mul_(tile.negatives[local])
        theirs = slice(*torch.searchsorted(texts, texts.new_tensor([tile.cols.start,
                                                                    tile.cols.stop])).tolist())
        local = texts[theirs] - tile.cols.start
        col_hinges = (tile.scores[:, local] - s_cols[None, theirs]).add_(self.margin)
        col_hinges.mul_(tile.negatives[:, local])
        return row_hinges, mine, col_hinges, theirs

    def update(self, tile, row_offset):
        row_hinges, mine, col_hinges, theirs = self._active(tile)
        self.value += row_hinges.clamp(min=0).sum() + col_hinges.clamp(min=0).sum()
        # clamp's gradient passes at 0, as autograd's does; a masked-out entry is 0 too
        self.i2t_counts[mine] += ((row_hinges >= 0) & tile.negatives[
            self.i2t[0][mine] - tile.rows.start]).sum(1)
        self.t2i_counts[theirs] += ((col_hinges >= 0) & tile.negatives[
            :, self.t2i[1][theirs] - tile.cols.start]).sum(0)

    def weight(self, tile: Tile) -> torch.Tensor:
        """(r, c) ``d value / d S`` of the tile's negative entries."""
        row_hinges, mine, col_hinges, theirs = self._active(tile)
        weights = torch.zeros_like(tile.scores)
        row_active = ((row_hinges >= 0) & tile.negatives[self.i2t[0][mine] - tile.rows.start])
        weights.index_add_(0, self.i2t[0][mine] - tile.rows.start, row_active.to(weights.dtype))
        col_active = ((col_hinges >= 0) & tile.negatives[:, self.t2i[1][theirs] - tile.cols.start])
        weights.index_add_(1, self.t2i[1][theirs] - tile.cols.start, col_active.to(weights.dtype))
        return weights


@OBJECTIVES.register()
class TripletLoss(HardNegativeLoss):
    """Bidirectional triplet ranking loss (``triplet_loss``) with the hardest negative
    (``max_violation``, VSE++) or the sum over all negatives (VSE0); ``margin`` 0.2 in
    VSE++/SCAN. On score tiles: docs/reference/objectives.md, "Score tiles".
    """

    name = "triplet"

    def __init__(self, margin: float = 0.2, max_violation: bool = True,
                 reduction: Reduction = "sum") -> None:
        super().__init__(reduction)
        self.margin = margin
        self.max_violation = max_violation

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return (self.margin + s_n - s_p).clamp(min=0)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        if self.max_violation:
            return super().forward(inputs)
        tiles = score_tiles(inputs)
        divisor = max(tiles.positive_count, 1) if self.reduction == "mean" else 1
        i2t_pairs = (tiles.positive_rows, tiles.positive_cols)
        texts, images = tiles.all_text_positives()
        s_i2t, s_t2i = tiles.pair_scores(*i2t_pairs), tiles.pair_scores(images, texts)
        hinges = _Hinges(tiles, self.margin, (*i2t_pairs, s_i2t.detach()),
                         (images, texts, s_t2i.detach()))
        tiles.statistics(hinges)

        def weight(tile: Tile) -> tuple[torch.Tensor, tuple]:
            return hinges.weight(tile).div_(divisor), ()

        # each active hinge's -1 on its positive's score: O(n) pairs, scored with a graph
        surrogate = -(hinges.i2t_counts * s_i2t).sum() - (hinges.t2i_counts * s_t2i).sum()
        loss = tiles.dense_loss(hinges.value / divisor, weight) \
            + (surrogate - surrogate.detach()) / divisor
        return {"triplet_loss": loss.to(tiles.scorer.dtype)}

