"""Shard sources for what a CLIP fine-tuner has at hand: open_clip's CSV files (``csv``), a
folder of images with caption files (``folder``), a Hugging Face dataset (``hf``), written
as ``karpathy`` writes them; what each takes, skips and refuses: docs/data.md, "Your own
data" and "What a conversion takes".
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

from mmgoal.data.conversion import (
    ShardSource,
    SkippedItem,
    image_member,
    split_names,
    within,
)
from mmgoal.extras import require_extra
from mmgoal.files import open_regular, read_text
from mmgoal.registry import SHARD_SOURCES

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
# The files a folder source takes for images (those PIL reads; the formats the training
# pipeline does not read as images, BMP, GIF and TIFF, are re-encoded as JPEG)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def given_splits(what: str, **inputs: str | None) -> dict[str, Path]:
    """The splits that were given an input (``train=..., val=None``), in split order; a
    ValueError where none was."""
    given = {split: Path(value) for split, value in inputs.items() if value}
    if not given:
        raise ValueError(f"give the {what} of at least one split: "
                         f"{', '.join('--' + split for split in inputs)}")
    return given


def caption_list(value: Any, where: str) -> list[str]:
    """A caption field as a list of captions: a string is one, a list of strings several;
    blanks and nulls are left out. A value that is not text (a number, a mapping) is a
    SkippedItem, never turned into text (a mapping's field names are no captions)."""
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(
            text is None or isinstance(text, str) for text in values):
        shown = repr(value)
        raise SkippedItem("caption not text", f"{where}: a {type(value).__name__} "
                          f"({shown[:60]}{'...' * (len(shown) > 60)}), not a string or a list "
                          f"of strings")
    return [text.strip() for text in values if text is not None and text.strip()]


def captioned_image(split: str, image_id: str | int, captions: list[str],
                    member: tuple[str, bytes, int, int]) -> dict:
    """A shard sample: the image member and the JSON the training pipeline reads."""
    extension, data, width, height = member
    meta = {"image_id": image_id, "captions": captions, "split": split, "width": width,
            "height": height}
    return {"__key__": str(image_id), extension: data, "json": json.dumps(meta).encode()}


@SHARD_SOURCES.register("csv")
class CSVSource(ShardSource):
    """Images and captions of open_clip's CSV files, a file per split (docs/data.md, "Your
    own data"); rows naming one image path are one sample, ``image_id`` that path.

    Args:
        img_key, caption_key, separator: open_clip's ``--csv-img-key``,
            ``--csv-caption-key``, ``--csv-separator`` (``\\t`` may be backslash and t).
        image_root: where relative image paths start and images must lie (default: each
            CSV file's folder).
        allow_outside: also take images outside it (absolute paths, ``..``, links).
        max_size, jpeg_quality: re-encode as JPEG images whose longer side exceeds
            ``max_size``, or every image at ``jpeg_quality``.
    """

    def __init__(self, train: str | None = None, val: str | None = None,
                 test: str | None = None, img_key: str = "filepath",
                 caption_key: str = "title", separator: str = "\t",
                 image_root: str | None = None, allow_outside: bool = False,
                 max_size: int | None = None, jpeg_quality: int | None = None) -> None:
        files = given_splits("CSV file", train=train, val=val, test=test)
        separator = "\t" if separator == "\\t" else separator
        if len(separator) != 1:
            raise ValueError(f"--separator must be one character (a tab: '\\t'), got "
                             f"{separator!r}")
        self.roots = {split: Path(image_root) if image_root else path.parent
                      for split, path in files.items()}
        self.allow_outside = allow_outside
        self.max_size, self.jpeg_quality = max_size, jpeg_quality
        self.by_split = {split: read_csv_images(path, img_key, caption_key, separator)
                         for split, path in files.items()}
        self.files = files

    def __getstate__(self) -> dict:
        # a shard's items travel with its task; the split lists (a whole CC3M) need not
        return {**self.__dict__, "by_split": {}}

    def splits(self) -> list[str]:
        return list(self.by_split)

    def items(self, split: str) -> list[CSVItem]:
        return self.by_split[split]

    def sample(self, split: str, item: CSVItem) -> dict:
        path, captions, line, refused = item
        if refused is not None:
            raise SkippedItem(refused, f"{self.files[split]} line {line}: {path}")
        if not path:
            raise SkippedItem("no image path", f"{self.files[split]} line {line}")
        if not captions:
            raise SkippedItem("no captions", f"{path} ({self.files[split]} line {line})")
        root = self.roots[split]
        member = image_member(root / path, self.max_size, self.jpeg_quality,
                              root=None if self.allow_outside else root)
        return captioned_image(split, path, captions, member)


# A CSV source's item: (image path, its captions, the line of its first row, None), or a row
# refused whole: (what it holds, [], its line, the reason)
CSVItem = tuple[str, list[str], int, "str | None"]
EXTRA_FIELDS = "more fields than the header"


def read_csv_images(path: Path, img_key: str, caption_key: str, separator: str
                    ) -> list[CSVItem]:
    """The items of every image a CSV file names, in the order of their first rows, then of
    every row refused whole (:data:`CSVItem`). A ValueError for a missing column names
    those the file has."""
    if not path.is_file():
        raise FileNotFoundError(f"CSV file {path} does not exist")
    images: dict[str, CSVItem] = {}
    refused: list[CSVItem] = []
    # utf-8-sig: a spreadsheet's byte order mark would otherwise join the first column's name
    with io.TextIOWrapper(open_regular(path, "CSV file"), newline="",
                          encoding="utf-8-sig") as file:
        rows = csv.reader(file, delimiter=separator)
        try:
            header = next(rows, [])
            for option, key in (("--img-key", img_key), ("--caption-key", caption_key)):
                if key not in header:
                    raise ValueError(csv_column_error(path, key, option, header, separator))
            image_column, caption_column = header.index(img_key), header.index(caption_key)
            for row in rows:
                if not row:
                    continue
                image = row[image_column] if image_column < len(row) else ""
                if any(field.strip() for field in row[len(header):]):  # a separator in a
                    # caption, unquoted: the fields past the header would be dropped
                    shown = separator.join(row)
                    refused.append((f"{len(row)} fields, the header {len(header)} (quote a "
                                    f"field holding {separator!r}): {shown[:80]}", [],
                                    rows.line_num, EXTRA_FIELDS))
                    continue
                caption = row[caption_column] if caption_column < len(row) else ""
                entry = images.setdefault(image, (image, [], rows.line_num, None))
                entry[1].extend(caption_list(caption, f"{path} line {rows.line_num}"))
        except (csv.Error, UnicodeDecodeError) as error:
            raise ValueError(f"{path} cannot be read as a UTF-8 CSV file "
                             f"({error})") from error
    return list(images.values()) + refused


def csv_column_error(path: Path, key: str, option: str, header: list[str],
                     separator: str) -> str:
    message = (f"{path} has no column {key!r} ({option}); its columns are: "
               f"{', '.join(repr(name) for name in header) or 'none (an empty file)'}")
    others = [name for name, mark in (("a tab", "\t"), ("a comma", ","), ("a semicolon", ";"))
              if mark != separator and len(header) == 1 and mark in header[0]]
    if others:
        message += f"; its header has {others[0]}: is that the separator (--separator)?"
    return message


@SHARD_SOURCES.register("folder")
class FolderSource(ShardSource):
    """Images in a folder per split, each with a caption file of its name: ``cat.jpg`` takes
    ``cat.txt`` (a caption a line) or else ``cat.json``; ``image_id`` is the path without
    extension (docs/data.md, "Your own data"). ``allow_outside`` takes links to files
    outside the folder; ``max_size``, ``jpeg_quality``: as :class:`CSVSource`.
    """

    def __init__(self, train: str | None = None, val: str | None = None,
                 test: str | None = None, allow_outside: bool = False,
                 max_size: int | None = None, jpeg_quality: int | None = None) -> None:
        self.roots = given_splits("folder", train=train, val=val, test=test)
        self.allow_outside = allow_outside
        self.max_size, self.jpeg_quality = max_size, jpeg_quality
        self.by_split = {split: folder_images(root) for split, root in self.roots.items()}
        named: set[str] = set()
        self.second_of_name: set[str] = set()  # small: only the clashes travel to workers
        for split, images in self.by_split.items():
            for image in images:
                name = f"{split}/{Path(image).with_suffix('').as_posix()}"
                if name in named:
                    self.second_of_name.add(f"{split}/{image}")
                named.add(name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "by_split": {}}  # a shard's items travel with its task

    def splits(self) -> list[str]:
        return list(self.by_split)

    def items(self, split: str) -> list[str]:
        return self.by_split[split]

    def sample(self, split: str, item: str) -> dict:
        path = self.roots[split] / item
        if f"{split}/{item}" in self.second_of_name:
            raise SkippedItem("another image has its name",
                              f"{path} (its caption file is the other's)")
        root = None if self.allow_outside else self.roots[split]
        captions = caption_file_captions(path, root)
        member = image_member(path, self.max_size, self.jpeg_quality, root=root)
        return captioned_image(split, Path(item).with_suffix("").as_posix(), captions, member)


def folder_images(root: Path) -> list[str]:
    """The images under ``root`` (paths relative to it, sorted), hidden ones left out; a
    FileNotFoundError where it is no folder or holds none."""
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} is not a folder")
    images = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if (path.suffix.lower() in IMAGE_SUFFIXES and not path.is_dir()
                and not any(part.startswith(".") for part in relative.parts)):
            images.append(relative.as_posix())
    images.sort()
    if not images:
        raise FileNotFoundError(f"{root} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return images


def caption_file_captions(image: Path, root: Path | None = None) -> list[str]:
    """The captions of ``image``'s caption file (``.txt``, else ``.json``), which must lie
    in ``root`` (:func:`~mmgoal.data.conversion.within`); a SkippedItem where there is
    none, it cannot be read, or it holds no caption."""
    text_file, json_file = image.with_suffix(".txt"), image.with_suffix(".json")
    if not os.path.lexists(text_file) and not os.path.lexists(json_file):
        raise SkippedItem("no caption file", f"{image} has no {text_file.name} or "
                                             f"{json_file.name}")
    caption_file = text_file if os.path.lexists(text_file) else json_file
    within(root, caption_file)
    try:
        text = read_text(caption_file, "caption file")
        if caption_file is text_file:
            captions = caption_list(text.splitlines(), str(caption_file))
        else:
            meta = json.loads(text)
            captions = caption_list(meta.get("captions", meta.get("caption"))
                                    if isinstance(meta, dict) else None, str(caption_file))
    except (OSError, ValueError) as error:  # NotAFileError and UnicodeDecodeError: ValueErrors
        raise SkippedItem("unreadable caption file", f"{caption_file} ({error})") from error
    if not captions:
        raise SkippedItem("no captions", f"{caption_file} holds no caption"
                          + ("" if caption_file is text_file else
                             " (neither a 'captions' list nor a 'caption' string)"))
    return captions


@SHARD_SOURCES.register("hf")
class HFSource(ShardSource):
    """Images and captions of a Hugging Face dataset (docs/data.md, "Your own data").

    Args:
        dataset: a ``save_to_disk`` folder (a ``Dataset`` is one split, ``train`` unless it
            names its own), or anything ``load_dataset`` takes (a hub id, online).
        id_key: a column of image ids; rows with one id are one sample with all their
            captions. Without it every row is an image, ``{split}-{row:07d}``.
        splits: comma-separated splits to convert (default: all).
        names: shard names of the dataset's splits (``"validation=val"``).
        allow_outside: also read image files named by a path outside the dataset's folder
            (for a hub id: the ``datasets`` cache).
        max_size, jpeg_quality: as :class:`CSVSource`.
    """

    def __init__(self, dataset: str, image_key: str = "image", caption_key: str = "caption",
                 id_key: str | None = None, splits: str | None = None,
                 names: str = "validation=val", allow_outside: bool = False,
                 max_size: int | None = None, jpeg_quality: int | None = None) -> None:
        require_extra("datasets", "mmgoal make-shards hf")
        self.dataset, self.image_key, self.caption_key = dataset, image_key, caption_key
        self.allow_outside = allow_outside
        self.id_key, self.max_size, self.jpeg_quality = id_key, max_size, jpeg_quality
        loaded = self._load()
        wanted = splits.split(",") if splits else list(loaded)
        unknown = [split for split in wanted if split not in loaded]
        if unknown:
            raise ValueError(f"{dataset} has no split {', '.join(map(repr, unknown))} "
                             f"(--splits); its splits are: {', '.join(loaded)}")
        renames = split_names(names)
        self.inputs = {renames.get(split, split): split for split in wanted}
        if len(self.inputs) < len(wanted):
            raise ValueError(f"names {names!r} give two splits the same shard name")
        for split in wanted:
            columns = loaded[split].column_names
            for option, key in (("--image-key", image_key), ("--caption-key", caption_key),
                                ("--id-key", id_key)):
                if key is not None and key not in columns:
                    raise ValueError(f"{dataset} split {split!r} has no column {key!r} "
                                     f"({option}); its columns are: {', '.join(columns)}")
            check_column_kinds(loaded[split].features, caption_key, id_key,
                               f"{dataset} split {split!r}")
        self._datasets = {name: self._readable(loaded[split])
                          for name, split in self.inputs.items()}

    def _load(self) -> dict:
        """The dataset's splits by name."""
        datasets = importlib.import_module("datasets")
        folder = Path(self.dataset)
        saved = any((folder / name).is_file()
                    for name in ("dataset_dict.json", "state.json", "dataset_info.json"))
        try:
            loaded = (datasets.load_from_disk(str(folder)) if saved
                      else datasets.load_dataset(self.dataset))
        except (OSError, ValueError) as error:  # the hub out of reach: a ConnectionError
            where = "a folder written by save_to_disk" if folder.is_dir() else "a local folder"
            raise FileNotFoundError(
                f"{self.dataset} is not {where}, and datasets.load_dataset could not load "
                f"it ({error}); give a folder written by save_to_disk, or a Hugging Face hub "
                f"id (online)") from error
        if isinstance(loaded, datasets.Dataset):
            return {str(loaded.split or "train"): loaded}
        return dict(loaded)

    def _readable(self, dataset: Any) -> Any:
        """The split's columns that a sample reads, its images as bytes (not decoded)."""
        datasets = importlib.import_module("datasets")
        dataset = dataset.select_columns([key for key in (self.image_key, self.caption_key,
                                                          self.id_key) if key])
        if isinstance(dataset.features[self.image_key], datasets.Image):
            dataset = dataset.cast_column(self.image_key, datasets.Image(decode=False))
        return dataset

    def _split(self, name: str) -> Any:
        if not self._datasets:  # in a worker process: opened again (a memory map)
            loaded = self._load()
            self._datasets = {shard: self._readable(loaded[split])
                              for shard, split in self.inputs.items()}
        return self._datasets[name]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_datasets": {}}

    def splits(self) -> list[str]:
        return list(self.inputs)

    def items(self, split: str) -> list[tuple[str | int, list[int]]]:
        """(image id, its rows) of every image, in the order of their first rows."""
        dataset = self._split(split)
        if self.id_key is None:
            return [(f"{split}-{row:07d}", [row]) for row in range(len(dataset))]
        rows: dict[Any, list[int]] = {}
        unnamed = []  # a null id names no image: its row is refused, never joined to others
        for row, image_id in enumerate(dataset[self.id_key]):
            if image_id is None:
                unnamed.append((None, [row]))
            else:
                rows.setdefault(image_id, []).append(row)
        return list(rows.items()) + unnamed

    def sample(self, split: str, item: tuple[str | int, list[int]]) -> dict:
        image_id, rows = item
        dataset = self._split(split)
        records = [dataset[row] for row in rows]
        where = f"{self.inputs[split]} row {rows[0]}"
        if image_id is None:
            raise SkippedItem("no image id", f"{self.dataset} {where}: its {self.id_key!r} "
                                             f"(--id-key) is null")
        captions = [text for row, record in zip(rows, records) for text in caption_list(
            record[self.caption_key], f"{self.dataset} {self.inputs[split]} row {row} column "
                                      f"{self.caption_key!r}")]
        if not captions:
            raise SkippedItem("no captions", f"{self.dataset} {where}")
        image = records[0][self.image_key]
        if isinstance(image, dict):  # an Image feature: its bytes, or a path to read
            name, data = image.get("path"), image.get("bytes")
        else:
            name, data = (image, None) if isinstance(image, str) else (None, image)
        if name is None and data is None:
            raise SkippedItem("missing image", f"{self.dataset} {where} has no image")
        root = None
        if data is None and not self.allow_outside:  # a file the dataset names: in its folder
            root = Path(self.dataset) if Path(self.dataset).is_dir() else Path(
                importlib.import_module("datasets").config.HF_DATASETS_CACHE)
        member = image_member(Path(name or where), self.max_size, self.jpeg_quality, data, root)
        return captioned_image(split, image_id, captions, member)


def check_column_kinds(features: dict, caption_key: str, id_key: str | None,
                       where: str) -> None:
    """A ValueError for a caption column that is not text (a string, or a list of strings)
    and an id column that is not a plain value: a mapping's field names are no captions, a
    list is no image id."""
    datasets = importlib.import_module("datasets")

    def text(feature: Any) -> bool:
        return isinstance(feature, datasets.Value) and feature.dtype in ("string",
                                                                         "large_string")

    caption = features[caption_key]
    if not text(caption) and not text(getattr(caption, "feature", None)):
        raise ValueError(f"{where}: the caption column {caption_key!r} (--caption-key) holds "
                         f"{caption}, not text (a string or a list of strings); give the "
                         f"column of the captions themselves")
    if id_key is not None and not isinstance(features[id_key], datasets.Value):
        raise ValueError(f"{where}: the id column {id_key!r} (--id-key) holds "
                         f"{features[id_key]}, not one value per row (a number or a "
                         f"string); give a column of image ids, or leave --id-key out")
