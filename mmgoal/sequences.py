"""Padded sequences: masks from lengths, packing the kept elements to the front, and
corrupting tokens (the text augment's and masked language modelling's draw)."""

from __future__ import annotations

import torch


def length_mask(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """(B,) lengths -> (B, max_length) bool, True at real elements."""
    return torch.arange(max_length, device=lengths.device)[None] < lengths[:, None]


def pack_kept(values: torch.Tensor, keep: torch.Tensor,
              fill: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the kept elements of every row to its front, in their order; pad with ``fill``.

    ``values`` (B, L) or (B, L, D), ``keep`` (B, L) bool -> values (B, L') with L' the most
    elements any row keeps, lengths (B,).
    """
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    index = order if values.dim() == 2 else order[..., None].expand_as(values)
    lengths = keep.sum(1)
    packed = values.gather(1, index)[:, :int(lengths.max())]
    real = length_mask(lengths, packed.shape[1])
    return packed.masked_fill(~(real if values.dim() == 2 else real[..., None]), fill), lengths


def corrupt_tokens(tokens: torch.Tensor, lengths: torch.Tensor, special_ids: torch.Tensor,
                   vocab_size: int, mask_id: int, p: float, mask: float, replace: float,
                   generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick real, non-special tokens with probability ``p``; a picked token becomes
    ``mask_id`` with probability ``mask``, a random non-special token with probability
    ``replace``, and stays otherwise (BERT's MLM: p 0.15, 80% / 10% / 10%; VSE-infinity
    deletes the rest). ``tokens`` (B, L) -> (new ids, picked, masked, replaced), all (B, L).
    """
    batch, width = tokens.shape
    real = length_mask(lengths, width)
    device = tokens.device  # the data pipeline's CPU, or the device MLMLoss trains on
    picked = ((torch.rand(batch, width, generator=generator, device=device) < p) & real
              & ~torch.isin(tokens, special_ids))
    action = torch.rand(batch, width, generator=generator, device=device)
    masked = picked & (action < mask)
    replaced = picked & (action >= mask) & (action < mask + replace)
    random_ids = torch.randint(vocab_size, (batch, width), generator=generator, device=device)
    random_ids = torch.where(torch.isin(random_ids, special_ids), tokens, random_ids)
    out = torch.where(masked, mask_id, torch.where(replaced, random_ids, tokens))
    return out, picked, masked, replaced
