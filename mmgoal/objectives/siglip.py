"""SigLIP's pairwise sigmoid loss (Zhai et al., ICCV 2023) on score tiles:
``L = -1/n_img sum_ij log sigmoid(z_ij (t s_ij + b))`` (docs/reference/objectives.md,
"SigLIP"). It equals open_clip's ``SigLipLoss`` on the same features.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmgoal.contract import LogitBiasModel, TemperatureModel
from mmgoal.objectives.mining import score_tiles
from mmgoal.registry import OBJECTIVES
from mmgoal.scoring import Statistic, Tile
from mmgoal.structures import ObjectiveInputs


class _SigmoidTerms(Statistic):
    """``-log sigmoid(z x)`` summed over every pair of this rank's image rows, ``x = scale *
    s + bias``, ``z = +-1`` (``value``); :meth:`weight` its ``d/dS`` and ``d/d(scale,
    bias)`` on a tile, recomputed from the tile's scores."""

    def __init__(self, scale: torch.Tensor, bias: torch.Tensor, divisor: int) -> None:
        self.scale, self.bias, self.divisor = scale, bias, divisor

    def start(self, n_rows, n_cols, like):
        self.value = like.new_zeros(())

    def _margins(self, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
        signs = torch.full_like(tile.scores, -1.0)
        signs[tile.positive_index] = 1.0
        return (tile.scores * self.scale + self.bias).mul_(signs), signs  # z x

    def update(self, tile, row_offset):
        margins, _ = self._margins(tile)
        self.value -= torch.nn.functional.logsigmoid(margins).sum() / self.divisor

    def weight(self, tile: Tile) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        margins, signs = self._margins(tile)
        dx = torch.sigmoid(margins.neg_()).mul_(signs).neg_().div_(self.divisor)  # d/dx
        return dx * self.scale, ((dx * tile.scores).sum(), dx.sum())


@OBJECTIVES.register()
class SigLIPLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss with a learnable scale ``t = exp(t')`` (``init_scale``
    is ``t'``) and bias, unless a :class:`~mmgoal.contract.TemperatureModel` /
    :class:`~mmgoal.contract.LogitBiasModel` ``model`` sets them (these are then buffers).
    Gives ``siglip_loss``, ``logit_scale`` and ``logit_bias``.
    """

    def __init__(self, init_scale: float = math.log(10.0), init_bias: float = -10.0,
                 learnable: bool = True, model: nn.Module | None = None) -> None:
        super().__init__()
        own_scale = not isinstance(model, TemperatureModel)
        own_bias = not (isinstance(model, LogitBiasModel) and model.logit_bias() is not None)
        for name, value, own in (("logit_scale", init_scale, own_scale),
                                 ("logit_bias", init_bias, own_bias)):
            tensor = torch.tensor(float(value))
            if learnable and own:
                setattr(self, name, nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)

    works_on_tiles = True  # every pair is its own term: a rank's rows hold its part

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        tiles = score_tiles(inputs)
        model = inputs.model
        scale = (1 / model.temperature() if isinstance(model, TemperatureModel)
                 else self.logit_scale.exp())
        bias = model.logit_bias() if isinstance(model, LogitBiasModel) else None
        bias = self.logit_bias if bias is None else bias
        scale, bias = scale.to(tiles.dtype), bias.to(tiles.dtype)
        terms = _SigmoidTerms(scale.detach(), bias.detach(), tiles.n_images)
        tiles.statistics(terms)
        loss = tiles.dense_loss(terms.value, terms.weight, (scale, bias))
        # copies: a parameter's detached view would show the value after the step
        return {"siglip_loss": loss.to(tiles.scorer.dtype), "logit_scale": scale.detach().clone(),
                "logit_bias": bias.detach().clone()}
