"""Data shared by models, objectives, data and evaluation (features, attention, objective
inputs, a model's preprocessing), below all of them so that none imports another for them
(docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mmgoal.scoring import ScoreTiles


@dataclass
class ImageFeatures:
    """Image-side output of a model: ``embedding`` (B, D) pooled, L2-normalised;
    ``tokens`` (B, R, D) region/grid features and ``mask`` (B, R) bool, True for real
    tokens, where the model uses them."""

    embedding: torch.Tensor
    tokens: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class TextFeatures:
    """Text-side output of a model: ``embedding`` (B, D) pooled, L2-normalised; ``tokens``
    (B, W, D) word features and ``mask`` (B, W) bool, True for real words, where used."""

    embedding: torch.Tensor
    tokens: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class Attention:
    """Attention of matched pairs: query fragments of one item over key fragments of its pair.

    Attributes:
        queries: (B, Q, D) query fragments (words for t2i, regions for i2t).
        keys: (B, K, D) key fragments.
        weights: (B, Q, K) attention, rows sum to 1 over real keys.
        scores: (B, Q, K) the clipped-L2 scores the softmax was taken of.
        query_mask, key_mask: (B, Q), (B, K) bool.
        direction, lambda_softmax: ``t2i`` or ``i2t``; the softmax's inverse temperature.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    query_mask: torch.Tensor
    key_mask: torch.Tensor
    direction: str
    lambda_softmax: float


@dataclass
class ObjectiveInputs:
    """What an objective receives for one batch (``TrainingStep`` fills it in). An objective
    with ``works_on_tiles`` reads ``tiles`` (:class:`~mmgoal.scoring.ScoreTiles`);
    else ``scores`` (n_img, n_txt) of the global batch and ``positives`` (bool; ``None``:
    the diagonal). Per-pair objectives also read the model, the features and the batch.

    Attributes:
        local_image_features, local_text_features: this rank's own features.
        generator: for random draws (ITM's negatives, MLM's masks); ``None``: torch's.
    """

    scores: torch.Tensor | None
    positives: torch.Tensor | None = None
    image_features: ImageFeatures | None = None
    text_features: TextFeatures | None = None
    local_image_features: ImageFeatures | None = None
    local_text_features: TextFeatures | None = None
    batch: dict | None = None
    model: Any = None
    generator: torch.Generator | None = None
    tiles: ScoreTiles | None = None


@dataclass(frozen=True)
class Preprocessing:
    """How images and captions become a model's inputs: plain data, as timm's ``default_cfg``
    (``TRANSFORMS`` configs, a ``TOKENIZERS`` config; ``None`` where the model has none). A
    model class may declare its own (classmethod ``preprocessing(cfg, image_size)``);
    :func:`mmgoal.runs.preprocessing.resolve_preprocessing` decides what a run uses.
    """

    train_transforms: list[dict] | None = None
    eval_transforms: list[dict] | None = None
    tokenizer: dict | None = None


@dataclass
class Member:
    """A model ready to encode a gallery, with its eval transform and tokenizer (one model
    of an evaluation ensemble)."""

    model: torch.nn.Module
    transform: Callable
    tokenizer: Callable


def check_inputs(inputs: ObjectiveInputs, needed_by: str, *fields: str) -> ObjectiveInputs:
    """``inputs`` when it is an ``ObjectiveInputs`` holding ``fields``; else a ``TypeError``
    (e.g. a tensor, the old call) or a ``ValueError`` naming the missing fields."""
    if not isinstance(inputs, ObjectiveInputs):
        raise TypeError(f"{needed_by} takes one ObjectiveInputs (mmgoal.structures), got "
                        f"{type(inputs).__name__}: call objective(ObjectiveInputs(sims, "
                        f"positives))")
    missing = [name for name in fields if getattr(inputs, name) is None]
    if missing:
        raise ValueError(f"{needed_by} needs {', '.join(missing)} in its ObjectiveInputs "
                         f"(the trainer passes them)")
    return inputs


def _pad_tokens(parts: list[torch.Tensor | None], masks: list[torch.Tensor | None]):
    if any(p is None for p in parts):
        return None, None
    width = max(p.shape[1] for p in parts)
    tokens = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1]))
                        for p in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
    return tokens, mask


def cat_features(parts: list[ImageFeatures] | list[TextFeatures]):
    """Concatenate features of several batches; tokens are padded to the longest batch."""
    tokens, mask = _pad_tokens([p.tokens for p in parts], [p.mask for p in parts])
    return type(parts[0])(torch.cat([p.embedding for p in parts]), tokens=tokens, mask=mask)


def slice_features(features: ImageFeatures | TextFeatures, start: int, end: int):
    """Rows ``start:end``, tokens cut to the longest real item of the slice."""
    if features.tokens is None:
        return type(features)(features.embedding[start:end])
    mask = features.mask[start:end]
    width = max(int(mask.sum(1).max()), 1) if len(mask) else 1
    return type(features)(features.embedding[start:end],
                          tokens=features.tokens[start:end, :width], mask=mask[:, :width])


def detach_features(features: ImageFeatures | TextFeatures, dtype=torch.float32):
    """A detached copy in ``dtype`` (float32 by default) for gallery storage."""
    tokens = None if features.tokens is None else features.tokens.detach().to(dtype)
    return type(features)(features.embedding.detach().to(dtype), tokens=tokens,
                          mask=features.mask)


def index_features(features: ImageFeatures | TextFeatures, index: torch.Tensor):
    """The rows ``index`` (a 1-D long tensor, repeats allowed) of features."""
    if features.tokens is None:
        return type(features)(features.embedding[index])
    return type(features)(features.embedding[index], tokens=features.tokens[index],
                          mask=features.mask[index])
