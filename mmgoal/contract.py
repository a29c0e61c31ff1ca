"""The model contract: what the trainer, objectives and evaluation call on a model (and
:class:`StepAwareObjective`, what the strategies call on an objective).

Every registered model is a :class:`RetrievalModel`; the other protocols are capabilities,
checked with :func:`require` where a component needs one. docs/plugins.md shows a model of
your own; its preprocessing: :mod:`mmgoal.runs.preprocessing`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from mmgoal.structures import Attention, ImageFeatures, TextFeatures


@runtime_checkable
class RetrievalModel(Protocol):
    """Required of every model.

    ``encode_image`` / ``encode_text`` take a collated batch (``images`` or ``regions``;
    ``input_ids`` and ``attention_mask``); ``similarity`` gives ``(n_img, n_txt)``, higher
    is more similar. The optional class attributes a model may declare are read by the
    functions below this module's protocols, with their defaults.
    """

    def encode_image(self, batch: dict) -> ImageFeatures: ...

    def encode_text(self, batch: dict) -> TextFeatures: ...

    def similarity(self, image_features: ImageFeatures,
                   text_features: TextFeatures) -> torch.Tensor: ...


@runtime_checkable
class CrossAttentionModel(RetrievalModel, Protocol):
    """Attention of words over regions (or back) for matched pairs: the CCR/CCS
    constraints and the attention metrics use it."""

    def attention(self, image_features: ImageFeatures, text_features: TextFeatures,
                  direction: str | None = None) -> Attention: ...


@runtime_checkable
class MatchingModel(RetrievalModel, Protocol):
    """An image-text matching head (ITM): ``(B, 2)`` logits (no match, match) of pairs
    ``(image b, text b)``; ITMLoss trains it and evaluation re-ranks with it."""

    def match_logits(self, image_features: ImageFeatures,
                     text_features: TextFeatures) -> torch.Tensor: ...


@runtime_checkable
class MaskedLanguageModel(RetrievalModel, Protocol):
    """Masked-token prediction conditioned on the image (X-VLM's MLM objective)."""

    def mlm_logits(self, image_features: ImageFeatures, text_batch: dict) -> torch.Tensor: ...


@runtime_checkable
class BoxPredictingModel(RetrievalModel, Protocol):
    """Box prediction for a phrase (X-VLM's grounding objective): ``(B, 4)`` boxes."""

    def predict_boxes(self, image_features: ImageFeatures, text_batch: dict) -> torch.Tensor: ...


@runtime_checkable
class TemperatureModel(RetrievalModel, Protocol):
    """A model that learns the temperature of its contrastive softmax, as CLIP learns
    ``logit_scale`` (temperature ``1 / exp(logit_scale)``): InfoNCELoss divides the scores
    by the model's ``temperature()`` instead of its own, so a pretrained CLIP is
    fine-tuned at the temperature it was trained with and keeps learning it."""

    def temperature(self) -> torch.Tensor: ...


@runtime_checkable
class LogitBiasModel(RetrievalModel, Protocol):
    """A model that may learn SigLIP's logit bias (a SigLIP model's ``logit_bias``):
    SigLIPLoss adds the model's ``logit_bias()`` to its logits instead of its own, where it
    is not None (a CLIP model of the same class has none)."""

    def logit_bias(self) -> torch.Tensor | None: ...


@runtime_checkable
class TowerLockingModel(RetrievalModel, Protocol):
    """Freezing a tower but its last ``unlocked`` layer groups, as open_clip's
    ``lock_image_tower``/``lock_text_tower`` (``train.lock_image``, ``train.lock_text``)."""

    def lock_image_tower(self, unlocked: int = 0) -> None: ...

    def lock_text_tower(self, unlocked: int = 0) -> None: ...


@runtime_checkable
class StepAwareObjective(Protocol):
    """An objective whose state follows the optimisation steps (``lam: auto``): the strategy
    calls ``finish_step(applied)`` on every rank after every step's micro-batches
    (``applied`` False for a skipped step); it may be collective."""

    def finish_step(self, applied: bool) -> None: ...


# ---------------------------------------------------------------- declared attributes
# What a model, an image encoder, an objective or a constraint may declare by a class
# attribute (or a method), each read only here, with the default of one that does not.

def similarity_uses_tokens(model: object) -> bool:
    """The model scores pairs from their tokens (SCAN's cross attention): the gallery keeps
    every region and word, and zero-shot classification is refused. Default False."""
    return bool(getattr(model, "similarity_uses_tokens", False))


def dot_product_scores(model: object) -> bool:
    """A pair's score is the dot product of its embeddings
    (:class:`~mmgoal.scoring.DotProductScores`), so score tiles are matrix products.
    Default False: tiles call the model's ``similarity``."""
    return bool(getattr(model, "dot_product_scores", False))


def pair_similarity(model: object) -> Callable[[ImageFeatures, TextFeatures], torch.Tensor] | None:
    """``(k,)`` scores of the pairs ``(image k, text k)`` without their matrix, where the
    model has such a method (SCAN's); ``None``: the diagonal of ``similarity``."""
    return getattr(model, "pair_similarity", None)


def region_boxes(model: object) -> Callable[[dict], list[torch.Tensor]] | None:
    """Where the model's image regions are, per image of a batch (the region encoders'
    ``image_encoder.region_boxes``, xyxy fractions), for the attention metrics and
    plots; ``None`` when its image encoder cannot say."""
    return getattr(getattr(model, "image_encoder", None), "region_boxes", None)


def returns_tokens(encoder: object) -> bool:
    """An image encoder returns ``(tokens, lengths)`` rather than ``(B, D)`` pooled
    features (regions, a timm grid). Default False."""
    return bool(getattr(encoder, "returns_tokens", False))


def works_on_tiles(objective: object) -> bool:
    """The objective reads :class:`~mmgoal.scoring.ScoreTiles` (every registered one);
    default False: it is given the batch's whole score matrix."""
    return bool(getattr(objective, "works_on_tiles", False))


def averages_pairs(constraint: object) -> bool:
    """The constraint's losses are means over its pairs (``reduction: mean``), so the
    ranks' parts are averaged, not summed. Default: sums."""
    return getattr(constraint, "reduction", "sum") == "mean"


CAPABILITIES: tuple[type, ...] = (CrossAttentionModel, MatchingModel, MaskedLanguageModel,
                                  BoxPredictingModel, TemperatureModel, LogitBiasModel,
                                  TowerLockingModel)


def require(model: object, protocol: type, needed_by: str) -> None:
    """Raise a ``ValueError`` naming what ``needed_by`` needs when ``model`` lacks it."""
    if isinstance(model, protocol):
        return
    methods = ", ".join(f"{name}()" for name in _methods(protocol))
    raise ValueError(f"{needed_by} needs a {protocol.__name__} ({methods}); "
                     f"{type(model).__name__} is not one")


def _methods(protocol: type) -> list[str]:
    own = [name for name, value in vars(protocol).items()
           if callable(value) and not name.startswith("_")]
    return own or ["encode_image", "encode_text", "similarity"]
