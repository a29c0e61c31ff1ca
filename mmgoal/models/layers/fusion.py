"""Fusion layers of a cross encoder, built from Hugging Face BERT parts.

A fusion layer is a BERT layer with a cross-attention block between its
self-attention and its feed-forward block: text tokens attend to each other
(bidirectionally), then to the image tokens. Hugging Face's own ``BertLayer``
only adds cross attention to *decoder* layers, whose self-attention is causal,
so the layer is assembled here from ``BertAttention``, ``BertIntermediate`` and
``BertOutput`` under ``BertLayer``'s parameter names; a pretrained BERT layer's
weights load into it (the cross attention starts from random weights).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, L) bool, True = attend -> (B, 1, 1, L) additive mask (0 or the dtype's minimum)."""
    return (~mask[:, None, None, :]).to(dtype) * torch.finfo(dtype).min


class FusionLayer(nn.Module):
    """Self-attention over text, cross-attention to image tokens, feed-forward; ``config``
    is a ``BertConfig`` whose ``is_decoder`` is ignored (self-attention is never causal)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.bert.modeling_bert import (
            BertAttention,
            BertIntermediate,
            BertOutput,
        )

        config = copy.deepcopy(config)
        config.is_decoder = False
        self.attention = BertAttention(config, is_causal=False)
        self.crossattention = BertAttention(config, is_causal=False, is_cross_attention=True)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, text: torch.Tensor, text_mask: torch.Tensor, image: torch.Tensor,
                image_mask: torch.Tensor) -> torch.Tensor:
        """text (B, L, H) with additive text_mask; image (B, N, H) with additive image_mask."""
        hidden, _ = self.attention(text, text_mask)
        hidden, _ = self.crossattention(hidden, None, encoder_hidden_states=image,
                                        encoder_attention_mask=image_mask)
        return self.output(self.intermediate(hidden), hidden)


class FusionEncoder(nn.Module):
    """A stack of :class:`FusionLayer`; ``init_from``: BERT layers whose self-attention and
    feed-forward weights initialise them, one for one."""

    def __init__(self, config, num_layers: int, init_from: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(FusionLayer(config) for _ in range(num_layers))
        self.grad_checkpointing = False
        for fusion, bert in zip(self.layer, init_from or []):
            missing, unexpected = fusion.load_state_dict(bert.state_dict(), strict=False)
            if unexpected or any(not k.startswith("crossattention.") for k in missing):
                raise ValueError(f"cannot initialise a fusion layer from {type(bert).__name__}: "
                                 f"missing {missing}, unexpected {unexpected}")

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each layer's activations in the backward instead of storing them."""
        self.grad_checkpointing = enable

    def forward(self, text: torch.Tensor, text_mask: torch.Tensor, image: torch.Tensor,
                image_mask: torch.Tensor) -> torch.Tensor:
        """text (B, L, H), text_mask (B, L) bool, image (B, N, H), image_mask (B, N) bool."""
        text_add = additive_mask(text_mask, text.dtype)
        image_add = additive_mask(image_mask, text.dtype)
        recompute = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layer:
            if recompute:
                text = checkpoint(layer, text, text_add, image, image_add, use_reentrant=False)
            else:
                text = layer(text, text_add, image, image_add)
        return text
