"""SigLIP's pairwise sigmoid loss (Zhai et al., ICCV 2023), computed in row blocks.

Every image-text pair of the batch is a binary decision: ``z_ij = +1`` for a matching
pair (every caption of the image, with several per image), ``-1`` otherwise, and

    L = -1/n_img sum_ij log sigmoid(z_ij (t s_ij + b))

with ``t = exp(t')`` a learnable scale and ``b`` a learnable bias (the paper's
initialisation: ``t' = log 10``, ``b = -10``; docs/reference/objectives.md). It equals
open_clip's ``SigLipLoss`` on the same features (tests/objectives/test_siglip.py).

The loss and its gradient are computed block by block of rows (:class:`_SigmoidLoss`):
no (n, n) tensor beyond the score matrix and its gradient is ever alive, whatever the
batch (the backward pass recomputes each block's sigmoid from the scores).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmgoal.contract import LogitBiasModel, TemperatureModel
from mmgoal.objectives.mining import score_share
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs

# Rows of the score matrix a block holds (its logits and sigmoid: 2 x rows x n values)
BLOCK_ROWS = 1024


def _block_grad(sims: torch.Tensor, positives: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss sum, dL/dx)`` of a block of rows, ``x = scale * sims + bias`` (rows, n):
    ``-log sigmoid(z x)`` and its derivative ``-z sigmoid(-z x)``, ``z = +-1``."""
    signs = positives.to(sims.dtype).mul_(2).sub_(1)
    margin = (sims * scale + bias).mul_(signs)  # z x
    loss = -torch.nn.functional.logsigmoid(margin).sum()
    return loss, torch.sigmoid(margin.neg_()).mul_(signs).neg_()


class _SigmoidLoss(torch.autograd.Function):
    """The summed sigmoid loss of ``sims`` (rows, n_txt) divided by ``divisor`` (the batch's
    images), forward and backward in blocks of ``block`` rows; gradients for the scores,
    the scale and the bias."""

    @staticmethod
    def forward(ctx, sims: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                positives: torch.Tensor, block: int, divisor: int) -> torch.Tensor:
        ctx.save_for_backward(sims, scale, bias, positives)
        ctx.block, ctx.divisor = block, divisor
        total = sims.new_zeros(())
        for start in range(0, len(sims), block):
            rows = slice(start, start + block)
            total += _block_grad(sims[rows], positives[rows], scale, bias)[0]
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        sims, scale, bias, positives = ctx.saved_tensors
        factor = grad_output / ctx.divisor
        grad_sims = torch.empty_like(sims)
        grad_scale, grad_bias = sims.new_zeros(()), sims.new_zeros(())
        for start in range(0, len(sims), ctx.block):
            rows = slice(start, start + ctx.block)
            dx = _block_grad(sims[rows], positives[rows], scale, bias)[1].mul_(factor)
            grad_scale += (dx * sims[rows]).sum()
            grad_bias += dx.sum()
            grad_sims[rows] = dx.mul_(scale)
        return grad_sims, grad_scale, grad_bias, None, None, None


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
        if block_rows < 1:
            raise ValueError(f"block_rows must be at least 1, got {block_rows}")
        self.block_rows = block_rows
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
        sims, positives = share.rows, share.row_positives
        model = inputs.model
        scale = (1 / model.temperature() if isinstance(model, TemperatureModel)
                 else self.logit_scale.exp())
        bias = model.logit_bias() if isinstance(model, LogitBiasModel) else None
        bias = self.logit_bias if bias is None else bias
        loss = _SigmoidLoss.apply(sims, scale.to(sims.dtype), bias.to(sims.dtype), positives,
                                  self.block_rows, share.n_images)
        # copies: a parameter's detached view would show the value after the step
        return {"siglip_loss": loss, "logit_scale": scale.detach().clone(),
                "logit_bias": bias.detach().clone()}
