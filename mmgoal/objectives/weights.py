"""GOAL triplet and pair weights (docs/reference/goal.md): pure functions of scores.

A triplet weight maps the scores of the positive and the mined negative,
``s_p, s_n: (N,)``, to ``T: (N,)``; a pair weight maps them to ``(P+, P-)``,
each ``(N,)``. A weight's options are its keyword parameters after the two
scores: a config sets them with the weight it belongs to (``triplet: {type:
cir, tau: 5}``) and ``GoalObjective`` rejects any option the weight does not
name. Pair weights that compare with the rest of the batch (multi-similarity)
take a ``relative`` parameter, a :class:`RelativeScores`, and an ``eps``
option: ``GoalObjective`` builds the comparison sets with that ``eps``, so the
weight's signature declares it even though its body only reads ``relative``.
Likewise a weight whose ``lam`` may be ``auto`` (mmgoal's adaptive lambda, not
the paper's; its type ``float | Literal["auto"]`` says so) declares ``lam_momentum``,
``lam_init`` and ``lam_steps``, which ``GoalObjective`` reads to keep the running
``lam`` it passes in. The registries check the options against the signatures (names,
types, the closest name to a typo) as they check every component's config.

Add a weight of your own in a few lines (docs/objectives.md)::

    @PAIR_WEIGHTS.register("sq")
    def pair_weight_sq(s_p, s_n):
        return (1 - s_p) ** 2, s_n.clamp(min=0) ** 2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from mmgoal.registry import PAIR_WEIGHTS, TRIPLET_WEIGHTS


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


# scores per block of the multi-similarity sets' masks (1 MiB of float32): no tensor of the
# score matrix's shape is made, and a block stays in cache
BLOCK = 1 << 18


class RelativeScores:
    """The multi-similarity comparison sets of one direction's triplets (docs/reference/goal.md).

    ``R+`` of a triplet: the scores ``r`` of the batch's *other* positive pairs
    with ``r <= s_n + eps``; ``R-``: the anchor's negatives other than the mined
    one with ``r >= min(batch positive scores) - eps``. Pair weights ask for
    means over these sets; they are computed from sorted positive scores and
    per-anchor sums over the scores (no (n_pos x n_pos) or (n_pos x n) tensor).

    It reads a share of the score matrix (:class:`~mmgoal.structures.ScoreShare`): the
    anchors' own scores, and the batch's positive scores, O(n) numbers. So under local
    scoring each rank builds the sets of its own triplets, and they equal one process's.

    Args:
        scores: detached scores whose rows (``i2t``: image anchors) or columns (``t2i``:
            text anchors) are the anchors; positives: same shape, bool.
        direction: ``i2t`` or ``t2i``.
        anchors: (N,) each triplet's anchor, a row or column index of ``scores``.
        s_p, s_n: (N,) the triplets' scores.
        positive_scores: (n_pos,) the score of every positive pair of the batch, once.
        eps: comparison margin.
        cache: shared by the two directions of one batch: the masked per-anchor sums of
            each score tensor (one tensor in one process, so both directions' sums come
            from one mask).
    """

    def __init__(self, scores: torch.Tensor, positives: torch.Tensor, direction: str,
                 anchors: torch.Tensor, s_p: torch.Tensor, s_n: torch.Tensor,
                 positive_scores: torch.Tensor, eps: float, cache: dict) -> None:
        self.scores, self.positives, self.eps = scores, positives, eps
        self.cache = cache.setdefault(id(scores), {"scores": scores})  # keeps the id valid
        self.s_p, self.s_n, self.positive_scores = s_p, s_n, positive_scores
        self.direction = direction
        self.anchors = anchors
        self.mined = s_n
        self.threshold = positive_scores.min() - eps

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
    def _anchor_sums(self, key: str,
                     fill: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                     ) -> torch.Tensor:
        """Per-anchor sums over the negatives ``>= threshold`` (both axes, cached).

        Computed a block of rows at a time (:data:`BLOCK` scores), so no tensor of the
        scores' shape is made: for each block, the 0/1 mask of its negatives ``>=
        threshold``, which ``fill(mask, block)`` turns in place into the masked values to
        sum (``None`` counts). ``r - below > 0`` exactly when ``r >= threshold``
        (``below`` is the next float down, and a rounded difference keeps its sign): one
        float pass, where a bool comparison and its conversion cost three times as much
        on CPU, and masked operations with bool tensors are slower still.
        """
        if key not in self.cache:
            self.cache[key] = self._block_sums(fill)
        by_row, by_col = self.cache[key]
        return by_row if self.direction == "i2t" else by_col

    def _block_sums(self, fill: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores
        below = torch.nextafter(self.threshold, self.threshold.new_tensor(-torch.inf))
        if "positives" not in self.cache:  # row-major: sorted by row
            self.cache["positives"] = self.positives.nonzero(as_tuple=True)
        pos_rows, pos_cols = self.cache["positives"]
        n_rows, n_cols = scores.shape
        rows = max(BLOCK // max(n_cols, 1), 1)
        starts = torch.arange(0, n_rows + rows, rows, device=pos_rows.device)
        bounds = torch.searchsorted(pos_rows, starts).tolist()  # each block's positives
        by_row, by_col = scores.new_empty(n_rows), scores.new_zeros(n_cols)
        for index, start in enumerate(range(0, n_rows, rows)):
            block = scores[start:start + rows]
            inside = (block - below).sign_().clamp_(min=0)
            first, last = bounds[index], bounds[index + 1]
            inside[pos_rows[first:last] - start, pos_cols[first:last]] = 0  # never negatives
            if fill is not None:
                fill(inside, block)
            by_row[start:start + rows] = inside.sum(1)
            by_col += inside.sum(0)
        return by_row, by_col

    def _negative_mean(self, key: str,
                       fill: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       mined_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        in_set = (self.mined >= self.threshold).to(self.s_n.dtype)  # the mined one is left out
        count = self._anchor_sums("count", None)[self.anchors] - in_set
        total = self._anchor_sums(key, fill)[self.anchors] - in_set * mined_value
        return total / count.clamp(min=1), count > 0.5

    def neg_mean_exp(self, scale: float, empty: float = 1.0) -> torch.Tensor:
        """``mean_{r in R-} exp(-scale (s_n - r))``; ``empty`` where ``R-`` is empty."""
        if "top" not in self.cache:
            self.cache["top"] = self.scores.max()  # exp(scale (r - top)) <= 1: no overflow
        top = self.cache["top"]

        def fill(inside: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
            # Not exp(log(mask) + ...): exp and log of infinities are ten times slower.
            return inside.mul_((block - top).mul_(scale).exp_())

        mean, nonempty = self._negative_mean(f"exp:{scale}", fill,
                                             torch.exp(scale * (self.mined - top)))
        mean = mean * torch.exp(scale * (top - self.s_n))
        return torch.where(nonempty, mean, torch.full_like(mean, empty))

    def neg_mean_diff(self, empty: float = 0.0) -> torch.Tensor:
        """``mean_{r in R-} (s_n - r)``; ``empty`` where ``R-`` is empty."""
        mean, nonempty = self._negative_mean("sum", lambda inside, block: inside.mul_(block),
                                             self.mined)
        mean = self.s_n - mean
        return torch.where(nonempty, mean, torch.full_like(mean, empty))


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

    ``lam_momentum``, ``lam_init`` and ``lam_steps`` configure ``lam: auto``, mmgoal's adaptive
    lambda (:mod:`mmgoal.objectives.adaptive_lam`): ``GoalObjective`` then passes
    the running value as ``lam``, so the body never reads them.
    """
    return torch.sigmoid(-alpha * (s_p - lam)), torch.sigmoid(beta * (s_n - lam))


@PAIR_WEIGHTS.register("sig_ms")
def pair_weight_sig_ms(s_p: torch.Tensor, s_n: torch.Tensor, relative: RelativeScores,
                       alpha: float = 2.0, beta: float = 10.0,
                       lam: float | Literal["auto"] = 0.5,
                       eps: float = 0.1, *, lam_momentum: float = 0.9, lam_init: float = 0.5,
                       lam_steps: int | None = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid with multi-similarity terms: ``1/(m+ + e^{alpha(s_p-lam)})``, ``1/(m- + ...)``.

    ``m+ = mean_{R+} e^{alpha(s_p - r)}``, ``m- = mean_{R-} e^{-beta(s_n - r)}``; 1 when empty.
    ``eps`` is the comparison margin ``relative`` was built with; ``lam_momentum``,
    ``lam_init`` and ``lam_steps`` configure ``lam: auto`` (as for ``sig``).
    """
    m_pos = relative.pos_mean_exp(alpha, empty=1.0)
    m_neg = relative.neg_mean_exp(beta, empty=1.0)
    return (1 / (m_pos + torch.exp(alpha * (s_p - lam))),
            1 / (m_neg + torch.exp(-beta * (s_n - lam))))


@PAIR_WEIGHTS.register("lin_ms")
def pair_weight_lin_ms(s_p: torch.Tensor, s_n: torch.Tensor, relative: RelativeScores,
                       lin_shift: float = 0.0, eps: float = 0.1
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear with multi-similarity terms: ``(1 - l+) [1 + g - s_p]_+``, ``(1 + l-) [s_n + g]_+``.

    ``l+ = mean_{R+} (s_p - r)``, ``l- = mean_{R-} (s_n - r)``; 0 when empty.
    ``eps`` is the comparison margin ``relative`` was built with.
    **Choice**: the linear factors are those of ``lin`` (clamped, shift ``g``), so
    an empty comparison set gives exactly ``lin`` (docs/reference/goal.md); the
    unclamped ``(1 - s_p)``, ``s_n`` of the released code differ for ``s_n < 0``.
    """
    l_pos = relative.pos_mean_diff(empty=0.0)
    l_neg = relative.neg_mean_diff(empty=0.0)
    w_pos, w_neg = pair_weight_lin(s_p, s_n, lin_shift)
    return (1 - l_pos) * w_pos, (1 + l_neg) * w_neg
