"""Image encoders built through timm."""

from __future__ import annotations

import timm
import torch
from torch import nn

import mmgoal.models.encoders.small_cnn  # noqa: F401  (registers mmgoal_small_cnn in timm)
from mmgoal.registry import ENCODERS


@ENCODERS.register()
class TimmImageEncoder(nn.Module):
    """Any timm model as a globally pooled image encoder.

    Args:
        model_name: a timm model name (``resnet50``, ``mmgoal_small_cnn``, ...).
        pretrained: timm's own pretrained flag (needs a local cache on this machine).
        model_kwargs: extra keyword arguments for ``timm.create_model``.
        global_pool: timm pooling name.
    """

    def __init__(self, model_name: str, pretrained: bool = False,
                 model_kwargs: dict | None = None, global_pool: str = "avg") -> None:
        super().__init__()
        try:
            self.model = timm.create_model(model_name, pretrained=pretrained, num_classes=0,
                                           global_pool=global_pool, **(model_kwargs or {}))
        except RuntimeError as error:
            if "Unknown model" not in str(error):
                raise
            close = timm.list_models(f"*{model_name.split('_')[0]}*")[:10]
            raise ValueError(
                f"timm has no model {model_name!r}; similar names: {', '.join(close) or 'none'}"
            ) from error
        self.out_dim = self.model.num_features * getattr(
            getattr(self.model, "global_pool", None), "feat_mult", lambda: 1)()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, out_dim)."""
        return self.model(images)
