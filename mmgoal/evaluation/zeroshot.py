"""Zero-shot classification of a dual encoder, as CLIP and CLIP_benchmark compute it
(docs/models.md, "Zero-shot classification"): a fine-tune's measure of forgetting.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from mmgoal.console import progress_bar
from mmgoal.contract import similarity_uses_tokens
from mmgoal.data.classification import ClassificationSet, LabelledImages
from mmgoal.data.pipeline import SkipCounter, iter_batches
from mmgoal.devices import module_device, move_to_device
from mmgoal.evaluation.gallery import encode_image_batches, in_eval_mode
from mmgoal.structures import Member

logger = logging.getLogger(__name__)

PREFIX = "zeroshot_"
# its accuracies (top-5 with 5 classes or more)
ACCURACIES = tuple(PREFIX + name for name in ("top1", "top5", "mean_per_class_recall"))


def check_dual_encoder(model: torch.nn.Module) -> None:
    """Zero-shot classification compares pooled embeddings: refuse a model whose score
    reads its tokens (SCAN's cross attention), with what to use instead."""
    if similarity_uses_tokens(model):
        raise ValueError(f"zero-shot classification needs a dual encoder (its image and text "
                         f"embeddings compared by a dot product); {type(model).__name__} "
                         f"scores pairs by cross attention")


@torch.no_grad()
def class_embeddings(model: torch.nn.Module, tokenizer, classnames: list[str],
                     templates: list[str], progress: bool = True) -> torch.Tensor:
    """(n_classes, D): each class's prompts embedded, normalised, averaged, normalised (a
    progress bar of the classes with ``progress``: ImageNet's are 1,000 x 80 prompts)."""
    device = module_device(model)
    rows = []
    for name in progress_bar(classnames, desc="zero-shot classes", unit="class",
                             show=progress, leave=False):
        prompts = [template.replace("{c}", name) for template in templates]
        embedding = model.encode_text(move_to_device(tokenizer(prompts), device)).embedding
        rows.append(F.normalize(F.normalize(embedding.float(), dim=-1).mean(0), dim=0))
    return torch.stack(rows)


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, n_classes: int,
                           prefix: str = PREFIX) -> dict[str, float]:
    """Top-1, top-5 (5 classes or more) and mean per-class recall of ``logits`` (N, C)
    against ``labels`` (N,), in percent."""
    ranked = logits.topk(min(5, n_classes), dim=1).indices
    hits = ranked == labels[:, None]
    out = {f"{prefix}top1": 100.0 * hits[:, 0].double().mean().item()}
    if n_classes >= 5:
        out[f"{prefix}top5"] = 100.0 * hits.any(dim=1).double().mean().item()
    predicted = ranked[:, 0]
    present = labels.unique()
    recalls = [(predicted[labels == c] == c).double().mean() for c in present]
    out[f"{prefix}mean_per_class_recall"] = 100.0 * torch.stack(recalls).mean().item()
    return out


@in_eval_mode
@torch.no_grad()
def zero_shot_logits(model: torch.nn.Module, transform, tokenizer, cset: ClassificationSet,
                     batch_size: int = 256, progress: bool = True,
                     skipped: SkipCounter | None = None, num_workers: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (N, C), labels (N,))`` of every readable image of ``cset``: the cosine of
    its embedding with each class's (:func:`class_embeddings`); images decoded in
    ``num_workers`` DataLoader processes, as the gallery's."""
    check_dual_encoder(model)
    classes = class_embeddings(model, tokenizer, cset.classnames, cset.templates, progress)
    skipped = skipped if skipped is not None else SkipCounter()
    batches = iter_batches(LabelledImages(cset, transform), batch_size, num_workers, skipped,
                           pin_memory=module_device(model).type == "cuda")
    logits, labels = [], []
    with contextlib.closing(batches):
        # an image folder's images are listed; shards' are not counted unread
        for batch, features in encode_image_batches(
                model, batches, "zero-shot images", progress,
                total=len(cset.files) if cset.files is not None else None):
            embedding = F.normalize(features.embedding.float(), dim=-1)
            logits.append(embedding @ classes.T)
            labels.append(batch["labels"])
    if not logits:
        raise ValueError(f"no readable image in the classification set {cset.root} "
                         f"({skipped.summary()})")
    return torch.cat(logits).cpu(), torch.cat(labels)  # one copy off the device


def evaluate_zeroshot(member: Member, cset: ClassificationSet, batch_size: int = 256,
                      progress: bool = True, num_workers: int = 0) -> dict[str, float]:
    """Zero-shot classification metrics of ``member`` (a model with its eval transform and
    tokenizer) on ``cset``, keys ``zeroshot_*``, with the images read and skipped."""
    skipped = SkipCounter()
    logits, labels = zero_shot_logits(member.model, member.transform, member.tokenizer, cset,
                                      batch_size, progress, skipped, num_workers)
    if skipped.total:
        logger.warning("zero-shot classification: %s", skipped.summary())
    return {**classification_metrics(logits, labels, len(cset.classnames)),
            f"{PREFIX}images": float(len(labels)), f"{PREFIX}skipped": float(skipped.total)}


def format_zeroshot(metrics: dict[str, float]) -> str:
    """One line of the zero-shot metrics in ``metrics`` (empty when there are none)."""
    names = {"top1": "top-1", "top5": "top-5", "mean_per_class_recall": "mean per-class recall"}
    parts = [f"{label} {metrics[PREFIX + key]:.2f}" for key, label in names.items()
             if PREFIX + key in metrics]
    if not parts:
        return ""
    return (f"zero-shot classification ({int(metrics[PREFIX + 'images'])} images): "
            + ", ".join(parts))
