"""The training computation of one batch as a module, so any strategy can wrap it.

DeepSpeed (and data-parallel wrappers in general) train one ``nn.Module``; the
model, the configured objective (InfoNCE's temperature is a parameter) and the
attention constraints are its children, and its ``forward`` returns the losses.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from mmgoal.distributed import (exchange_columns, gather_features, gather_groups,
                                gather_varying_length, sum_over_ranks, world_info)
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.structures import ObjectiveInputs, ScoreShare

logger = logging.getLogger(__name__)


class TrainingStep(nn.Module):
    """Model + objective + constraints; ``forward(batch)`` gives the batch's losses.

    With several processes the objective sees the global batch. Under ``local`` scoring
    (docs/distributed.md, "Local scoring") a rank scores only its images against every
    text; the columns of its texts come from the other ranks' rows (one all-to-all), and
    an objective that works on rows (``works_on_rows``) computes its part of the global
    loss from that :class:`~mmgoal.structures.ScoreShare`: the score matrix and the
    objective's work are divided by the number of ranks. An objective that does not, and
    ``replicated`` scoring, score the whole global matrix on every rank.

    Args:
        model: encodes images and texts and scores them (the model contract).
        objective: the configured objective.
        constraints: attention constraints (CCR/CCS), computed on this rank's pairs.
        gather: with several processes, score the features gathered from every
            rank (the global batch) instead of this rank's alone.
        scoring: ``local`` or ``replicated`` (``train.scoring``).
    """

    def __init__(self, model: nn.Module, objective: nn.Module,
                 constraints: list[nn.Module] | None = None, gather: bool = True,
                 scoring: str = "local") -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.constraints = nn.ModuleList(constraints or [])
        self.gather = gather
        self.scoring = scoring
        self._said_replicated: set[str] = set()  # objectives whose replicated scoring was said

    def forward(self, batch: dict, objective: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Losses of ``batch`` under ``objective`` (default: the configured one).

        Returns:
            The objective's and constraints' outputs plus ``loss``, the sum of
            every ``*_loss`` entry.
        """
        objective = self.objective if objective is None else objective
        image_features = self.model.encode_image(batch)
        text_features = self.model.encode_text(batch)
        groups = batch["image_groups"]
        all_images, all_texts = image_features, text_features
        features = dict(image_features=all_images, text_features=all_texts,
                        local_image_features=image_features,
                        local_text_features=text_features, batch=batch, model=self.model)
        rank, world = world_info()
        if self.gather and world > 1:
            all_images = gather_features(image_features)
            all_texts = gather_features(text_features)
            groups = gather_groups(batch["image_ids"], device=groups.device)
            features.update(image_features=all_images, text_features=all_texts)
        local = self.gather and world > 1 and self.scoring == "local"
        if local and getattr(objective, "works_on_rows", False):
            outputs = global_losses(objective(ObjectiveInputs(
                None, share=local_share(self.model, image_features, all_texts, groups, rank),
                **features)), world)
        else:
            if local and type(objective).__name__ not in self._said_replicated:
                self._said_replicated.add(type(objective).__name__)
                logger.info("train.scoring local: %s works on the whole score matrix, so "
                            "every rank scores the global batch (docs/distributed.md, "
                            "'Local scoring')", type(objective).__name__)
            # Per-pair objectives (MLM, box grounding) take this rank's own pairs.
            outputs = objective(ObjectiveInputs(
                self.model.similarity(all_images, all_texts), positives_from_groups(groups),
                **features))
        if len(self.constraints):  # image b and text b of a training batch are a matched pair
            attention = self.model.attention(image_features, text_features)
            for constraint in self.constraints:
                outputs.update(constraint(attention))
        outputs["loss"] = sum(v for k, v in outputs.items() if k.endswith("_loss"))
        return outputs


def local_share(model: nn.Module, images, all_texts, groups: torch.Tensor, rank: int
                ) -> ScoreShare:
    """This rank's :class:`~mmgoal.structures.ScoreShare` of the global batch: its
    ``images`` against ``all_texts`` (the rows), the other ranks' rows' blocks of its texts
    (the columns), their positives from the global batch's image ``groups``."""
    rows = model.similarity(images, all_texts)
    batch = rows.shape[0]
    mine = groups[rank * batch:(rank + 1) * batch]
    counts = torch.unique(groups, return_counts=True)[1]
    return ScoreShare(rows, positives_from_groups(mine, groups),
                      positives_from_groups(groups, mine), int(counts.pow(2).sum()),
                      len(groups), lambda: exchange_columns(rows), gather_varying_length,
                      sum_over_ranks)


def global_losses(outputs: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """A rank's part of each ``*_loss`` made the global loss: its value the sum of every
    rank's part (one all-reduce of them all), its gradient ``world`` times the part's, so
    that the data-parallel average of the ranks' gradients is the global loss's gradient."""
    keys = [key for key in outputs if key.endswith("_loss")]
    if not keys:
        return outputs
    parts = torch.stack([outputs[key].detach().to(torch.float64) for key in keys])
    dist.all_reduce(parts)
    for key, total in zip(keys, parts):
        scaled = outputs[key] * world
        outputs[key] = scaled + (total.to(scaled.dtype) - scaled).detach()
    return outputs
