"""A trained model from Python: encode images and texts, score them, search a gallery.

    import mmgoal
    model = mmgoal.load("work_dirs/quickstart", device="cpu")   # its best checkpoint
    model = mmgoal.load("quickstart.safetensors")               # an export (mmgoal export)
    model.encode_images(["cat.png", pil_image])    # (n, d), L2-normalised (dual encoders)
    model.encode_texts(["a red circle"])           # (m, d)
    model.score(images, texts)                     # (n_images, n_texts), every model family
    hits = model.search(["a red circle"], model.index(images), top_k=5)

Everything runs batched, under ``no_grad``, on the model's device, with the
model's own eval transform and tokenizer (:func:`mmgoal.runs.loading.load_for_evaluation`).
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
from mmgoal.evaluation.gallery import score_gallery
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
    """A loaded model with its preprocessing (see the module docstring).

    Args:
        loaded: what :func:`load_for_evaluation` returns.
        batch_size: images or texts encoded at a time.
    """

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
        parts = []
        for start in range(0, len(images), self.batch_size):
            pixels = torch.stack([self.transform(rgb_image(image))
                                  for image in images[start:start + self.batch_size]])
            try:
                features = self.model.encode_image(move_to_device({"images": pixels},
                                                                  self.device))
            except KeyError as error:
                raise ValueError(f"{type(self.model).__name__} does not encode images here: it "
                                 f"reads {error} (precomputed features) from its shards") from None
            parts.append(detach_features(features))
        return cat_features(parts)

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
        """(n_images, n_texts) similarities, scored by the model itself (cross attention
        included), on memory-bounded blocks as in evaluation.

        Args:
            rerank_k: a cross encoder's ITM head re-scores the top ``rerank_k`` candidates
                of every query, placed above the rest (default: the config's
                ``evaluation.rerank_k``; 0: the ITC scores alone). Re-ranked scores are
                float64 (the ITC order kept below the ITM scores).
            direction: with re-ranking, whose candidates: ``t2i`` (each text's top
                images, the columns) or ``i2t`` (each image's top texts, the rows).
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
    """A trained model, built with the config saved inside it: a run directory (its
    ``checkpoints/best.pt``, else its latest checkpoint), a checkpoint file, or an
    export (``mmgoal export``: ``.pt`` or ``.safetensors``).

    The saved config's ``custom_imports`` are not imported (a file you received must
    not run code): a model that needs a plug-in of yours is loaded with
    ``trust_custom_imports=True``, which imports them and logs each."""
    return Retriever(load_for_evaluation(path, device=device,
                                         trust_custom_imports=trust_custom_imports),
                     batch_size)


def from_config(config: str | os.PathLike | dict, checkpoint: str | os.PathLike | None = None,
                device: str | torch.device = "auto", batch_size: int = 64,
                overrides: Sequence[str] = (), *, trust_custom_imports: bool = False
                ) -> Retriever:
    """The model of a config: a training config, or one with only ``model`` (and
    ``data.tokenizer``, eval preprocessing; left out, the model's own: an ``OpenCLIP`` or
    ``HFCLIP`` section alone is enough). With ``checkpoint`` (a run directory or a
    checkpoint/export file) it gets those weights and vocabulary; without, the weights
    its own sections load (pretrained towers, a CLIP file) and a pretrained tokenizer.
    ``overrides`` are ``--cfg-options`` strings (``"model.embed_dim=256"``). The
    config's ``custom_imports`` are imported only with ``trust_custom_imports`` (as
    :func:`load`)."""
    if checkpoint is None:
        return Retriever(build_from_config(config, overrides, device,
                                           trust_custom_imports=trust_custom_imports),
                         batch_size)
    return Retriever(load_for_evaluation(checkpoint, config=config, overrides=overrides,
                                         device=device,
                                         trust_custom_imports=trust_custom_imports),
                     batch_size)


def as_texts(texts: str | Sequence[str]) -> list[str]:
    """``texts`` as a list of strings: one string is one text (not its characters).

    Raises:
        TypeError: something other than strings; ValueError: no text at all.
    """
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts must be a string or a list of strings, got "
                        f"{type(texts).__name__}")
    if not texts:
        raise ValueError("no texts given: pass at least one string")
    return list(texts)


def as_images(images: ImageLike | Sequence[ImageLike]) -> list[ImageLike]:
    """``images`` as a list: one PIL image or path alone is a list of one.

    Raises:
        ValueError: no image at all.
    """
    images = [images] if isinstance(images, (str, os.PathLike, Image.Image)) else list(images)
    if not images:
        raise ValueError("no images given: pass at least one image (a PIL image or a path)")
    return images


def rgb_image(image: ImageLike) -> Image.Image:
    """An RGB PIL image from a PIL image or a file path.

    Raises:
        FileNotFoundError: a missing file; ValueError: a file that is not a readable image.
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = Path(image)
    if not path.exists():
        raise FileNotFoundError(f"image {path} does not exist")
    try:
        return decode_image(path, f"image {path}").convert("RGB")
    except ImageDecodeError as error:
        raise ValueError(f"{error}; give a JPEG, PNG or another format Pillow reads") from None
