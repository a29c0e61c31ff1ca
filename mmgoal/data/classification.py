"""Image classification sets for zero-shot classification, in CLIP_benchmark's WebDataset
layout or as an image folder (both layouts: docs/models.md, "Zero-shot classification").
:func:`write_synthetic_classification` writes one of the synthetic scenes, so that zero-shot
classification is testable offline.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from PIL import Image

from mmgoal import strict_json
from mmgoal.config import check_value
from mmgoal.data.images import decode_image
from mmgoal.data.tars import IMAGE_EXTENSIONS, MAX_SAMPLE_BYTES
from mmgoal.files import open_regular, read_text, write_atomically, write_text

if TYPE_CHECKING:
    from mmgoal.data.pipeline import SkipCounter

CLASSNAMES = "classnames.txt"
TEMPLATES = "zeroshot_classification_templates.txt"
DEFAULT_TEMPLATES = ("a photo of a {c}.",)
# the synthetic sets: what a class is, and the prompts (the scenes' captions name a shape
# with its colour: "a small red circle")
SyntheticTask = Literal["shape", "colour"]
SyntheticLayout = Literal["wds", "folder"]  # CLIP_benchmark's WebDataset layout, or folders
SYNTHETIC_TEMPLATES = {"shape": ("a {c}.", "there is a {c}.", "a small {c}.", "a large {c}."),
                       "colour": ("a {c} shape.", "something {c}.", "a small {c} shape.")}


@dataclass
class ClassificationSet:
    """A split of a classification set: its class names (by label), prompts (the class name
    as ``{c}``) and images: ``shards`` (WebDataset layout) or ``(path, label)`` ``files``
    (image folder)."""

    root: Path
    classnames: list[str]
    templates: list[str]
    shards: list[str] | None = None
    files: list[tuple[Path, int]] | None = None


def _lines(path: Path) -> list[str]:
    """The non-blank lines of a set's list file (class names, prompts), bounded by
    :data:`~mmgoal.files.MAX_LIST_BYTES`."""
    return [line.strip() for line in read_text(path, "list file").splitlines()
            if line.strip()]


def read_classification_set(root: str | Path, split: str = "test") -> ClassificationSet:
    """The ``split`` of the classification set in ``root`` (either layout of the module)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"zero-shot classification set {root}: no such folder")
    templates = _lines(root / TEMPLATES) if (root / TEMPLATES).exists() else list(
        DEFAULT_TEMPLATES)
    if not templates or any("{c}" not in t for t in templates):
        raise ValueError(f"{root / TEMPLATES}: every prompt must hold the class name as {{c}} "
                         f"(a photo of a {{c}}.); got {templates[:3]}")
    if not (root / split).is_dir():  # a set of split folders without this one: a typo
        splits = sorted(p.name for p in root.iterdir() if p.is_dir() and (
            (p / "nshards.txt").is_file() or any(q.is_dir() for q in p.iterdir())))
        if splits:
            raise FileNotFoundError(f"zero-shot classification set {root} has no split "
                                    f"{split!r}; its splits: {', '.join(splits)}")
    if (root / split / "nshards.txt").is_file():  # CLIP_benchmark's WebDataset layout
        if not (root / CLASSNAMES).is_file():
            raise FileNotFoundError(f"{root}: a WebDataset classification set needs "
                                    f"{CLASSNAMES} (one class name per line, in label order)")
        shards = _listed_shards(root / split)
        return ClassificationSet(root, _lines(root / CLASSNAMES), templates, shards=shards)
    folder = root / split if (root / split).is_dir() else root
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise FileNotFoundError(
            f"{root}: neither a WebDataset classification set ({split}/nshards.txt, "
            f"{CLASSNAMES}) nor an image folder (one sub-folder of images per class)")
    names = (_lines(root / CLASSNAMES) if (root / CLASSNAMES).exists()
             else [c.replace("_", " ") for c in classes])
    if len(names) != len(classes):
        raise ValueError(f"{root / CLASSNAMES} names {len(names)} classes, the folder has "
                         f"{len(classes)} ({', '.join(classes[:5])}, ...)")
    if set(names) == set(classes):  # the file names the folders: its order is the labels'
        classes = names
    files = [(path, label) for label, name in enumerate(classes)
             for path in sorted((folder / name).iterdir())
             if path.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS]
    return ClassificationSet(root, names, templates, files=files)


def _listed_shards(folder: Path) -> list[str]:
    """The shards ``folder/nshards.txt`` counts, ``0.tar`` to ``<n-1>.tar``, each of which
    must be there: a count from a file (anyone's) allocates no more names than the folder
    has shards. Absolute paths: a folder named ``pipe:...`` stays a folder."""
    listed = folder / "nshards.txt"
    with open_regular(listed, "shard count file") as file:
        text = file.read(32).decode("ascii", errors="replace").strip()
    present = sum(1 for path in folder.iterdir() if path.suffix == ".tar")
    if not text.isdigit() or not 0 < int(text) <= present:
        raise ValueError(f"{listed} must hold the number of the split's shards (0.tar ... "
                         f"<n-1>.tar, {present} .tar files there); got {text!r}")
    shards = [folder.absolute() / f"{index}.tar" for index in range(int(text))]
    missing = [path.name for path in shards if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"{listed} counts {len(shards)} shards; {folder} lacks "
                                f"{', '.join(missing[:5])}")
    return [str(path) for path in shards]


def _decoded(data: bytes | Path, where: str) -> Image.Image:
    """An RGB image (:func:`~mmgoal.data.images.decode_image`: a regular file only,
    bounded); a ValueError naming ``where`` and why."""
    try:
        return decode_image(data, where).convert("RGB")
    except OSError as error:  # a file gone since the folder was listed
        raise ValueError(f"{where}: {error.strerror or error}") from error


class LabelledImages:
    """The images of a set with their labels, as :class:`~mmgoal.data.pipeline.EvalBatches`
    reads a source: items in order, each decoded to ``(image, label)`` (the image
    transformed), batches ``{"images", "labels"}``."""

    def __init__(self, cset: ClassificationSet, transform: Callable,
                 max_sample_bytes: int = MAX_SAMPLE_BYTES) -> None:
        self.cset, self.transform, self.max_sample_bytes = cset, transform, max_sample_bytes

    def items(self, counter: SkipCounter) -> Iterator:
        """``(path, label)`` of an image folder, or the raw samples of its shards (a shard
        not read whole raises :class:`~mmgoal.data.pipeline.IncompleteSplitError`)."""
        if self.cset.files is not None:
            return iter(self.cset.files)
        from mmgoal.data.pipeline import whole_split
        from mmgoal.data.remote import iter_samples

        return iter_samples(self.cset.shards, whole_split(counter),
                            max_sample_bytes=self.max_sample_bytes)

    def decode(self, item: tuple[Path, int] | dict) -> tuple[Any, int]:
        """``(image, label)``; a ValueError names the image and why it cannot be used."""
        if isinstance(item, tuple):
            image, label = _decoded(item[0], str(item[0])), item[1]
        else:
            where = f"sample {item.get('__key__', '?')!r} of {item.get('__url__', '?')}"
            member = next((e for e in IMAGE_EXTENSIONS if e in item), None)
            if member is None or "cls" not in item:
                raise ValueError(f"{where} has no image member or no cls member")
            try:
                label = int(item["cls"].decode().strip())
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(f"{where}: its cls member is not a number ({error})") from None
            n_classes = len(self.cset.classnames)
            if not 0 <= label < n_classes:
                raise ValueError(f"{where}: label {label} outside the {n_classes} classes")
            image = _decoded(item[member], where)
        return self.transform(image), label

    def collate(self, decoded: list[tuple[Any, int]]) -> dict:
        import torch

        return {"images": torch.stack([image for image, _ in decoded]) if decoded else None,
                "labels": torch.tensor([label for _, label in decoded], dtype=torch.long)}


def write_synthetic_classification(out: str | Path, task: SyntheticTask = "shape",
                                   count: int = 200, seed: int = 0, image_size: int = 64,
                                   shard_size: int = 500, split: str = "test",
                                   layout: SyntheticLayout = "wds") -> ClassificationSet:
    """A classification set of one-object synthetic scenes, the object's shape (6 classes)
    or colour (8) the class, drawn as the retrieval benchmark's but with seeds of its own;
    the same set for the same arguments."""
    from mmgoal.data.shards import ShardWriter
    from mmgoal.data.synthetic import COLOURS, SHAPES, place_objects, render_scene

    check_value("task", task, SyntheticTask)
    check_value("layout", layout, SyntheticLayout)
    out = Path(out)
    classes = list(SHAPES) if task == "shape" else list(COLOURS)
    items = []  # (key, png bytes, label)
    for index in range(count):
        rng = np.random.default_rng([seed, 30_000_000 + index])  # apart from the benchmark's
        obj = place_objects(rng, 1, image_size)
        label = classes.index(obj[0].shape if task == "shape" else obj[0].colour)
        buffer = io.BytesIO()
        render_scene(rng, obj, image_size).save(buffer, format="PNG")
        items.append((f"{index:06d}", buffer.getvalue(), label))
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / CLASSNAMES, "\n".join(classes) + "\n")
    write_text(out / TEMPLATES, "\n".join(SYNTHETIC_TEMPLATES[task]) + "\n")
    if layout == "folder":
        for key, png, label in items:
            folder = out / split / classes[label]
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(folder / f"{key}.png", lambda tmp, png=png: tmp.write_bytes(png))
    else:
        with ShardWriter(out / split, "", shard_size) as writer:
            for key, png, label in items:
                writer.write({"__key__": key, "png": png, "cls": str(label).encode()})
        write_text(out / split / "nshards.txt", f"{len(writer.paths)}\n")
    write_text(out / "meta.json", strict_json.dumps({
        "task": task, "count": count, "seed": seed, "image_size": image_size, "layout": layout}))
    return read_classification_set(out, split)

