"""Data shared by models, objectives, data and evaluation: features, attention, objective
inputs, a model's preprocessing.

Models produce them, objectives and constraints consume them, evaluation caches
and slices them; they live below all of them so that none imports another for them
(docs/architecture.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ImageFeatures:
    """Image-side output of a model.

    Attributes:
        embedding: (B, D) pooled, L2-normalised embedding.
        tokens: (B, R, D) region/grid features where the model uses them.
        mask: (B, R) bool, True for real (not padded) tokens.
    """

    embedding: torch.Tensor
    tokens: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class TextFeatures:
    """Text-side output of a model.

    Attributes:
        embedding: (B, D) pooled, L2-normalised embedding.
        tokens: (B, W, D) word features where the model uses them.
        mask: (B, W) bool, True for real (not padded) words.
    """

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
        query_mask: (B, Q) bool; key_mask: (B, K) bool.
        direction: ``t2i`` or ``i2t``.
        lambda_softmax: the inverse temperature of the softmax.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    query_mask: torch.Tensor
    key_mask: torch.Tensor
    direction: str
    lambda_softmax: float


def _as_is(values: torch.Tensor) -> torch.Tensor:
    """One process's gather and total: the share is the whole batch."""
    return values


@dataclass
class ScoreShare:
    """A share of a batch's score matrix ``S`` (n_img, n_txt) for an objective that works
    on rows (docs/distributed.md, "Local scoring"): with several ranks, this rank's images
    against every text of the global batch, and every image against this rank's texts; in
    one process, the whole matrix both ways (:meth:`whole`).

    An objective that works on rows computes its image-anchored terms from ``rows`` and its
    text-anchored terms from ``columns`` (:meth:`directions`), and returns this share's
    part of the global loss: the parts of every rank sum to the one-process loss.

    Attributes:
        rows: (n_rows, n_txt) the rows of ``S`` of this rank's images.
        row_positives: (n_rows, n_txt) bool; column_positives: (n_img, n_cols) bool.
        positive_count: the matching pairs of the whole batch.
        n_images: the images of the whole batch.
        fetch_columns: gives ``columns`` (a collective with several ranks: an objective
            asks for them on every rank or on none); ``columns`` is fetched once.
        gather: (k,) values of this share -> those of every share, in rank order, on
            every rank (no gradient; a collective with several ranks): what an objective
            needs of the whole batch in O(n), such as every positive pair's score.
        total: a tensor of this share -> its sum over every share (likewise).
        offset: the position in the batch of this share's first image (and text): its
            rows are images ``offset, offset + 1, ...``, its columns texts alike.
    """

    rows: torch.Tensor
    row_positives: torch.Tensor
    column_positives: torch.Tensor
    positive_count: int
    n_images: int
    fetch_columns: Callable[[], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor] = _as_is
    total: Callable[[torch.Tensor], torch.Tensor] = _as_is
    offset: int = 0

    @classmethod
    def whole(cls, scores: torch.Tensor, positives: torch.Tensor) -> ScoreShare:
        """All of ``scores`` (n_img, n_txt) and ``positives``: one process's share."""
        # count_nonzero reads the mask as it is (a sum would convert it to int64 first)
        count = int(torch.count_nonzero(positives))
        return cls(scores, positives, positives, count, scores.shape[0], lambda: scores)

    @functools.cached_property
    def columns(self) -> torch.Tensor:
        """(n_img, n_cols) the columns of ``S`` of this rank's texts (fetched when first
        asked for: an objective on the image rows alone, SigLIP's, never holds them), with
        a gradient back to their rows whenever the rows have one, even when first asked
        for under ``torch.no_grad`` (by a mining step)."""
        with torch.set_grad_enabled(self.rows.requires_grad):
            return self.fetch_columns()

    @property
    def one_matrix(self) -> bool:
        """The columns are the rows' own tensor (one process's whole matrix): both
        directions read, and write their gradient into, one tensor."""
        return self.columns is self.rows

    @property
    def n_texts(self) -> int:
        return self.rows.shape[1]

    def directions(self) -> tuple[tuple[str, torch.Tensor, torch.Tensor], ...]:
        """``(direction, scores, positives)`` with anchors along dimension 0: ``i2t`` (this
        share's image rows against every text) and ``t2i`` (this share's text columns
        against every image, transposed)."""
        return (("i2t", self.rows, self.row_positives),
                ("t2i", self.columns.T, self.column_positives.T))


@dataclass
class ObjectiveInputs:
    """What an objective receives for one batch (``TrainingStep`` fills it in).

    Objectives on scores alone read ``scores`` and ``positives``; per-pair
    objectives (ITM, MLM, box grounding) read the model, the features and the
    batch as well.

    Attributes:
        scores: (n_img, n_txt) the model's similarities of the batch (with several
            processes: of the global batch, gathered from every rank).
        positives: (n_img, n_txt) bool, the matching pairs; ``None``: the diagonal.
        image_features, text_features: the features that were scored.
        local_image_features, local_text_features: this rank's own features.
        batch: this rank's collated batch.
        model: the model being trained (its heads: ``match_logits``, ``mlm_logits``, ...).
        generator: for random draws (ITM's negatives, MLM's masks); ``None``: torch's.
        share: under local scoring (several ranks, an objective that works on rows), this
            rank's :class:`ScoreShare`; ``scores`` and ``positives`` are then None.
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
    share: ScoreShare | None = None


@dataclass(frozen=True)
class Preprocessing:
    """How images and captions become a model's inputs: plain data, as timm's ``default_cfg``.

    A model class may declare its own with a classmethod ``preprocessing(cfg,
    image_size) -> Preprocessing`` (its config section and ``data.image_size``,
    ``None`` when not set); each field is ``None`` where it has none of its own.
    :func:`mmgoal.runs.preprocessing.resolve_preprocessing` decides what a run uses.

    Attributes:
        train_transforms: ``TRANSFORMS`` configs of the training images.
        eval_transforms: ``TRANSFORMS`` configs of the evaluated images.
        tokenizer: a ``TOKENIZERS`` config.
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
    """``inputs`` when it is an ``ObjectiveInputs`` holding ``fields``; else an error for
    people: a ``TypeError`` for anything else (an objective called the old way, with a
    tensor), a ``ValueError`` naming the missing fields."""
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
