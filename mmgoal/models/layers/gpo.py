"""Set poolers over padded token features: mean, max and GPO, the Generalized Pooling
Operator of VSE-infinity (Chen et al., CVPR 2021; docs/reference/dual_encoders.md, after
the authors' ``lib/modules/aggr/gpo.py``).

Every pooler maps ``features (B, L, D)`` padded and ``lengths (B,)`` to
``(pooled (B, D), weights (B, L) or None)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mmgoal.config import PositiveInt
from mmgoal.registry import POOLERS
from mmgoal.sequences import length_mask


def sinusoidal_positions(length: int, dim: int,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """(length, dim) sine (even channels) / cosine (odd channels) encoding of 0..length-1."""
    position = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device)
                          * -(math.log(10000.0) / dim))
    encoding = torch.zeros(length, dim, device=device)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)
    return encoding


def sorted_weighted_sum(features: torch.Tensor, lengths: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """(B, D) ``sum_k weights[:, k] * sorted_k``: every channel of ``features`` (B, L, D)
    sorted over the real tokens (descending), ``weights`` (B, L); padding counts 0."""
    mask = length_mask(lengths, features.shape[1])[..., None]
    ordered = features.masked_fill(~mask, -math.inf).sort(dim=1, descending=True).values
    ordered = ordered.masked_fill(~mask, 0.0)
    return (ordered * weights[..., None].to(ordered.dtype)).sum(1)


@POOLERS.register()
class MeanPool(nn.Module):
    """Mean over the real tokens."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, features: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        weights = length_mask(lengths, features.shape[1]).to(features.dtype)
        weights = weights / lengths[:, None].clamp(min=1).to(features.dtype)
        return (features * weights[..., None]).sum(1), weights


@POOLERS.register()
class MaxPool(nn.Module):
    """Channel-wise maximum over the real tokens (GPO with all weight on k = 1)."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, features: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, None]:
        mask = length_mask(lengths, features.shape[1])[..., None]
        return features.masked_fill(~mask, -math.inf).amax(1), None


@POOLERS.register()
class GPO(nn.Module):
    """Generalized Pooling Operator (docs/reference/dual_encoders.md, "GPO"): weights from
    the set size alone, through a GRU over position encodings (``d_pe``, ``d_hidden``) and
    a softmax at ``temperature``, on every channel's values sorted in descending order."""

    def __init__(self, d_pe: PositiveInt = 32, d_hidden: PositiveInt = 32,
                 temperature: float = 0.1) -> None:
        super().__init__()
        if d_pe % 2:
            raise ValueError(f"GPO d_pe must be even (sine/cosine pairs), got {d_pe}")
        self.d_pe = d_pe
        self.temperature = temperature
        self.gru = nn.GRU(d_pe, d_hidden, batch_first=True, bidirectional=True)
        self.linear = nn.Linear(d_hidden, 1, bias=False)

    def pool_weights(self, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
        """(B,) lengths -> (B, max_length) weights, summing to 1 over the real positions."""
        encoding = sinusoidal_positions(max_length, self.d_pe, lengths.device)
        encoding = encoding.expand(len(lengths), -1, -1)
        packed = pack_padded_sequence(encoding, lengths.cpu().clamp(min=1), batch_first=True,
                                      enforce_sorted=False)
        states, _ = self.gru(packed)
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=max_length)
        forward, backward = states.chunk(2, dim=-1)
        scores = self.linear((forward + backward) / 2).squeeze(-1)
        scores = scores.masked_fill(~length_mask(lengths, max_length), -math.inf)
        return torch.softmax(scores / self.temperature, dim=1)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D), (B,) -> pooled (B, D), weights (B, L)."""
        weights = self.pool_weights(lengths, features.shape[1])
        return sorted_weighted_sum(features, lengths, weights), weights
