"""Classic metric-learning losses as ordinary autograd objectives.

They are the references of the GOAL equivalence tests (docs/reference/goal.md,
"The 15 combinations and the known losses they equal"; the formulas:
docs/reference/objectives.md) and baselines for users. All but ``InfoNCELoss`` and
``MultiSimilarityLoss`` work on the hardest negative of every positive, in both
directions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.contract import TemperatureModel
from mmgoal.objectives.blocks import BLOCK_ROWS, RowTerm, check_block_rows, in_row_blocks
from mmgoal.objectives.hard_negative import HardNegativeLoss, check_reduction
from mmgoal.objectives.mining import score_share
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


@OBJECTIVES.register()
class NTXentHardLoss(HardNegativeLoss):
    """Hard-negative NT-Xent: ``-log(e^{tau s_p} / (e^{tau s_p} + e^{tau s_n}))``.

    Args:
        tau: inverse temperature.
        reduction: ``sum`` or ``mean`` over positives.
    """

    name = "ntxent"

    def __init__(self, tau: float = 10.0, reduction: str = "sum") -> None:
        super().__init__(reduction)
        self.tau = tau

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.tau * (s_n - s_p))


@OBJECTIVES.register()
class BinomialDevianceLoss(HardNegativeLoss):
    """Binomial deviance on (positive, hardest negative).

    ``(1/alpha) log(1 + e^{-alpha(s_p - lam)}) + (1/beta) log(1 + e^{beta(s_n - lam)})``.
    """

    name = "binomial"

    def __init__(self, alpha: float = 2.0, beta: float = 10.0, lam: float = 0.5,
                 reduction: str = "sum") -> None:
        super().__init__(reduction)
        self.alpha, self.beta, self.lam = alpha, beta, lam

    def triplet_loss(self, s_p: torch.Tensor, s_n: torch.Tensor) -> torch.Tensor:
        return (F.softplus(-self.alpha * (s_p - self.lam)) / self.alpha
                + F.softplus(self.beta * (s_n - self.lam)) / self.beta)


@OBJECTIVES.register()
class CircleLoss(HardNegativeLoss):
    """Circle loss (Sun et al., CVPR 2020) on (positive, hardest negative).

    ``softplus(gamma (a_n (s_n - m) - a_p (s_p - 1 + m)))`` with detached
    ``a_p = [1 + m - s_p]_+`` and ``a_n = [s_n + m]_+``.

    Args:
        margin: relaxation ``m``.
        gamma: scale.
    """

    name = "circle"

    def __init__(self, margin: float = 0.25, gamma: float = 64.0, reduction: str = "sum") -> None:
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
    """Multi-similarity loss of every row as an anchor (Wang et al., CVPR 2019, eq. 12).

    Pairs are mined first (their eq. 7-8): a negative is kept when ``S + eps >``
    the anchor's lowest positive, a positive when ``S - eps <`` its highest negative.

    Args:
        sims: (n_anchor, n_ref); positives: (n_anchor, n_ref) bool.

    Returns:
        (n_anchor,) losses (0 for an anchor without kept pairs).
    """
    detached = sims.detach()
    negatives = ~positives
    min_pos = detached.masked_fill(negatives, float("inf")).amin(dim=1, keepdim=True)
    max_neg = detached.masked_fill(positives, float("-inf")).amax(dim=1, keepdim=True)
    keep_neg = negatives & (detached + eps > min_pos)
    keep_pos = positives & (detached - eps < max_neg)
    return (_log1p_sum_exp(-alpha * (sims - lam), keep_pos) / alpha
            + _log1p_sum_exp(beta * (sims - lam), keep_neg) / beta)


class _MultiSimilarityTerms(RowTerm):
    """:func:`multi_similarity_rows` of a block, over ``divisor``."""

    def __init__(self, loss: MultiSimilarityLoss, divisor: int) -> None:
        self.hp = (loss.alpha, loss.beta, loss.lam, loss.eps)
        self.divisor = divisor

    def loss(self, direction, scores, positives):
        return multi_similarity_rows(scores, positives, *self.hp).sum() / self.divisor, None


@OBJECTIVES.register()
class MultiSimilarityLoss(nn.Module):
    """Multi-similarity loss over all mined pairs, images and texts both as anchors.

    Args:
        alpha, beta, lam: the MS scales and threshold (2, 50, 0.5 in the MS paper;
            ``beta`` 10 matches GOAL's ``sig`` default).
        eps: pair-mining margin.
        reduction: ``sum`` or ``mean`` over anchors.
        block_rows: anchors whose terms are computed at once (docs/objectives.md).
    """

    def __init__(self, alpha: float = 2.0, beta: float = 10.0, lam: float = 0.5,
                 eps: float = 0.1, reduction: str = "sum", block_rows: int = BLOCK_ROWS
                 ) -> None:
        super().__init__()
        self.block_rows = check_block_rows(block_rows)
        self.alpha, self.beta, self.lam, self.eps = alpha, beta, lam, eps
        self.reduction = check_reduction(reduction)

    works_on_rows = True  # each anchor's terms are its row's (ScoreShare)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        share = score_share(inputs)
        # the mean is over every anchor of the batch, both directions
        divisor = share.n_images + share.n_texts if self.reduction == "mean" else 1
        loss = in_row_blocks(_MultiSimilarityTerms(self, divisor), share,
                             block=self.block_rows)
        return {"ms_loss": loss}


class _SoftmaxTerms(RowTerm):
    """InfoNCE's term of every anchor of a block, ``x = s / T``: ``logsumexp(x_a)`` less
    the mean of ``x`` over the anchor's positives (the cross-entropy of the softmax with
    the target spread uniformly over them; 0 for an anchor without one), over twice the
    direction's anchors in the batch (the mean of the two directions' means). Its
    derivative is ``softmax(x_a) - target_a``, from the row's kept ``logsumexp``."""

    def __init__(self, n_images: int, n_texts: int) -> None:
        self.divisors = {"i2t": 2 * n_images, "t2i": 2 * n_texts}

    def loss(self, direction, scores, positives, temperature):
        x = scores / temperature
        counts = torch.count_nonzero(positives, dim=1).to(scores.dtype)
        lse = torch.logsumexp(x, dim=1).masked_fill_(counts == 0, 0.0)
        rows, cols = positives.nonzero(as_tuple=True)  # few: one or a few per anchor
        positive_sums = x.new_zeros(len(x)).index_add_(0, rows, x[rows, cols])
        return (lse - positive_sums / counts.clamp(min=1)).sum() / self.divisors[direction], lse

    def grad(self, direction, scores, positives, lse, temperature):
        counts = torch.count_nonzero(positives, dim=1).to(scores.dtype)
        # the softmax, in the one block this allocates
        dx = (scores / temperature).sub_(lse[:, None]).exp_()
        dx[counts == 0] = 0.0
        rows, cols = positives.nonzero(as_tuple=True)
        dx[rows, cols] -= 1 / counts[rows]
        dx /= self.divisors[direction]
        # x = s / T: d/ds = dx / T, d/dT = -sum(dx x) / T = -sum(dx s) / T^2
        grad_temperature = -(dx.reshape(-1) @ scores.reshape(-1)) / temperature ** 2
        return dx.div_(temperature), (grad_temperature,)


@OBJECTIVES.register()
class InfoNCELoss(nn.Module):
    """CLIP/ITC contrastive loss with a learnable temperature.

    Rows and columns of ``sims / temperature`` are softmax-normalised; the
    target of each row (column) spreads uniformly over its positives, so every
    caption of the same image counts as a positive (X-VLM's ITC). The
    temperature is clamped to ``[min_temperature, max_temperature]``.

    A model that learns its own temperature (a
    :class:`~mmgoal.contract.TemperatureModel`: CLIP's ``1 / exp(logit_scale)``)
    sets it: the scores are divided by ``model.temperature()``, which the gradient
    trains, and this loss's own ``temperature`` is not used. Built for such a model
    (the trainer passes ``model``), the loss's temperature is then a buffer, not a
    parameter: nothing the optimizer would hold without a gradient.

    Args:
        temperature: initial temperature (0.07 in CLIP and X-VLM).
        learnable: optimise the temperature with the model.
        min_temperature, max_temperature: clamp range (X-VLM: 0.001, 0.5).
        block_rows: anchors whose terms are computed at once (docs/objectives.md).
        model: the model it trains (set by the trainer, not the config).

    Returns (from ``forward``): ``infonce_loss`` (mean of both directions) and
    the logged ``temperature``.
    """

    def __init__(self, temperature: float = 0.07, learnable: bool = True,
                 min_temperature: float = 0.001, max_temperature: float = 0.5,
                 block_rows: int = BLOCK_ROWS, model: nn.Module | None = None) -> None:
        super().__init__()
        self.block_rows = check_block_rows(block_rows)
        if not min_temperature <= temperature <= max_temperature:
            raise ValueError(f"temperature {temperature} lies outside "
                             f"[{min_temperature}, {max_temperature}]")
        value = torch.tensor(float(temperature))
        if learnable and not isinstance(model, TemperatureModel):
            self.temperature = nn.Parameter(value)
        else:
            self.register_buffer("temperature", value)
        self.min_temperature, self.max_temperature = min_temperature, max_temperature

    works_on_rows = True  # each direction's terms are its anchors' (ScoreShare)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        share = score_share(inputs)
        own = inputs.model.temperature() if isinstance(inputs.model, TemperatureModel) \
            else self.temperature
        temperature = own.clamp(self.min_temperature, self.max_temperature)
        term = _SoftmaxTerms(share.n_images, share.n_texts)
        loss = in_row_blocks(term, share, temperature.to(share.rows.dtype),
                             block=self.block_rows)
        return {"infonce_loss": loss, "temperature": temperature.detach()}
