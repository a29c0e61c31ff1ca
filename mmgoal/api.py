"""A trained model from Python: encode images and texts, score them, search a gallery
(docs/getting_started.md, "Use your model"). Batched, under ``no_grad``, on the model's
device, with its own eval transform and tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from PIL import Image

from mmgoal.config import check_value
from mmgoal.contract import MatchingModel, require
from mmgoal.data.images import ImageDecodeError, decode_image
from mmgoal.devices import module_device, move_to_device
from mmgoal.evaluation.gallery import encode_image_batches, score_gallery
from mmgoal.evaluation.rerank import itm_rerank
from mmgoal.runs.loading import LoadedModel, build_from_config, load_for_evaluation
from mmgoal.runs.schema import ScoringConfig
from mmgoal.structures import ImageFeatures, TextFeatures, cat_features, detach_features

ImageLike = str | os.PathLike | Image.Image
GalleryKind = Literal["images", "texts"]


@dataclass
class Index:
    """An encoded gallery, searched many times: ``kind`` is ``images`` or ``texts``."""

    kind: GalleryKind
    features: ImageFeatures | TextFeatures

    def __len__(self) -> int:
        return len(self.features.embedding)


class Retriever:
    """A loaded model (:func:`load_for_evaluation`) with its preprocessing; ``batch_size``
    images or texts are encoded at a time."""

    def __init__(self, loaded: LoadedModel, batch_size: int = 64) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number >= 1 (images or texts encoded "
                             f"at a time), got {batch_size!r}")
        self.model, self.transform, self.tokenizer = loaded.model, loaded.transform, \
            loaded.tokenizer
        self.config, self.batch_size = loaded.config, batch_size
        self.device = module_device(self.model)
        self.scoring = ScoringConfig.of(loaded.config["evaluation"])

    @torch.no_grad()
    def image_features(self, images: Sequence[ImageLike]) -> ImageFeatures:
        """Every feature the model computes for ``images`` (tokens too, for cross attention):
        PIL images or file paths; one image alone is a batch of one."""
        images = as_images(images)
        batches = ({"images": torch.stack([self.transform(rgb_image(image))
                                           for image in images[start:start + self.batch_size]])}
                   for start in range(0, len(images), self.batch_size))
        try:
            return cat_features([detach_features(features) for _, features in
                                 encode_image_batches(self.model, batches, "encode images",
                                                      progress=False)])
        except KeyError as error:
            raise ValueError(f"{type(self.model).__name__} does not encode images here: it "
                             f"reads {error} (precomputed features) from its shards") from None

    @torch.no_grad()
    def text_features(self, texts: Sequence[str]) -> TextFeatures:
        """Every feature the model computes for ``texts``; one string alone is one text."""
        texts = as_texts(texts)
        parts = [detach_features(self.model.encode_text(move_to_device(
            self.tokenizer(list(texts[start:start + self.batch_size])), self.device)))
            for start in range(0, len(texts), self.batch_size)]
        return cat_features(parts)

    def encode_images(self, images: Sequence[ImageLike]) -> torch.Tensor:
        """(n, d) L2-normalised image embeddings (the dual encoders' retrieval space)."""
        return self.image_features(images).embedding

    def encode_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """(m, d) L2-normalised text embeddings."""
        return self.text_features(texts).embedding

    def index(self, items: Sequence[ImageLike] | Sequence[str],
              kind: GalleryKind = "images") -> Index:
        """Encode a gallery once: images (PIL images or paths), or ``kind="texts"``."""
        check_value("kind", kind, GalleryKind)
        features = self.image_features(items) if kind == "images" else self.text_features(items)
        return Index(kind, features)

    @torch.no_grad()
    def score(self, images: Sequence[ImageLike] | Index, texts: Sequence[str] | Index,
              rerank_k: int | None = None, direction: str = "t2i") -> torch.Tensor:
        """(n_images, n_texts) similarities by the model itself, in blocks as in evaluation.

        Args:
            rerank_k: a cross encoder's ITM head re-scores every query's top ``rerank_k``,
                placed above the rest, as float64 (default ``evaluation.rerank_k``; 0: off).
            direction: whose candidates are re-ranked: ``t2i`` (columns) or ``i2t`` (rows).
        """
        image_features = images.features if isinstance(images, Index) else \
            self.image_features(images)
        text_features = texts.features if isinstance(texts, Index) else self.text_features(texts)
        sims = score_gallery(self.model, image_features, text_features,
                             self.scoring.block_images, self.scoring.max_block_mb,
                             progress=False, matmul_precision=self.scoring.matmul_precision)
        rerank_k = self.scoring.rerank_k if rerank_k is None else rerank_k
        if rerank_k <= 0:
            return sims
        require(self.model, MatchingModel, "rerank_k (ITM re-ranking)")
        return itm_rerank(self.model, image_features, text_features, sims, rerank_k,
                          self.scoring.rerank_batch_size, progress=False,
                          directions=(direction,))[0]

    def search(self, queries: Sequence[str] | Sequence[ImageLike], gallery: Index,
               top_k: int = 5, rerank_k: int | None = None) -> list[list[tuple[int, float]]]:
        """The ``top_k`` gallery items of every query, best first, as ``(index, score)``:
        text queries against an image index, image queries against a text index
        (``rerank_k`` as in :meth:`score`). One string (or image) alone is one query."""
        if not isinstance(gallery, Index):
            raise TypeError(f"search takes the gallery as an Index, which encodes it once for "
                            f"many searches, got {type(gallery).__name__}: pass "
                            f"model.index(images), or model.index(texts, kind='texts') for "
                            f"image queries")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be a whole number >= 1, got {top_k!r}")
        if gallery.kind == "images":
            sims = self.score(gallery, as_texts(queries), rerank_k, direction="t2i").T
        else:
            sims = self.score(as_images(queries), gallery, rerank_k, direction="i2t")
        values, indices = sims.topk(min(top_k, len(gallery)), dim=1)
        return [list(zip(row_indices.tolist(), row_values.tolist()))
                for row_indices, row_values in zip(indices, values)]


def load(path: str | os.PathLike, device: str | torch.device = "auto",
         batch_size: int = 64, *, trust_custom_imports: bool = False) -> Retriever:
    """A trained model, built with its saved config: a run directory (``best.pt``, else the
    latest checkpoint), a checkpoint or an export (``.pt``, ``.safetensors``).

    The saved ``custom_imports`` run only with ``trust_custom_imports=True`` (a received
    file must not run code)."""
    return Retriever(load_for_evaluation(path, device=device,
                                         trust_custom_imports=trust_custom_imports),
                     batch_size)


def from_config(config: str | os.PathLike | dict, checkpoint: str | os.PathLike | None = None,
                device: str | torch.device = "auto", batch_size: int = 64,
                overrides: Sequence[str] = (), *, trust_custom_imports: bool = False
                ) -> Retriever:
    """The model of a config (docs/getting_started.md, "Use your model"): with
    ``checkpoint`` (run directory or file) its weights and vocabulary, else what its own
    sections load. ``overrides``: ``--cfg-options`` strings; ``trust_custom_imports`` as
    in :func:`load`."""
    if checkpoint is None:
        return Retriever(build_from_config(config, overrides, device,
                                           trust_custom_imports=trust_custom_imports),
                         batch_size)
    return Retriever(load_for_evaluation(checkpoint, config=config, overrides=overrides,
                                         device=device,
                                         trust_custom_imports=trust_custom_imports),
                     batch_size)


def as_texts(texts: str | Sequence[str]) -> list[str]:
    """``texts`` as a list of strings: one string is one text (not its characters)."""
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts must be a string or a list of strings, got "
                        f"{type(texts).__name__}")
    if not texts:
        raise ValueError("no texts given: pass at least one string")
    return list(texts)


def as_images(images: ImageLike | Sequence[ImageLike]) -> list[ImageLike]:
    """``images`` as a list: one PIL image or path alone is a list of one."""
    images = [images] if isinstance(images, (str, os.PathLike, Image.Image)) else list(images)
    if not images:
        raise ValueError("no images given: pass at least one image (a PIL image or a path)")
    return images


def rgb_image(image: ImageLike) -> Image.Image:
    """An RGB PIL image from a PIL image or a file path (``ValueError`` if unreadable)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = Path(image)
    if not path.exists():
        raise FileNotFoundError(f"image {path} does not exist")
    try:
        return decode_image(path, f"image {path}").convert("RGB")
    except ImageDecodeError as error:
        raise ValueError(f"{error}; give a JPEG, PNG or another format Pillow reads") from None
