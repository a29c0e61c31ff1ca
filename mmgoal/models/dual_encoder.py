"""Dual encoders: VSE++ (Faghri et al., BMVC 2018) and VSE-infinity (Chen et al., CVPR 2021),
one class configured (docs/reference/dual_encoders.md). VSE++ projects one pooled vector
per side; VSE-infinity projects every token and word, then pools them (``GPO``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.config import PositiveInt, check_value
from mmgoal.contract import returns_tokens
from mmgoal.models.efficiency import enable_grad_checkpointing
from mmgoal.models.locking import lock_groups
from mmgoal.models.pretrained import tower_weights
from mmgoal.registry import ENCODERS, MODELS, POOLERS
from mmgoal.scoring import DotProductScores
from mmgoal.sequences import length_mask
from mmgoal.structures import ImageFeatures, Preprocessing, TextFeatures


class ResidualMLPProjection(nn.Module):
    """VSE-infinity's region projection (the authors' ``EncoderImageAggr``): ``linear(x) +
    MLP(x)``, a 2-layer MLP with BN that sees the real tokens only."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)
        self.mlp = nn.Sequential(nn.Linear(in_dim, out_dim // 2), nn.BatchNorm1d(out_dim // 2),
                                 nn.ReLU(inplace=True), nn.Linear(out_dim // 2, out_dim))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(N, in_dim) -> (N, out_dim)."""
        return self.linear(features) + self.mlp(features)


# linear, linear + residual MLP, or none (the encoder's own size)
Projection = Literal["linear", "mlp", "none"]


def build_projection(kind: Projection, in_dim: int, out_dim: int, side: str) -> nn.Module:
    """The projection ``kind`` of the ``side`` (``image``, ``text``) encoder's features."""
    check_value(f"{side}_projection", kind, Projection)
    if kind == "linear":
        return nn.Linear(in_dim, out_dim)
    if kind == "mlp":
        return ResidualMLPProjection(in_dim, out_dim)
    if in_dim != out_dim:
        raise ValueError(f"{side}_projection: none needs the {side} encoder's size "
                         f"({in_dim}) to equal embed_dim ({out_dim})")
    return nn.Identity()


@MODELS.register()
class DualEncoder(DotProductScores, nn.Module):
    """Image encoder + text encoder + projections (+ poolers) + L2 norm.

    Args:
        image_pooler: ``POOLERS`` config, when (only when) the image encoder
            ``returns_tokens``.
        text_pooler: ``POOLERS`` config (``GPO``); without it the text encoder pools itself.
        image_projection, text_projection: applied to every token before pooling
            (``mlp``: VSE-infinity's linear + residual MLP).
    """

    def __init__(self, image_encoder: dict, text_encoder: dict, embed_dim: PositiveInt = 1024,
                 image_pooler: dict | None = None, text_pooler: dict | None = None,
                 image_projection: Projection = "linear", text_projection: Projection = "linear",
                 grad_checkpointing: bool = False, tokenizer=None) -> None:
        super().__init__()
        self.image_encoder = ENCODERS.build(image_encoder)
        self.text_encoder = ENCODERS.build(text_encoder, tokenizer=tokenizer)
        image_tokens = returns_tokens(self.image_encoder)
        if image_tokens and image_pooler is None:
            raise ValueError(f"{image_encoder['type']} returns tokens: set model.image_pooler, "
                             f"e.g. {{type: GPO}} or {{type: MeanPool}}")
        if not image_tokens and image_pooler is not None:
            raise ValueError(f"{image_encoder['type']} returns one pooled vector per image; "
                             f"remove model.image_pooler or use output: grid / a region encoder")
        self.image_pooler = POOLERS.build(image_pooler) if image_pooler else None
        self.text_pooler = POOLERS.build(text_pooler) if text_pooler else None
        self.image_proj = build_projection(image_projection, self.image_encoder.out_dim,
                                           embed_dim, "image")
        self.text_proj = build_projection(text_projection, self.text_encoder.out_dim,
                                          embed_dim, "text")
        self.embed_dim = embed_dim
        if grad_checkpointing:
            enable_grad_checkpointing(self)

    @classmethod
    def pretrained_weights(cls, cfg: dict) -> str | None:
        """The towers' weights files and hub names (zero-shot evaluation asks)."""
        return tower_weights(cfg.get("image_encoder"), cfg.get("text_encoder"))

    def lock_image_tower(self, unlocked: int = 0) -> None:
        """Two groups: the encoder, then its pooler and projection."""
        lock_groups([[self.image_encoder], [self.image_pooler, self.image_proj]], unlocked,
                    "DualEncoder's image tower")

    def lock_text_tower(self, unlocked: int = 0) -> None:
        lock_groups([[self.text_encoder], [self.text_pooler, self.text_proj]], unlocked,
                    "DualEncoder's text tower")

    @classmethod
    def preprocessing(cls, cfg: dict, image_size: int | None) -> Preprocessing:
        """The image encoder's own transforms (a pretrained timm tower's statistics, see
        ``TimmImageEncoder.preprocessing``); no tokenizer of its own."""
        image_encoder = cfg["image_encoder"]
        own = getattr(ENCODERS.get(image_encoder["type"]), "preprocessing", None)
        return Preprocessing() if own is None else own(image_encoder, image_size)

    @staticmethod
    def _project_tokens(projection: nn.Module, tokens: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
        """Project the real tokens only (batch norm must not see padding)."""
        real = length_mask(lengths, tokens.shape[1])
        projected = projection(tokens[real])
        out = projected.new_zeros(*tokens.shape[:2], projected.shape[-1])
        out[real] = projected
        return out

    def encode_image(self, batch: dict) -> ImageFeatures:
        """The batch's images (or regions) -> (B, embed_dim) unit vectors (+ tokens)."""
        output = self.image_encoder(batch)
        if self.image_pooler is None:
            return ImageFeatures(F.normalize(self.image_proj(output), dim=-1))
        tokens, lengths = output
        tokens = self._project_tokens(self.image_proj, tokens, lengths)
        pooled, _ = self.image_pooler(tokens, lengths)
        return ImageFeatures(F.normalize(pooled, dim=-1), tokens=tokens,
                             mask=length_mask(lengths, tokens.shape[1]))

    def encode_text(self, batch: dict) -> TextFeatures:
        """``batch["tokens"]`` (B, L), ``batch["lengths"]`` (B,) -> (B, embed_dim) unit vectors."""
        if self.text_pooler is None:
            return TextFeatures(F.normalize(
                self.text_proj(self.text_encoder(batch["tokens"], batch["lengths"])), dim=-1))
        lengths = batch["lengths"]
        states = self.text_encoder.forward_tokens(batch["tokens"], lengths)
        states = self._project_tokens(self.text_proj, states, lengths)
        pooled, _ = self.text_pooler(states, lengths)
        return TextFeatures(F.normalize(pooled, dim=-1), tokens=states,
                            mask=length_mask(lengths, states.shape[1]))
