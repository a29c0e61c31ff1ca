"""Classic metric-learning losses (docs/reference/objectives.md): baselines, and the
references of the GOAL equivalence tests (docs/reference/goal.md). All but
``InfoNCELoss`` and ``MultiSimilarityLoss`` work on every positive's hardest negative.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.contract import TemperatureModel
from mmgoal.objectives.hard_negative import HardNegativeLoss, Reduction
from mmgoal.objectives.mining import score_tiles
from mmgoal.registry import OBJECTIVES
from mmgoal.scoring import HardestNegative, LogSumExp, Tile, for_cols, for_rows
from mmgoal.structures import ObjectiveInputs


@OBJECTIVES.register()
class NTXentHardLoss(HardNegativeLoss):
    """Hard-negative NT-Xent: ``-log(e^{tau s_p} / (e^{tau s_p} + e^{tau s_n}))``, ``tau``
    an inverse temperature."""

    name = "ntxent"

    def __init__(self, tau: float = 10.0, reduction: Reduction = "sum") -> None:
        super().__init__(reduction)
        self.tau = tau

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.tau * (s_n - s_p))


@OBJECTIVES.register()
class BinomialDevianceLoss(HardNegativeLoss):
    """Binomial deviance on (positive, hardest negative):
    ``(1/alpha) log(1 + e^{-alpha(s_p - lam)}) + (1/beta) log(1 + e^{beta(s_n - lam)})``."""

    name = "binomial"

    def __init__(self, alpha: float = 2.0, beta: float = 10.0, lam: float = 0.5,
                 reduction: Reduction = "sum") -> None:
        super().__init__(reduction)
        self.alpha, self.beta, self.lam = alpha, beta, lam

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return (F.softplus(-self.alpha * (s_p - self.lam)) / self.alpha
                + F.softplus(self.beta * (s_n - self.lam)) / self.beta)


@OBJECTIVES.register()
class CircleLoss(HardNegativeLoss):
    """Circle loss (Sun et al., CVPR 2020) on (positive, hardest negative):
    ``softplus(gamma (a_n (s_n - m) - a_p (s_p - 1 + m)))`` with detached
    ``a_p = [1 + m - s_p]_+``, ``a_n = [s_n + m]_+`` and ``m`` the ``margin``."""

    name = "circle"

    def __init__(self, margin: float = 0.25, gamma: float = 64.0,
                 reduction: Reduction = "sum") -> None:
        super().__init__(reduction)
        self.margin, self.gamma = margin, gamma

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        m = self.margin
        alpha_p = (1 + m - s_p.detach()).clamp(min=0)
        alpha_n = (s_n.detach() + m).clamp(min=0)
        return F.softplus(self.gamma * (alpha_n * (s_n - m) - alpha_p * (s_p - 1 + m)))


def _log1p_sum_exp(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row-wise ``log(1 + sum_{mask} e^{values})``, stable. (N, K) -> (N,)."""
    masked = values.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(torch.cat([torch.zeros_like(masked[:, :1]), masked], dim=1), dim=1)


def multi_similarity_rows(sims: torch.Tensor, positives: torch.Tensor, alpha: float,
                          beta: float, lam: float, eps: float) -> torch.Tensor:
    """(n_anchor,) multi-similarity loss of every row of ``sims`` (n_anchor, n_ref) as an
    anchor (Wang et al., CVPR 2019, eq. 12; 0 without kept pairs). Pairs are mined first
    (eq. 7-8): a negative is kept when ``S + eps >`` the anchor's lowest positive, a
    positive when ``S - eps <`` its highest negative."""
    detached = sims.detach()
    negatives = ~positives
    min_pos = detached.masked_fill(negatives, float("inf")).amin(dim=1, keepdim=True)
    max_neg = detached.masked_fill(positives, float("-inf")).amax(dim=1, keepdim=True)
    keep_neg = negatives & (detached + eps > min_pos)
    keep_pos = positives & (detached - eps < max_neg)
    return (_log1p_sum_exp(-alpha * (sims - lam), keep_pos) / alpha
            + _log1p_sum_exp(beta * (sims - lam), keep_neg) / beta)


def segment_log1p_sum_exp(values: torch.Tensor, segments: torch.Tensor, n_segments: int
                          ) -> torch.Tensor:
    """``log(1 + sum_{k in segment} e^{values_k})`` of every segment (``-inf`` values: left
    out), stable, with the gradient of ``values``. (k,) -> (n_segments,)."""
    top = torch.zeros(n_segments, dtype=values.dtype, device=values.device)
    top = top.scatter_reduce(0, segments, values.detach(), reduce="amax", include_self=True)
    sums = torch.exp(-top).index_add(0, segments, torch.exp(values - top[segments]))
    return top + torch.log(sums)


def _segment_min(values: torch.Tensor, segments: torch.Tensor, n_segments: int) -> torch.Tensor:
    """Each segment's smallest value (``inf`` for an empty one). (k,) -> (n_segments,)."""
    return values.new_full((n_segments,), torch.inf).scatter_reduce(
        0, segments, values, reduce="amin", include_self=True)


@OBJECTIVES.register()
class MultiSimilarityLoss(nn.Module):
    """Multi-similarity loss over all mined pairs, images and texts both as anchors.
    ``alpha``, ``beta``, ``lam``: the MS scales and threshold (``beta`` 10 as GOAL's ``sig``,
    50 in the MS paper); ``eps``: the pair-mining margin (docs/reference/objectives.md).
    """

    def __init__(self, alpha: float = 2.0, beta: float = 10.0, lam: float = 0.5,
                 eps: float = 0.1, reduction: Reduction = "sum") -> None:
        super().__init__()
        self.alpha, self.beta, self.lam, self.eps = alpha, beta, lam, eps
        self.reduction = reduction

    works_on_tiles = True

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        tiles = score_tiles(inputs)
        alpha, beta, lam, eps = self.alpha, self.beta, self.lam, self.eps
        n_rows = tiles.rows.stop - tiles.rows.start
        i2t = (tiles.positive_rows, tiles.positive_cols)
        t2i = (tiles.own_positive_rows, tiles.own_positive_cols)
        s_i2t, s_t2i = tiles.pair_scores(*i2t), tiles.pair_scores(*t2i)
        every_text, their_images = tiles.all_text_positives()
        row_min = _segment_min(s_i2t.detach(), i2t[0] - tiles.rows.start, n_rows)
        col_min = _segment_min(tiles.pair_scores(their_images, every_text).detach(), every_text,
                               tiles.n_texts)
        kept = (lambda tile, offset: tile.negatives & (tile.scores + eps > for_rows(row_min)(
                    tile, offset)),
                lambda tile, offset: tile.negatives & (tile.scores + eps > for_cols(col_min)(
                    tile)))
        hardest, negatives = HardestNegative(), LogSumExp(beta, kept)
        tiles.statistics(hardest, negatives)
        # the negatives' terms log(1 + sum e^{beta (s - lam)}) / beta: dense
        row_terms = F.softplus(negatives.row - beta * lam)
        col_terms = F.softplus(negatives.col - beta * lam)
        value = (row_terms.sum() + col_terms[tiles.own_texts].sum()) / beta
        # the positives' terms: O(n) pairs, with their gradient
        for (anchors, s_p, max_neg, n) in (
                (i2t[0] - tiles.rows.start, s_i2t, hardest.row_value, n_rows),
                (t2i[1], s_t2i, hardest.col_value, tiles.n_texts)):
            values = (-alpha * (s_p - lam)).masked_fill(s_p.detach() - eps >= max_neg[anchors],
                                                        -math.inf)
            value = value + segment_log1p_sum_exp(values, anchors, n).sum() / alpha
        divisor = tiles.n_images + tiles.n_texts if self.reduction == "mean" else 1

        def weight(tile: Tile) -> tuple[torch.Tensor, tuple]:
            """e^{beta (s - lam)} / (1 + sum) at each anchor's kept negatives."""
            shifted = tile.scores * beta - beta * lam
            rows = shifted - for_rows(row_terms)(tile, tiles.rows.start)
            weights = rows.exp_().mul_(kept[0](tile, tiles.rows.start))
            cols = (shifted - for_cols(col_terms)(tile)).exp_().mul_(kept[1](tile, 0))
            return weights.add_(cols).div_(divisor), ()

        loss = tiles.dense_loss(value.detach() / divisor, weight) \
            + (value - value.detach()) / divisor
        return {"ms_loss": loss.to(tiles.scorer.dtype)}


def softmax_sum(x: torch.Tensor, row_lse: torch.Tensor, col_lse: torch.Tensor,
                row_factor: torch.Tensor, col_factor: torch.Tensor) -> torch.Tensor:
    """``exp(x - row_lse) row_factor + exp(x - col_lse) col_factor`` of a tile ``x`` (r, c),
    the per-row values (r, 1) and per-column ones (1, c): with one exp where every row's and
    column's log-sum-exp lies near the tile's largest value (``x`` is overwritten)."""
    top = x.max()
    row_shift, col_shift = top - row_lse, top - col_lse
    limit = 60.0 if x.dtype != torch.float64 else 600.0
    if bool(torch.maximum(row_shift.max(), col_shift.max()) <= limit):
        scales = (row_shift.exp() * row_factor) + (col_shift.exp() * col_factor)
        return x.sub_(top).exp_().mul_(scales)
    rows = (x - row_lse).exp_().mul_(row_factor)
    return rows.add_(x.sub_(col_lse).exp_().mul_(col_factor))


@OBJECTIVES.register()
class InfoNCELoss(nn.Module):
    """CLIP/ITC contrastive loss with a learnable temperature clamped to
    ``[min_temperature, max_temperature]``; a row's target spreads over its positives
    (X-VLM's ITC). A :class:`~mmgoal.contract.TemperatureModel` ``model`` sets the
    temperature instead (this one is then a buffer). Gives ``infonce_loss`` and
    ``temperature``; on score tiles as Inf-CL (docs/reference/objectives.md, "Score tiles").
    """

    def __init__(self, temperature: float = 0.07, learnable: bool = True,
                 min_temperature: float = 0.001, max_temperature: float = 0.5,
                 model: nn.Module | None = None) -> None:
        super().__init__()
        if not min_temperature <= temperature <= max_temperature:
            raise ValueError(f"temperature {temperature} lies outside "
                             f"[{min_temperature}, {max_temperature}]")
        value = torch.tensor(float(temperature))
        if learnable and not isinstance(model, TemperatureModel):
            self.temperature = nn.Parameter(value)
        else:
            self.register_buffer("temperature", value)
        self.min_temperature, self.max_temperature = min_temperature, max_temperature

    works_on_tiles = True

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        tiles = score_tiles(inputs)
        own = inputs.model.temperature() if isinstance(inputs.model, TemperatureModel) \
            else self.temperature
        temperature = own.clamp(self.min_temperature, self.max_temperature).to(tiles.dtype)
        n_rows = tiles.rows.stop - tiles.rows.start
        every_text, _ = tiles.all_text_positives()
        row_count = torch.bincount(tiles.positive_rows - tiles.rows.start, minlength=n_rows)
        col_count = torch.bincount(every_text, minlength=tiles.n_texts)
        # a direction's terms are means over its anchors with a positive, halved
        row_factor = (row_count > 0).to(tiles.dtype) / (2 * tiles.n_images)
        col_factor = (col_count > 0).to(tiles.dtype) / (2 * tiles.n_texts)
        scale = 1 / temperature.detach()
        lse = LogSumExp(scale)
        tiles.statistics(lse)
        row_lse = torch.where(row_count > 0, lse.row, torch.zeros_like(lse.row))
        col_lse = torch.where(col_count > 0, lse.col, torch.zeros_like(lse.col))
        value = (row_lse * row_factor).sum() + (col_lse * col_factor)[tiles.own_texts].sum()
        # the targets: minus the mean of s / T over each anchor's positives, O(n) pairs
        i2t = (tiles.positive_rows, tiles.positive_cols)
        t2i = (tiles.own_positive_rows, tiles.own_positive_cols)
        targets = torch.zeros((), dtype=tiles.dtype, device=tiles.device)
        for (images, texts), anchors, count, factor in (
                (i2t, i2t[0] - tiles.rows.start, row_count, row_factor),
                (t2i, t2i[1], col_count, col_factor)):
            s_p = tiles.pair_scores(images, texts)
            share = factor[anchors] / count[anchors].clamp(min=1)
            targets = targets - (s_p * share).sum() / temperature

        def weight(tile: Tile) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
            """``softmax / T`` of both directions; ``-sum(softmax s) / T^2`` for T."""
            # (an anchor without positives: factor 0, its lse finite)
            row_lse = for_rows(lse.row)(tile, tiles.rows.start)
            probabilities = softmax_sum(tile.scores * scale, row_lse, for_cols(lse.col)(tile),
                                        for_rows(row_factor)(tile, tiles.rows.start),
                                        for_cols(col_factor)(tile))
            grad_temperature = -torch.dot(probabilities.view(-1),
                                          tile.scores.view(-1)) * scale ** 2
            return probabilities.mul_(scale), (grad_temperature,)

        loss = tiles.dense_loss(value, weight, (temperature,)) + targets
        return {"infonce_loss": loss.to(tiles.scorer.dtype),
                "temperature": temperature.detach().to(own.dtype)}
