"""SCAN's stacked cross attention (Lee et al., ECCV 2018; steps 1-4 of
docs/reference/scan.md), batched over all pairs.

:func:`scan_similarity` scores every (image, text) pair of two blocks without forming
the attended vectors: ``query_q . att_q = sum_k a[q, k] s_raw[q, k]`` and ``|att_q|^2 =
a_q G a_q^T`` with ``G`` the key item's Gram matrix, so the heavy work is one matrix
product of all queries with all keys.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Literal

import torch
import torch.nn.functional as F

from mmgoal.config import check_value
from mmgoal.devices import work_buffer
from mmgoal.structures import Attention

Direction = Literal["t2i", "i2t"]  # words attend to regions, or regions to words
Pooling = Literal["avg", "lse"]  # of the query fragments' relevances
EPS = 1e-8
# exp(2 * lambda) must stay far from float32's limit in |att|^2 without a max shift.
_NO_MAX_SHIFT_BELOW = 20.0


def _check(direction: Direction, pooling: Pooling) -> None:
    check_value("direction", direction, Direction)
    check_value("pooling", pooling, Pooling)


def clipped_l2_scores(raw: torch.Tensor, query_mask: torch.Tensor, query_dim: int) -> torch.Tensor:
    """LeakyReLU(0.1) then L2 normalisation over ``raw``'s ``query_dim`` axis, padded
    queries (``query_mask``, broadcastable to ``raw``) excluded."""
    scores = F.leaky_relu(raw, 0.1) * query_mask
    # norm() has a zero gradient at zero (a padded key), where sqrt(sum of squares) has NaN.
    return scores / (scores.norm(dim=query_dim, keepdim=True) + EPS)


def _pool(relevance: torch.Tensor, query_mask: torch.Tensor, pooling: Pooling,
          lambda_lse: float) -> torch.Tensor:
    """Pool relevance (n_key_items, n_query_items, Q) over its last (query) axis."""
    mask = query_mask[None]
    if pooling == "avg":
        return relevance.masked_fill(~mask, 0).sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.logsumexp((lambda_lse * relevance).masked_fill(~mask, float("-inf")),
                           dim=-1) / lambda_lse


def _attend_all_pairs(queries: torch.Tensor, query_mask: torch.Tensor, keys: torch.Tensor,
                      key_mask: torch.Tensor, lambda_softmax: float, pooling: Pooling,
                      lambda_lse: float) -> torch.Tensor:
    """(Nq, Q, D) query items x (Nk, K, D) key items -> (Nk, Nq) pooled relevance.

    Layout (Nk, K, Nq, Q): one matrix product gives it contiguous, the softmax
    runs over K, and the Gram term is one batched product per key item. Without
    autograd (evaluation) the same steps run in place, which saves most of the
    memory traffic of the large (Nk, K, Nq, Q) arrays.
    """
    n_q, q_len, dim = queries.shape
    n_k, k_len, _ = keys.shape
    shape = (n_k, k_len, n_q, q_len)
    in_place = not (torch.is_grad_enabled() and (queries.requires_grad or keys.requires_grad))
    raw = torch.mm(keys.reshape(n_k * k_len, dim), queries.reshape(n_q * q_len, dim).T,
                   out=work_buffer("raw", (n_k * k_len, n_q * q_len), keys, in_place)).view(shape)
    gram = keys @ keys.transpose(1, 2)  # (Nk, K, K)
    query_norm = queries.norm(dim=-1)[None]
    all_queries, all_keys = bool(query_mask.all()), bool(key_mask.all())
    if not in_place:
        scores = F.leaky_relu(raw, 0.1)
        if not all_queries:
            scores = scores * query_mask
        # Clipped L2 norm over the queries and the softmax's lambda in one scaling.
        logits = scores * (lambda_softmax / (scores.norm(dim=-1, keepdim=True) + EPS))
        if not all_keys:
            logits = logits.masked_fill(~key_mask[:, :, None, None], float("-inf"))
        attention = torch.softmax(logits, dim=1)  # over the keys
        # query . attended = sum_k a s_raw;  |attended|^2 = a G a^T.
        dot = (attention * raw).sum(1)  # (Nk, Nq, Q)
        quad = (torch.bmm(gram, attention.reshape(n_k, k_len, n_q * q_len))
                .view(n_k, k_len, n_q, q_len) * attention).sum(1)
        relevance = dot / (query_norm * quad.clamp(min=EPS**2).sqrt()).clamp(min=EPS)
        return _pool(relevance, query_mask, pooling, lambda_lse)
    buffer = work_buffer("attention", shape, raw, in_place)
    attention = F.leaky_relu(raw, 0.1) if buffer is None else \
        torch.ops.aten.leaky_relu.out(raw, 0.1, out=buffer)
    if not all_queries:
        attention.mul_(query_mask)
    attention.mul_(attention.norm(dim=-1, keepdim=True).add_(EPS).reciprocal_()
                   .mul_(lambda_softmax))
    # The relevance is invariant to the attention's scale (the softmax's sum cancels
    # between e.att and |att|), so the softmax is left unnormalised; the clipped scores
    # lie in [-1, 1], so exp(lambda * score) cannot overflow for moderate lambdas.
    if not all_keys:
        attention.masked_fill_(~key_mask[:, :, None, None], float("-inf"))
    if lambda_softmax > _NO_MAX_SHIFT_BELOW:
        attention.sub_(attention.amax(1, keepdim=True))
    attention.exp_()
    quad = torch.bmm(gram, attention.view(n_k, k_len, n_q * q_len),
                     out=work_buffer("quad", (n_k, k_len, n_q * q_len), raw, in_place)).view(shape)
    quad = quad.mul_(attention).sum(1)
    dot = raw.mul_(attention).sum(1)
    relevance = dot.div_((query_norm * quad.clamp_(min=EPS**2).sqrt_()).clamp_(min=EPS))
    return _pool(relevance, query_mask, pooling, lambda_lse)


def full_precision(device: torch.device) -> AbstractContextManager:
    """Autocast off: SCAN divides by norms down to ``EPS`` (1e-8), which float16 cannot
    hold, so its cross attention runs in float32 also in bf16/fp16 training (on GPUs
    the products still use TF32 under ``train.matmul_precision: high``)."""
    return torch.autocast(device.type, enabled=False)


def at_least_float32(features: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 features as float32; float32 and float64 as they are."""
    return features.float() if features.dtype in (torch.float16, torch.bfloat16) else features


def scan_similarity(regions: torch.Tensor, region_mask: torch.Tensor, words: torch.Tensor,
                    word_mask: torch.Tensor, direction: Direction = "t2i",
                    lambda_softmax: float = 9.0, pooling: Pooling = "avg",
                    lambda_lse: float = 6.0) -> torch.Tensor:
    """(n_img, n_txt) SCAN scores of ``regions`` (n_img, R, D) against ``words`` (n_txt, W,
    D), both L2-normalised, with bool masks (True: real); ``lambda_softmax`` is the
    attention's inverse temperature, ``lambda_lse`` the LSE pooling's sharpness."""
    _check(direction, pooling)
    region_mask, word_mask = region_mask.bool(), word_mask.bool()
    with full_precision(regions.device):
        regions, words = at_least_float32(regions), at_least_float32(words)
        if direction == "t2i":
            return _attend_all_pairs(words, word_mask, regions, region_mask, lambda_softmax,
                                     pooling, lambda_lse)
        return _attend_all_pairs(regions, region_mask, words, word_mask, lambda_softmax,
                                 pooling, lambda_lse).T


def scan_pair_similarity(regions: torch.Tensor, region_mask: torch.Tensor, words: torch.Tensor,
                         word_mask: torch.Tensor, direction: Direction = "t2i",
                         lambda_softmax: float = 9.0, pooling: Pooling = "avg",
                         lambda_lse: float = 6.0) -> torch.Tensor:
    """(B,) SCAN scores of aligned pairs, ``regions[b]`` with ``words[b]``: the diagonal of
    :func:`scan_similarity` for those pairs alone (score tiles' O(n) chosen pairs)."""
    _check(direction, pooling)
    if regions.shape[0] != words.shape[0]:
        raise ValueError(f"aligned pairs need as many images as texts, got "
                         f"{regions.shape[0]} and {words.shape[0]}")
    region_mask, word_mask = region_mask.bool(), word_mask.bool()
    with full_precision(regions.device):
        regions, words = at_least_float32(regions), at_least_float32(words)
        if direction == "t2i":
            queries, query_mask, keys, key_mask = words, word_mask, regions, region_mask
        else:
            queries, query_mask, keys, key_mask = regions, region_mask, words, word_mask
        raw = keys @ queries.transpose(1, 2)  # (B, K, Q)
        scores = F.leaky_relu(raw, 0.1) * query_mask[:, None, :]
        logits = scores * (lambda_softmax / (scores.norm(dim=-1, keepdim=True) + EPS))
        logits = logits.masked_fill(~key_mask[:, :, None], float("-inf"))
        attention = torch.softmax(logits, dim=1)  # over the keys
        dot = (attention * raw).sum(1)  # (B, Q)
        quad = ((keys @ keys.transpose(1, 2)) @ attention * attention).sum(1)
        relevance = dot / (queries.norm(dim=-1) * quad.clamp(min=EPS**2).sqrt()).clamp(min=EPS)
        if pooling == "avg":
            return relevance.masked_fill(~query_mask, 0).sum(-1) / query_mask.sum(-1).clamp(min=1)
        return torch.logsumexp((lambda_lse * relevance).masked_fill(~query_mask, float("-inf")),
                               dim=-1) / lambda_lse


def scan_attention(regions: torch.Tensor, region_mask: torch.Tensor, words: torch.Tensor,
                   word_mask: torch.Tensor, direction: Direction = "t2i",
                   lambda_softmax: float = 9.0) -> Attention:
    """SCAN attention of matched pairs: ``regions[b]`` with ``words[b]`` (arguments as
    :func:`scan_similarity`'s)."""
    _check(direction, "avg")
    if regions.shape[0] != words.shape[0]:
        raise ValueError(f"matched pairs need as many images as texts, got "
                         f"{regions.shape[0]} and {words.shape[0]}")
    region_mask, word_mask = region_mask.bool(), word_mask.bool()
    regions, words = at_least_float32(regions), at_least_float32(words)
    if direction == "t2i":
        queries, query_mask, keys, key_mask = words, word_mask, regions, region_mask
    else:
        queries, query_mask, keys, key_mask = regions, region_mask, words, word_mask
    with full_precision(regions.device):
        raw = queries @ keys.transpose(1, 2)
        scores = clipped_l2_scores(raw, query_mask[:, :, None], query_dim=1)
        logits = (lambda_softmax * scores).masked_fill(~key_mask[:, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1)
    return Attention(queries, keys, weights, scores, query_mask, key_mask, direction,
                     lambda_softmax)
