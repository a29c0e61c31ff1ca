"""Converting datasets into shards: sources, one shard per task, resumable.

A source (``SHARD_SOURCES``) says which splits it has, which items each holds and how one
becomes a sample; each shard of ``shard_size`` items is one task with its ``.stats.json``
written after it, so ``resume`` redoes only the unfinished shards (docs/data.md,
"Conversion"). An item that cannot be converted is skipped and counted, never fatal.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from mmgoal import strict_json
from mmgoal.console import progress_bar
from mmgoal.data.images import ImageDecodeError, decode_image
from mmgoal.data.shards import ShardWriter
from mmgoal.data.tars import IMAGE_EXTENSIONS
from mmgoal.files import (
    MAX_IMAGE_BYTES,
    NotAFileError,
    OversizedFileError,
    read_bytes,
    read_text,
    write_text,
)

logger = logging.getLogger(__name__)

MAX_EXAMPLES = 5


class SkippedItem(Exception):
    """An item that cannot become a sample; ``reason`` groups it in the summary."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class ShardSource:
    """Base class of shard sources (see the module docstring)."""

    def splits(self) -> list[str]:
        """Names of the splits, which become the shards' name prefixes."""
        raise NotImplementedError

    def items(self, split: str) -> Sequence[Any]:
        """The split's items, in a fixed order (picklable: they travel to workers)."""
        raise NotImplementedError

    def plan(self, split: str, shard_size: int) -> list[Sequence[Any]]:
        """The items of every shard of ``split``: consecutive runs of ``shard_size``."""
        items = self.items(split)
        return [items[start:start + shard_size] for start in range(0, len(items), shard_size)]

    def sample(self, split: str, item: Any) -> dict:
        """One shard sample (``__key__`` plus ``ext: bytes``); raises ``SkippedItem``."""
        raise NotImplementedError


def image_member(path: Path, max_size: int | None = None, jpeg_quality: int | None = None,
                 data: bytes | None = None, root: Path | None = None
                 ) -> tuple[str, bytes, int, int]:
    """An image file (or ``data``, ``path`` then only names it) as a sample member:
    (extension, bytes, width, height). Decoded whole to catch truncated images; re-encoded
    as JPEG past ``max_size``, with ``jpeg_quality``, or outside ``IMAGE_EXTENSIONS``. The
    file must lie in ``root`` (``None``: anywhere). Raises SkippedItem.
    """
    if data is None:
        within(root, path)
        try:
            data = read_bytes(path, "image", MAX_IMAGE_BYTES)
        except NotAFileError as error:
            raise SkippedItem("not a regular file", str(error)) from error
        except OversizedFileError as error:
            raise SkippedItem("oversized image", str(error)) from error
        except OSError as error:
            raise SkippedItem("missing image", f"{path} ({error.strerror})") from error
    try:
        image = decode_image(data, str(path))
    except ImageDecodeError as error:
        raise SkippedItem("unreadable image", str(error)) from error
    width, height = image.size
    extension = (path.suffix.lstrip(".") or image.format or "").lower().replace("jpeg", "jpg")
    too_large = max_size is not None and max(width, height) > max_size
    if not too_large and jpeg_quality is None and extension in IMAGE_EXTENSIONS:
        return extension, data, width, height
    image = image.convert("RGB")
    if too_large:
        image.thumbnail((max_size, max_size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=jpeg_quality or 95)
    return "jpg", buffer.getvalue(), image.size[0], image.size[1]


def within(root: Path | None, path: Path) -> None:
    """A SkippedItem where ``path`` leads outside the folder ``root`` (``..``, an absolute
    path, a link): a list someone sends could otherwise pull your own files into shards you
    later share. ``root`` ``None``: allowed (``--allow-outside``)."""
    if root is None or not os.path.exists(path):  # nothing there: the read says it is missing
        return
    real, base = os.path.realpath(path), os.path.realpath(root)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise SkippedItem("outside the source folder",
                          f"{path} leads to {real}, outside {root} (--allow-outside takes "
                          f"files from anywhere)")


def safe_key(key: str) -> str:
    """``key`` as a WebDataset sample key: WebDataset splits a member name at its first dot
    and a slash makes folders, so both become ``_``, and a changed key gets 8 hex digits
    of the original's SHA-1 (``a.b`` and ``a_b`` stay two keys)."""
    safe = re.sub(r"[./]", "_", key)
    if safe == key and key:
        return key
    return f"{safe}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def split_names(names: str | dict[str, str]) -> dict[str, str]:
    """Shard names of input splits: ``"dev=val,testall=test"`` (or that mapping) ->
    ``{"dev": "val", "testall": "test"}``."""
    if isinstance(names, dict):
        return dict(names)
    pairs = [pair for pair in names.split(",") if pair]
    wrong = [pair for pair in pairs if "=" not in pair]
    if wrong:
        raise ValueError(f"split names {names!r}: {', '.join(wrong)} is not INPUT=SHARD_NAME; "
                         f"write e.g. 'validation=val,dev=val'")
    return dict(pair.split("=", 1) for pair in pairs)


def stats_path(out_dir: Path, split: str, index: int) -> Path:
    return out_dir / f".{split}-{index:06d}.stats.json"


def convert_shard(task: tuple[ShardSource, Path, str, int, Sequence[Any]]) -> dict:
    """Write one shard and its stats; return the stats."""
    source, out_dir, split, index, items = task
    skipped: Counter[str] = Counter()
    examples: list[str] = []
    samples = captions = 0
    with ShardWriter(out_dir, split, max_count=max(len(items), 1), first_index=index) as writer:
        for item in items:
            try:
                sample = source.sample(split, item)
            except SkippedItem as error:
                skipped[error.reason] += 1
                if len(examples) < MAX_EXAMPLES or skipped[error.reason] == 1:  # every reason
                    examples.append(str(error))                            # is shown once
                continue
            writer.write({**sample, "__key__": safe_key(str(sample["__key__"]))})
            samples += 1
            captions += len(json.loads(sample["json"]).get("captions", [])) \
                if "json" in sample else 0
    shard = shard_path(out_dir, split, index)
    stats = {"split": split, "index": index, "items": len(items), "samples": samples,
             "captions": captions, "skipped": dict(skipped), "examples": examples,
             "bytes": shard.stat().st_size if samples else 0}
    path = stats_path(out_dir, split, index)
    write_text(path, strict_json.dumps(stats))
    return stats


def shard_path(out_dir: Path, split: str, index: int) -> Path:
    return out_dir / f"{split}-{index:06d}.tar"


def finished_stats(out_dir: Path, split: str, index: int) -> dict | None:
    """The stats of shard ``index`` of ``split`` where it is finished: stats readable, the
    shard there with the size they record (an empty shard: no file). None where it must be
    written again; a shard not as its stats say is logged."""
    path, shard = stats_path(out_dir, split, index), shard_path(out_dir, split, index)
    if not path.is_file():
        return None
    try:
        stats = json.loads(read_text(path, "shard stats file"))
    except ValueError as error:  # not JSON, or too large to be stats
        logger.warning("%s cannot be read (%s): its shard is written again", path, error)
        return None
    size = stats.get("bytes") if isinstance(stats, dict) else None
    present = shard.stat().st_size if shard.is_file() and not shard.is_symlink() else None
    if not isinstance(size, int) or present != (size or None):
        found = "missing" if present is None else f"{present:,} bytes"
        logger.warning("%s is %s where its stats say %s: it is written again", shard, found,
                       "no shard (no samples)" if size == 0 else f"{size:,} bytes"
                       if isinstance(size, int) else "nothing of its size")
        return None
    return stats


def convert(source: ShardSource, out_dir: str | os.PathLike, shard_size: int = 1000,
            workers: int = 1, resume: bool = False, progress: bool = True,
            options: dict | None = None) -> dict:
    """Convert every split of ``source`` into shards under ``out_dir``; returns the
    ``summary.json`` written there (``options`` and ``shard_size``, which ``resume``
    requires the same, and per split shards, samples, captions and skipped items).
    """
    out_dir = Path(out_dir)
    if out_dir.is_symlink() and not out_dir.exists():
        raise FileNotFoundError(f"--out {out_dir} is a symbolic link to {os.readlink(out_dir)}, "
                                f"which does not exist: create that folder, or give another "
                                f"--out")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"--out {out_dir} is a file, not a folder: give a folder for the "
                              f"shards")
    out_dir.mkdir(parents=True, exist_ok=True)
    # as summary.json records them (tuples as lists, NaN as null): what --resume compares
    options = json.loads(strict_json.dumps({**(options or {}), "shard_size": shard_size}))
    if resume:
        check_same_options(out_dir, options)
    elif any(out_dir.glob("*.tar")):
        raise FileExistsError(f"{out_dir} already holds shards; pass --resume to finish an "
                              f"interrupted conversion, or choose an empty --out folder")
    write_text(out_dir / "summary.json", strict_json.dumps({"options": options, "splits": {}},
                                                           indent=2))
    tasks = [(source, out_dir, split, index, items)
             for split in source.splits()
             for index, items in enumerate(source.plan(split, shard_size))]
    done = {}
    for _, _, split, index, _ in tasks if resume else ():
        stats = finished_stats(out_dir, split, index)
        if stats is not None:
            done[(split, index)] = stats
    todo = [t for t in tasks if (t[2], t[3]) not in done]
    if done:
        logger.info("resuming: %d of %d shards already written", len(done), len(tasks))
    results = list(done.values())
    bar = progress_bar(total=len(tasks), initial=len(done), unit="shard", show=progress,
                       desc=f"{type(source).__name__} -> {out_dir}", dynamic_ncols=True)
    for stats in _run(todo, workers):
        results.append(stats)
        bar.update(1)
    bar.close()
    summary = {"options": options, "splits": summarise(results)}
    write_text(out_dir / "summary.json", strict_json.dumps(summary, indent=2))
    return summary


def check_same_options(out_dir: Path, options: dict) -> None:
    """Raise a ``ValueError`` naming every option that differs from those ``out_dir``'s
    ``summary.json`` records (a folder without them is not checked)."""
    path = out_dir / "summary.json"
    try:
        recorded = json.loads(read_text(path, "conversion summary")).get("options") \
            if path.is_file() else None
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); it records the options "
                         f"--resume must match: delete it to resume unchecked") from error
    if recorded is None:
        if any(out_dir.glob("*.tar")):
            logger.warning("%s records no conversion options; --resume cannot check that "
                           "they are those of the shards already there", out_dir)
        return
    differing = [f"{key}: {recorded.get(key, 'absent')} then, {options.get(key, 'absent')} now"
                 for key in sorted(set(recorded) | set(options))
                 if recorded.get(key) != options.get(key)]
    if differing:
        raise ValueError(f"{out_dir} was started with other conversion options "
                         f"({'; '.join(differing)}); --resume only finishes a conversion "
                         f"with the options it started with: run it with those, or convert "
                         f"into an empty --out folder")


def _run(tasks: list, workers: int) -> Iterator[dict]:
    if workers <= 1 or len(tasks) <= 1:
        yield from map(convert_shard, tasks)
        return
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(convert_shard, tasks)


def summarise(results: list[dict]) -> dict:
    """Per split: shards, samples, captions, skipped items by reason (with examples)."""
    summary: dict[str, dict] = {}
    for stats in sorted(results, key=lambda s: (s["split"], s["index"])):
        split = summary.setdefault(stats["split"], {"shards": 0, "samples": 0, "captions": 0,
                                                    "skipped": {}, "examples": []})
        split["shards"] += 1 if stats["samples"] else 0
        split["samples"] += stats["samples"]
        split["captions"] += stats["captions"]
        for reason, count in stats["skipped"].items():
            split["skipped"][reason] = split["skipped"].get(reason, 0) + count
        split["examples"] = first_examples(split["examples"] + stats["examples"])
    return summary


def first_examples(examples: list[str]) -> list[str]:
    """The first :data:`MAX_EXAMPLES` examples, and the first of every other reason (an
    example is ``reason: detail``)."""
    kept, reasons = [], set()
    for example in examples:
        reason = example.split(":", 1)[0]
        if len(kept) < MAX_EXAMPLES or reason not in reasons:
            kept.append(example)
        reasons.add(reason)
    return kept


def format_summary(summary: dict) -> str:
    """A few lines for people: samples and captions per split, what was skipped and why."""
    lines = []
    for split, row in summary["splits"].items():
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(row["skipped"].items()))
        lines.append(f"{split:>8}: {row['samples']} samples, {row['captions']} captions in "
                     f"{row['shards']} shards" + (f"; skipped {skipped}" if skipped else ""))
        lines.extend(f"          e.g. {example}" for example in row["examples"])
    return "\n".join(lines)
