"""X-VLM's pretraining objectives beside ITC and ITM: masked language modelling and box
grounding (docs/reference/xvlm.md, "Pretraining objectives")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.contract import BoxPredictingModel, MaskedLanguageModel, require
from mmgoal.registry import OBJECTIVES
from mmgoal.sequences import corrupt_tokens
from mmgoal.structures import ObjectiveInputs, check_inputs, index_features

IGNORE = -100  # cross-entropy's ignore_index: positions that are not predicted


def mlm_inputs(tokens: torch.Tensor, lengths: torch.Tensor, tokenizer, p: float = 0.15,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids -> (masked ids, labels): labels hold the original id where a token was
    picked and ``IGNORE`` elsewhere (special tokens and padding are never picked)."""
    special = torch.tensor(tokenizer.special_ids, dtype=torch.long, device=tokens.device)
    inputs, picked, _, _ = corrupt_tokens(tokens, lengths, special, len(tokenizer),
                                          tokenizer.mask_id, p, 0.8, 0.1, generator)
    return inputs, torch.where(picked, tokens, IGNORE)


def box_cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """(..., 4) centre, width, height -> corners."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def box_xyxy_to_cxcywh(boxes: torch.Tensor) -> torch.Tensor:
    """(..., 4) corners -> centre, width, height."""
    x0, y0, x1, y1 = boxes.unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def paired_generalized_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) GIoU of box ``a[i]`` with box ``b[i]`` (both (N, 4) xyxy): IoU minus the share of
    the enclosing box the union leaves empty (Rezatofighi et al. 2019)."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    inter_wh = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp(min=0)
    inter = inter_wh[:, 0] * inter_wh[:, 1]
    union = area_a + area_b - inter
    hull_wh = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).clamp(min=0)
    hull = hull_wh[:, 0] * hull_wh[:, 1]
    return inter / union - (hull - union) / hull


def box_loss(predicted: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean L1 on (cx, cy, w, h) and mean 1 - GIoU of ``predicted`` (N, 4) cxcywh against
    ``target`` (N, 4) xyxy, both fractions of the image."""
    l1 = F.l1_loss(predicted, box_xyxy_to_cxcywh(target), reduction="none").sum(-1).mean()
    giou = 1 - paired_generalized_iou(box_cxcywh_to_xyxy(predicted), target)
    return {"l1": l1, "giou": giou.mean()}


@OBJECTIVES.register()
class MLMLoss(nn.Module):
    """Masked language modelling through the fusion layers of a cross encoder, on this
    rank's pairs: needs ``mlm_logits`` (``XVLM(mlm_head: tied)``) and a tokenizer with a mask
    token (``HFTokenizer``, passed by the trainer)."""

    def __init__(self, weight: float = 1.0, mask_prob: float = 0.15, tokenizer=None) -> None:
        super().__init__()
        if tokenizer is None or not hasattr(tokenizer, "mask_id"):
            raise ValueError("MLMLoss needs a tokenizer with a mask token (HFTokenizer)")
        self.weight, self.mask_prob, self.tokenizer = weight, mask_prob, tokenizer

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        check_inputs(inputs, "MLMLoss", "model", "batch", "local_image_features")
        require(inputs.model, MaskedLanguageModel, "MLMLoss")
        batch = inputs.batch
        tokens, labels = mlm_inputs(batch["tokens"], batch["lengths"], self.tokenizer,
                                    self.mask_prob, inputs.generator)
        logits = inputs.model.mlm_logits(inputs.local_image_features,
                                         {**batch, "tokens": tokens})
        picked = labels != IGNORE
        if not picked.any():  # a batch of one-word captions: nothing to predict
            return {"mlm_loss": logits.sum() * 0.0}
        loss = F.cross_entropy(logits[picked], labels[picked])
        accuracy = (logits[picked].argmax(-1) == labels[picked]).float().mean()
        return {"mlm_loss": self.weight * loss, "mlm_accuracy": accuracy.detach()}


@OBJECTIVES.register()
class BoxGroundingLoss(nn.Module):
    """Box of a phrase from the fusion CLS of (image, phrase): L1 + (1 - GIoU), weighted
    ``l1_weight``, ``giou_weight``. Batches carry one phrase per sample whose entity has a
    box (``phrases``, ``phrase_boxes``, ``phrase_valid``); samples without one do not count.
    """

    def __init__(self, weight: float = 1.0, l1_weight: float = 1.0, giou_weight: float = 1.0,
                 tokenizer=None) -> None:
        super().__init__()
        if tokenizer is None:
            raise ValueError("BoxGroundingLoss needs the tokenizer (the trainer passes it)")
        self.weight, self.l1_weight, self.giou_weight = weight, l1_weight, giou_weight
        self.tokenizer = tokenizer

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        check_inputs(inputs, "BoxGroundingLoss", "model", "batch", "local_image_features")
        require(inputs.model, BoxPredictingModel, "BoxGroundingLoss")
        model, batch, local_image_features = (inputs.model, inputs.batch,
                                              inputs.local_image_features)
        valid = batch.get("phrase_valid")
        if valid is None or not valid.any():
            zero = sum(p.sum() for p in model.box_head.parameters()) * 0.0
            return {"box_loss": zero}
        index = valid.nonzero().flatten()
        phrases = [batch["phrases"][i] for i in index.tolist()]
        predicted = model.predict_boxes(index_features(local_image_features, index),
                                        self.tokenizer(phrases))
        terms = box_loss(predicted, batch["phrase_boxes"][index].to(predicted.dtype))
        loss = self.l1_weight * terms["l1"] + self.giou_weight * terms["giou"]
        return {"box_loss": self.weight * loss, "box_l1": terms["l1"].detach(),
                "box_giou": terms["giou"].detach()}
