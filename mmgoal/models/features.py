"""What encoders hand to similarity functions and objectives."""

from __future__ import annotations

from dataclasses import dataclass

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
    """The rows ``index`` (a 1-D long tensor, repeats allowed) of features with tokens."""
    return type(features)(features.embedding[index], tokens=features.tokens[index],
                          mask=features.mask[index])
