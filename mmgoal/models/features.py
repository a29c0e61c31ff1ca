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
