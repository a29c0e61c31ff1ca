"""Encoding a test gallery from shards and scoring it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from mmgoal.data.pipeline import SkipCounter, iter_eval_batches
from mmgoal.evaluation.retrieval import retrieval_metrics


@torch.no_grad()
def encode_gallery(model: torch.nn.Module, shards: str | list[str], transform: Callable,
                   tokenizer: Callable, batch_size: int = 256, progress: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Embed every image and caption of the shards, in shard order.

    Returns:
        image_embeddings: (n_images, D); text_embeddings: (n_texts, D);
        text_to_image: (n_texts,) image index of each caption; skipped: bad samples.
    """
    was_training = model.training
    model.eval()
    counter = SkipCounter()
    images: list[torch.Tensor] = []
    captions: list[str] = []
    text_to_image: list[int] = []
    n_images = 0
    for batch in tqdm(iter_eval_batches(shards, transform, batch_size, counter),
                      desc="encode images", unit="batch", disable=not progress, leave=False):
        images.append(model.encode_image(batch).embedding.float())
        for caption_list in batch["captions"]:
            captions += caption_list
            text_to_image += [n_images] * len(caption_list)
            n_images += 1
    if not images:
        raise ValueError(f"no readable sample in {shards!r} ({counter.total} skipped)")
    texts = []
    for start in tqdm(range(0, len(captions), batch_size), desc="encode texts", unit="batch",
                      disable=not progress, leave=False):
        texts.append(model.encode_text(tokenizer(captions[start:start + batch_size]))
                     .embedding.float())
    model.train(was_training)
    return torch.cat(images), torch.cat(texts), torch.tensor(text_to_image), counter.total


def evaluate_retrieval(model: torch.nn.Module, shards: str | list[str], transform: Callable,
                       tokenizer: Callable, batch_size: int = 256, folds: int = 1,
                       progress: bool = True) -> dict[str, float]:
    """Retrieval metrics of ``model`` on a gallery of shards (plus ``skipped`` samples)."""
    images, texts, text_to_image, skipped = encode_gallery(
        model, shards, transform, tokenizer, batch_size, progress)
    sims = images @ texts.T
    metrics = retrieval_metrics(sims, text_to_image, folds=folds)
    metrics["skipped"] = skipped
    return metrics
