"""A batch's scores as tiles: what an objective reads, the score matrix never built.

An objective reduces a :class:`ScoreTiles` tile by tile (:meth:`ScoreTiles.statistics`),
then scores chosen pairs with their gradient (:meth:`ScoreTiles.pair_scores`) or weights
every entry (:meth:`ScoreTiles.dense_loss`). docs/reference/objectives.md ("Score tiles")
derives each objective this way; docs/distributed.md gives its memory and time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mmgoal.contract import dot_product_scores, pair_similarity
from mmgoal.distributed import gather, sum_over_ranks, world_info
from mmgoal.structures import ImageFeatures, TextFeatures, index_features

# A dot product's tile: 1 M scores, 4 MiB in float32, stays in a CPU's cache with what a
# pass makes of it (its columns' reductions are 2.4x faster than a 1024-row tile's)
TILE_ROWS = 256
TILE_COLS = 4096
# A cross-attention tile: pairs scored at once, each of which holds its tokens' attention
TOKEN_TILE_ROWS = 32
TOKEN_TILE_COLS = 32


# --------------------------------------------------------------------------- scorers
class Scorer:
    """How a batch's scores are computed from ``inputs`` (what the loss's gradient flows
    to): :meth:`tile` a block of images x texts without a graph, :meth:`pairs` chosen
    pairs with one."""

    inputs: tuple[torch.Tensor, ...] = ()
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    token_tiles = False  # a tile holds tokens: smaller default tiles

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        raise NotImplementedError

    def pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tile_backward(self, rows: slice, cols: slice, weights: torch.Tensor,
                      grads: list[torch.Tensor | None], scale: float = 1.0) -> None:
        """Add ``scale`` times the gradient of ``sum(weights * tile)`` to ``grads``."""
        raise NotImplementedError


class DotScorer(Scorer):
    """``S = images @ texts.T`` of two (n, d) embeddings: a tile is one product, and its
    backward two (``d images += W texts``, ``d texts += W^T images``)."""

    def __init__(self, images: torch.Tensor, texts: torch.Tensor) -> None:
        self.images, self.texts = images, texts
        self.inputs = (images, texts)
        self.dtype, self.device = images.dtype, images.device
        # chosen pairs are scored, and their gradients summed, in float32 at least: one
        # rounding to bf16 of each feature's whole gradient, not one per pair
        wide = torch.promote_types(images.dtype, torch.float32)
        self.wide = (images.to(wide), texts.to(wide))

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        return self.images[rows].detach() @ self.texts[cols].detach().T

    def pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        # index_select: its backward adds rows (index_add), where indexing's puts them one
        # by one with accumulation, several times slower on a CPU
        return (self.wide[0].index_select(0, rows) * self.wide[1].index_select(0, cols)).sum(-1)

    def tile_backward(self, rows, cols, weights, grads, scale=1.0) -> None:
        if grads[0] is not None:
            grads[0][rows].addmm_(weights, self.wide[1][cols].detach(), alpha=scale)
        if grads[1] is not None:
            grads[1][cols].addmm_(weights.T, self.wide[0][rows].detach(), alpha=scale)


class MatrixScorer(Scorer):
    """A score matrix given whole (``GoalLoss(scores=...)``, a plug-in's matrix under
    ``train.scoring: replicated``): a tile is a slice of it, its gradient a slice of one
    gradient of the matrix's shape."""

    def __init__(self, scores: torch.Tensor) -> None:
        self.scores = scores
        self.inputs = (scores,)
        self.dtype, self.device = scores.dtype, scores.device
        # read in float32 at least: a bf16 matrix's gradient is summed in float32 and
        # rounded once (one copy of the matrix, which is given whole anyway)
        self.wide = scores.to(torch.promote_types(scores.dtype, torch.float32))

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        return self.wide[rows, cols].detach()

    def pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.wide.reshape(-1).index_select(0, rows * self.wide.shape[1] + cols)

    def tile_backward(self, rows, cols, weights, grads, scale=1.0) -> None:
        if grads[0] is not None:
            grads[0][rows, cols].add_(weights, alpha=scale)


def _feature_tensors(features: ImageFeatures | TextFeatures) -> list[str]:
    """The floating fields of a features object (what a cross-attention score reads)."""
    return [field.name for field in dataclasses.fields(features)
            if isinstance(getattr(features, field.name), torch.Tensor)
            and getattr(features, field.name).is_floating_point()]


def _rows_of(features, index) -> Any:
    """``features`` at ``index`` (a slice or a long tensor), every field kept whole in its
    other dimensions (token tiles are as wide as the batch: no cut, so a tile's gradient
    lands where its tokens are)."""
    values = {field.name: getattr(features, field.name) for field in dataclasses.fields(features)}
    return type(features)(**{name: value[index] if isinstance(value, torch.Tensor) else value
                             for name, value in values.items()})


class ModelScorer(Scorer):
    """The model's own ``similarity`` (SCAN's cross attention; any model without
    dot-product scores). A tile's backward recomputes it with a graph for its
    vector-Jacobian product; chosen pairs are scored by ``pair_similarity`` where the model
    has one, else as small tiles whose diagonal is kept."""

    token_tiles = True

    def __init__(self, model: Any, images: ImageFeatures, texts: TextFeatures) -> None:
        self.model, self.images, self.texts = model, images, texts
        self.image_fields, self.text_fields = _feature_tensors(images), _feature_tensors(texts)
        self.inputs = (*(getattr(images, name) for name in self.image_fields),
                       *(getattr(texts, name) for name in self.text_fields))
        self.dtype, self.device = self.inputs[0].dtype, self.inputs[0].device

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        with torch.no_grad():
            return self.model.similarity(_rows_of(self.images, rows), _rows_of(self.texts, cols))

    def pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        images, texts = index_features(self.images, rows), index_features(self.texts, cols)
        own = pair_similarity(self.model)
        if own is not None:
            return own(images, texts)
        chunk = TOKEN_TILE_ROWS
        parts = [torch.diagonal(self.model.similarity(
            _rows_of(images, slice(start, start + chunk)),
            _rows_of(texts, slice(start, start + chunk)))) for start in range(0, len(rows), chunk)]
        return torch.cat(parts) if parts else self.inputs[0].new_zeros(0)

    def tile_backward(self, rows, cols, weights, grads, scale=1.0) -> None:
        weights = weights * scale
        with torch.enable_grad():
            image_part = {name: getattr(self.images, name)[rows].detach().requires_grad_()
                          for name in self.image_fields}
            text_part = {name: getattr(self.texts, name)[cols].detach().requires_grad_()
                         for name in self.text_fields}
            images = dataclasses.replace(_rows_of(self.images, rows), **image_part)
            texts = dataclasses.replace(_rows_of(self.texts, cols), **text_part)
            tile = self.model.similarity(images, texts)
            leaves = [*image_part.values(), *text_part.values()]
            found = torch.autograd.grad(tile, leaves, weights.to(tile.dtype), allow_unused=True)
        n_image = len(image_part)
        for k, (grad, part) in enumerate(zip(grads, found)):
            if grad is not None and part is not None:
                grad[rows if k < n_image else cols] += part.to(grad.dtype)


class DotProductScores:
    """A model mixin: the score of a pair is the dot product of its unit embeddings, a cosine
    (the dual encoders, CLIP, X-VLM's ITC), so score tiles are products of the embeddings
    (:func:`scorer_for`) and ``similarity`` is one matrix product."""

    dot_product_scores = True

    def similarity(self, image_features: ImageFeatures,
                   text_features: TextFeatures) -> torch.Tensor:
        """(n_images, n_texts) cosine similarities."""
        return image_features.embedding @ text_features.embedding.T


def scorer_for(model: Any, images: ImageFeatures, texts: TextFeatures) -> Scorer:
    """A dot product of the embeddings where ``model.dot_product_scores``, else the model's
    own ``similarity`` on tiles."""
    if dot_product_scores(model):
        return DotScorer(*(features if isinstance(features, torch.Tensor) else features.embedding
                           for features in (images, texts)))
    return ModelScorer(model, images, texts)


# --------------------------------------------------------------------------- tiles
@dataclass
class Tile:
    """One tile of ``S``: images ``rows`` against texts ``cols`` (positions in the batch);
    ``scores`` (r, c) without a graph, at least float32; ``positive_index``: its positives'
    positions (cheaper than a bool mask); ``cache``: what one pass's statistics share.
    """

    rows: slice
    cols: slice
    scores: torch.Tensor
    positive_index: tuple[torch.Tensor, torch.Tensor]
    cache: dict = dataclasses.field(default_factory=dict)

    @property
    def positives(self) -> torch.Tensor:
        """(r, c) bool: the positive entries, made when first asked for."""
        if "positives" not in self.cache:
            mask = torch.zeros(self.scores.shape, dtype=torch.bool, device=self.scores.device)
            mask[self.positive_index] = True
            self.cache["positives"] = mask
        return self.cache["positives"]

    @property
    def negatives(self) -> torch.Tensor:
        """(r, c) bool: ``~positives``, made once per tile."""
        if "negatives" not in self.cache:
            self.cache["negatives"] = ~self.positives
        return self.cache["negatives"]

    @property
    def masked(self) -> torch.Tensor:
        """(r, c) the scores with ``-inf`` at the positives, made once per tile."""
        if "masked" not in self.cache:
            masked = self.scores.clone()
            masked[self.positive_index] = -math.inf
            self.cache["masked"] = masked
        return self.cache["masked"]


class Statistic:
    """An associative reduction of the entries of every row and every column of ``S``:
    :meth:`update` takes one tile, :meth:`combine_columns` the columns' partial results of
    every rank (each rank reduces its own rows, all columns)."""

    def start(self, n_rows: int, n_cols: int, like: torch.Tensor) -> None:
        raise NotImplementedError

    def update(self, tile: Tile, row_offset: int) -> None:
        raise NotImplementedError

    def combine_columns(self) -> None:
        """Make the columns' results those of every rank's rows (a collective)."""


def _neg_inf(shape: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_full((shape,), -math.inf)


class HardestNegative(Statistic):
    """Every row's and every column's highest-scoring negative: ``row_value``/``row_index``
    (a text of the batch), ``col_value``/``col_index`` (an image), ``-inf`` and 0 where
    there is none. Ties keep the lowest index, as ``argmax`` does."""

    def __init__(self, rows: bool = True, cols: bool = True) -> None:
        self.rows, self.cols = rows, cols

    def start(self, n_rows, n_cols, like):
        self.row_value, self.col_value = _neg_inf(n_rows, like), _neg_inf(n_cols, like)
        self.row_index = torch.zeros(n_rows, dtype=torch.long, device=like.device)
        self.col_index = torch.zeros(n_cols, dtype=torch.long, device=like.device)

    def update(self, tile, row_offset):
        masked = tile.masked
        local = slice(tile.rows.start - row_offset, tile.rows.stop - row_offset)
        if self.rows:
            value, index = masked.max(dim=1)
            _keep_larger(self.row_value, self.row_index, local, value, index + tile.cols.start)
        if self.cols:
            value, index = masked.max(dim=0)
            _keep_larger(self.col_value, self.col_index, tile.cols, value,
                         index + tile.rows.start)

    def combine_columns(self):
        if self.cols:
            self.col_value, self.col_index = _max_over_ranks(self.col_value, self.col_index)


def _keep_larger(values: torch.Tensor, indices: torch.Tensor, where: slice,
                 new: torch.Tensor, new_index: torch.Tensor) -> None:
    """``values[where], indices[where]`` take ``new`` where it is strictly larger (the
    earlier tile, a lower index, wins a tie)."""
    better = new > values[where]
    values[where] = torch.where(better, new, values[where])
    indices[where] = torch.where(better, new_index, indices[where])


def _max_over_ranks(values: torch.Tensor, indices: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest value of every position over the ranks and its index (the lowest rank's
    on a tie: its rows come first in the batch)."""
    if world_info()[1] == 1:
        return values, indices
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)  # two all-reduces of O(n) numbers
    where = torch.where(values == best, indices, torch.iinfo(indices.dtype).max)
    dist.all_reduce(where, op=dist.ReduceOp.MIN)  # the lowest index among equals
    return best, where


class LogSumExp(Statistic):
    """``log sum exp(scale * s)`` over the selected entries of every row and column (the
    online softmax): ``row``/``col``, ``-inf`` where nothing is selected; ``scale``: a
    number or a 0-d tensor (an inverse temperature).

    Args:
        select: ``(tile, row_offset) ->`` the entries taken, ``(r, c)`` bool or 0/1;
            ``None``: all; a pair ``(for rows, for columns)`` where they differ.
        floor: a score no taken entry lies below (GOAL's ``R-`` threshold), ``scale``
            positive: then one exp serves rows and columns where it cannot underflow.
    """

    def __init__(self, scale: float | torch.Tensor, select=None, rows: bool = True,
                 cols: bool = True, floor: torch.Tensor | float | None = None) -> None:
        self.scale = scale
        self.select = select if isinstance(select, tuple) else (select, select)
        self.rows, self.cols = rows, cols
        self.floor = floor

    def start(self, n_rows, n_cols, like):
        self.row_max, self.col_max = _neg_inf(n_rows, like), _neg_inf(n_cols, like)
        self.row_sum, self.col_sum = like.new_zeros(n_rows), like.new_zeros(n_cols)

    def _values(self, tile: Tile, select, row_offset: int) -> torch.Tensor:
        values = tile.scores * self.scale
        if select is not None:
            taken = select(tile, row_offset)
            values = values.masked_fill_(~taken if taken.dtype == torch.bool else taken <= 0,
                                         -math.inf)
        return values

    def update(self, tile, row_offset):
        local = slice(tile.rows.start - row_offset, tile.rows.stop - row_offset)
        shared = self.rows and self.cols and self.select[0] is self.select[1]
        if shared and self.floor is not None:
            if "top" not in tile.cache:
                tile.cache["top"] = tile.scores.max()
            top = tile.cache["top"]
            if bool((top - self.floor) * self.scale <= _SHARED_SHIFT[tile.scores.dtype]):
                taken = self.select[0](tile, row_offset)
                scaled = (tile.masked - top).mul_(self.scale).exp_()
                scaled = scaled.mul_(taken) if taken.dtype != torch.bool else \
                    scaled.masked_fill_(~taken, 0.0)
                shift = top * self.scale
                _fold(self.row_max, self.row_sum, local, shift, scaled.sum(1))
                _fold(self.col_max, self.col_sum, tile.cols, shift, scaled.sum(0))
                return
        if shared:
            values = self._values(tile, self.select[0], row_offset)
            row_top, col_top = values.amax(dim=1), values.amax(dim=0)
            top = row_top.max()
            if _within_range(top, row_top, values.dtype) and \
                    _within_range(top, col_top, values.dtype):
                # one exp for both: every row's and column's largest entry is near the
                # tile's, so nothing that counts underflows below it
                scaled = values.sub_(top).exp_()
                _fold(self.row_max, self.row_sum, local, top, scaled.sum(1))
                _fold(self.col_max, self.col_sum, tile.cols, top, scaled.sum(0))
                return
            _online_update(self.row_max, self.row_sum, local, values, dim=1)
            _online_update(self.col_max, self.col_sum, tile.cols, values, dim=0)
            return
        if self.rows:
            values = self._values(tile, self.select[0], row_offset)
            _online_update(self.row_max, self.row_sum, local, values, dim=1)
        if self.cols:
            values = self._values(tile, self.select[1], row_offset)
            _online_update(self.col_max, self.col_sum, tile.cols, values, dim=0)

    def combine_columns(self):
        if not self.cols or world_info()[1] == 1:
            return
        top = self.col_max.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX)  # then the sums rescaled to it: O(n)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        self.col_sum = (self.col_sum * torch.exp(self.col_max - shift)).nan_to_num_(0.0)
        dist.all_reduce(self.col_sum)
        self.col_max = top

    @property
    def row(self) -> torch.Tensor:
        return _finish(self.row_max, self.row_sum)

    @property
    def col(self) -> torch.Tensor:
        return _finish(self.col_max, self.col_sum)


# How far below a tile's largest value a row's largest may lie for one shared exp: exp of
# minus this stays a normal number (float32's smallest is exp(-87)), so a row's own largest
# entry keeps its precision and what underflows is negligible beside it
_SHARED_SHIFT = {torch.float16: 8.0, torch.bfloat16: 60.0, torch.float32: 60.0,
                 torch.float64: 600.0}


def _within_range(top: torch.Tensor, maxima: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every finite ``maxima`` lies within the shared shift of ``top``."""
    finite = torch.where(torch.isfinite(maxima), maxima, top)
    return bool(torch.isfinite(top)) and bool(top - finite.min() <= _SHARED_SHIFT[dtype])


def _fold(maxima: torch.Tensor, sums: torch.Tensor, where: slice, top: torch.Tensor,
          scaled: torch.Tensor) -> None:
    """Fold sums ``scaled`` in units of ``exp(top)`` into the running maxima and sums."""
    new = torch.maximum(maxima[where], top)
    sums[where] = (sums[where] * torch.exp(maxima[where] - new).nan_to_num_(0.0)
                   + scaled * torch.exp(top - new))
    maxima[where] = new


def _online_update(maxima: torch.Tensor, sums: torch.Tensor, where: slice,
                   values: torch.Tensor, dim: int) -> None:
    """Fold ``values`` (-inf: not taken) into the running maxima and sums of ``where``."""
    top = torch.maximum(maxima[where], values.amax(dim=dim))
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    scaled = torch.exp(values - (shift[:, None] if dim == 1 else shift[None, :])).sum(dim)
    sums[where] = sums[where] * torch.exp(maxima[where] - shift).nan_to_num_(0.0) + scaled
    maxima[where] = top


def _finish(maxima: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    shift = torch.where(torch.isfinite(maxima), maxima, torch.zeros_like(maxima))
    return shift + torch.log(sums)  # -inf where nothing was taken


class Sum(Statistic):
    """``sum f(s)`` over the selected entries of every row and column: ``row``/``col``.
    ``select`` as :class:`LogSumExp`'s; ``values``: ``f(tile)``, (r, c), or ``None`` for a
    count."""

    def __init__(self, select=None, values=None, rows: bool = True, cols: bool = True) -> None:
        self.select = select if isinstance(select, tuple) else (select, select)
        self.values, self.rows, self.cols = values, rows, cols

    def start(self, n_rows, n_cols, like):
        self.row, self.col = like.new_zeros(n_rows), like.new_zeros(n_cols)

    def _taken(self, tile: Tile, select, row_offset: int) -> torch.Tensor:
        """The taken entries (mask or 0/1), or their values (zero where not taken)."""
        taken = (select(tile, row_offset) if select is not None
                 else torch.ones_like(tile.scores))
        if self.values is None:
            return taken
        if taken.dtype == torch.bool:
            return torch.where(taken, self.values(tile), 0.0)
        return self.values(tile) * taken

    def _sum(self, taken: torch.Tensor, dim: int) -> torch.Tensor:
        return (torch.count_nonzero(taken, dim=dim) if taken.dtype == torch.bool
                else taken.sum(dim))

    def update(self, tile, row_offset):
        local = slice(tile.rows.start - row_offset, tile.rows.stop - row_offset)
        shared = self.select[0] is self.select[1]
        taken = None
        if self.rows:
            taken = self._taken(tile, self.select[0], row_offset)
            self.row[local] += self._sum(taken, 1)
        if self.cols:
            if taken is None or not shared:
                taken = self._taken(tile, self.select[1], row_offset)
            self.col[tile.cols] += self._sum(taken, 0)

    def combine_columns(self):
        if self.cols:
            self.col = sum_over_ranks(self.col)


# ITM's noise: a uniform draw per entry of S from its global position alone, so a draw
# does not depend on the tiles or the ranks (splitmix64's finaliser, in int64 arithmetic
# that wraps)
_MIX = (-4658895280553007687, -7723592293110705685)  # 0xbf58476d1ce4e5b9, 0x94d049bb133111eb
_LOW_31 = (1 << 31) - 1


def entry_uniforms(seed: int, rows: torch.Tensor, cols: torch.Tensor, n_cols: int
                   ) -> torch.Tensor:
    """Uniform draws in (0, 1) of the entries ``(rows[:, None], cols[None, :])`` of an
    ``n_cols``-wide matrix: a function of ``seed`` and the entry's position only."""
    x = rows[:, None] * n_cols + cols[None, :] + seed * 0x9E3779B97F4A7C15 % (1 << 62)
    for multiplier in _MIX:
        x = x ^ ((x >> 31) & _LOW_31)
        x = x * multiplier
    x = x ^ ((x >> 31) & _LOW_31)
    bits = (x >> 11) & ((1 << 52) - 1)  # 52 bits: exact in float64
    return (bits.to(torch.float64) + 0.5) / float(1 << 52)


class GumbelMax(Statistic):
    """One negative per row (``seed``) and column (``seed + 1``) drawn from
    ``softmax(s / temperature)`` over its negatives by the Gumbel-max trick, a uniform
    per entry from its position (:func:`entry_uniforms`), so any tiling and any number of
    ranks draw the same. ``row_index``/``col_index``; ``*_valid``: it has a negative."""

    def __init__(self, temperature: float, seed: int, n_cols: int, n_rows: int,
                 rows: bool = True, cols: bool = True) -> None:
        self.temperature, self.seed = temperature, seed
        self.width, self.height = n_cols, n_rows
        self.rows, self.cols = rows, cols
        self.best = {"rows": HardestNegative(cols=False), "cols": HardestNegative(rows=False)}

    def start(self, n_rows, n_cols, like):
        for statistic in self.best.values():
            statistic.start(n_rows, n_cols, like.double())

    def _noisy(self, tile: Tile, seed: int, transpose: bool) -> Tile:
        rows = torch.arange(tile.rows.start, tile.rows.stop, device=tile.scores.device)
        cols = torch.arange(tile.cols.start, tile.cols.stop, device=tile.scores.device)
        uniforms = (entry_uniforms(seed, cols, rows, self.height).T if transpose
                    else entry_uniforms(seed, rows, cols, self.width))
        noisy = tile.scores.double() / self.temperature - torch.log(-torch.log(uniforms))
        return Tile(tile.rows, tile.cols, noisy, tile.positive_index)

    def update(self, tile, row_offset):
        if self.rows:
            self.best["rows"].update(self._noisy(tile, self.seed, False), row_offset)
        if self.cols:
            self.best["cols"].update(self._noisy(tile, self.seed + 1, True), row_offset)

    def combine_columns(self):
        self.best["cols"].combine_columns()

    @property
    def row_index(self) -> torch.Tensor:
        return self.best["rows"].row_index

    @property
    def row_valid(self) -> torch.Tensor:
        return torch.isfinite(self.best["rows"].row_value)

    @property
    def col_index(self) -> torch.Tensor:
        return self.best["cols"].col_index

    @property
    def col_valid(self) -> torch.Tensor:
        return torch.isfinite(self.best["cols"].col_value)


# --------------------------------------------------------------------------- ScoreTiles
class ScoreTiles:
    """The score matrix ``S`` (n_img, n_txt) of the (global) batch as tiles.

    Args:
        image_groups, text_groups: (n_img,), (n_txt,) integer ids, equal ids positives;
            or ``positives``: (n_img, n_txt) bool, given whole.
        rows: the images this rank streams, the anchors of its image-to-text terms.
        own_texts: the texts whose text-to-image terms this rank computes.

    Attributes:
        positive_rows, positive_cols: the positive pairs of this rank's rows (row-major);
            ``own_positive_*``: those of its own texts (by text, then image).
        positive_count, sharded: the whole batch's positive pairs; rows are a share of it.
    """

    def __init__(self, scorer: Scorer, n_images: int, n_texts: int,
                 image_groups: torch.Tensor | None = None,
                 text_groups: torch.Tensor | None = None,
                 positives: torch.Tensor | None = None, rows: slice | None = None,
                 own_texts: slice | None = None, tile_rows: int | None = None,
                 tile_cols: int | None = None) -> None:
        if (positives is None) == (image_groups is None):
            raise ValueError("ScoreTiles needs image_groups (and text_groups) or a positives "
                             "mask")
        self.scorer = scorer
        self.n_images, self.n_texts = n_images, n_texts
        self.image_groups = image_groups
        self.text_groups = image_groups if text_groups is None and positives is None \
            else text_groups
        self.mask = positives
        self.rows = rows if rows is not None else slice(0, n_images)
        self.own_texts = own_texts if own_texts is not None else slice(0, n_texts)
        self.sharded = (self.rows.stop - self.rows.start) < n_images
        default_rows, default_cols = ((TOKEN_TILE_ROWS, TOKEN_TILE_COLS) if scorer.token_tiles
                                      else (TILE_ROWS, TILE_COLS))
        self.tile_rows = check_tile(tile_rows or default_rows, "tile_rows")
        self.tile_cols = check_tile(tile_cols or default_cols, "tile_cols")
        self.device = scorer.device
        self.dtype = torch.promote_types(scorer.dtype, torch.float32)
        self.positive_rows, self.positive_cols = self._positive_pairs(self.rows, by_text=False)
        self.own_positive_cols, self.own_positive_rows = self._positive_pairs(
            self.own_texts, by_text=True)
        self.positive_count = int(self.total(torch.tensor(
            float(len(self.positive_rows)), dtype=torch.float64, device=self.device)))

    # ------------------------------------------------------------------ positives
    def _positive_pairs(self, anchors: slice, by_text: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(anchor, other)`` of every positive pair of ``anchors`` (images, or texts with
        ``by_text``), sorted by anchor then other, without an ``n x n`` mask."""
        if self.mask is not None:
            mask = self.mask[:, anchors].T if by_text else self.mask[anchors]
            found, others = mask.nonzero(as_tuple=True)
            return found + anchors.start, others
        mine = (self.text_groups if by_text else self.image_groups)[anchors]
        theirs = self.image_groups if by_text else self.text_groups
        order = torch.sort(theirs, stable=True)
        lower = torch.searchsorted(order.values, mine, right=False)
        upper = torch.searchsorted(order.values, mine, right=True)
        counts = upper - lower
        found = torch.repeat_interleave(torch.arange(len(mine), device=mine.device), counts)
        starts = torch.repeat_interleave(lower - torch.cumsum(counts, 0) + counts, counts)
        others = order.indices[starts + torch.arange(len(found), device=mine.device)]
        return found + anchors.start, others

    def all_text_positives(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(text, image)`` of every positive pair of every text of the batch (sorted by
        text, then image): what a rank needs where its rows reach every text's pairs."""
        if self.own_texts == slice(0, self.n_texts):
            return self.own_positive_cols, self.own_positive_rows
        return self._positive_pairs(slice(0, self.n_texts), by_text=True)

    def _tile_positives(self, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions in the tile of its positive entries, from this rank's rows'
        positive pairs (sorted by row): a search and a filter of O(pairs) numbers."""
        bounds = torch.searchsorted(self.positive_rows, self.positive_rows.new_tensor(
            [rows.start, rows.stop])).tolist()
        found_rows = self.positive_rows[bounds[0]:bounds[1]]
        found_cols = self.positive_cols[bounds[0]:bounds[1]]
        inside = (found_cols >= cols.start) & (found_cols < cols.stop)
        return found_rows[inside] - rows.start, found_cols[inside] - cols.start

    # ------------------------------------------------------------------ tiles
    def tiles(self) -> Iterator[Tile]:
        """Every tile of this rank's rows against every text, row block by row block."""
        for row in range(self.rows.start, self.rows.stop, self.tile_rows):
            rows = slice(row, min(row + self.tile_rows, self.rows.stop))
            for col in range(0, self.n_texts, self.tile_cols):
                cols = slice(col, min(col + self.tile_cols, self.n_texts))
                scores = self.scorer.tile(rows, cols).to(self.dtype)
                yield Tile(rows, cols, scores, self._tile_positives(rows, cols))

    @torch.no_grad()
    def statistics(self, *statistics: Statistic) -> None:
        """Reduce every statistic over this rank's tiles, in one pass, then make the
        columns' results those of the whole batch (collective with several ranks)."""
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        for statistic in statistics:
            statistic.start(self.rows.stop - self.rows.start, self.n_texts, like)
        for tile in self.tiles():
            for statistic in statistics:
                statistic.update(tile, self.rows.start)
        if self.sharded:
            for statistic in statistics:
                statistic.combine_columns()

    def pair_scores(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(k,) the scores of pairs ``(rows[k], cols[k])`` (positions in the batch), with
        their gradient to the scorer's inputs, in at least float32."""
        return self.scorer.pairs(rows, cols).to(self.dtype)

    # ------------------------------------------------------------------ across ranks
    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """(k,) values of this rank -> those of every rank, in rank order (no gradient)."""
        return gather(values, uneven=True) if self.sharded else values

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """A value of this rank summed over the ranks (no gradient)."""
        return sum_over_ranks(value) if self.sharded else value

    # ------------------------------------------------------------------ dense gradients
    def dense_loss(self, value: torch.Tensor, weight: DenseWeight,
                   params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``value`` (this rank's part of an objective's loss) whose gradient is ``W``:
        the backward pass recomputes every tile of this rank's rows once, asks ``weight``
        for its ``dl/dS`` (and the loss's gradient with respect to each of ``params``),
        and writes the scorer's inputs' gradients tile by tile."""
        return _DenseTiles.apply(self, weight, value, len(self.scorer.inputs),
                                 *self.scorer.inputs, *params)


def check_tile(size: int, name: str) -> int:
    """A tile's side, checked where it is configured."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {size!r}")
    return size


DenseWeight = Callable[[Tile], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


class _DenseTiles(torch.autograd.Function):
    """A dense objective's part of the loss forward; its ``W = dl/dS`` tile by tile
    backward (see :meth:`ScoreTiles.dense_loss`)."""

    @staticmethod
    def forward(ctx, tiles: ScoreTiles, weight: DenseWeight, value: torch.Tensor,
                n_inputs: int, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.tiles, ctx.weight, ctx.n_inputs = tiles, weight, n_inputs
        ctx.params = tensors[n_inputs:]
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        tiles, n_inputs = ctx.tiles, ctx.n_inputs
        inputs = tiles.scorer.inputs
        wanted = ctx.needs_input_grad[4:4 + n_inputs]
        grads = [torch.zeros(x.shape, dtype=tiles.dtype, device=x.device) if need else None
                 for x, need in zip(inputs, wanted)]
        param_grads = [torch.zeros((), dtype=tiles.dtype, device=tiles.device)
                       for _ in ctx.params]
        scale = float(grad_output)  # one wait for the device a backward, not one a tile
        with torch.no_grad():
            for tile in tiles.tiles():
                weights, d_params = ctx.weight(tile)
                for total, d in zip(param_grads, d_params):
                    total += d
                if any(g is not None for g in grads):
                    tiles.scorer.tile_backward(tile.rows, tile.cols, weights, grads, scale)
        outputs = [None if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
        params = [(g * grad_output).to(p.dtype).reshape(p.shape)
                  for g, p in zip(param_grads, ctx.params)]
        return (None, None, None, None, *outputs, *params)


# --------------------------------------------------------------------------- helpers
def for_rows(vector: torch.Tensor) -> Callable[[Tile, int], torch.Tensor]:
    """A per-row value of this rank's rows, as a tile's ``(r, 1)`` column to broadcast."""
    def pick(tile: Tile, row_offset: int) -> torch.Tensor:
        return vector[tile.rows.start - row_offset:tile.rows.stop - row_offset][:, None]
    return pick


def for_cols(vector: torch.Tensor) -> Callable[[Tile], torch.Tensor]:
    """A per-column value (of every text), as a tile's ``(1, c)`` row to broadcast."""
    def pick(tile: Tile) -> torch.Tensor:
        return vector[tile.cols][None, :]
    return pick
