"""Hugging Face text encoders: from a local folder, a hub name (fetched unless offline), or a
config of random weights."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from mmgoal.models.pretrained import load_hf_model
from mmgoal.registry import ENCODERS
from mmgoal.sequences import length_mask


@ENCODERS.register()
class HFTextEncoder(nn.Module):
    """A Hugging Face ``AutoModel`` text encoder.

    Args:
        model_path: a local folder (``pkg://`` too) or a hub name, fetched unless offline.
        config: instead, a random model's config, e.g. ``{model_type: bert, hidden_size:
            64, ...}``; ``vocab_size`` defaults to the ``tokenizer``'s.
        pooling: ``cls`` (first token) or ``mean`` (over real tokens).
    """

    def __init__(self, model_path: str | None = None, config: dict | None = None,
                 tokenizer=None, pooling: Literal["cls", "mean"] = "cls") -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        if (model_path is None) == (config is None):
            raise ValueError("HFTextEncoder needs exactly one of model_path or config")
        if model_path is not None:
            self.model = load_hf_model(model_path, "HFTextEncoder model_path")
        else:
            config = dict(config)
            model_type = config.pop("model_type", None)
            if model_type is None:
                raise ValueError("HFTextEncoder config needs a model_type (e.g. bert)")
            if "vocab_size" not in config and tokenizer is not None:
                config["vocab_size"] = len(tokenizer)
            self.model = AutoModel.from_config(AutoConfig.for_model(model_type, **config))
        self.pooling = pooling
        self.out_dim = self.model.config.hidden_size

    def forward_tokens(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L) ids, (B,) lengths -> (B, L, hidden)."""
        mask = length_mask(lengths, tokens.shape[1])
        return self.model(input_ids=tokens, attention_mask=mask.long()).last_hidden_state

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L) ids, (B,) lengths -> (B, hidden)."""
        states = self.forward_tokens(tokens, lengths)
        if self.pooling == "cls":
            return states[:, 0]
        mask = length_mask(lengths, tokens.shape[1])
        return (states * mask[..., None]).sum(1) / lengths[:, None].clamp(min=1)
