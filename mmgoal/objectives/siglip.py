"""SigLIP's pairwise sigmoid loss (Zhai et al., ICCV 2023), computed in row blocks.

Every image-text pair of the batch is a binary decision: ``z_ij = +1`` for a matching
pair (every caption of the image, with several per image), ``-1`` otherwise, and

    L = -1/n_img sum_ij log sigmoid(z_ij (t s_ij + b))

with ``t = exp(t')`` a learnable scale and ``b`` a learnable bias (the paper's
initialisation: ``t' = log 10``, ``b = -10``; docs/reference/objectives.md). It equals
open_clip's ``SigLipLoss`` on the same features (tests/objectives/test_siglip.py).

The loss and its gradient are computed block by block of rows
(:func:`~mmgoal.objectives.blocks.in_row_blocks`): no (n, n) tensor beyond the score
matrix and its gradient is ever alive, whatever the batch (the backward pass recomputes
each block's sigmoid from the scores).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmgoal.contract import LogitBiasModel, TemperatureModel
from mmgoal.objectives.blocks import BLOCK_ROWS, RowTerm, check_block_rows, in_row_blocks
from mmgoal.objectives.mining import score_share
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


class _Sigmoid(RowTerm):
    """``-log sigmoid(z x)`` of every pair of a block of image rows, ``x = scale * s + bias``,
    ``z = +-1``, divided by the batch's images; the backward pass recomputes the sigmoid."""

    directions = ("i2t",)

    def __init__(self, divisor: int) -> None:
        self.divisor = divisor

    def _margins(self, scores, positives, scale, bias):
        signs = positives.to(scores.dtype).mul_(2).sub_(1)
        return (scores * scale + bias).mul_(signs), signs  # z x

    def loss(self, direction, scores, positives, scale, bias):
        margins, _ = self._margins(scores, positives, scale, bias)
        return -torch.nn.functional.logsigmoid(margins).sum() / self.divisor, None

    def grad(self, direction, scores, positives, kept, scale, bias):
        margins, signs = self._margins(scores, positives, scale, bias)
        dx = torch.sigmoid(margins.neg_()).mul_(signs).neg_().div_(self.divisor)  # d/dx
        return dx * scale, ((dx * scores).sum(), dx.sum())


@OBJECTIVES.register()
class SigLIPLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss with a learnable scale and bias (see the module).

    A model with a scale of its own (a :class:`~mmgoal.contract.TemperatureModel`: CLIP's
    ``logit_scale``, ``t = 1 / temperature()``) and a bias of its own (a
    :class:`~mmgoal.contract.LogitBiasModel` whose ``logit_bias()`` is not None: a SigLIP
    model's ``logit_bias``) uses those, which the gradient trains; this loss's own are
    then buffers, not parameters (the trainer passes ``model``).

    Args:
        init_scale: the initial ``t' = log t`` (the paper: log 10).
        init_bias: the initial bias (the paper: -10).
        learnable: optimise the loss's own scale and bias.
        block_rows: rows of the score matrix computed at once.
        model: the model it trains (set by the trainer, not the config).

    Returns (from ``forward``): ``siglip_loss``, and the logged ``logit_scale`` (``t``)
    and ``logit_bias``.
    """

    def __init__(self, init_scale: float = math.log(10.0), init_bias: float = -10.0,
                 learnable: bool = True, block_rows: int = BLOCK_ROWS,
                 model: nn.Module | None = None) -> None:
        super().__init__()
        self.block_rows = check_block_rows(block_rows)
        own_scale = not isinstance(model, TemperatureModel)
        own_bias = not (isinstance(model, LogitBiasModel) and model.logit_bias() is not None)
        for name, value, own in (("logit_scale", init_scale, own_scale),
                                 ("logit_bias", init_bias, own_bias)):
            tensor = torch.tensor(float(value))
            if learnable and own:
                setattr(self, name, nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)

    # every pair is its own term: the image rows of a ScoreShare hold a share's part
    works_on_rows = True

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        share = score_share(inputs)
        sims = share.rows
        model = inputs.model
        scale = (1 / model.temperature() if isinstance(model, TemperatureModel)
                 else self.logit_scale.exp())
        bias = model.logit_bias() if isinstance(model, LogitBiasModel) else None
        bias = self.logit_bias if bias is None else bias
        loss = in_row_blocks(_Sigmoid(share.n_images), share, scale.to(sims.dtype),
                             bias.to(sims.dtype), block=self.block_rows)
        # copies: a parameter's detached view would show the value after the step
        return {"siglip_loss": loss, "logit_scale": scale.detach().clone(),
                "logit_bias": bias.detach().clone()}
