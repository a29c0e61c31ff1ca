"""Top-k re-ranking of a gallery by a cross encoder's ITM head (X-VLM, ALBEF).

The ITC scores rank every candidate; the ``k`` best of each query are scored
again by ``match_logits`` (the "match" logit) and placed above every other
candidate, which keep their ITC order. Image-to-text and text-to-image each get
their own matrix, so the metrics come from :func:`retrieval_metrics` with
``sims_t2i``.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from mmgoal.structures import ImageFeatures, TextFeatures, index_features, slice_features


@torch.no_grad()
def itm_scores(model: torch.nn.Module, images: ImageFeatures, texts: TextFeatures,
               image_index: torch.Tensor, text_index: torch.Tensor, batch_size: int = 128,
               progress: bool = False, desc: str = "ITM") -> torch.Tensor:
    """The "match" logit of the pairs (image_index[p], text_index[p]), in batches."""
    scores = torch.empty(len(image_index), device=images.embedding.device)
    for start in tqdm(range(0, len(image_index), batch_size), desc=desc, unit="batch",
                      disable=not progress, leave=False):
        end = start + batch_size
        image_part = index_features(images, image_index[start:end])
        # The pairs' captions, their padding cut to the longest of them.
        text_part = slice_features(index_features(texts, text_index[start:end]), 0, batch_size)
        scores[start:end] = model.match_logits(image_part, text_part)[:, 1].float()
    return scores


def _place_above(itc: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 itm: torch.Tensor) -> torch.Tensor:
    """ITC scores shifted below every ITM score, the ITM scores at (rows, cols)."""
    out = itc.double() - (itc.max().double() - itm.min().double() + 1.0)
    out[rows, cols] = itm.double()
    return out


@torch.no_grad()
def itm_rerank(model: torch.nn.Module, images: ImageFeatures, texts: TextFeatures,
               itc: torch.Tensor, k: int, batch_size: int = 128, progress: bool = True,
               directions: tuple[str, ...] = ("i2t", "t2i")) -> tuple[torch.Tensor, ...]:
    """Re-rank the top ``k`` candidates of every query in each direction.

    Args:
        images, texts: gallery features with tokens (the fusion layers need them).
        itc: (n_images, n_texts) ITC scores.
        k: candidates per query (clipped to the gallery).
        directions: ``i2t`` (each image's top k texts re-scored) and/or ``t2i``
            (each text's top k images).

    Returns:
        one (n_images, n_texts) float64 matrix per direction, in order.
    """
    if k < 1:
        raise ValueError(f"re-ranking needs k >= 1, got {k}")
    n_images, n_texts = itc.shape
    out = []
    for direction in directions:
        if direction == "i2t":
            k_texts = min(k, n_texts)
            cols = itc.topk(k_texts, dim=1).indices.reshape(-1)  # (n_images * k)
            rows = torch.arange(n_images, device=itc.device).repeat_interleave(k_texts)
        elif direction == "t2i":
            k_images = min(k, n_images)
            rows = itc.T.topk(k_images, dim=1).indices.reshape(-1)  # (n_texts * k)
            cols = torch.arange(n_texts, device=itc.device).repeat_interleave(k_images)
        else:
            raise ValueError(f"a re-ranking direction is 'i2t' or 't2i', got {direction!r}")
        out.append(_place_above(itc, rows, cols, itm_scores(
            model, images, texts, rows, cols, batch_size, progress, f"ITM {direction}")))
    return tuple(out)
