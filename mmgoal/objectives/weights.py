"""GOAL triplet and pair weights (docs/reference/goal.md): pure functions of scores.

A triplet weight maps ``s_p, s_n: (N,)`` to ``T: (N,)``, a pair weight to ``(P+, P-)``;
its options are its keyword parameters after the scores (and ``relative``, a
:class:`RelativeScores`). ``eps`` and ``lam_*`` are declared for ``GoalObjective``, not
read by the bodies (docs/objectives.md, "Adding a weight").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from mmgoal.registry import PAIR_WEIGHTS, TRIPLET_WEIGHTS
from mmgoal.scoring import LogSumExp, Statistic, Sum, Tile


@TRIPLET_WEIGHTS.register("con")
def triplet_weight_con(s_p: torch.Tensor, s_n: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    """``1[m + s_n - s_p > 0]``: the hinge of the triplet loss is active."""
    return (margin + s_n - s_p > 0).to(s_p.dtype)


@TRIPLET_WEIGHTS.register("nca")
def triplet_weight_nca(s_p: torch.Tensor, s_n: torch.Tensor, tau: float = 10.0) -> torch.Tensor:
    """``1 / (1 + exp(tau (s_p - s_n)))``: the softmax weight of NCA / NT-Xent."""
    return torch.sigmoid(-tau * (s_p - s_n))


@TRIPLET_WEIGHTS.register("cir")
def triplet_weight_cir(s_p: torch.Tensor, s_n: torch.Tensor, tau: float = 10.0,
                       cir_offset: float = 0.5) -> torch.Tensor:
    """``1 / (1 + exp(tau (s_p (2 - s_p) - s_n^2 - c)))``: circles around (1, 0)."""
    return torch.sigmoid(-tau * (s_p * (2 - s_p) - s_n ** 2 - cir_offset))


class NegativeSums:
    """What ``R-`` needs of each triplet's anchor: over its negatives with ``r >= threshold``
    (the mined one included), their ``count``, ``total`` (``sum r``) and ``log sum
    exp(scale r)`` at each scale asked. A dry run of the pair weight records what it reads;
    the objective reduces exactly those over the tiles and gives them back (:meth:`of`)."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.wants_total = False
        self.values: dict | None = None

    def of(self, count: torch.Tensor, total: torch.Tensor | None,
           log_sum_exp: dict[float, torch.Tensor]) -> NegativeSums:
        """These sums, per triplet."""
        given = NegativeSums()
        given.values = {"count": count, "total": total, **log_sum_exp}
        return given

    def count(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(like.shape) if self.values is None else self.values["count"]

    def total(self, like: torch.Tensor) -> torch.Tensor:
        if self.values is None:
            self.wants_total = True
            return like.new_zeros(like.shape)
        return self.values["total"]

    def log_sum_exp(self, scale: float, like: torch.Tensor) -> torch.Tensor:
        if self.values is None:
            if scale not in self.scales:
                self.scales.append(scale)
            return like.new_zeros(like.shape)
        return self.values[scale]


def negative_set_statistics(asked: NegativeSums, threshold: torch.Tensor
                            ) -> dict[str | float, Statistic]:
    """The statistics that give what a pair weight asked of ``R-`` (``asked``), over every
    anchor's negatives with ``r >= threshold``: a count, and the sum or the log-sum-exp at
    each scale where asked, keyed as :meth:`NegativeSums.of` takes them."""
    # r - below > 0 exactly when r >= threshold (below: the next float down, and a rounded
    # difference keeps its sign): 0/1 in one float pass, where a bool comparison and its
    # conversion cost several times as much on a CPU
    below = torch.nextafter(threshold, threshold.new_tensor(-math.inf))

    def taken(tile: Tile, _offset: int) -> torch.Tensor:
        if "taken" not in tile.cache:  # the tile's negatives in R-'s range, as 1s
            tile.cache["taken"] = (tile.masked - below).sign_().clamp_(min=0)
        return tile.cache["taken"]

    statistics: dict[str | float, Statistic] = {"count": Sum(taken)}
    if asked.wants_total:
        statistics["total"] = Sum(taken, lambda tile: tile.scores)
    statistics.update({scale: LogSumExp(scale, taken, floor=threshold if scale > 0 else None)
                       for scale in asked.scales})
    return statistics


def negative_sums(asked: NegativeSums, statistics: dict[str | float, Statistic], rows: bool,
                  anchors: torch.Tensor) -> NegativeSums:
    """The reduced ``statistics`` (:func:`negative_set_statistics`) of each triplet's anchor:
    a row (an image, ``rows``) or a column (a text)."""
    of_anchors = {key: (statistic.row if rows else statistic.col)[anchors]
                  for key, statistic in statistics.items()}
    return asked.of(of_anchors.pop("count"), of_anchors.pop("total", None), of_anchors)


class RelativeScores:
    """The multi-similarity comparison sets ``R+``, ``R-`` of one direction's triplets
    (docs/reference/goal.md), whose means the pair weights ask for: ``R+`` by a prefix sum
    over the sorted ``positive_scores``, ``R-`` from ``negatives`` (:class:`NegativeSums`).
    """

    def __init__(self, s_p: torch.Tensor, s_n: torch.Tensor, positive_scores: torch.Tensor,
                 eps: float, negatives: NegativeSums) -> None:
        self.s_p, self.s_n, self.positive_scores = s_p, s_n, positive_scores
        self.eps, self.negatives = eps, negatives
        self.threshold = (positive_scores.min() if len(positive_scores)
                          else s_p.new_tensor(math.inf)) - eps

    # ---------------------------------------------------------------- R+
    def _positive_sums(self, values: Callable[[torch.Tensor], torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of ``values(r)`` over ``R+`` and its size, per triplet, via a sorted prefix sum."""
        sorted_scores = self.positive_scores.sort().values
        prefix = torch.cat([sorted_scores.new_zeros(1, dtype=torch.float64),
                            values(sorted_scores).double().cumsum(0)])
        count = torch.searchsorted(sorted_scores, self.s_n + self.eps, right=True)
        own = (self.s_p <= self.s_n + self.eps)  # the triplet's own positive is not "other"
        total = prefix[count] - own * values(self.s_p).double()
        return total.to(self.s_p.dtype), count - own.long()

    def pos_mean_exp(self, scale: float, empty: float = 1.0) -> torch.Tensor:
        """``mean_{r in R+} exp(scale (s_p - r))``; ``empty`` where ``R+`` is empty."""
        total, count = self._positive_sums(lambda r: torch.exp(-scale * r))
        mean = torch.exp(scale * self.s_p) * total / count.clamp(min=1)
        return torch.where(count > 0, mean, torch.full_like(mean, empty))

    def pos_mean_diff(self, empty: float = 0.0) -> torch.Tensor:
        """``mean_{r in R+} (s_p - r)``; ``empty`` where ``R+`` is empty."""
        total, count = self._positive_sums(lambda r: r)
        mean = self.s_p - total / count.clamp(min=1)
        return torch.where(count > 0, mean, torch.full_like(mean, empty))

    # ---------------------------------------------------------------- R-
    def _in_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mined negative's membership of its anchor's set (it is left out of ``R-``)
        and the size of ``R-``."""
        in_set = (self.s_n >= self.threshold).to(self.s_n.dtype)
        return in_set, self.negatives.count(self.s_n) - in_set

    def neg_mean_exp(self, scale: float, empty: float = 1.0) -> torch.Tensor:
        """``mean_{r in R-} exp(-scale (s_n - r))``; ``empty`` where ``R-`` is empty."""
        in_set, count = self._in_set()
        # sum over the set of exp(scale (r - s_n)) <= its size: s_n is the anchor's largest
        total = torch.exp(self.negatives.log_sum_exp(scale, self.s_n) - scale * self.s_n)
        mean = (total - in_set) / count.clamp(min=1)
        return torch.where(count > 0.5, mean, torch.full_like(mean, empty))

    def neg_mean_diff(self, empty: float = 0.0) -> torch.Tensor:
        """``mean_{r in R-} (s_n - r)``; ``empty`` where ``R-`` is empty."""
        in_set, count = self._in_set()
        total = self.negatives.total(self.s_n) - in_set * self.s_n
        mean = self.s_n - total / count.clamp(min=1)
        return torch.where(count > 0.5, mean, torch.full_like(mean, empty))


@PAIR_WEIGHTS.register("con")
def pair_weight_con(s_p: torch.Tensor, s_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Constant: ``P+ = P- = 1``."""
    return torch.ones_like(s_p), torch.ones_like(s_n)


@PAIR_WEIGHTS.register("lin")
def pair_weight_lin(s_p: torch.Tensor, s_n: torch.Tensor, lin_shift: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear: ``P+ = [1 + g - s_p]_+``, ``P- = [s_n + g]_+`` (Circle loss's alphas)."""
    return (1 + lin_shift - s_p).clamp(min=0), (s_n + lin_shift).clamp(min=0)


@PAIR_WEIGHTS.register("sig")
def pair_weight_sig(s_p: torch.Tensor, s_n: torch.Tensor, alpha: float = 2.0,
                    beta: float = 10.0, lam: float | Literal["auto"] = 0.5, *,
                    lam_momentum: float = 0.9,
                    lam_init: float = 0.5, lam_steps: int | None = 10
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid (binomial deviance): ``1/(1+e^{alpha(s_p-lam)})``, ``1/(1+e^{-beta(s_n-lam)})``.
    ``lam_*`` configure ``lam: auto`` (:mod:`mmgoal.objectives.adaptive_lam`)."""
    return torch.sigmoid(-alpha * (s_p - lam)), torch.sigmoid(beta * (s_n - lam))


@PAIR_WEIGHTS.register("sig_ms")
def pair_weight_sig_ms(s_p: torch.Tensor, s_n: torch.Tensor, relative: RelativeScores,
                       alpha: float = 2.0, beta: float = 10.0,
                       lam: float | Literal["auto"] = 0.5,
                       eps: float = 0.1, *, lam_momentum: float = 0.9, lam_init: float = 0.5,
                       lam_steps: int | None = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid with multi-similarity terms: ``1/(m+ + e^{alpha(s_p-lam)})``, ``1/(m- + ...)``;
    ``m+ = mean_{R+} e^{alpha(s_p - r)}``, ``m- = mean_{R-} e^{-beta(s_n - r)}``, 1 when empty.
    """
    m_pos = relative.pos_mean_exp(alpha, empty=1.0)
    m_neg = relative.neg_mean_exp(beta, empty=1.0)
    return (1 / (m_pos + torch.exp(alpha * (s_p - lam))),
            1 / (m_neg + torch.exp(-beta * (s_n - lam))))


@PAIR_WEIGHTS.register("lin_ms")
def pair_weight_lin_ms(s_p: torch.Tensor, s_n: torch.Tensor, relative: RelativeScores,
                       lin_shift: float = 0.0, eps: float = 0.1
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear with multi-similarity terms: ``(1 - l+) [1 + g - s_p]_+``, ``(1 + l-) [s_n + g]_+``;
    ``l+ = mean_{R+} (s_p - r)``, ``l- = mean_{R-} (s_n - r)``, 0 when empty. ``lin``'s
    clamped factors, not the released code's (docs/objectives.md, ``lin_ms``)."""
    l_pos = relative.pos_mean_diff(empty=0.0)
    l_neg = relative.neg_mean_diff(empty=0.0)
    w_pos, w_neg = pair_weight_lin(s_p, s_n, lin_shift)
    return (1 - l_pos) * w_pos, (1 + l_neg) * w_neg
