"""A small CNN for CPU-sized experiments, registered in timm as ``mmgoal_small_cnn``.

Optional coordinate channels (CoordConv, Liu et al. 2018) let globally pooled features
know where things are: the synthetic benchmark's captions talk about positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from timm.layers import SelectAdaptivePool2d
from timm.models import register_model
from torch import nn

from mmgoal.config import PositiveInt
from mmgoal.registry import check_arguments


class SmallCNN(nn.Module):
    """Stages of (3x3 conv stride 2, 3x3 conv) with a norm and ReLU, then global pooling.

    Args:
        widths: channels of each stage; each stage halves the resolution.
        coord_channels: append normalised x/y coordinates to the input.
        num_classes: size of a linear classifier; 0 gives pooled features.
        norm: ``batch`` or ``group`` (8 groups or fewer; batch-independent, so a batch
            split over processes trains exactly as the whole batch in one: SyncBatchNorm
            does not run on CPU).
    """

    def __init__(self, widths: Sequence[PositiveInt] = (32, 64, 128, 256),
                 coord_channels: bool = True, in_chans: PositiveInt = 3, num_classes: int = 0,
                 global_pool: str = "avg", drop_rate: float = 0.0,
                 norm: Literal["batch", "group"] = "batch") -> None:
        super().__init__()

        def norm_layer(width: int) -> nn.Module:
            if norm == "batch":
                return nn.BatchNorm2d(width)
            return nn.GroupNorm(min(8, width), width)

        self.coord_channels = coord_channels
        layers: list[nn.Module] = []
        channels = in_chans + (2 if coord_channels else 0)
        for width in widths:
            layers += [
                nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False),
                norm_layer(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                norm_layer(width), nn.ReLU(inplace=True),
            ]
            channels = width
        self.features = nn.Sequential(*layers)
        self.num_features = channels
        self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
        self.drop = nn.Dropout(drop_rate)
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features * self.global_pool.feat_mult(), num_classes) \
            if num_classes else nn.Identity()

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            self.global_pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features * self.global_pool.feat_mult(), num_classes) \
            if num_classes else nn.Identity()

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, widths[-1], H / 2^stages, W / 2^stages)."""
        if self.coord_channels:
            b, _, h, w = images.shape
            ys = torch.linspace(-1, 1, h, device=images.device, dtype=images.dtype)
            xs = torch.linspace(-1, 1, w, device=images.device, dtype=images.dtype)
            grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij")).expand(b, 2, h, w)
            images = torch.cat([images, grid], dim=1)
        return self.features(images)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        pooled = self.drop(self.global_pool(features))
        return pooled if pre_logits else self.fc(pooled)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))


@register_model
def mmgoal_small_cnn(pretrained: bool = False, **kwargs) -> SmallCNN:
    """timm entry point; ``pretrained`` is refused (there are no released weights). A
    config's ``model_kwargs`` reach it through timm, past the registry's check, so their
    values are checked against ``SmallCNN``'s hints here (``widths: [8, -1]``)."""
    if pretrained:
        raise ValueError("mmgoal_small_cnn has no pretrained weights; set pretrained: false")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    check_arguments(SmallCNN, kwargs, "mmgoal_small_cnn")
    return SmallCNN(**kwargs)
