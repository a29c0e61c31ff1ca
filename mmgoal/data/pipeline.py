"""Streaming shards: a WebDataset pipeline built as an explicit list of stages.

Training: shard list -> seeded shard shuffle -> split by node -> split by worker
-> tar to samples -> seeded sample shuffle -> decode -> caption choice (one per
image) or expansion (one sample per caption) -> image transform -> tokenize and
batch. Evaluation reads the shards in order, one sample per image with all its
captions. Every stage that can meet bad data has a handler that logs the
problem, counts it and skips the sample; a corrupt sample never stops a run.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import braceexpand
import torch
import webdataset as wds
from PIL import Image

from mmgoal.registry import DATASETS

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


class CorruptSampleError(ValueError):
    """A sample that cannot be used (bad image, bad JSON, missing keys)."""


class SkipCounter:
    """Handler for WebDataset stages: logs and counts a bad sample, then continues.

    One counter lives in each worker process; ``take()`` hands the number of
    skips since the last call to the batch that carries it to the trainer.
    """

    def __init__(self, max_logged: int = 20) -> None:
        self.counts: Counter[str] = Counter()
        self.max_logged = max_logged
        self._pending = 0

    def __call__(self, error: Exception) -> bool:
        kind = type(error).__name__
        self.counts[kind] += 1
        self._pending += 1
        if sum(self.counts.values()) <= self.max_logged:
            logger.warning("skipped a bad sample (%s): %s", kind, error)
        return True

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def take(self) -> int:
        pending, self._pending = self._pending, 0
        return pending


def expand_shards(shards: str | Sequence[str]) -> list[str]:
    """Shard paths from brace patterns (``a-{000..009}.tar``), globs or lists.

    Raises:
        FileNotFoundError: a pattern matches no file, or a listed shard is missing.
    """
    patterns = [shards] if isinstance(shards, str) else list(shards)
    paths: list[str] = []
    for pattern in patterns:
        for expanded in braceexpand.braceexpand(str(pattern)):
            if any(c in expanded for c in "*?["):
                matches = sorted(glob.glob(expanded))
                if not matches:
                    raise FileNotFoundError(f"shard pattern {expanded!r} matches no file")
                paths.extend(matches)
            elif not Path(expanded).is_file():
                raise FileNotFoundError(
                    f"shard {expanded!r} does not exist (from {pattern!r}); generate the "
                    f"data first, e.g. python tools/make_synthetic.py --out data/synthetic"
                )
            else:
                paths.append(expanded)
    if not paths:
        raise FileNotFoundError(f"no shards given by {shards!r}")
    return paths


def decode_sample(sample: dict) -> dict:
    """Tar members -> ``{"key", "image": PIL RGB, "image_id", "captions", "meta"}``."""
    key = sample.get("__key__", "?")
    where = f"sample {key!r} of {sample.get('__url__', '?')}"
    if "json" not in sample:
        raise CorruptSampleError(f"{where} has no .json member")
    try:
        meta = json.loads(sample["json"])
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptSampleError(f"{where}: unreadable JSON ({error})") from error
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    if image_ext is None:
        raise CorruptSampleError(f"{where} has no image member ({', '.join(IMAGE_EXTENSIONS)})")
    try:
        image = Image.open(io.BytesIO(sample[image_ext]))
        image = image.convert("RGB")
    except Exception as error:  # PIL raises many types for broken files
        raise CorruptSampleError(f"{where}: unreadable image ({error})") from error
    captions = meta.get("captions")
    if not captions or not all(isinstance(c, str) for c in captions):
        raise CorruptSampleError(f"{where}: 'captions' must be a non-empty list of strings")
    return {"key": key, "image": image, "image_id": meta.get("image_id", key),
            "captions": captions, "meta": meta}


def choose_captions(samples: Iterator[dict], expand: bool, rng: random.Random) -> Iterator[dict]:
    """One sample per caption (``expand``) or per image with a random caption."""
    for sample in samples:
        if expand:
            for caption in sample["captions"]:
                yield {**sample, "caption": caption}
        else:
            yield {**sample, "caption": rng.choice(sample["captions"])}


def image_id_groups(image_ids: Sequence) -> torch.Tensor:
    """(B,) long: equal ids get equal numbers, so ``g[:, None] == g[None, :]`` marks positives."""
    numbering: dict = {}
    return torch.tensor([numbering.setdefault(i, len(numbering)) for i in image_ids],
                        dtype=torch.long)


def collate_batch(samples: list[dict], tokenizer: Callable, counter: SkipCounter) -> dict:
    """Samples -> batch: ``images (B,3,H,W)``, tokens, ``image_groups``, ids, captions."""
    batch = {
        "images": torch.stack([s["image"] for s in samples]),
        "image_ids": [s["image_id"] for s in samples],
        "image_groups": image_id_groups([s["image_id"] for s in samples]),
        "captions": [s["caption"] for s in samples],
        "skipped": counter.take(),
    }
    batch.update(tokenizer(batch["captions"]))
    return batch


def _shuffled(items: Iterator[dict], rng: random.Random) -> Iterator[dict]:
    items = list(items)
    rng.shuffle(items)
    yield from items


@DATASETS.register()
class ShardDataset(torch.utils.data.IterableDataset):
    """Batches streamed from WebDataset shards.

    Args:
        shards: brace pattern, glob or list of tar files.
        batch_size: samples per batch.
        tokenizer: turns captions into token ids (set by the trainer).
        transform: turns a PIL image into a tensor (set by the trainer).
        training: shuffle shards and samples (seeded by ``seed`` and the epoch)
            and drop the last partial batch.
        expand_captions: one sample per caption instead of one per image.
        shuffle_buffer: samples held for shuffling.
        seed: base seed of every random choice of the pipeline.
    """

    def __init__(self, shards: str | list[str], batch_size: int, tokenizer: Callable,
                 transform: Callable, training: bool = True, expand_captions: bool = False,
                 shuffle_buffer: int = 2000, seed: int = 0) -> None:
        super().__init__()
        self.urls = expand_shards(shards)
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.transform = transform
        self.training = training
        self.expand_captions = expand_captions
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.epoch = 0
        self.counter = SkipCounter()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose (reproducible) order the next iteration yields."""
        self.epoch = epoch

    def _rng(self, stage: int) -> random.Random:
        rank, world, worker, workers = wds.utils.pytorch_worker_info()
        return random.Random(f"{self.seed}-{self.epoch}-{stage}-{rank}-{worker}")

    def stages(self) -> list:
        """The pipeline, stage by stage (see the module docstring)."""
        handler = self.counter
        stages: list = [wds.SimpleShardList(self.urls)]
        if self.training:
            # The shard order must be the same on every rank and worker.
            order = random.Random(f"{self.seed}-{self.epoch}-shards")
            stages.append(lambda src: _shuffled(src, order))
        stages += [
            wds.split_by_node,
            wds.split_by_worker,
            wds.tarfile_to_samples(handler=handler),
        ]
        if self.training:
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer // 2,
                                      rng=self._rng(1)))
        stages += [
            wds.map(decode_sample, handler=handler),
            lambda src: choose_captions(src, self.expand_captions, self._rng(2)),
            wds.map(self._transform, handler=handler),
            wds.batched(self.batch_size, partial=not self.training,
                        collation_fn=lambda s: collate_batch(s, self.tokenizer, self.counter)),
        ]
        return stages

    def _transform(self, sample: dict) -> dict:
        return {**sample, "image": self.transform(sample["image"])}

    def __iter__(self) -> Iterator[dict]:
        return iter(wds.DataPipeline(*self.stages()))


def iter_eval_batches(shards: str | list[str], transform: Callable, batch_size: int,
                      counter: SkipCounter | None = None) -> Iterator[dict]:
    """Evaluation batches in shard order, one sample per image with all its captions.

    Yields:
        ``{"images": (B,3,H,W), "image_ids": [...], "captions": [[...], ...]}``.
    """
    counter = counter or SkipCounter()
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(expand_shards(shards)),
        wds.tarfile_to_samples(handler=counter),
        wds.map(decode_sample, handler=counter),
        wds.map(lambda s: {**s, "image": transform(s["image"])}, handler=counter),
        wds.batched(batch_size, partial=True, collation_fn=lambda samples: {
            "images": torch.stack([s["image"] for s in samples]),
            "image_ids": [s["image_id"] for s in samples],
            "captions": [s["captions"] for s in samples],
        }),
    )
    yield from pipeline


def read_captions(shards: str | list[str]) -> list[str]:
    """Every caption of the shards (used to fit word vocabularies); images are not decoded."""
    counter = SkipCounter()
    captions: list[str] = []
    for sample in wds.DataPipeline(
        wds.SimpleShardList(expand_shards(shards)),
        wds.tarfile_to_samples(handler=counter, select_files=lambda name: name.endswith(".json")),
    ):
        try:
            captions.extend(json.loads(sample["json"]).get("captions", []))
        except (KeyError, ValueError) as error:
            counter(CorruptSampleError(f"sample {sample.get('__key__')!r}: {error}"))
    return captions
