"""Image encoders built through timm: a globally pooled vector (VSE++) or a grid of tokens.

Image encoders take the batch and return either ``(B, out_dim)`` pooled
features (``returns_tokens = False``) or ``(tokens (B, L, out_dim), lengths
(B,))`` (``returns_tokens = True``) for a pooler such as GPO to reduce.
"""

from __future__ import annotations

from typing import Literal

import timm
import torch
from einops import rearrange
from torch import nn

import mmgoal.models.encoders.small_cnn  # noqa: F401  (registers mmgoal_small_cnn in timm)
from mmgoal.models.pretrained import load_pretrained
from mmgoal.registry import ENCODERS
from mmgoal.sequences import length_mask, pack_kept
from mmgoal.structures import Preprocessing


def create_timm_backbone(model_name: str, pretrained: str | bool | None = None,
                         checkpoint_remap: str = "auto", model_kwargs: dict | None = None,
                         global_pool: str = "avg") -> nn.Module:
    """``timm.create_model`` without a classifier, with weights from a local file.

    Args:
        model_name: a timm model name.
        pretrained: a local checkpoint path (loaded with ``load_pretrained``
            and ``checkpoint_remap``), ``True`` for timm's own pretrained
            weights (needs timm's cache on this machine), or ``None``/``False``.
        checkpoint_remap: a ``CHECKPOINT_REMAPS`` name or ``auto``.
        model_kwargs: extra keyword arguments for ``timm.create_model``.
        global_pool: timm pooling name (``''`` keeps the feature map).
    """
    try:
        model = timm.create_model(model_name, pretrained=pretrained is True, num_classes=0,
                                  global_pool=global_pool, **(model_kwargs or {}))
    except RuntimeError as error:
        if "Unknown model" not in str(error):
            raise
        close = timm.list_models(f"*{model_name.split('_')[0]}*")[:10]
        raise ValueError(
            f"timm has no model {model_name!r}; similar names: {', '.join(close) or 'none'}"
        ) from error
    except TypeError as error:  # model_kwargs of another model (left after a model_name swap)
        raise ValueError(f"timm model {model_name!r} does not take model_kwargs "
                         f"{sorted(model_kwargs or {})} ({error}); they may belong to another "
                         f"model_name: give {model_name}'s own arguments, or remove "
                         f"model_kwargs") from error
    if isinstance(pretrained, str):
        load_pretrained(model, pretrained, remap=checkpoint_remap)
    return model


def drop_tokens(tokens: torch.Tensor, lengths: torch.Tensor,
                p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop each real token with probability ``p`` and pack the survivors to the front.

    VSE-infinity's feature dropout (p = 0.2) for region and grid tokens; at
    least one token of every row survives and the order is kept.

    Args:
        tokens: (B, L, D) padded.
        lengths: (B,) real tokens per row.

    Returns:
        tokens (B, L', D) with L' the longest surviving row (padding zeroed),
        lengths (B,).
    """
    batch, length, _ = tokens.shape
    keep = (torch.rand(batch, length, device=tokens.device) >= p) & length_mask(lengths, length)
    keep[keep.sum(1) == 0, 0] = True
    return pack_kept(tokens, keep)


@ENCODERS.register()
class TimmImageEncoder(nn.Module):
    """Any timm model as an image encoder: pooled vector or grid of tokens.

    Args:
        model_name: a timm model name (``resnet152``, ``tf_efficientnet_lite0``,
            ``mmgoal_small_cnn``, ``vit_tiny_patch16_224``, ...).
        pretrained: local checkpoint path, ``True`` for timm's cache, or ``None``.
        checkpoint_remap: how to rename the checkpoint's keys (``auto`` detects
            the family; see ``mmgoal.models.pretrained``).
        model_kwargs: extra keyword arguments for ``timm.create_model``.
        global_pool: timm pooling name for ``output: pooled``.
        output: ``pooled`` (VSE++: one vector per image) or ``grid`` (VSE-infinity
            grid features: every position of the last feature map, or every
            token of a transformer, is a token).
        token_dropout: in training, drop each grid token with this probability.
    """

    def __init__(self, model_name: str, pretrained: str | bool | None = None,
                 checkpoint_remap: str = "auto", model_kwargs: dict | None = None,
                 global_pool: str = "avg", output: Literal["pooled", "grid"] = "pooled",
                 token_dropout: float = 0.0) -> None:
        super().__init__()
        self.model = create_timm_backbone(model_name, pretrained, checkpoint_remap, model_kwargs,
                                          global_pool if output == "pooled" else "")
        self.output = output
        self.returns_tokens = output == "grid"
        self.token_dropout = token_dropout
        feat_mult = getattr(getattr(self.model, "global_pool", None), "feat_mult", lambda: 1)()
        self.out_dim = self.model.num_features * (feat_mult if output == "pooled" else 1)

    @classmethod
    def preprocessing(cls, cfg: dict, image_size: int | None) -> Preprocessing:
        """timm's preprocessing of the model's pretrained config (``TimmTransform``: its
        mean/std, resize and centre crop; ``data.image_size`` sets the crop) for training
        and evaluation alike (augmentation is the config's choice), when the tower loads
        pretrained weights: random weights have no statistics of their own, nor does a
        model timm has no pretrained config for."""
        if not cfg.get("pretrained") or timm.models.get_pretrained_cfg(cfg["model_name"]) is None:
            return Preprocessing()
        transform = {"type": "TimmTransform", "model_name": cfg["model_name"]}
        if image_size is not None:
            transform["image_size"] = image_size
        return Preprocessing(train_transforms=[transform], eval_transforms=[transform])

    def forward(self, batch: dict) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``batch["images"]`` (B, 3, H, W) -> (B, out_dim), or tokens (B, L, out_dim) + lengths."""
        images = batch["images"]
        if self.output == "pooled":
            return self.model(images)
        features = self.model.forward_features(images)
        if features.dim() == 4:
            tokens = rearrange(features, "b c h w -> b (h w) c")
        else:  # a transformer's tokens, without its class/register tokens
            tokens = features[:, getattr(self.model, "num_prefix_tokens", 0):]
        lengths = torch.full((len(tokens),), tokens.shape[1], dtype=torch.long,
                             device=tokens.device)
        if self.training and self.token_dropout > 0:
            tokens, lengths = drop_tokens(tokens, lengths, self.token_dropout)
        return tokens, lengths
