"""GOAL triplet and pair weights (REFERENCE.md section 3): pure functions of scores.

A triplet weight maps the scores of the positive and the mined negative,
``s_p, s_n: (N,)``, to ``T: (N,)``; a pair weight maps them to ``(P+, P-)``,
each ``(N,)``. Hyperparameters are keyword parameters: ``GoalObjective`` passes
each function the ones its signature names (``margin``, ``tau``,
``cir_offset``, ``alpha``, ``beta``, ``lam``, ``eps``, ``lin_shift``). Pair
weights that compare with the rest of the batch (multi-similarity) take a
``relative`` parameter: a :class:`RelativeScores`.

Add a weight of your own in a few lines (docs/objectives.md)::

    @PAIR_WEIGHTS.register("sq")
    def pair_weight_sq(s_p, s_n):
        return (1 - s_p) ** 2, s_n.clamp(min=0) ** 2
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class RelativeScores:
    """Scores a triplet's pair weights are compared with (multi-similarity terms).

    Attributes:
        pos_diffs: (N, M) ``s_p - r`` for the batch's positive scores ``r``.
        pos_mask: (N, M) bool, ``r`` is in ``R+`` (another positive ``<= s_n + eps``).
        neg_diffs: (N, K) ``s_n - r`` for the anchor's negative scores ``r``.
        neg_mask: (N, K) bool, ``r`` is in ``R-`` (not the mined negative,
            ``>= min(batch positives) - eps``).
    """

    pos_diffs: torch.Tensor
    pos_mask: torch.Tensor
    neg_diffs: torch.Tensor
    neg_mask: torch.Tensor

    @staticmethod
    def masked_mean(values: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
        """Row means of ``values`` over ``mask``; ``empty`` where a row has none."""
        count = mask.sum(dim=1)
        total = (values * mask).sum(dim=1)
        return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, empty))


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
                    beta: float = 10.0, lam: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid (binomial deviance): ``1/(1+e^{alpha(s_p-lam)})``, ``1/(1+e^{-beta(s_n-lam)})``."""
    return torch.sigmoid(-alpha * (s_p - lam)), torch.sigmoid(beta * (s_n - lam))


@PAIR_WEIGHTS.register("sig_ms")
def pair_weight_sig_ms(s_p: torch.Tensor, s_n: torch.Tensor, relative: RelativeScores,
                       alpha: float = 2.0, beta: float = 10.0, lam: float = 0.5
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid with multi-similarity terms: ``1/(m+ + e^{alpha(s_p-lam)})``, ``1/(m- + ...)``.

    ``m+ = mean_{R+} e^{alpha(s_p - r)}``, ``m- = mean_{R-} e^{-beta(s_n - r)}``; 1 when empty.
    """
    m_pos = relative.masked_mean(torch.exp(alpha * relative.pos_diffs), relative.pos_mask, 1.0)
    m_neg = relative.masked_mean(torch.exp(-beta * relative.neg_diffs), relative.neg_mask, 1.0)
    return (1 / (m_pos + torch.exp(alpha * (s_p - lam))),
            1 / (m_neg + torch.exp(-beta * (s_n - lam))))


@PAIR_WEIGHTS.register("lin_ms")
def pair_weight_lin_ms(s_p: torch.Tensor, s_n: torch.Tensor, relative: RelativeScores,
                       lin_shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear with multi-similarity terms: ``(1 - l+) [1 + g - s_p]_+``, ``(1 + l-) [s_n + g]_+``.

    ``l+ = mean_{R+} (s_p - r)``, ``l- = mean_{R-} (s_n - r)``; 0 when empty.
    **Choice**: the linear factors are those of ``lin`` (clamped, shift ``g``), so
    an empty comparison set gives exactly ``lin`` as REFERENCE.md requires; the
    unclamped ``(1 - s_p)``, ``s_n`` of the released code differ for ``s_n < 0``.
    """
    l_pos = relative.masked_mean(relative.pos_diffs, relative.pos_mask, 0.0)
    l_neg = relative.masked_mean(relative.neg_diffs, relative.neg_mask, 0.0)
    w_pos, w_neg = pair_weight_lin(s_p, s_n, lin_shift)
    return (1 - l_pos) * w_pos, (1 + l_neg) * w_neg
