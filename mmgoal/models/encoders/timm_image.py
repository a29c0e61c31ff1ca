"""Image encoders built through timm: a globally pooled vector (VSE++) or a grid of tokens.

Image encoders return ``(B, out_dim)`` (``returns_tokens = False``) or ``(tokens (B, L,
out_dim), lengths (B,))`` (``returns_tokens = True``) for a pooler such as GPO.
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
    """``timm.create_model`` without a classifier; ``pretrained``: a local checkpoint
    (``load_pretrained`` with ``checkpoint_remap``), ``True`` for timm's own weights, or
    ``None``/``False``. ``global_pool=''`` keeps the feature map."""
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
    """Drop each real token of ``tokens`` (B, L, D) with probability ``p`` and pack the
    survivors to the front, in order, at least one a row: VSE-infinity's feature dropout
    (p = 0.2). Returns tokens (B, L', D), L' the longest surviving row, and lengths."""
    batch, length, _ = tokens.shape
    keep = (torch.rand(batch, length, device=tokens.device) >= p) & length_mask(lengths, length)
    keep[keep.sum(1) == 0, 0] = True
    return pack_kept(tokens, keep)


@ENCODERS.register()
class TimmImageEncoder(nn.Module):
    """Any timm model as an image encoder (arguments as :func:`create_timm_backbone`'s).

    ``output``: ``pooled`` (VSE++: one vector per image) or ``grid`` (VSE-infinity: every
    position of the last feature map, or every token of a transformer, is a token, each
    dropped in training with probability ``token_dropout``).
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
        """timm's preprocessing of the model's pretrained config (``TimmTransform``;
        ``data.image_size`` sets the crop), for training and evaluation alike, when the
        tower loads pretrained weights that have one."""
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
