"""Top-k re-ranking of a gallery by a cross encoder's ITM head (X-VLM, ALBEF): each
query's ``k`` best ITC candidates are scored by the "match" logit and placed above the
rest, which keep their ITC order; one matrix per direction (``sims_t2i`` of
:func:`retrieval_metrics`).
"""

from __future__ import annotations

import torch

from mmgoal.console import progress_bar
from mmgoal.distributed import gather_each, rank_share, world_info
from mmgoal.structures import ImageFeatures, TextFeatures, index_features, slice_features


@torch.no_grad()
def itm_scores(model: torch.nn.Module, images: ImageFeatures, texts: TextFeatures,
               image_index: torch.Tensor, text_index: torch.Tensor, batch_size: int = 128,
               progress: bool = False, desc: str = "ITM") -> torch.Tensor:
    """The "match" logit of the pairs (image_index[p], text_index[p]), in batches."""
    scores = torch.empty(len(image_index), device=images.embedding.device)
    for start in progress_bar(range(0, len(image_index), batch_size), desc=desc, unit="batch",
                              show=progress, leave=False):
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
               directions: tuple[str, ...] = ("i2t", "t2i"), across_ranks: bool = False
               ) -> tuple[torch.Tensor, ...]:
    """One (n_images, n_texts) float64 matrix per direction (``i2t``: each image's top
    ``k`` texts re-scored; ``t2i``: each text's top ``k`` images) from the ITC scores
    ``itc``; ``images``/``texts`` need their tokens. ``across_ranks`` (a collective):
    each rank re-scores a share of the pairs and every rank gets every matrix."""
    if k < 1:
        raise ValueError(f"re-ranking needs k >= 1, got {k}")
    n_images, n_texts = itc.shape
    out = []
    for direction in directions:
        if direction == "i2t":
            per_query = min(k, n_texts)
            cols = itc.topk(per_query, dim=1).indices.reshape(-1)  # (n_images * k)
            rows = torch.arange(n_images, device=itc.device).repeat_interleave(per_query)
        elif direction == "t2i":
            per_query = min(k, n_images)
            rows = itc.T.topk(per_query, dim=1).indices.reshape(-1)  # (n_texts * k)
            cols = torch.arange(n_texts, device=itc.device).repeat_interleave(per_query)
        else:
            raise ValueError(f"a re-ranking direction is 'i2t' or 't2i', got {direction!r}")
        out.append(_place_above(itc, rows, cols, _shared_itm_scores(
            model, images, texts, rows, cols, batch_size, progress, f"ITM {direction}",
            across_ranks)))
    return tuple(out)


def _shared_itm_scores(model: torch.nn.Module, images: ImageFeatures, texts: TextFeatures,
                       rows: torch.Tensor, cols: torch.Tensor, batch_size: int, progress: bool,
                       desc: str, across_ranks: bool) -> torch.Tensor:
    """:func:`itm_scores` of the pairs; with ``across_ranks`` each rank scores a contiguous
    share of their batches."""
    rank, world = world_info() if across_ranks else (0, 1)
    if world == 1:
        return itm_scores(model, images, texts, rows, cols, batch_size, progress, desc)
    start, end = rank_share(len(rows), rank, world, batch_size)  # the batches of one process
    mine = itm_scores(model, images, texts, rows[start:end], cols[start:end], batch_size,
                      progress, desc)
    return torch.cat(gather_each(mine))
