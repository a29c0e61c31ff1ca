"""Retrieval metrics (docs/reference/retrieval.md): Recall@K, median/mean rank, rsum, COCO folds;
and their text forms (a log line, a table) that the trainer and the tools print."""

from __future__ import annotations

import math

import torch

RECALL_KS = (1, 5, 10)
# the retrieval metrics where higher is better (the ranks, *_medr and *_meanr, are not)
RECALLS = (*(f"{d}_r{k}" for d in ("i2t", "t2i") for k in RECALL_KS), "rsum")
_ROW_BLOCK = 1024


def _ranks(sims: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """(n_queries,) 0-based rank of each row's best positive among its negatives; ties
    count against the query. sims: (n_queries, n_items); positives: the same, bool."""
    ranks = []
    for start in range(0, sims.shape[0], _ROW_BLOCK):
        block = sims[start:start + _ROW_BLOCK]
        pos = positives[start:start + _ROW_BLOCK]
        best = block.masked_fill(~pos, float("-inf")).amax(dim=1, keepdim=True)
        ranks.append(((block >= best) & ~pos).sum(dim=1))
    return torch.cat(ranks)


def _summary(ranks: torch.Tensor, prefix: str) -> dict[str, float]:
    ranks = ranks.double()
    out = {f"{prefix}_r{k}": 100.0 * (ranks < k).double().mean().item() for k in RECALL_KS}
    # VSE++/SCAN convention: floor(numpy-style median of the 0-based ranks) + 1.
    out[f"{prefix}_medr"] = math.floor(ranks.quantile(0.5).item()) + 1.0
    out[f"{prefix}_meanr"] = ranks.mean().item() + 1.0
    return out


def _single_fold(sims: torch.Tensor, text_to_image: torch.Tensor,
                 sims_t2i: torch.Tensor) -> dict[str, float]:
    n_images, _ = sims.shape
    positives = torch.arange(n_images, device=sims.device)[:, None] == text_to_image[None, :]
    if not positives.any(dim=1).all():
        missing = (~positives.any(dim=1)).nonzero().flatten()[:5].tolist()
        raise ValueError(f"images {missing} have no caption in text_to_image; every image "
                         f"needs at least one")
    metrics = _summary(_ranks(sims, positives), "i2t")
    metrics.update(_summary(_ranks(sims_t2i.T, positives.T), "t2i"))
    metrics["rsum"] = sum(metrics[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_KS)
    return metrics


def retrieval_metrics(sims: torch.Tensor, text_to_image, folds: int = 1,
                      sims_t2i: torch.Tensor | None = None) -> dict[str, float]:
    """Both directions' Recall@K, median/mean rank and rsum of ``sims`` (n_images, n_texts),
    given the (n_texts,) image index of each text; keys and rules:
    docs/reference/retrieval.md, "Metrics".

    Args:
        folds: 5 averages over five consecutive folds of images and their texts (COCO 1K).
        sims_t2i: a separate text-to-image matrix (ITM re-ranking); ``sims`` is then i2t's.
    """
    # Ranks are counted where the scores are (a GPU's gallery stays there).
    device = sims.device if isinstance(sims, torch.Tensor) else torch.device("cpu")
    sims = torch.as_tensor(sims, device=device).detach().float()
    sims_t2i = (sims if sims_t2i is None else
                torch.as_tensor(sims_t2i, device=device).detach().float())
    if sims_t2i.shape != sims.shape:
        raise ValueError(f"sims_t2i must have the shape of sims {tuple(sims.shape)}, got "
                         f"{tuple(sims_t2i.shape)}")
    text_to_image = torch.as_tensor(text_to_image, dtype=torch.long, device=device)
    if sims.ndim != 2 or text_to_image.shape != (sims.shape[1],):
        raise ValueError(f"sims must be (n_images, n_texts) and text_to_image (n_texts,); got "
                         f"{tuple(sims.shape)} and {tuple(text_to_image.shape)}")
    if not (torch.isfinite(sims).all() and torch.isfinite(sims_t2i).all()):
        raise ValueError("sims holds NaN or inf scores; check the model's outputs")
    n_images = sims.shape[0]
    if text_to_image.min() < 0 or text_to_image.max() >= n_images:
        raise ValueError(f"text_to_image must index images 0..{n_images - 1}")
    if folds < 1 or n_images % folds:
        raise ValueError(f"cannot split {n_images} images into {folds} equal folds")
    size = n_images // folds
    per_fold = []
    for fold in range(folds):
        texts = ((text_to_image >= fold * size) & (text_to_image < (fold + 1) * size)).nonzero()
        texts = texts.flatten()
        rows = slice(fold * size, (fold + 1) * size)
        per_fold.append(_single_fold(sims[rows, texts], text_to_image[texts] - fold * size,
                                     sims_t2i[rows, texts]))
    return {key: sum(m[key] for m in per_fold) / folds for key in per_fold[0]}


def format_metrics(metrics: dict[str, float]) -> str:
    """One line: R@1/5/10 both ways and rsum (and the zero-shot top-1 where there is one)."""
    return " ".join(f"{k}={metrics[k]:.1f}" for k in
                    ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum",
                     "zeroshot_top1") if k in metrics)


def metrics_table(metrics: dict[str, float]) -> str:
    """A small text table of retrieval metrics."""
    rows = [f"{'':>6} {'R@1':>7} {'R@5':>7} {'R@10':>7} {'medr':>6} {'meanr':>7}"]
    for direction, name in (("i2t", "i2t"), ("t2i", "t2i")):
        rows.append(f"{name:>6} " + " ".join(
            f"{metrics[f'{direction}_r{k}']:>7.2f}" for k in (1, 5, 10))
            + f" {metrics[f'{direction}_medr']:>6.0f} {metrics[f'{direction}_meanr']:>7.2f}")
    rows.append(f"  rsum {metrics['rsum']:.2f}")
    return "\n".join(rows + protocol_rows(metrics))


# protocol -> its title and (metric key, column header) (mmgoal/evaluation/protocols.py)
PROTOCOL_COLUMNS = {
    "eccv": ("ECCV Caption", (("map_at_r", "mAP@R"), ("rprecision", "R-P"), ("r1", "R@1"))),
    "cxc": ("CxC", (("r1", "R@1"), ("r5", "R@5"), ("r10", "R@10"))),
    "pm": ("PM-COCO", (("rprecision", "PMRP"),)),
}


def protocol_rows(metrics: dict[str, float]) -> list[str]:
    """The table rows of the extended COCO protocols in ``metrics`` (none when absent)."""
    rows = []
    for protocol, (title, columns) in PROTOCOL_COLUMNS.items():
        if f"{protocol}_i2t_{columns[0][0]}" not in metrics:
            continue
        rows.append(f"{title:>14} " + " ".join(f"{header:>7}" for _, header in columns))
        for direction in ("i2t", "t2i"):
            rows.append(f"{direction:>14} " + " ".join(
                f"{metrics[f'{protocol}_{direction}_{key}']:>7.2f}" for key, _ in columns))
    return rows
