"""Encoding a test gallery from shards once, on the model's device, and scoring it in
memory-bounded blocks, so a cross-attention model never forms the images x captions x
regions x words tensor (docs/cross_attention.md, "Evaluation: blocks, ensembles";
docs/distributed.md, "Evaluation on every rank"). ``stop``, where taken, is polled between
batches and blocks and raises :class:`EvaluationStopped` (one process only).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mmgoal.config import MatmulPrecision, check_value
from mmgoal.console import progress_bar
from mmgoal.contract import MatchingModel, region_boxes, require, similarity_uses_tokens
from mmgoal.data.pipeline import EvalReader, SkipCounter, iter_eval_batches
from mmgoal.devices import (
    cache_share_mb,
    free_memory_mb,
    module_device,
    move_to_device,
    reuse_buffers,
)
from mmgoal.distributed import all_objects, gather_each, gather_rows, rank_share, world_info
from mmgoal.evaluation.protocols import protocol_metrics, protocol_rankings
from mmgoal.evaluation.rerank import itm_rerank
from mmgoal.evaluation.retrieval import retrieval_metrics
from mmgoal.runs.schema import ScoringConfig
from mmgoal.structures import (
    ImageFeatures,
    Member,
    TextFeatures,
    cat_features,
    detach_features,
    index_features,
    slice_features,
)

logger = logging.getLogger(__name__)

# The default bound of a block's working set: on the CPU, the process's share of the
# last-level cache (devices.cache_share_mb) within these bounds, CPU_BLOCK_MB where the
# system does not say (docs/results/performance.md, "Evaluation on 2 ranks")
CPU_BLOCK_BOUNDS_MB = (32.0, 1024.0)
CPU_BLOCK_MB = 128.0
GPU_FREE_SHARE = 0.5  # ... and on a GPU, this share of its free memory
# Tensors of the size of a block's query-key score array that the cross attention
# keeps alive at its peak (raw scores, clipped scores, attention, products).
_LIVE_COPIES = 6


class EvaluationStopped(BaseException):
    """The caller's ``stop`` ended an evaluation; nothing of it is kept. A BaseException,
    like KeyboardInterrupt, so ``except Exception`` lets the request through."""


def _stop_if_asked(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise EvaluationStopped("the evaluation was asked to stop and was dropped")


def in_eval_mode(encode: Callable) -> Callable:
    """``encode(model, ...)`` with ``model`` in eval mode; every module gets its own mode
    back however it ends (a stop, an error), so a validation leaves training as it was
    (frozen batch norms of a FreezeSchedule stay in eval mode)."""
    @functools.wraps(encode)
    def wrapper(model: torch.nn.Module, *args, **kwargs):
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            return encode(model, *args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training
    return wrapper


def encode_image_batches(model: torch.nn.Module, batches: Iterable[dict], desc: str,
                         progress: bool = True, stop: Callable[[], bool] | None = None,
                         total: int | None = None) -> Iterator[tuple[dict, ImageFeatures]]:
    """``(batch, its image features)`` of each batch, encoded on the model's device:
    evaluation's one image encoder, with a progress bar (of ``total`` where the caller
    knows it) and ``stop`` polled before each batch."""
    device = module_device(model)
    pinned = device.type == "cuda"  # the readers pin their batches for it
    with progress_bar(total=total, desc=desc, unit="image", show=progress, leave=False) as bar:
        for batch in batches:
            _stop_if_asked(stop)
            # the tensors only: walking the captions and entities costs more than the copy
            on_device = {key: value.to(device, non_blocking=pinned)
                         for key, value in batch.items() if isinstance(value, torch.Tensor)}
            features = model.encode_image(on_device)
            bar.update(len(features.embedding))
            yield batch, features


@dataclass
class Gallery:
    """The encoded gallery of a split, in shard order, each image id once.

    Attributes:
        text_to_image: (n_texts,) the image index of each caption.
        duplicates: samples whose image id an earlier sample had.
        caption_ids: COCO caption ids (``None`` where a shard has none: mmgoal.data.coco).
        entities, region_boxes: per image (``with_annotations``); boxes as xyxy fractions.
        image_rows: ``(start, end)`` when ``images`` holds only this rank's scoring rows
            (``image_share``), else ``None``.
    """

    images: ImageFeatures
    texts: TextFeatures
    text_to_image: torch.Tensor
    skipped: int
    duplicates: int = 0
    captions: list[str] = field(default_factory=list)
    image_ids: list = field(default_factory=list)
    caption_ids: list = field(default_factory=list)
    entities: list[list[dict]] = field(default_factory=list)
    region_boxes: list[torch.Tensor] = field(default_factory=list)
    image_rows: tuple[int, int] | None = None


def _keep_tokens(model: torch.nn.Module, features, keep: bool):
    """Tokens are stored only where the score, re-ranking or the attention metrics need them."""
    if similarity_uses_tokens(model) or keep:
        return detach_features(features)
    return type(features)(features.embedding.detach().float())


@in_eval_mode
@torch.no_grad()
def encode_gallery(model: torch.nn.Module, reader: EvalReader | str | Sequence[str],
                   transform: Callable, tokenizer: Callable, progress: bool = True,
                   with_annotations: bool = False, keep_tokens: bool = False,
                   across_ranks: bool = False, image_share: int | None = None,
                   stop: Callable[[], bool] | None = None) -> Gallery:
    """Encode every image and caption ``reader`` reads (an ``EvalReader``, or shards read
    with its defaults), in shard order, on the model's device; a repeated image id adds
    only its new captions (docs/data.md, "Duplicate images in an evaluation split").
    ``with_annotations`` keeps entities and boxes, ``keep_tokens`` every token (ITM).
    ``across_ranks`` (a collective): each rank encodes its share and gets one process's
    gallery, with ``image_share`` only its scoring rows.
    """
    reader = EvalReader.of(reader)
    device = module_device(model)
    rank, world = world_info() if across_ranks else (0, 1)
    counter = SkipCounter()
    boxes_of = region_boxes(model) if with_annotations else None
    keep = with_annotations or keep_tokens
    mine: list[dict] = []  # this rank's batches: their place, samples and region boxes
    encoded: list[ImageFeatures] = []
    # closed however the loop ends: its DataLoader workers end then, not when collected
    with contextlib.closing(iter_eval_batches(reader, transform, counter, part=(rank, world),
                                              pin_memory=device.type == "cuda",
                                              numbered=True)) as batches:
        for batch, features in encode_image_batches(model, batches, "encode images",
                                                    progress, stop):
            encoded.append(_keep_tokens(model, features, keep))
            boxes = [] if boxes_of is None else [b.float() for b in boxes_of(batch)]  # CPU's
            mine.append({"number": batch["number"], "image_ids": batch["image_ids"],
                         "captions": batch["captions"], "caption_ids": batch["caption_ids"],
                         "entities": batch["entities"], "boxes": boxes})
    images = cat_features(encoded) if encoded else None
    encoded.clear()  # the batches' copies: the concatenation holds them now
    if world > 1:  # every rank's batches, in the order of the one-process stream; the
        shares = all_objects((mine, counter.total))  # features stay until rows are chosen
        skipped = sum(total for _, total in shares)
        ordered = sorted((item for source, share in enumerate(shares)
                          for item in _with_offsets(share[0], source)),
                         key=lambda item: item[0]["number"])
    else:
        skipped = counter.total
        ordered = list(_with_offsets(mine, images))
    if not ordered:
        raise ValueError(f"no readable sample in {reader.shards!r} ({skipped} skipped)")
    gallery = Gallery(None, None, None, skipped)
    text_to_image: list[int] = []
    known: dict = {}  # image id -> (its index in the gallery, the set of its captions)
    kept = []  # (features or their rank, the rows of them the gallery keeps), in order
    for batch, features, offset in ordered:
        rows = _add_samples(gallery, batch, known, text_to_image)
        if rows:
            kept.append((features, [offset + row for row in rows]))
            gallery.region_boxes += [batch["boxes"][row] for row in rows if batch["boxes"]]
    if gallery.duplicates and rank == 0:  # every rank knows them: one says so
        logger.warning("%d samples repeat an image id of an earlier sample in %s; each image "
                       "is evaluated once, with the captions of its copies (check the shards "
                       "with mmgoal inspect-shards)", gallery.duplicates, reader.shards)
    if world > 1:  # each rank fetches the rows it keeps from the ranks that encoded them
        wanted = [(source, row) for source, rows in kept for row in rows]
        if image_share is not None:
            gallery.image_rows = rank_share(len(wanted), rank, world, image_share)
            wanted = wanted[slice(*gallery.image_rows)]
        gallery.images = gather_rows(images, wanted, device)
    elif not gallery.duplicates:  # one process, no repeated image: every row, as it is
        gallery.images = images
    else:
        gallery.images = cat_features([index_features(
            features, torch.tensor(rows, device=features.embedding.device))
            for features, rows in kept])
    gallery.texts = _encode_captions(model, tokenizer, gallery.captions, reader.batch_size,
                                     keep, progress, device, rank, world, stop)
    gallery.text_to_image = torch.tensor(text_to_image, device=device)
    return gallery


def _with_offsets(batches: list[dict], images: ImageFeatures | int | None):
    """``(batch, images, offset)``: each of a rank's batches with that rank's features (or
    its rank number) and the row where the batch's images start in them."""
    offset = 0
    for batch in batches:
        yield batch, images, offset
        offset += len(batch["image_ids"])


def _encode_captions(model: torch.nn.Module, tokenizer: Callable, captions: list[str],
                     batch_size: int, keep: bool, progress: bool, device: torch.device,
                     rank: int, world: int, stop: Callable[[], bool] | None) -> TextFeatures:
    """The captions' features; with several ranks each encodes a contiguous share of the
    batches (those one process forms) and every rank gets them all, in order."""
    share = captions[slice(*rank_share(len(captions), rank, world, batch_size))]
    texts = []
    with progress_bar(total=len(share), desc="encode texts", unit="caption", show=progress,
                      leave=False) as bar:
        for start in range(0, len(share), batch_size):
            _stop_if_asked(stop)
            chunk = share[start:start + batch_size]
            tokens = move_to_device(tokenizer(chunk), device)
            texts.append(_keep_tokens(model, model.encode_text(tokens), keep))
            bar.update(len(chunk))
    mine = cat_features(texts) if texts else None
    if world == 1:
        return mine
    return cat_features([part for part in gather_each(mine, device) if part is not None])


def _add_samples(gallery: Gallery, batch: dict, known: dict, text_to_image: list[int]
                 ) -> list[int]:
    """Add a batch's images and captions to the gallery; return the rows of its new images.
    A sample whose id is in ``known`` (id -> index, caption set) adds only new captions."""
    rows = []
    for row, (image_id, captions, caption_ids, entities) in enumerate(
            zip(batch["image_ids"], batch["captions"], batch["caption_ids"], batch["entities"])):
        ids = caption_ids or [None] * len(captions)
        if image_id in known:
            gallery.duplicates += 1
            image, own = known[image_id]
            first: dict = {}  # each text once, with its first caption id
            for caption, caption_id in zip(captions, ids):
                first.setdefault(caption, caption_id)
            new = [c for c in first if c not in own]
            ids = [first[c] for c in new]
            own.update(new)
        else:
            rows.append(row)
            image, new = len(gallery.image_ids), captions
            known[image_id] = (image, set(captions))
            gallery.image_ids.append(image_id)
            gallery.entities.append(entities)
        gallery.captions += new
        gallery.caption_ids += ids
        text_to_image += [image] * len(new)
    return rows


def block_budget_mb(device: torch.device, max_block_mb: float | None = None) -> float:
    """The memory bound of one scoring block in MiB: ``max_block_mb``, else half a GPU's free
    memory or the process's share of the CPU's last-level cache (CPU_BLOCK_BOUNDS_MB)."""
    if max_block_mb is not None:
        return float(max_block_mb)
    free = free_memory_mb(device)
    if free is not None:
        return GPU_FREE_SHARE * free
    cache = cache_share_mb()
    low, high = CPU_BLOCK_BOUNDS_MB
    return CPU_BLOCK_MB if cache is None else min(max(cache, low), high)


def block_sizes(n_images: int, n_texts: int, image_fragments: int, text_fragments: int,
                block_images: int = 128, max_block_mb: float = CPU_BLOCK_MB) -> tuple[int, int]:
    """Images and texts per scoring block so that its working set, about
    ``6 * bi * bt * R * W`` floats (R, W: fragments per image/text), fits the bound."""
    budget = max_block_mb * 2**20 / (4 * _LIVE_COPIES)
    per_pair = max(image_fragments, 1) * max(text_fragments, 1)
    bi = max(min(block_images, n_images), 1)
    bt = int(budget // (bi * per_pair))
    if bt < 1:  # even one text per block is too much: fewer images
        bi = max(int(budget // per_pair), 1)
        bt = 1
    return bi, max(min(bt, n_texts), 1)


@torch.no_grad()
def score_gallery(model: torch.nn.Module, images: ImageFeatures, texts: TextFeatures,
                  block_images: int = 128, max_block_mb: float | None = None,
                  progress: bool = True, matmul_precision: MatmulPrecision = "highest",
                  across_ranks: bool = False, image_rows: tuple[int, int] | None = None,
                  stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """(n_images, n_texts) scores from ``model.similarity`` on memory-bounded blocks, on
    the features' device. ``across_ranks`` (a collective): each rank scores whole blocks,
    every rank gets the whole matrix (``image_rows``: ``images`` is already its share).
    ``matmul_precision`` ``medium``: bfloat16 products (scores differ by about 1e-3).
    """
    check_value("matmul_precision", matmul_precision, MatmulPrecision)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    rank, world = world_info() if across_ranks else (0, 1)
    try:
        with reuse_buffers():
            sims = _score_blocks(model, images, texts, block_images, max_block_mb, progress,
                                 rank, world, image_rows, stop)
    finally:
        torch.set_float32_matmul_precision(previous)
    return sims if world == 1 else torch.cat(gather_each(sims))


def _score_blocks(model: torch.nn.Module, images: ImageFeatures, texts: TextFeatures,
                  block_images: int, max_block_mb: float | None, progress: bool,
                  rank: int = 0, world: int = 1, image_rows: tuple[int, int] | None = None,
                  stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """The rows of rank ``rank``'s share of the image blocks (all of them in one process);
    where a block fits, each block is the one a single process scores."""
    n_texts = len(texts.embedding)
    device = images.embedding.device
    if image_rows is None:  # the whole gallery: this rank's rows of it
        first, last = rank_share(len(images.embedding), rank, world, block_images)
    else:  # already this rank's rows
        first, last = 0, len(images.embedding)
    image_fragments = images.tokens.shape[1] if images.tokens is not None else 1
    text_fragments = texts.tokens.shape[1] if texts.tokens is not None else 1
    bi, bt = block_sizes(max(last - first, 1), n_texts, image_fragments, text_fragments,
                         block_images, block_budget_mb(device, max_block_mb))
    sims = torch.empty(last - first, n_texts, device=device)
    blocks = math.ceil((last - first) / bi) * math.ceil(n_texts / bt)
    with progress_bar(total=blocks, desc="score gallery", unit="block", show=progress,
                      leave=False) as bar:
        for i in range(first, last, bi):
            image_block = slice_features(images, i, min(i + bi, last))
            for t in range(0, n_texts, bt):
                _stop_if_asked(stop)
                sims[i - first:i - first + bi, t:t + bt] = model.similarity(
                    image_block, slice_features(texts, t, t + bt)).float()
                bar.update(1)
    return sims


def gallery_similarity(members: Sequence[Member], reader: EvalReader | str | Sequence[str],
                       scoring: ScoringConfig | dict | None = None, progress: bool = True,
                       across_ranks: bool = False, stop: Callable[[], bool] | None = None
                       ) -> tuple[torch.Tensor, Gallery]:
    """The mean score matrix of the members (one member: its own) and the first's gallery
    of what ``reader`` reads (``across_ranks``: encoded and scored by every rank,
    :func:`encode_gallery`; ``stop``: polled as there and in :func:`score_gallery`)."""
    scoring = ScoringConfig.of(scoring)
    total, first = None, None
    for member in members:
        # across ranks, a cross-attention gallery stays spread over them unless the
        # re-ranking needs every image's tokens on every rank
        spread = (across_ranks and scoring.rerank_k <= 0
                  and similarity_uses_tokens(member.model))
        gallery = encode_gallery(member.model, reader, member.transform, member.tokenizer,
                                 progress, keep_tokens=scoring.rerank_k > 0,
                                 across_ranks=across_ranks,
                                 image_share=scoring.block_images if spread else None,
                                 stop=stop)
        sims = score_gallery(member.model, gallery.images, gallery.texts,
                             scoring.block_images, scoring.max_block_mb, progress,
                             scoring.matmul_precision, across_ranks, gallery.image_rows, stop)
        if first is None:
            first, total = gallery, sims
        else:
            if not torch.equal(gallery.text_to_image, first.text_to_image):
                raise ValueError("ensemble members read different galleries")
            total += sims
    return total / len(members), first


def evaluate_retrieval(model: torch.nn.Module | Sequence[Member],
                       reader: EvalReader | str | Sequence[str],
                       transform: Callable | None = None, tokenizer: Callable | None = None,
                       folds: int = 1, progress: bool = True,
                       scoring: ScoringConfig | dict | None = None, across_ranks: bool = False,
                       protocols: Sequence[str] | None = None, rankings: dict | None = None,
                       stop: Callable[[], bool] | None = None) -> dict[str, float]:
    """Retrieval metrics on the gallery ``reader`` reads (plus ``skipped`` samples).

    Args:
        model: a model (with ``transform`` and ``tokenizer``), or an ensemble: a list of
            :class:`Member` whose score matrices are averaged.
        scoring: with ``rerank_k`` > 0 the metrics are ITM re-ranked, ``itc_*`` the ITC's.
        across_ranks: a collective; every rank returns one process's metrics.
        protocols: default ``scoring.protocols`` (docs/reference/retrieval.md, "Protocols").
        rankings: receives every COCO test query's top items (``protocol_rankings``).
        stop: as in the module doc; not polled inside the ITM re-ranking.
    """
    scoring = ScoringConfig.of(scoring)
    members = [Member(model, transform, tokenizer)] if isinstance(model, torch.nn.Module) \
        else list(model)
    sims, gallery = gallery_similarity(members, reader, scoring, progress, across_ranks, stop)
    protocols = scoring.protocols if protocols is None else list(protocols)
    if scoring.rerank_k <= 0:
        metrics = retrieval_metrics(sims, gallery.text_to_image, folds=folds)
        metrics.update(_protocols(gallery, sims, None, protocols, scoring.pm_dir, rankings))
        metrics["skipped"] = gallery.skipped
        return metrics
    reranker = members[0].model
    if len(members) > 1:
        raise ValueError("evaluation.rerank_k re-ranks with one model's ITM head, not an "
                         "ensemble")
    require(reranker, MatchingModel, "evaluation.rerank_k (ITM re-ranking)")
    if folds > 1:
        raise ValueError("ITM re-ranking scores the whole gallery; use folds: 1")
    i2t, t2i = itm_rerank(reranker.eval(), gallery.images, gallery.texts, sims,
                          scoring.rerank_k, scoring.rerank_batch_size, progress,
                          across_ranks=across_ranks)
    metrics = retrieval_metrics(i2t, gallery.text_to_image, sims_t2i=t2i)
    metrics.update(_protocols(gallery, i2t, t2i, protocols, scoring.pm_dir, rankings))
    itc = retrieval_metrics(sims, gallery.text_to_image)
    metrics.update({f"itc_{key}": value for key, value in itc.items()})
    metrics["skipped"] = gallery.skipped
    return metrics


def _protocols(gallery: Gallery, sims: torch.Tensor, sims_t2i: torch.Tensor | None,
               protocols: Sequence[str], pm_dir: str | None, rankings: dict | None
               ) -> dict[str, float]:
    """The extended COCO protocols' metrics (none for ``[coco]``), and ``rankings`` filled."""
    ids = (gallery.image_ids, gallery.caption_ids, gallery.text_to_image.tolist())
    if rankings is not None:
        rankings.update(protocol_rankings(sims, *ids, protocols, pm_dir, sims_t2i))
    return protocol_metrics(sims, *ids, protocols, pm_dir, sims_t2i)
