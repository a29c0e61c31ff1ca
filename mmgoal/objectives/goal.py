"""GOAL: objectives defined by their gradient (Xuan & Chen, WACV 2023).

Every triplet-family loss has the gradient ``T(s_p, s_n) * P+`` on the positive
and ``T(s_p, s_n) * P-`` on the negative of each hardest-negative triplet
(REFERENCE.md section 3). ``GoalObjective`` assembles that gradient ``G =
dl/dS`` for any triplet weight x pair weight, including the combinations that
no loss integrates to, and hands it to autograd through the surrogate
``(G.detach() * S).sum()``: its gradient is exactly ``G``, scaled by whatever
gradient flows in (loss scaling, accumulation), and autograd carries it on into
the encoders (for a dual encoder ``dl/dx_i = sum_j G[i, j] y_j``, the paper's
eq. 2-4). Unlike the authors' code it honours the incoming gradient, handles
several positives per row, and has no Python loop over the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from mmgoal.objectives.hard_negative import check_reduction
from mmgoal.objectives.mining import check_positives, mine_triplets
from mmgoal.objectives.weights import RelativeScores
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS


def _keyword_binder(fn: Callable, hyper: dict[str, float]) -> tuple[dict[str, float], bool]:
    """The hyperparameters ``fn`` names, and whether it takes ``relative``."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in hyper.items() if k in params}, "relative" in params


@OBJECTIVES.register()
class GoalObjective(nn.Module):
    """Triplet weight x pair weight, applied directly as the gradient of the scores.

    Args:
        triplet: a ``TRIPLET_WEIGHTS`` name: ``con``, ``nca``, ``cir``.
        pair: a ``PAIR_WEIGHTS`` name: ``con``, ``lin``, ``sig``, ``lin_ms``, ``sig_ms``.
        margin: ``con`` triplet margin.
        tau: ``nca``/``cir`` sharpness (the paper's figures: 10; released code: 1).
        cir_offset: ``cir`` offset ``c`` (released code: 0.5; paper: 0).
        alpha, beta, lam: ``sig``/``sig_ms`` scales and threshold.
        eps: multi-similarity comparison margin.
        lin_shift: ``lin`` shift ``g``.
        reduction: ``sum`` over triplets (VSE++) or ``mean`` over positives.

    Returns (from ``forward``): ``goal_loss``, whose value is the weighted
    violation ``sum T * (s_n - s_p)`` (for logging; it is not a loss whose
    gradient is ``G``) and whose gradient is ``G``; ``active_fraction``, the
    mean triplet weight.
    """

    def __init__(self, triplet: str = "con", pair: str = "con", margin: float = 0.2,
                 tau: float = 10.0, cir_offset: float = 0.5, alpha: float = 2.0,
                 beta: float = 10.0, lam: float = 0.5, eps: float = 0.1,
                 lin_shift: float = 0.0, reduction: str = "sum") -> None:
        super().__init__()
        self.triplet, self.pair = triplet, pair
        self.triplet_weight = TRIPLET_WEIGHTS.get(triplet)
        self.pair_weight = PAIR_WEIGHTS.get(pair)
        self.hyper = {"margin": margin, "tau": tau, "cir_offset": cir_offset, "alpha": alpha,
                      "beta": beta, "lam": lam, "eps": eps, "lin_shift": lin_shift}
        self.reduction = check_reduction(reduction)
        # Bound once: inspecting signatures every step would sit on the hot path.
        self._triplet_kwargs, _ = _keyword_binder(self.triplet_weight, self.hyper)
        self._pair_kwargs, self._needs_relative = _keyword_binder(self.pair_weight, self.hyper)

    def extra_repr(self) -> str:
        return f"triplet={self.triplet}, pair={self.pair}, reduction={self.reduction}"

    @torch.no_grad()
    def gradient(self, sims: torch.Tensor, positives: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``G = dl/dS``, the logged violation and the mean triplet weight.

        Weights are computed in float32 from the detached scores whatever their
        dtype (float64 scores keep float64), so bf16/fp16 training gets exact weights.

        Args:
            sims: (n_img, n_txt) scores.
            positives: (n_img, n_txt) bool.
        """
        scores = sims.detach().to(torch.promote_types(sims.dtype, torch.float32))
        triplets = mine_triplets(scores, positives)
        s_p, *negatives = triplets.scores(scores)
        triplet_kwargs, pair_kwargs = self._triplet_kwargs, dict(self._pair_kwargs)
        grad = torch.zeros_like(scores)
        violation = scores.new_zeros(())
        weight_sum = scores.new_zeros(())
        directions = (("i2t", negatives[0], triplets.i2t_valid, triplets.i2t_negatives,
                       (triplets.rows, triplets.i2t_negatives)),
                      ("t2i", negatives[1], triplets.t2i_valid, triplets.t2i_negatives,
                       (triplets.t2i_negatives, triplets.cols)))
        shared: dict = {}  # per-anchor sums the two directions' comparison sets share
        for direction, s_n, valid, mined, negative_index in directions:
            t = self.triplet_weight(s_p, s_n, **triplet_kwargs) * valid
            if self._needs_relative:
                pair_kwargs["relative"] = RelativeScores(
                    scores, positives, triplets.rows, triplets.cols, mined, direction, s_p, s_n,
                    self.hyper["eps"], shared)
            w_pos, w_neg = self.pair_weight(s_p, s_n, **pair_kwargs)
            grad.index_put_((triplets.rows, triplets.cols), -t * w_pos, accumulate=True)
            grad.index_put_(negative_index, t * w_neg, accumulate=True)
            violation += (t * (s_n - s_p)).sum()
            weight_sum += t.sum()
        n_triplets = max(2 * len(s_p), 1)
        if self.reduction == "mean":
            grad /= max(len(s_p), 1)
            violation /= max(len(s_p), 1)
        return grad, violation, weight_sum / n_triplets

    def forward(self, sims: torch.Tensor, positives: torch.Tensor | None = None,
                **extras) -> dict[str, torch.Tensor]:
        positives = check_positives(sims, positives)
        grad, violation, mean_weight = self.gradient(sims, positives)
        surrogate = (grad.to(sims.dtype) * sims).sum()
        # value: the logged violation; gradient: exactly G (times the incoming gradient)
        loss = surrogate - surrogate.detach() + violation.to(sims.dtype)
        return {"goal_loss": loss, "active_fraction": mean_weight}
