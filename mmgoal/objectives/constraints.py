"""CCR and CCS attention constraints ("More Than Just Attention: Improving Cross-Modal
Attentions with Contrastive Constraints for Image-Text Matching"; formulas and ``reverse``:
docs/reference/scan.md), on the :class:`~mmgoal.structures.Attention` of matched pairs of
any model whose ``attention`` returns one; one query fragment is sampled per pair.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.objectives.hard_negative import Reduction
from mmgoal.objectives.mining import draw_one_per_row
from mmgoal.registry import CONSTRAINTS
from mmgoal.structures import Attention

# the weights of what an attention ignored (docs/reference/scan.md)
Reverse = Literal["complement", "negated_softmax"]


def sample_fragments(mask: torch.Tensor, generator: torch.Generator | None = None,
                     exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One uniformly sampled real fragment per row of ``mask`` (B, L), never ``exclude``
    (B,): index (B,) and valid (B,), False where a row has nothing to draw."""
    allowed = mask.clone()
    if exclude is not None:
        allowed[torch.arange(len(mask), device=mask.device), exclude] = False
    valid = allowed.any(1)
    probs = allowed.float() + (~valid)[:, None].float()  # rows with nothing: any index
    return draw_one_per_row(probs, generator), valid


def reversed_weights(attention: Attention, kind: Reverse, lambda_softmax: float | None = None
                     ) -> torch.Tensor:
    """(B, Q, K) weights on what the attention ignores, zero on padded keys."""
    key_mask = attention.key_mask[:, None, :]
    if kind == "complement":
        weights = (1 - attention.weights) * key_mask
        return weights / weights.sum(-1, keepdim=True).clamp(min=1e-8)
    lam = attention.lambda_softmax if lambda_softmax is None else lambda_softmax
    logits = (-lam * attention.scores).masked_fill(~key_mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


class _AttentionConstraint(nn.Module):
    name = ""

    def __init__(self, weight: float = 1.0, margin: float = 0.1,
                 reverse: Reverse = "complement", reverse_lambda: float | None = None,
                 reduction: Reduction = "sum") -> None:
        super().__init__()
        self.weight = weight
        self.margin = margin
        self.reverse = reverse
        self.reverse_lambda = reverse_lambda
        self.reduction = reduction

    def hinges(self, attention: Attention, query_index: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, attention: Attention, generator: torch.Generator | None = None
                ) -> dict[str, torch.Tensor]:
        """``{"<name>_loss": weight * reduced hinge, "<name>_active": fraction > 0}``."""
        query_index, valid = sample_fragments(attention.query_mask, generator)
        hinge, valid_pair = self.hinges(attention, query_index, generator)
        valid = valid & valid_pair
        hinge = hinge * valid
        total = hinge.sum()
        if self.reduction == "mean":
            total = total / valid.sum().clamp(min=1)
        active = ((hinge > 0) & valid).float().sum() / valid.sum().clamp(min=1)
        return {f"{self.name}_loss": self.weight * total, f"{self.name}_active": active.detach()}

    @staticmethod
    def _gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """values (B, L, ...) at index (B,) -> (B, ...)."""
        return values[torch.arange(len(index), device=values.device), index]


@CONSTRAINTS.register()
class CCRConstraint(_AttentionConstraint):
    """Contrastive Content Re-sourcing: ``[margin - cos(q, a) + cos(q, a^)]_+`` for one
    sampled query fragment per matched pair; ``weight`` is lambda_CCR, ``margin`` gamma_2,
    ``reverse_lambda`` the negated softmax's (default: the attention's lambda_softmax)."""

    name = "ccr"

    def hinges(self, attention, query_index, generator):
        query = self._gather(attention.queries, query_index)  # (B, D)
        weights = self._gather(attention.weights, query_index)  # (B, K)
        reverse = self._gather(reversed_weights(attention, self.reverse, self.reverse_lambda),
                               query_index)
        attended = torch.einsum("bk,bkd->bd", weights, attention.keys)
        ignored = torch.einsum("bk,bkd->bd", reverse, attention.keys)
        hinge = (self.margin - F.cosine_similarity(query, attended, dim=-1)
                 + F.cosine_similarity(query, ignored, dim=-1)).clamp(min=0)
        return hinge, torch.ones_like(hinge, dtype=torch.bool)


@CONSTRAINTS.register()
class CCSConstraint(_AttentionConstraint):
    """Contrastive Content Swapping: ``[margin - cos(a, q) + cos(a, q^)]_+``, ``q^`` another
    fragment of the query's own sentence or image, sampled uniformly (none: no term).
    Options as :class:`CCRConstraint`'s (lambda_CCS, gamma_3); ``reverse`` is unused."""

    name = "ccs"

    def hinges(self, attention, query_index, generator):
        sibling, has_sibling = sample_fragments(attention.query_mask, generator,
                                                exclude=query_index)
        query = self._gather(attention.queries, query_index)
        other = self._gather(attention.queries, sibling)
        weights = self._gather(attention.weights, query_index)
        attended = torch.einsum("bk,bkd->bd", weights, attention.keys)
        hinge = (self.margin - F.cosine_similarity(attended, query, dim=-1)
                 + F.cosine_similarity(attended, other, dim=-1)).clamp(min=0)
        return hinge, has_sibling
