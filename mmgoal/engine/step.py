"""The training computation of one batch as a module, so any strategy can wrap it.

DeepSpeed (and data-parallel wrappers in general) train one ``nn.Module``; the
model, the configured objective (InfoNCE's temperature is a parameter) and the
attention constraints are its children, and its ``forward`` returns the losses.
"""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.distributed import gather_features, gather_groups, world_info
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.structures import ObjectiveInputs


class TrainingStep(nn.Module):
    """Model + objective + constraints; ``forward(batch)`` gives the batch's losses.

    Args:
        model: encodes images and texts and scores them (the model contract).
        objective: the configured objective.
        constraints: attention constraints (CCR/CCS), computed on this rank's pairs.
        gather: with several processes, score the features gathered from every
            rank (the global batch) instead of this rank's alone.
    """

    def __init__(self, model: nn.Module, objective: nn.Module,
                 constraints: list[nn.Module] | None = None, gather: bool = True) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.constraints = nn.ModuleList(constraints or [])
        self.gather = gather

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
        if self.gather and world_info()[1] > 1:
            all_images = gather_features(image_features)
            all_texts = gather_features(text_features)
            groups = gather_groups(batch["image_ids"], device=groups.device)
        sims = self.model.similarity(all_images, all_texts)
        # Per-pair objectives (MLM, box grounding) take this rank's own pairs.
        outputs = objective(ObjectiveInputs(
            sims, positives_from_groups(groups), image_features=all_images,
            text_features=all_texts, local_image_features=image_features,
            local_text_features=text_features, batch=batch, model=self.model))
        if len(self.constraints):  # image b and text b of a training batch are a matched pair
            attention = self.model.attention(image_features, text_features)
            for constraint in self.constraints:
                outputs.update(constraint(attention))
        outputs["loss"] = sum(v for k, v in outputs.items() if k.endswith("_loss"))
        return outputs
