"""Region features as ``(tokens (B, R, D), lengths (B,))``: precomputed (VSE-infinity's and
SCAN's 36 BUTD regions of 2048 channels, ``regions.npy`` in the shards), or RoIAlign of the
shards' boxes on a timm feature map, for benchmarks without a detector (synthetic scenes).
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.ops import roi_align

from mmgoal.config import PositiveInt
from mmgoal.models.encoders.timm_image import create_timm_backbone, drop_tokens
from mmgoal.registry import ENCODERS
from mmgoal.sequences import length_mask


def _require(batch: dict, keys: tuple[str, ...], encoder: str, hint: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{encoder} needs batch key(s) {', '.join(missing)}; {hint}")


@ENCODERS.register()
class PrecomputedRegionEncoder(nn.Module):
    """Region features stored in the shards (``feature_dim`` 2048 for BUTD), as tokens."""

    returns_tokens = True

    def __init__(self, feature_dim: PositiveInt = 2048, token_dropout: float = 0.0) -> None:
        super().__init__()
        self.out_dim = feature_dim
        self.token_dropout = token_dropout

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch["regions"]`` (B, R, D), ``batch["region_lengths"]`` -> tokens, lengths."""
        _require(batch, ("regions", "region_lengths"), "PrecomputedRegionEncoder",
                 "the shards need <key>.regions.npy members (mmgoal make-shards precomputed)")
        regions, lengths = batch["regions"].float(), batch["region_lengths"]
        if regions.shape[-1] != self.out_dim:
            raise ValueError(f"the shards' region features have {regions.shape[-1]} channels; "
                             f"set feature_dim: {regions.shape[-1]}")
        if self.training and self.token_dropout > 0:
            return drop_tokens(regions, lengths, self.token_dropout)
        return regions, lengths

    def region_boxes(self, batch: dict) -> list[torch.Tensor]:
        """Each image's region boxes, (R_i, 4) xyxy fractions: the shards' ``boxes.npy``."""
        _require(batch, ("boxes", "box_lengths", "region_lengths"), "region boxes",
                 "the shards need <key>.boxes.npy members, one box per region")
        if not torch.equal(batch["box_lengths"], batch["region_lengths"]):
            raise ValueError("boxes.npy must hold one box per row of regions.npy")
        return [b[:n] for b, n in zip(batch["boxes"], batch["box_lengths"].tolist())]


@ENCODERS.register()
class RoIRegionEncoder(nn.Module):
    """Region features from the image: RoIAlign of each of the batch's ``boxes`` (B, R, 4,
    xyxy fractions) on a timm CNN's (B, C, h, w) map, an ``output_size`` grid averaged to
    one vector. With ``whole_image`` the image is the first region, so an image without
    boxes still has a token. The backbone's arguments are ``TimmImageEncoder``'s.
    """

    returns_tokens = True

    def __init__(self, model_name: str, pretrained: str | bool | None = None,
                 checkpoint_remap: str = "auto", model_kwargs: dict | None = None,
                 output_size: PositiveInt = 2, whole_image: bool = True,
                 token_dropout: float = 0.0) -> None:
        super().__init__()
        self.model = create_timm_backbone(model_name, pretrained, checkpoint_remap, model_kwargs,
                                          global_pool="")
        self.out_dim = self.model.num_features
        self.output_size = output_size
        self.whole_image = whole_image
        self.token_dropout = token_dropout

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """images (B, 3, H, W), boxes (B, R, 4), box_lengths (B,) -> tokens, lengths."""
        _require(batch, ("images", "boxes", "box_lengths"), "RoIRegionEncoder",
                 "the shards need <key>.boxes.npy members or entity boxes in their JSON")
        images, boxes, box_lengths = batch["images"], batch["boxes"], batch["box_lengths"]
        feature_map = self.model.forward_features(images)
        if feature_map.dim() != 4:
            raise ValueError(f"RoIRegionEncoder needs a CNN feature map; "
                             f"{type(self.model).__name__} gives shape {tuple(feature_map.shape)}")
        height, width = images.shape[-2:]
        scale = boxes.new_tensor([width, height, width, height])
        rois = []
        for b in range(len(images)):  # one list entry per image, as torchvision expects
            image_boxes = boxes[b, :box_lengths[b]].float() * scale
            if self.whole_image:
                image_boxes = torch.cat([scale.new_tensor([[0, 0, width, height]]), image_boxes])
            rois.append(image_boxes.to(feature_map.dtype))
        pooled = roi_align(feature_map, rois, self.output_size,
                           spatial_scale=feature_map.shape[-1] / width, sampling_ratio=2,
                           aligned=True).mean((2, 3))
        lengths = box_lengths.to(images.device) + int(self.whole_image)
        tokens = pooled.new_zeros(len(images), int(lengths.max()), pooled.shape[-1])
        real = length_mask(lengths, tokens.shape[1])
        tokens[real] = pooled
        if self.training and self.token_dropout > 0:
            return drop_tokens(tokens, lengths, self.token_dropout)
        return tokens, lengths

    def region_boxes(self, batch: dict) -> list[torch.Tensor]:
        """Each image's region boxes, (R_i, 4) xyxy fractions, in token order."""
        whole = batch["boxes"].new_tensor([[0.0, 0.0, 1.0, 1.0]])
        return [torch.cat([whole, b[:n]]) if self.whole_image else b[:n]
                for b, n in zip(batch["boxes"], batch["box_lengths"].tolist())]
