"""Streaming shards: a WebDataset pipeline built as an explicit list of stages.

Training: endless seeded passes over the shards (or ``resampled`` draws) -> split by node
and worker -> tar to samples -> seeded shuffle -> decode -> one caption per image (or one
sample per caption) -> image transform -> tokenize and batch; the stream never runs dry
(docs/data.md, "What an epoch is"). Evaluation reads the shards in order, one sample per
image with all its captions. A bad sample is logged, counted and skipped.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds

from mmgoal.config import PositiveInt
from mmgoal.data.images import ImageDecodeError, decode_image
from mmgoal.data.remote import (
    RETRIES,
    TIMEOUT,
    expand_shards,
    is_remote,
    iter_samples,
    shard_sizes,
    tar_samples,
)
from mmgoal.data.tars import IMAGE_EXTENSIONS, MAX_SAMPLE_BYTES, ShardError, sample_keys
from mmgoal.files import open_regular
from mmgoal.registry import DATASETS, TEXT_AUGMENTS

logger = logging.getLogger(__name__)

# Draws that make a resampled reader's pass at least: one unreadable shard among few must
# not stop a run by being drawn a few times in a row (half unreadable: 1 pass in 65,536).
MIN_RESAMPLED_PASS = 16


class CorruptSampleError(ValueError):
    """A sample that cannot be used (bad image, bad JSON, missing keys)."""


class UnreadableShardsError(RuntimeError):
    """A training reader went through a whole pass of its shards without a readable sample."""


class IncompleteSplitError(ValueError):
    """An evaluation split with a shard that could not be read to its end (it failed, or its
    tar is damaged): metrics over part of its gallery would pass for the split's."""


class SkipCounter:
    """Handler for WebDataset stages: logs and counts a bad sample, then continues. One per
    worker process; ``take()`` hands the skips since its last call to the next batch."""

    def __init__(self, max_logged: int = 20) -> None:
        self.counts: Counter[str] = Counter()
        self.last: dict[str, str] = {}  # the latest message of each kind, for summary()
        self.max_logged = max_logged
        self._pending = 0

    def __call__(self, error: Exception) -> bool:
        kind = type(error).__name__
        self.counts[kind] += 1
        self.last[kind] = str(error)
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

    def add(self, skipped: int, kind: str) -> None:
        """Count ``skipped`` samples that another process skipped (and logged)."""
        if skipped:
            self.counts[kind] += skipped
            self.last.setdefault(kind, f"{skipped} sample(s) skipped in another process")

    def summary(self) -> str:
        """The skips by kind, each with its latest message (for error messages)."""
        kinds = "; ".join(f"{count} {kind}, the last: {self.last[kind]}"
                          for kind, count in self.counts.most_common())
        return f"{self.total} samples skipped" + (f": {kinds}" if kinds else "")


def whole_split(counter: SkipCounter) -> Callable[[Exception], bool]:
    """A handler for an evaluation split's reader: a bad sample is counted and skipped
    (``counter``), a shard that could not be read whole is an :class:`IncompleteSplitError`."""
    def handle(error: Exception) -> bool:
        if isinstance(error, ShardError):
            raise IncompleteSplitError(
                f"{error}. An evaluation reads its split whole: metrics over part of the "
                f"gallery would not be the split's, so none are given; repair or replace the "
                f"shard (mmgoal inspect-shards names what is wrong), or leave it out of the "
                f"split") from error
        return counter(error)

    return handle


def shuffle_within_passes(samples: Iterator[dict], size: int, rng: random.Random
                          ) -> Iterator[dict]:
    """``wds.shuffle``'s buffer of ``size`` samples, never mixing two passes
    (``exact_passes``): a sample with a new ``__pass__`` tag first empties the buffer."""
    buffer: list[dict] = []
    current = None
    samples = iter(samples)
    for sample in samples:
        if sample["__pass__"] != current:
            rng.shuffle(buffer)
            yield from buffer
            buffer.clear()
            current = sample["__pass__"]
        buffer.append(sample)
        if len(buffer) < size:  # filling: a second sample of the same pass, if there is one
            following = next(samples, None)
            if following is not None and following["__pass__"] == current:
                buffer.append(following)
            elif following is not None:  # the pass ended: this one starts the next
                rng.shuffle(buffer)
                yield from buffer
                buffer = [following]
                current = following["__pass__"]
        if len(buffer) >= size // 2:
            k = rng.randrange(len(buffer))
            buffer[k], buffer[-1] = buffer[-1], buffer[k]
            yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


class UnreadablePassCheck:
    """Stops a training reader after a whole pass of its shards without a sample decoded
    and transformed (sound tars of bad images would be read for ever). Samples carry their
    pass number, as the shuffle buffer may hold many passes. Stages: ``tag`` after the tar
    reader, ``settle`` after the shuffle, ``count_readable`` last.
    """

    def __init__(self, message: Callable[[], str]) -> None:
        self.message = message
        self.reading: int | None = None  # the pass whose shards are being read
        self.unsettled: Counter[int] = Counter()  # pass -> samples read, not yet decoded
        self.readable: set[int] = set()  # passes that gave a readable sample
        self.decoding: int | None = None  # the pass of the sample in the stages after settle

    def start_pass(self, number: int) -> None:
        ended, self.reading = self.reading, number
        if ended is not None:
            self._judge(ended)

    def tag(self, samples: Iterator[dict]) -> Iterator[dict]:
        for sample in samples:
            self.unsettled[self.reading] += 1
            sample["__pass__"] = self.reading
            yield sample

    def settle(self, samples: Iterator[dict]) -> Iterator[dict]:
        # Asked for a sample: the one before it went through every later stage.
        for sample in samples:
            if self.decoding is not None:
                done, self.decoding = self.decoding, None
                self.unsettled[done] -= 1
                self._judge(done)
            self.decoding = sample.pop("__pass__")
            yield sample

    def count_readable(self, samples: Iterator[dict]) -> Iterator[dict]:
        for sample in samples:
            self.readable.add(self.decoding)
            yield sample

    def _judge(self, number: int) -> None:
        """Forget pass ``number`` once it is over; raise if it gave no readable sample."""
        if number == self.reading or self.unsettled[number] > 0:
            return
        del self.unsettled[number]
        if number not in self.readable:
            raise UnreadableShardsError(self.message())
        self.readable.discard(number)


def shard_keys(url: str) -> frozenset[str]:
    """The sample keys of the local shard ``url``, from its tar headers (no member is read);
    a damaged shard's keys before the damage, with a warning. Read once per version of
    the file in a process (the trainer counts them, then compares the splits')."""
    stat = Path(url).stat()
    return _shard_keys(url, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _shard_keys(url: str, _mtime_ns: int, _size: int) -> frozenset[str]:
    return frozenset(sample_keys(url))


# Image keys a split-overlap warning shows; bytes compared at a time
SHOWN_KEYS = 5
CHUNK_BYTES = 1 << 20


def split_overlaps(train: Sequence[str], splits: dict[str, Sequence[str]]) -> list[str]:
    """Sentences naming what each evaluation split (name -> expanded shards) shares with the
    ``train`` shards: the same file or bytes, or sample keys; metrics over samples trained on
    are no test. Only local shards are compared (a remote one's keys are unknown unread)."""
    train = [url for url in train if not is_remote(url)]
    by_size: dict[int, list[str]] = {}
    for url in train:
        by_size.setdefault(Path(url).stat().st_size, []).append(url)
    train_keys = frozenset().union(*map(shard_keys, train)) if train else frozenset()
    found = []
    for name, urls in splits.items():
        local = []  # those that are not a training shard: their keys are compared
        for url in (url for url in urls if not is_remote(url)):
            same = next((other for other in by_size.get(Path(url).stat().st_size, [])
                         if _same_bytes(url, other)), None)
            if same is None:
                local.append(url)
            else:
                found.append(f"{name}'s shard {url} is the training shard {same}: its "
                             f"metrics measure samples the model trained on, not a test")
        shared = sorted(frozenset().union(*map(shard_keys, local)) & train_keys) \
            if local else []
        if shared:
            shown = ", ".join(shared[:SHOWN_KEYS]) + (" ..." if len(shared) > SHOWN_KEYS
                                                       else "")
            found.append(f"{name} shares {len(shared)} sample keys with the training split "
                         f"({shown}): metrics over samples trained on are no test; take them "
                         f"out of one of the splits")
    return found


def _same_bytes(a: str, b: str) -> bool:
    """Whether files ``a`` and ``b`` (of one size) are the same file or hold the same bytes."""
    if Path(a).samefile(b):
        return True
    with open_regular(a, "shard") as first, open_regular(b, "shard") as second:
        while True:
            chunk = first.read(CHUNK_BYTES)
            if chunk != second.read(CHUNK_BYTES):
                return False
            if not chunk:
                return True


def entity_boxes(meta: dict) -> list[list[float]]:
    """The distinct boxes of a sample's entities (xyxy pixels), in order of appearance."""
    boxes: list[list[float]] = []
    for entity in meta.get("entities") or []:
        for box in entity.get("boxes") or []:
            if list(box) not in boxes:
                boxes.append(list(box))
    return boxes


def _load_npy(data: bytes, where: str, name: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as error:
        raise CorruptSampleError(f"{where}: unreadable {name} ({error})") from error


def decode_sample(sample: dict, caption_key: str | None = None) -> dict:
    """Tar members -> ``{"key", "image_id", "captions"}`` plus what the sample has:
    ``image`` (PIL RGB), ``regions`` (R, D), ``boxes`` (R, 4) and ``entities`` (xyxy
    fractions of the image size), ``caption_ids``. Captions from the JSON's ``captions`` or
    the ``caption_key`` member alone. A sample needs an image or regions.
    """
    key = sample.get("__key__", "?")
    where = f"sample {key!r} of {sample.get('__url__', '?')}"
    meta: dict = {}
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except (ValueError, UnicodeDecodeError) as error:
            raise CorruptSampleError(f"{where}: unreadable JSON ({error})") from error
    elif caption_key is None:
        raise CorruptSampleError(f"{where} has no .json member")
    if caption_key is None:
        captions = meta.get("captions")
    elif caption_key in sample:
        captions = [sample[caption_key].decode("utf-8", errors="replace").strip()]
    else:
        raise CorruptSampleError(f"{where} has no .{caption_key} member (data.train.caption_key)")
    if not captions or not all(isinstance(c, str) and c for c in captions):
        raise CorruptSampleError(f"{where}: captions must be a non-empty list of non-empty "
                                 f"strings")
    out = {"key": key, "image_id": meta.get("image_id", key), "captions": captions}
    if meta.get("caption_ids") is not None and caption_key is None:
        out["caption_ids"] = _caption_ids(meta["caption_ids"], len(captions), where)
    if "regions.npy" in sample:
        regions = _load_npy(sample["regions.npy"], where, "regions.npy")
        if regions.ndim != 2:
            raise CorruptSampleError(f"{where}: regions.npy must be (regions, channels), "
                                     f"got shape {regions.shape}")
        out["regions"] = torch.from_numpy(regions.astype(np.float32))
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    if image_ext is not None:
        try:
            out["image"] = decode_image(sample[image_ext], where).convert("RGB")
        except ImageDecodeError as error:
            raise CorruptSampleError(str(error)) from error
    elif "regions" not in out:
        raise CorruptSampleError(f"{where} has no image member ({', '.join(IMAGE_EXTENSIONS)}) "
                                 f"and no regions.npy")
    width, height = out["image"].size if "image" in out else (meta.get("width"),
                                                              meta.get("height"))
    boxes = (_xyxy(_load_npy(sample["boxes.npy"], where, "boxes.npy"), where, "boxes.npy")
             if "boxes.npy" in sample else _xyxy(entity_boxes(meta), where, "entity boxes"))
    if width and height:
        scale = np.float32([width, height, width, height])
        out["boxes"] = torch.from_numpy(boxes / scale)
        out["entities"] = scale_entity_boxes(meta.get("entities") or [], scale, where)
    return out


def _caption_ids(ids, captions: int, where: str) -> list[int | None]:
    """A JSON's ``caption_ids`` (COCO caption ids, :mod:`mmgoal.data.coco`), checked."""
    if (not isinstance(ids, list) or len(ids) != captions
            or not all(i is None or (isinstance(i, int) and not isinstance(i, bool))
                       for i in ids)):
        raise CorruptSampleError(f"{where}: caption_ids must be a list of {captions} integers "
                                 f"or nulls, one per caption, got {ids!r}")
    return ids


def _xyxy(boxes: list | np.ndarray, where: str, what: str) -> np.ndarray:
    """Boxes (the JSON's lists, or ``boxes.npy``) -> (n, 4) float32; a ``CorruptSampleError``
    unless each is 4 numbers (an empty list is no box)."""
    if isinstance(boxes, list) and not boxes:
        return np.zeros((0, 4), dtype=np.float32)
    try:
        array = np.asarray(boxes, dtype=np.float32)
    except (ValueError, TypeError) as error:  # ragged lists, strings
        raise CorruptSampleError(f"{where}: {what} must be xyxy, 4 numbers each "
                                 f"({error})") from error
    if array.ndim != 2 or array.shape[1] != 4:
        raise CorruptSampleError(f"{where}: {what} must be xyxy, 4 numbers each, got an "
                                 f"array of shape {array.shape}")
    return array


def scale_entity_boxes(entities: list[dict], scale: np.ndarray, where: str = "a sample"
                       ) -> list[dict]:
    """The entities with their boxes divided by ``scale`` (float32, as lists of floats); one
    array operation for all of them (a sample has a dozen entities)."""
    if not entities:
        return []
    counts = [len(entity.get("boxes") or []) for entity in entities]
    flat = _xyxy([box for entity in entities for box in entity.get("boxes") or []], where,
                 "entity boxes")
    scaled = (flat / scale).tolist()
    starts = itertools.accumulate(counts, initial=0)
    return [{**entity, "boxes": scaled[start:start + count]}
            for entity, start, count in zip(entities, starts, counts)]


def choose_captions(samples: Iterator[dict], expand: bool, rng: random.Random,
                    phrase_rng: random.Random | None = None) -> Iterator[dict]:
    """One sample per caption (``expand``) or per image with a random caption; with
    ``phrase_rng``, a random entity with boxes as ``phrase`` and ``phrase_box`` (box
    grounding). ``entities`` are dropped: their many small objects would slow every GC.
    """
    for sample in samples:
        captions, entities = sample["captions"], sample.pop("entities", None) or []
        for index in range(len(captions)) if expand else [rng.randrange(len(captions))]:
            out = {**sample, "caption": captions[index]}
            grounded = [e for e in entities if e.get("boxes") and e.get("caption") == index]
            if phrase_rng is not None and grounded:
                entity = phrase_rng.choice(grounded)
                out["phrase"], out["phrase_box"] = entity["phrase"], entity["boxes"][0]
            yield out


def image_id_groups(image_ids: Sequence) -> torch.Tensor:
    """(B,) long: equal ids get equal numbers, so ``g[:, None] == g[None, :]`` marks positives."""
    numbering: dict = {}
    return torch.tensor([numbering.setdefault(i, len(numbering)) for i in image_ids],
                        dtype=torch.long)


def pad_rows(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_i, width) tensors -> (B, max n_i, width) zero-padded, lengths (B,)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    padded = torch.zeros(len(rows), int(lengths.max()) if len(rows) else 0, width)
    for row, values in enumerate(rows):
        padded[row, :len(values)] = values
    return padded, lengths


def collate_visual(samples: list[dict]) -> dict:
    """``images`` (B, 3, H, W); ``regions`` + ``region_lengths``; ``boxes`` + ``box_lengths``;
    each where every sample of the batch has it."""
    batch: dict = {}
    if all("image" in s for s in samples):
        batch["images"] = torch.stack([s["image"] for s in samples])
    if all("regions" in s for s in samples):
        batch["regions"], batch["region_lengths"] = pad_rows(
            [s["regions"] for s in samples], samples[0]["regions"].shape[1])
    if all("boxes" in s for s in samples):
        batch["boxes"], batch["box_lengths"] = pad_rows([s["boxes"] for s in samples], 4)
    return batch


def collate_batch(samples: list[dict], tokenizer: Callable, counter: SkipCounter,
                  text_augment: Callable | None = None,
                  generator: torch.Generator | None = None) -> dict:
    """Samples -> batch: images/regions/boxes, tokens, ``image_groups``, ids, captions, and
    ``phrases``/``phrase_boxes``/``phrase_valid`` where samples carry a grounded phrase."""
    batch = {
        **collate_visual(samples),
        "image_ids": [s["image_id"] for s in samples],
        "image_groups": image_id_groups([s["image_id"] for s in samples]),
        "captions": [s["caption"] for s in samples],
        "skipped": counter.take(),
    }
    if any("phrase" in s for s in samples):  # box grounding: one phrase per sample
        batch["phrases"] = [s.get("phrase", "") for s in samples]
        batch["phrase_boxes"] = torch.tensor([s.get("phrase_box", [0.0] * 4) for s in samples],
                                             dtype=torch.float32)
        batch["phrase_valid"] = torch.tensor(["phrase" in s for s in samples])
    batch.update(tokenizer(batch["captions"]))
    if text_augment is not None:
        batch.update(text_augment(batch["tokens"], batch["lengths"], generator=generator))
    return batch


def transform_image(sample: dict, transform: Callable) -> dict:
    """Apply the image transform where the sample has an image."""
    return {**sample, "image": transform(sample["image"])} if "image" in sample else sample


@DATASETS.register()
class ShardDataset(torch.utils.data.IterableDataset):
    """Training batches streamed without end from WebDataset shards (the module docstring's
    stages); options as docs/configs.md's ``data.train`` and docs/data.md describe them.

    Args:
        shards: brace patterns, globs, lists, URLs or ``pipe:`` commands.
        tokenizer, transform: captions -> token ids, PIL image -> tensor (set by the trainer).
        expand_captions: one sample per caption instead of one per image.
        seed: base seed of every random choice (shard and sample orders, with the epoch).
        text_augment: ``TEXT_AUGMENTS`` config for the token ids, e.g. ``{type: TokenAugment}``.
        retries, timeout: reads of a failed remote shard, each after a doubling pause, before
            it is skipped; seconds a read may wait for data (:mod:`mmgoal.data.remote`).
        resampled: draw shards with replacement per rank and worker (a pass: at least
            ``MIN_RESAMPLED_PASS`` draws); ``exact_passes``, not with it: each pass
            shuffled on its own.
    """

    def __init__(self, shards: str | list[str], batch_size: PositiveInt, tokenizer: Callable,
                 transform: Callable, expand_captions: bool = False,
                 shuffle_buffer: int = 2000, seed: int = 0,
                 text_augment: dict | None = None, resampled: bool = False,
                 caption_key: str | None = None, retries: int = RETRIES,
                 timeout: float = TIMEOUT, exact_passes: bool = False,
                 max_sample_bytes: int = MAX_SAMPLE_BYTES) -> None:
        super().__init__()
        self.shards = shards
        self.max_sample_bytes = max_sample_bytes
        if exact_passes and resampled:
            raise ValueError("data.train.exact_passes shuffles each pass over the shards, and "
                             "resampled draws shards with replacement, which has no passes: "
                             "set one of them")
        self.exact_passes = exact_passes
        self.urls = expand_shards(shards)
        self.retries, self.timeout = retries, timeout
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.transform = transform
        self.expand_captions = expand_captions
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.resampled = resampled
        self.caption_key = caption_key
        self.epoch = 0
        self.counter = SkipCounter()
        # remote shards' samples as sizes.json claims them (num_samples); a shard that holds
        # fewer is warned of as it is read
        self.claimed: dict[str, int] | None = None
        self.text_augment = (TEXT_AUGMENTS.build(text_augment, tokenizer=tokenizer)
                             if text_augment else None)

    def num_samples(self) -> int:
        """Training samples in one pass: images (tar headers), or captions when expanded
        (JSON members). Remote shards are not read: their ``sizes.json`` or img2dataset
        stats say it, or a ValueError names the three ways to say it."""
        if any(is_remote(url) for url in self.urls):
            sizes = None if self.expand_captions else shard_sizes(self.urls, self.timeout)
            if sizes is None:
                counted = "captions" if self.expand_captions else "samples"
                raise ValueError(
                    f"the {counted} of the remote shards {self.shards!r} are not known without "
                    f"reading the whole data set: put a sizes.json beside the shards "
                    f"({{\"train-000000.tar\": 10000, ...}}, as webdataset and open_clip "
                    f"read it), keep img2dataset's <shard>_stats.json beside them, or set "
                    f"train.samples_per_epoch")
            self.claimed = dict(zip(self.urls, sizes))
            return sum(sizes)
        if self.expand_captions:
            return len(read_captions(self.urls, self.caption_key))
        return sum(len(shard_keys(url)) for url in self.urls)

    def check_readers(self, world_size: int, workers: int) -> None:
        """Fail early when the shards cannot give every rank and worker one of its own."""
        if not self.resampled and len(self.urls) < world_size * workers:
            raise ValueError(
                f"{len(self.urls)} training shard(s) cannot feed {world_size} rank(s) x "
                f"{workers} data worker(s): every reader needs a shard of its own. Write more, "
                f"smaller shards, lower data.num_workers, or set data.train.resampled: true")

    def shard_stream(self, check: UnreadablePassCheck) -> Iterator[dict]:
        """Training shards for ever: seeded passes (or draws with replacement), each
        announced to ``check``."""
        rank, _, worker, _ = wds.utils.pytorch_worker_info()
        draws = random.Random(f"{self.seed}-{self.epoch}-{rank}-{worker}-resample")
        for number in itertools.count():
            check.start_pass(number)
            if self.resampled:  # the draws are one seeded sequence, however cut into passes
                urls = [draws.choice(self.urls) for _ in range(self._resampled_pass())]
            else:  # the same order on every rank and worker, which then split it
                urls = list(self.urls)
                random.Random(f"{self.seed}-{self.epoch}-{number}-shards").shuffle(urls)
            yield from ({"url": url} for url in urls)

    def _resampled_pass(self) -> int:
        """Draws in a resampled reader's pass: its share of the shards, at least
        ``MIN_RESAMPLED_PASS``."""
        _, world_size, _, workers = wds.utils.pytorch_worker_info()
        return max(-(-len(self.urls) // (world_size * workers)), MIN_RESAMPLED_PASS)

    def _unreadable_pass_message(self) -> str:
        rank, _, worker, _ = wds.utils.pytorch_worker_info()
        shards = self.shards if isinstance(self.shards, str) else ", ".join(self.urls[:2]) + (
            f", ... ({len(self.urls)} shards)" if len(self.urls) > 2 else "")
        passed = (f"drew {self._resampled_pass()} of its" if self.resampled
                  else "read a whole pass of its")
        return (f"rank {rank} worker {worker} {passed} training shards without a readable "
                f"sample: no sample of {shards} could be decoded ({self.counter.summary()}); "
                f"check the shards with mmgoal inspect-shards")

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose (reproducible) order the next iteration yields."""
        self.epoch = epoch

    def _rng(self, stage: int) -> random.Random:
        rank, world, worker, workers = wds.utils.pytorch_worker_info()
        return random.Random(f"{self.seed}-{self.epoch}-{stage}-{rank}-{worker}")

    def stages(self) -> list:
        """The pipeline, stage by stage (see the module docstring)."""
        generator = torch.Generator().manual_seed(self._rng(3).getrandbits(63))
        return [*self.sample_stages(), wds.batched(
            self.batch_size, collation_fn=lambda s: collate_batch(
                s, self.tokenizer, self.counter, self.text_augment, generator))]

    def sample_stages(self) -> list:
        """The stages up to one transformed sample per caption choice (no batching)."""
        handler = self.counter
        check = UnreadablePassCheck(self._unreadable_pass_message)
        stages: list = [lambda: self.shard_stream(check)]
        if not self.resampled:
            stages += [wds.split_by_node, wds.split_by_worker]
        shuffle = (functools.partial(shuffle_within_passes, size=self.shuffle_buffer,
                                     rng=self._rng(1)) if self.exact_passes else
                   wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer // 2,
                               rng=self._rng(1)))
        return [*stages,
                tar_samples(handler, retries=self.retries, timeout=self.timeout,
                            max_sample_bytes=self.max_sample_bytes, claimed=self.claimed),
                check.tag, shuffle, check.settle,
                wds.map(functools.partial(decode_sample, caption_key=self.caption_key),
                        handler=handler),
                lambda src: choose_captions(src, self.expand_captions, self._rng(2),
                                            self._rng(4)),
                wds.map(lambda s: transform_image(s, self.transform), handler=handler),
                check.count_readable]

    def __iter__(self) -> Iterator[dict]:
        return iter(wds.DataPipeline(*self.stages()))


@dataclass(frozen=True)
class EvalReader:
    """How an evaluation split is read (its shards, as :func:`expand_shards` takes them, and
    the ``data`` section's settings), for :func:`iter_eval_batches` and ``encode_gallery``;
    ``num_workers`` decode while the caller encodes."""

    shards: str | Sequence[str]
    batch_size: int = 256
    caption_key: str | None = None
    num_workers: int = 0
    max_sample_bytes: int = MAX_SAMPLE_BYTES

    @classmethod
    def of(cls, source: EvalReader | str | Sequence[str]) -> EvalReader:
        """``source`` itself, or a reader of those shards with the default settings."""
        return source if isinstance(source, EvalReader) else cls(source)

    @classmethod
    def of_split(cls, split: Mapping[str, Any], data: Mapping[str, Any]) -> EvalReader:
        """The reader of a config's split: ``split`` its ``data.<split>`` section (its
        ``shards``, ``caption_key``), ``data`` the ``data`` section (a run's or a model's:
        ``eval_batch_size``, ``num_workers``, ``max_sample_bytes``); resolved dicts or the
        typed sections, read alike."""
        return cls(split["shards"], data["eval_batch_size"], split.get("caption_key"),
                   data["num_workers"], data["max_sample_bytes"])


class CaptionedShards:
    """The samples of an evaluation split (what :class:`EvalBatches` decodes): each image
    with its captions, ids and annotations, transformed; batches as :func:`eval_collate`."""

    def __init__(self, reader: EvalReader, transform: Callable | None) -> None:
        self.urls = expand_shards(reader.shards)
        self.reader, self.transform = reader, transform

    def items(self, counter: SkipCounter) -> Iterator[dict]:
        return iter_samples(self.urls, whole_split(counter),
                            max_sample_bytes=self.reader.max_sample_bytes)

    def decode(self, sample: dict) -> dict:
        return transform_image(decode_sample(sample, caption_key=self.reader.caption_key),
                               self.transform)

    def collate(self, samples: list[dict]) -> dict:
        return eval_collate(samples)


class EvalBatches(torch.utils.data.IterableDataset):
    """Batches of a source read in order (:class:`CaptionedShards`, zero-shot's labelled
    images: ``items(counter)``, ``decode(item)``, ``collate(decoded)``). ``part=(index,
    count)`` decodes only batches ``b % count == index`` (DataLoader worker ``w`` of ``W``:
    ``index * W + w`` of ``count * W``); every reader reads all items, so the workers' turns
    keep the source's order (a batch of failed items is yielded empty). Each batch carries
    ``skipped``, ``number`` and ``size``; a shard not read to its end raises
    :class:`IncompleteSplitError`.
    """

    def __init__(self, source: Any, batch_size: int, part: tuple[int, int] = (0, 1),
                 counter: SkipCounter | None = None) -> None:
        self.source, self.batch_size, self.part = source, batch_size, part
        self.counter = counter  # in the process that iterates (a worker has its own copy)

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        index, count = self.part
        mine, every = index * workers + worker, count * workers
        counter = self.counter if self.counter is not None else SkipCounter()
        counter.take()
        for number, raw in enumerate(_chunks(self.source.items(counter), self.batch_size)):
            if number % every != mine:
                counter.take()  # tar-level skips surfaced here are another reader's
                continue
            decoded = []
            for item in raw:
                try:
                    decoded.append(self.source.decode(item))
                except Exception as error:  # a bad sample: logged, counted, skipped
                    counter(error)
            yield {**self.source.collate(decoded), "skipped": counter.take(),
                   "number": number, "size": len(decoded)}


def decoded_samples(shards: str | Sequence[str], counter: SkipCounter) -> Iterator[dict]:
    """Every readable sample of ``shards`` in order, decoded (:func:`decode_sample`); the
    others counted by ``counter``."""
    for sample in iter_samples(shards, counter):
        try:
            yield decode_sample(sample)
        except Exception as error:  # a bad sample: logged, counted, skipped
            counter(error)


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def eval_collate(samples: list[dict]) -> dict:
    """An evaluation batch of decoded samples: images (and regions, boxes), ids, captions
    and entities; only the lists when there is no sample."""
    return {**(collate_visual(samples) if samples else {}),
            "image_ids": [s["image_id"] for s in samples],
            "captions": [s["captions"] for s in samples],
            "caption_ids": [s.get("caption_ids") for s in samples],
            "entities": [s.get("entities") or [] for s in samples]}


def iter_eval_batches(reader: EvalReader | str | Sequence[str], transform: Callable,
                      counter: SkipCounter | None = None, part: tuple[int, int] = (0, 1),
                      pin_memory: bool = False, numbered: bool = False) -> Iterator:
    """Evaluation batches of ``reader`` (an :class:`EvalReader`, or shards read with its
    defaults) in shard order, one sample per image with all its captions.

    ``part=(rank, world)`` yields a rank's share (:class:`EvalBatches`); ``numbered`` keeps
    each batch's ``number``; ``counter`` counts unreadable samples; a shard that failed or
    is damaged raises :class:`IncompleteSplitError`. Yields ``{"images": (B,3,H,W),
    "image_ids", "captions", "caption_ids", "entities"}`` (``regions``/``boxes`` too).
    """
    reader = EvalReader.of(reader)
    return iter_batches(CaptionedShards(reader, transform), reader.batch_size,
                        reader.num_workers, counter, part, pin_memory, numbered)


def iter_batches(source: Any, batch_size: int, num_workers: int = 0,
                 counter: SkipCounter | None = None, part: tuple[int, int] = (0, 1),
                 pin_memory: bool = False, numbered: bool = False) -> Iterator:
    """The non-empty batches of ``source`` (as :class:`EvalBatches` reads it) in order,
    decoded in ``num_workers`` DataLoader processes (0: here); arguments as
    :func:`iter_eval_batches`'s. Evaluation's one batch reader."""
    counter = counter if counter is not None else SkipCounter()
    dataset = EvalBatches(source, batch_size, part, counter if num_workers == 0 else None)
    batches = dataset if num_workers == 0 else torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)
    for batch in batches:
        skipped, number, size = batch.pop("skipped"), batch.pop("number"), batch.pop("size")
        if num_workers:
            counter.add(skipped, "in a DataLoader worker")
        if size:
            yield {**batch, "number": number} if numbered else batch


def read_captions(shards: str | list[str], caption_key: str | None = None) -> list[str]:
    """Every caption of the shards, from the JSON or the ``caption_key`` member (to fit word
    vocabularies); images are not decoded."""
    counter = SkipCounter()
    captions: list[str] = []
    suffix = f".{caption_key or 'json'}"
    for sample in iter_samples(shards, counter, select_files=lambda name: name.endswith(suffix)):
        try:
            if caption_key is None:
                captions.extend(json.loads(sample["json"]).get("captions", []))
            else:
                captions.append(sample[caption_key].decode("utf-8", errors="replace").strip())
        except (KeyError, ValueError) as error:
            counter(CorruptSampleError(f"sample {sample.get('__key__')!r}: {error}"))
    return captions


@DATASETS.register()
class MixtureDataset(torch.utils.data.IterableDataset):
    """Training batches mixed from several endless ``ShardDataset`` sources, each sample from
    source ``k`` with probability ``weight_k / sum(weights)`` (docs/pretraining.md, "Data
    mixtures"). ``sources``: ``ShardDataset`` configs without ``type`` and ``batch_size``,
    each with a ``name`` and ``weight``. Batches carry ``source_counts``, which are logged.
    """

    def __init__(self, sources: list[dict], batch_size: int, tokenizer: Callable,
                 transform: Callable, seed: int = 0, text_augment: dict | None = None,
                 max_sample_bytes: int = MAX_SAMPLE_BYTES) -> None:
        super().__init__()
        if not sources:
            raise ValueError("MixtureDataset needs at least one source")
        self.names, self.weights, self.sources = [], [], []
        for index, source in enumerate(sources):
            source = dict(source)
            name = str(source.pop("name", f"source{index}"))
            weight = float(source.pop("weight", 1.0))
            if weight <= 0:
                raise ValueError(f"MixtureDataset source {name!r}: weight must be positive, "
                                 f"got {weight}")
            self.names.append(name)
            self.weights.append(weight)
            # Through the registry: a wrong key in a source gets its message and hint.
            self.sources.append(DATASETS.build(
                {"type": "ShardDataset", **source}, batch_size=1, tokenizer=tokenizer,
                transform=transform, seed=seed + 7919 * index,
                max_sample_bytes=max_sample_bytes))
        if len(set(self.names)) < len(self.names):
            raise ValueError(f"MixtureDataset source names must differ, got {self.names}")
        self.batch_size, self.tokenizer = batch_size, tokenizer
        self.seed, self.epoch = seed, 0
        self.counter = SkipCounter()
        self.text_augment = (TEXT_AUGMENTS.build(text_augment, tokenizer=tokenizer)
                             if text_augment else None)

    def num_samples(self) -> int:
        return sum(source.num_samples() for source in self.sources)

    def check_readers(self, world_size: int, workers: int) -> None:
        for source in self.sources:
            source.check_readers(world_size, workers)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for source in self.sources:
            source.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        rank, _, worker, _ = wds.utils.pytorch_worker_info()
        rng = random.Random(f"{self.seed}-{self.epoch}-{rank}-{worker}-mixture")
        generator = torch.Generator().manual_seed(rng.getrandbits(63))
        streams = [iter(wds.DataPipeline(*source.sample_stages())) for source in self.sources]
        order = range(len(streams))
        while True:
            picks = rng.choices(order, weights=self.weights, k=self.batch_size)
            samples = [next(streams[k]) for k in picks]
            skipped = sum(source.counter.take() for source in self.sources)
            batch = collate_batch(samples, self.tokenizer, self.counter, self.text_augment,
                                  generator)
            batch["skipped"] += skipped
            batch["source_counts"] = {name: picks.count(k) for k, name in enumerate(self.names)}
            yield batch
