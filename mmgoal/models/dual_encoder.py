"""Dual encoders: VSE++ (Faghri et al., BMVC 2018) and relatives.

An image encoder and a text encoder, each followed by a linear projection to a
shared space and L2 normalisation; the score of an (image, text) pair is the
dot product of their embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.models.features import ImageFeatures, TextFeatures
from mmgoal.registry import ENCODERS, MODELS


@MODELS.register()
class DualEncoder(nn.Module):
    """Image encoder + text encoder + linear projections + L2 norm.

    Args:
        image_encoder: config of an ``ENCODERS`` image encoder (``out_dim`` attribute).
        text_encoder: config of an ``ENCODERS`` text encoder (``out_dim`` attribute).
        embed_dim: size of the joint space.
        tokenizer: passed to the text encoder (vocabulary size, padding id).
    """

    def __init__(self, image_encoder: dict, text_encoder: dict, embed_dim: int = 1024,
                 tokenizer=None) -> None:
        super().__init__()
        self.image_encoder = ENCODERS.build(image_encoder)
        self.text_encoder = ENCODERS.build(text_encoder, tokenizer=tokenizer)
        self.image_proj = nn.Linear(self.image_encoder.out_dim, embed_dim)
        self.text_proj = nn.Linear(self.text_encoder.out_dim, embed_dim)
        self.embed_dim = embed_dim

    def encode_image(self, batch: dict) -> ImageFeatures:
        """``batch["images"]`` (B, 3, H, W) -> (B, embed_dim) unit vectors."""
        return ImageFeatures(F.normalize(self.image_proj(self.image_encoder(batch["images"])),
                                         dim=-1))

    def encode_text(self, batch: dict) -> TextFeatures:
        """``batch["tokens"]`` (B, L), ``batch["lengths"]`` (B,) -> (B, embed_dim) unit vectors."""
        return TextFeatures(F.normalize(
            self.text_proj(self.text_encoder(batch["tokens"], batch["lengths"])), dim=-1))

    def similarity(self, image_features: ImageFeatures,
                   text_features: TextFeatures) -> torch.Tensor:
        """(n_images, n_texts) cosine similarities."""
        return image_features.embedding @ text_features.embedding.T
