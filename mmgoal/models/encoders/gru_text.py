"""Recurrent text encoder of VSE++ and SCAN."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mmgoal.config import PositiveInt
from mmgoal.registry import ENCODERS


@ENCODERS.register()
class GRUTextEncoder(nn.Module):
    """Word embedding (``word_dim`` 300 in VSE++/SCAN) -> (bi)GRU of ``hidden_size``, the
    output size; a bidirectional GRU's directions are averaged (SCAN). ``pooling``:
    ``last`` (the state after the last real word, VSE++) or ``mean`` over real words."""

    def __init__(self, tokenizer, word_dim: PositiveInt = 300, hidden_size: PositiveInt = 1024,
                 num_layers: PositiveInt = 1, bidirectional: bool = False,
                 pooling: Literal["last", "mean"] = "last") -> None:
        super().__init__()
        self.embedding = nn.Embedding(len(tokenizer), word_dim, padding_idx=tokenizer.pad_id)
        self.gru = nn.GRU(word_dim, hidden_size, num_layers, batch_first=True,
                          bidirectional=bidirectional)
        self.bidirectional = bidirectional
        self.pooling = pooling
        self.out_dim = hidden_size
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)

    def _run(self, tokens: torch.Tensor, lengths: torch.Tensor):
        packed = pack_padded_sequence(self.embedding(tokens), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        return self.gru(packed)

    def forward_tokens(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L) ids, (B,) lengths -> (B, L, hidden) word states (zeros at padding)."""
        states, _ = self._run(tokens, lengths)
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=tokens.shape[1])
        if self.bidirectional:
            states = sum(states.chunk(2, dim=-1)) / 2
        return states

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L) ids, (B,) lengths -> (B, hidden)."""
        if self.pooling == "mean":
            states = self.forward_tokens(tokens, lengths)
            return states.sum(1) / lengths[:, None].clamp(min=1).to(states.dtype)
        _, final = self._run(tokens, lengths)  # (layers * directions, B, hidden)
        # The final states of the last layer: after the last real word (forward) and
        # after the first word (backward).
        return final[-2:].mean(0) if self.bidirectional else final[-1]
