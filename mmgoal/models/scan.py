"""SCAN: stacked cross attention for image-text matching (Lee et al., ECCV 2018;
docs/reference/scan.md): regions and words projected and L2-normalised one by one, a
pair scored by :func:`mmgoal.models.layers.cross_attention.scan_similarity`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.config import PositiveInt
from mmgoal.contract import returns_tokens
from mmgoal.models.dual_encoder import DualEncoder, Projection, build_projection
from mmgoal.models.efficiency import enable_grad_checkpointing
from mmgoal.models.layers.cross_attention import (
    Direction,
    Pooling,
    at_least_float32,
    scan_attention,
    scan_pair_similarity,
    scan_similarity,
)
from mmgoal.models.layers.gpo import MeanPool
from mmgoal.models.pretrained import tower_weights
from mmgoal.registry import ENCODERS, MODELS
from mmgoal.sequences import length_mask
from mmgoal.structures import Attention, ImageFeatures, TextFeatures


def _mean_embedding(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The normalised mean of the real fragments."""
    return F.normalize(MeanPool()(tokens, lengths)[0], dim=-1)


def unit_fragments(fragments: torch.Tensor) -> torch.Tensor:
    """(B, L, D) fragments L2-normalised in float32, padding (zeros) kept zero: in float16
    the norm's floor (1e-12) is zero and a padding row would turn into NaN."""
    return F.normalize(at_least_float32(fragments), dim=-1)


@MODELS.register()
class SCAN(nn.Module):
    """Regions and words in one space, scored by stacked cross attention (the features'
    ``embedding``, the fragments' normalised mean, is for logging only).

    Args:
        image_encoder: an ``ENCODERS`` config that returns tokens (``PrecomputedRegionEncoder``,
            ``RoIRegionEncoder``, ``TimmImageEncoder`` with ``output: grid``).
        text_encoder: an ``ENCODERS`` config with ``forward_tokens``.
        direction, lambda_softmax, pooling, lambda_lse: the cross attention's; the
            paper's values per direction: docs/reference/scan.md.
    """

    similarity_uses_tokens = True  # the gallery keeps every region and word for scoring

    @classmethod
    def pretrained_weights(cls, cfg: dict) -> str | None:
        """The towers' weights files and hub names (zero-shot evaluation asks)."""
        return tower_weights(cfg.get("image_encoder"), cfg.get("text_encoder"))

    def __init__(self, image_encoder: dict, text_encoder: dict, embed_dim: PositiveInt = 1024,
                 image_projection: Projection = "linear", text_projection: Projection = "none",
                 direction: Direction = "t2i", lambda_softmax: float = 9.0,
                 pooling: Pooling = "avg", lambda_lse: float = 6.0,
                 grad_checkpointing: bool = False, tokenizer=None) -> None:
        super().__init__()
        self.image_encoder = ENCODERS.build(image_encoder)
        if not returns_tokens(self.image_encoder):
            raise ValueError(f"SCAN needs image regions: {image_encoder['type']} returns one "
                             f"vector per image; use PrecomputedRegionEncoder, RoIRegionEncoder "
                             f"or TimmImageEncoder with output: grid")
        self.text_encoder = ENCODERS.build(text_encoder, tokenizer=tokenizer)
        if not hasattr(self.text_encoder, "forward_tokens"):
            raise ValueError(f"SCAN needs word features: {text_encoder['type']} has no "
                             f"forward_tokens")
        self.image_proj = build_projection(image_projection, self.image_encoder.out_dim,
                                           embed_dim, "image")
        self.text_proj = build_projection(text_projection, self.text_encoder.out_dim,
                                          embed_dim, "text")
        self.embed_dim = embed_dim
        self.direction = direction
        self.lambda_softmax = lambda_softmax
        self.pooling = pooling
        self.lambda_lse = lambda_lse
        if grad_checkpointing:
            enable_grad_checkpointing(self)

    def encode_image(self, batch: dict) -> ImageFeatures:
        """The batch's images or regions -> L2-normalised region features and their mask."""
        tokens, lengths = self.image_encoder(batch)
        tokens = unit_fragments(DualEncoder._project_tokens(self.image_proj, tokens, lengths))
        mask = length_mask(lengths, tokens.shape[1])
        return ImageFeatures(_mean_embedding(tokens, lengths), tokens=tokens, mask=mask)

    def encode_text(self, batch: dict) -> TextFeatures:
        """``tokens`` (B, L), ``lengths`` (B,) -> L2-normalised word features and their mask."""
        lengths = batch["lengths"]
        states = self.text_encoder.forward_tokens(batch["tokens"], lengths)
        words = unit_fragments(DualEncoder._project_tokens(self.text_proj, states, lengths))
        mask = length_mask(lengths, words.shape[1])
        return TextFeatures(_mean_embedding(words, lengths), tokens=words, mask=mask)

    def similarity(self, image_features: ImageFeatures,
                   text_features: TextFeatures) -> torch.Tensor:
        """(n_images, n_texts) stacked cross attention scores of every pair."""
        return scan_similarity(image_features.tokens, image_features.mask, text_features.tokens,
                               text_features.mask, self.direction, self.lambda_softmax,
                               self.pooling, self.lambda_lse)

    def pair_similarity(self, image_features: ImageFeatures,
                        text_features: TextFeatures) -> torch.Tensor:
        """(B,) stacked cross attention scores of aligned pairs (image ``b``, text ``b``):
        what score tiles read of the O(n) pairs an objective chose."""
        return scan_pair_similarity(image_features.tokens, image_features.mask,
                                    text_features.tokens, text_features.mask, self.direction,
                                    self.lambda_softmax, self.pooling, self.lambda_lse)

    def attention(self, image_features: ImageFeatures, text_features: TextFeatures,
                  direction: Direction | None = None) -> Attention:
        """Attention of matched pairs (image ``b`` with text ``b``), in the model's direction
        unless ``direction`` is given (the attention metrics ask for ``t2i``)."""
        return scan_attention(image_features.tokens, image_features.mask, text_features.tokens,
                              text_features.mask, direction or self.direction,
                              self.lambda_softmax)
