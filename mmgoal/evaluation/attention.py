"""Attention precision, recall and F1 of the CCR/CCS paper, per word, maximised within a
phrase and averaged over phrases for each ``T_att`` of a sweep (docs/reference/scan.md,
"Attention precision, recall and F1"): the reported AF is not the F1 of AP and AR.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torchvision.ops import box_iou

from mmgoal.console import progress_bar
from mmgoal.contract import CrossAttentionModel, require
from mmgoal.data.flickr_entities import entities_for_captions, read_image_entities
from mmgoal.data.pipeline import EvalReader
from mmgoal.evaluation.gallery import Gallery, encode_gallery
from mmgoal.structures import Member, index_features

T_ATT_SWEEP = tuple(round(0.01 * k, 2) for k in range(11))
T_IOU = 0.4


def word_precision_recall(weights: torch.Tensor, relevant: torch.Tensor,
                          thresholds: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """AP and AR, each (n_words, n_thresholds), of words' attention ``weights``
    (n_words, R) over regions, ``relevant`` (n_words, R) bool, at each ``T_att``."""
    attended = weights[:, :, None] > torch.as_tensor(thresholds, dtype=weights.dtype,
                                                     device=weights.device)
    hits = (attended & relevant[:, :, None]).sum(1).double()
    precision = hits / attended.sum(1).clamp(min=1)
    recall = hits / relevant.sum(1, keepdim=True).clamp(min=1)
    return precision, recall


def word_f1(precision: torch.Tensor, recall: torch.Tensor) -> torch.Tensor:
    """AF of words, ``2 AP AR / (AP + AR)``, 0 where both are 0; (n_words, n_thresholds)."""
    total = precision + recall
    return torch.where(total > 0, 2 * precision * recall / total.clamp(min=1e-12),
                       torch.zeros_like(total))


@dataclass
class AttentionReport:
    """The sweep: one precision/recall/F1 per ``T_att`` (each the mean over phrases of the
    phrase's best word for it), and the best F1."""

    thresholds: list[float]
    precision: list[float]
    recall: list[float]
    f1: list[float]
    phrases: int
    phrases_without_box: int
    phrases_without_relevant_region: int

    @property
    def best(self) -> dict[str, float]:
        k = max(range(len(self.f1)), key=lambda i: self.f1[i])
        return {"t_att": self.thresholds[k], "precision": self.precision[k],
                "recall": self.recall[k], "f1": self.f1[k]}

    def as_dict(self) -> dict:
        return {"best": self.best, "phrases": self.phrases,
                "phrases_without_box": self.phrases_without_box,
                "phrases_without_relevant_region": self.phrases_without_relevant_region,
                "curve": [{"t_att": t, "precision": p, "recall": r, "f1": f} for t, p, r, f
                          in zip(self.thresholds, self.precision, self.recall, self.f1)]}


class AttentionScorer:
    """Accumulates phrase-level AP/AR/AF over a sweep of ``T_att``."""

    def __init__(self, thresholds: Sequence[float] = T_ATT_SWEEP, t_iou: float = T_IOU) -> None:
        self.thresholds = list(thresholds)
        self.t_iou = t_iou
        self.precision_sum = torch.zeros(len(self.thresholds), dtype=torch.float64)
        self.recall_sum = torch.zeros(len(self.thresholds), dtype=torch.float64)
        self.f1_sum = torch.zeros(len(self.thresholds), dtype=torch.float64)
        self.phrases = 0
        self.without_box = 0
        self.without_relevant = 0

    def add_phrase(self, weights: torch.Tensor, region_boxes: torch.Tensor,
                   phrase_boxes: torch.Tensor) -> None:
        """One phrase of a matched pair: ``weights`` (n_phrase_words, R) over regions,
        ``region_boxes`` (R, 4) and ``phrase_boxes`` (n_boxes, 4), xyxy in the same units."""
        if len(phrase_boxes) == 0 or len(weights) == 0:
            self.without_box += 1
            return
        relevant = box_iou(region_boxes.double(), phrase_boxes.double()).amax(1) > self.t_iou
        if not relevant.any():
            self.without_relevant += 1
            return
        precision, recall = word_precision_recall(
            weights.double(), relevant[None].expand(len(weights), -1), self.thresholds)
        self.precision_sum += precision.amax(0)
        self.recall_sum += recall.amax(0)
        self.f1_sum += word_f1(precision, recall).amax(0)
        self.phrases += 1

    def report(self) -> AttentionReport:
        n = max(self.phrases, 1)
        return AttentionReport(self.thresholds, (self.precision_sum / n).tolist(),
                               (self.recall_sum / n).tolist(), (self.f1_sum / n).tolist(),
                               self.phrases, self.without_box, self.without_relevant)


def matched_pairs_with_phrases(gallery: Gallery, tokenizer) -> list[tuple[int, int, list]]:
    """(image index, text index, [(token positions, boxes)]) for every annotated caption."""
    owner = gallery.text_to_image.tolist()  # one transfer, not one per entity
    first_text: dict[int, int] = {}
    for text, image in enumerate(owner):
        first_text.setdefault(image, text)
    pairs = []
    for image, entities in enumerate(gallery.entities):
        by_caption: dict[int, list] = {}
        for entity in entities:
            text = first_text[image] + int(entity["caption"])
            if text >= len(owner) or owner[text] != image:
                raise ValueError(f"image {gallery.image_ids[image]!r}: an entity refers to "
                                 f"caption {entity['caption']}, which the image does not have")
            spans = tokenizer.word_token_spans(gallery.captions[text])
            start = int(entity["first_word"])
            positions = sorted({p for span in spans[start:start + len(entity["phrase"].split())]
                                for p in span})
            by_caption.setdefault(text, []).append(
                (positions, torch.tensor(entity["boxes"], dtype=torch.float64,
                                         device="cpu").reshape(-1, 4)))
        pairs += [(image, text, phrases) for text, phrases in sorted(by_caption.items())]
    return pairs


@torch.no_grad()
def evaluate_attention(model: torch.nn.Module, gallery: Gallery, tokenizer,
                       thresholds: Sequence[float] = T_ATT_SWEEP, t_iou: float = T_IOU,
                       batch_size: int = 256, progress: bool = True,
                       entity_source: Callable | None = None) -> AttentionReport:
    """Attention P/R/F1 of ``model`` (text queries over regions) on a gallery encoded
    ``with_annotations``; ``entity_source`` (``image_id -> entities``, Flickr30K
    Entities files) replaces the shards' entities."""
    require(model, CrossAttentionModel, "the attention metrics")
    if not gallery.region_boxes:
        raise ValueError(f"{type(model.image_encoder).__name__} cannot say where its regions "
                         f"are (no region_boxes); attention metrics need region boxes")
    if entity_source is not None:
        gallery.entities = [entity_source(i) for i in gallery.image_ids]
    scorer = AttentionScorer(thresholds, t_iou)
    pairs = matched_pairs_with_phrases(gallery, tokenizer)
    for start in progress_bar(range(0, len(pairs), batch_size), desc="attention", unit="batch",
                              show=progress, leave=False):
        chunk = pairs[start:start + batch_size]
        device = gallery.images.embedding.device
        images = torch.tensor([p[0] for p in chunk], device=device)
        texts = torch.tensor([p[1] for p in chunk], device=device)
        weights = model.attention(index_features(gallery.images, images),
                                  index_features(gallery.texts, texts), direction="t2i").weights
        # The attention runs where the model is; the per-phrase counting of a few
        # regions and words is bookkeeping, done on the CPU from one transfer per chunk.
        weights = weights.double().cpu()
        for row, (image, _, phrases) in enumerate(chunk):
            boxes = gallery.region_boxes[image].double()
            for positions, phrase_boxes in phrases:
                scorer.add_phrase(weights[row, positions, :len(boxes)], boxes, phrase_boxes)
    return scorer.report()


def attention_on_split(member: Member, reader: EvalReader, thresholds: Sequence[float],
                       t_iou: float = T_IOU, entities: str | None = None) -> AttentionReport:
    """Attention P/R/F1 of ``member`` on the split ``reader`` reads: its entity boxes the
    shards' or, with ``entities``, a Flickr30K Entities folder's joined by image id."""
    gallery = encode_gallery(member.model, reader, member.transform, member.tokenizer,
                             with_annotations=True)
    source = None
    if entities:
        texts_of: dict = {}
        for caption, image in zip(gallery.captions, gallery.text_to_image.tolist()):
            texts_of.setdefault(gallery.image_ids[image], []).append(caption)

        def source(image_id):
            record = read_image_entities(entities, image_id)
            return [] if record is None else entities_for_captions(record, texts_of[image_id])
    return evaluate_attention(member.model, gallery, member.tokenizer, thresholds,
                              t_iou=t_iou, entity_source=source)
