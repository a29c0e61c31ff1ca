"""Shard sources for the papers' data sets (``mmgoal make-shards SOURCE``): ``karpathy``
(a Karpathy split JSON and its images), ``precomputed`` (SCAN / VSE-infinity region
features, read through memory maps) and ``entities`` (Flickr30K Entities joined into
existing shards); docs/data.md has each one's downloads and commands.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from mmgoal.data.coco import CaptionIds
from mmgoal.data.conversion import (
    MAX_EXAMPLES,
    ShardSource,
    SkippedItem,
    image_member,
    split_names,
)
from mmgoal.data.flickr_entities import entities_for_captions, read_image_entities
from mmgoal.data.remote import expand_shards, iter_samples, raise_problem
from mmgoal.data.tars import sample_keys
from mmgoal.files import MAX_ANNOTATION_BYTES, check_regular, read_text
from mmgoal.registry import SHARD_SOURCES

logger = logging.getLogger(__name__)

KARPATHY_SPLITS = ("train", "restval", "val", "test")


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


@SHARD_SOURCES.register("karpathy")
class KarpathySource(ShardSource):
    """Images and captions of a Karpathy split JSON: ``images[]`` entries with ``filename``,
    optional ``filepath``, ``split`` and ``sentences[].raw`` (docs/data.md, "COCO").
    ``image_id`` is ``cocoid``, else the file name without extension (Flickr30K's id). An
    image listed twice is converted once, with a warning: its copy would be a negative.

    Args:
        image_root: the folder ``filepath/filename`` paths start from.
        max_size, jpeg_quality: re-encode as JPEG images whose longer side exceeds
            ``max_size``, or every image at ``jpeg_quality``.
        coco_captions: COCO's caption files, comma-separated, for each JSON's
            ``caption_ids`` (:mod:`mmgoal.data.coco`).
        allow_outside: also take images whose path leads outside ``image_root``.
    """

    def __init__(self, json: str, image_root: str, max_size: int | None = None,
                 jpeg_quality: int | None = None, coco_captions: str | None = None,
                 allow_outside: bool = False) -> None:
        path = Path(json)
        if not path.is_file():
            raise FileNotFoundError(f"Karpathy split file {path} does not exist")
        try:
            images = _read_json(path)["images"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path} has no 'images' list; is it a Karpathy split file "
                             f"(dataset_coco.json / dataset_flickr30k.json)?") from error
        self.image_root = Path(image_root)
        if not self.image_root.is_dir():
            raise FileNotFoundError(f"image root {self.image_root} is not a folder")
        self.max_size, self.jpeg_quality = max_size, jpeg_quality
        self.allow_outside = allow_outside
        self.by_split: dict[str, list[dict]] = {}
        first_split: dict = {}
        repeated = []
        for image in images:
            image_id = karpathy_image_id(image)
            if image_id in first_split:
                repeated.append(f"{image_id!r} ({first_split[image_id]}, {image['split']})")
                continue
            first_split[image_id] = image["split"]
            self.by_split.setdefault(image["split"], []).append(image)
        if repeated:
            logger.warning("%s lists %d images more than once, e.g. %s; each is converted "
                           "once, from its first entry", path, len(repeated),
                           ", ".join(repeated[:MAX_EXAMPLES]))
        if coco_captions:
            self._match_caption_ids(CaptionIds(coco_captions), path)

    def _match_caption_ids(self, annotations: CaptionIds, path: Path) -> None:
        """Give every entry ``caption_ids``, its sentences' COCO caption ids."""
        entries = [image for split in self.splits() for image in self.by_split[split]]
        matched = annotations.match_images(
            ((karpathy_image_id(image), [s["raw"] for s in image.get("sentences", [])])
             for image in entries), str(path))
        for image, ids in zip(entries, matched):
            image["caption_ids"] = ids

    def splits(self) -> list[str]:
        return [s for s in KARPATHY_SPLITS if s in self.by_split] + sorted(
            set(self.by_split) - set(KARPATHY_SPLITS))

    def items(self, split: str) -> list[dict]:
        return self.by_split[split]

    def sample(self, split: str, item: dict) -> dict:
        image_id = karpathy_image_id(item)
        captions = [s["raw"] for s in item.get("sentences", [])]
        if not captions:
            raise SkippedItem("no captions", item["filename"])
        path = self.image_root / item.get("filepath", "") / item["filename"]
        extension, data, width, height = image_member(
            path, self.max_size, self.jpeg_quality,
            root=None if self.allow_outside else self.image_root)
        meta = {"image_id": image_id, "captions": captions, "filename": item["filename"],
                "split": split, "width": width, "height": height}
        if "imgid" in item:
            meta["imgid"] = item["imgid"]
        if "caption_ids" in item:
            meta["caption_ids"] = item["caption_ids"]
        return {"__key__": str(image_id), extension: data, "json": json.dumps(meta).encode()}


def karpathy_image_id(item: dict) -> int | str:
    """The ``cocoid`` of a Karpathy entry (COCO), else its file name without extension."""
    return item.get("cocoid", Path(item["filename"]).stem)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path, "annotation file", MAX_ANNOTATION_BYTES))
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from error


@SHARD_SOURCES.register("precomputed")
class PrecomputedSource(ShardSource):
    """Region features of SCAN / VSE-infinity: ``{split}_ims.npy`` (images, regions, dim),
    or one row per caption, + ``{split}_caps.txt``; optional ``{split}_boxes.npy`` or
    ``_ims_bbx.npy`` pixel boxes, ``_ims_size.npy`` and ``_ids.txt`` (docs/data.md,
    "Precomputed region features"). Features and boxes keep their dtype.

    Args:
        splits: comma-separated or a list (default: every ``*_caps.txt``).
        names: shard names of input splits, ``"dev=val,testall=test"``.
        coco_captions: as ``karpathy``'s; needs COCO image ids in ``{split}_ids.txt``.
    """

    def __init__(self, data_dir: str, splits: str | list[str] | None = None,
                 captions_per_image: int = 5, names: str | dict = "dev=val",
                 coco_captions: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        if not self.data_dir.is_dir():
            raise FileNotFoundError(f"feature folder {self.data_dir} does not exist")
        found = sorted(p.name[:-len("_caps.txt")] for p in self.data_dir.glob("*_caps.txt"))
        wanted = splits.split(",") if isinstance(splits, str) else list(splits or found)
        missing = [s for s in wanted if not (self.data_dir / f"{s}_ims.npy").is_file()
                   or s not in found]
        if missing or not wanted:
            raise FileNotFoundError(f"{self.data_dir} lacks {{split}}_ims.npy / _caps.txt for "
                                    f"{', '.join(missing) or 'any split'}; found captions for "
                                    f"{', '.join(found) or 'none'}")
        self.wanted = wanted
        self.per_image = captions_per_image
        self.names = split_names(names)
        self.inputs = {self.names.get(s, s): s for s in wanted}
        if len(self.inputs) < len(wanted):
            raise ValueError(f"names {names!r} give two splits the same shard name")
        self._arrays: dict[str, Any] = {}
        self.caption_ids: dict[str, list] = {}
        if coco_captions:
            self._match_caption_ids(CaptionIds(coco_captions))

    def _match_caption_ids(self, annotations: CaptionIds) -> None:
        """Every split's caption ids, by image (its ``{split}_ids.txt`` must name COCO ids)."""
        for split in self.wanted:
            ids = self._ids(split)
            if not ids:
                raise FileNotFoundError(f"--coco-captions needs the COCO image id of every "
                                        f"image: {self.data_dir / split}_ids.txt is missing")
            captions = self._captions(split)
            per_image = [captions[i * self.per_image:(i + 1) * self.per_image]
                         for i in range(len(ids))]
            self.caption_ids[split] = annotations.match_images(
                zip(ids, per_image), str(self.data_dir / f"{split}_caps.txt"))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": {}}  # memory maps are reopened in each worker

    def _array(self, name: str) -> np.ndarray | None:
        if name not in self._arrays:
            path = self.data_dir / name
            self._arrays[name] = np.load(path, mmap_mode="r") if path.exists() and \
                check_regular(path, "feature file") else None
        return self._arrays[name]

    def _captions(self, split: str) -> list[str]:
        key = f"{split}_caps.txt"
        if key not in self._arrays:
            self._arrays[key] = read_text(self.data_dir / key, "caption file",
                                          MAX_ANNOTATION_BYTES).splitlines()
        return self._arrays[key]

    def splits(self) -> list[str]:
        return list(self.inputs)

    def rows_per_image(self, split: str) -> int:
        """1 when the features hold a row per image, ``captions_per_image`` when per caption."""
        split = self.inputs.get(split, split)
        images = -(-len(self._captions(split)) // self.per_image)
        rows = self._array(f"{split}_ims.npy").shape[0]
        if rows not in (images, images * self.per_image):
            raise ValueError(f"{self.data_dir / split}_ims.npy has {rows} rows for "
                             f"{len(self._captions(split))} caption lines: expected one per "
                             f"image ({images}) or one per caption ({images * self.per_image})")
        return rows // images

    def items(self, split: str) -> list[int]:
        rows = self._array(f"{self.inputs[split]}_ims.npy").shape[0]
        return list(range(rows // self.rows_per_image(split)))

    def sample(self, name: str, index: int) -> dict:
        split = self.inputs[name]
        features = self._array(f"{split}_ims.npy")
        captions = self._captions(split)
        row = index * self.rows_per_image(split)
        mine = captions[index * self.per_image:(index + 1) * self.per_image]
        if len(mine) < self.per_image:
            raise SkippedItem("missing captions", f"{split} image {index} has {len(mine)} of "
                                                  f"{self.per_image} caption lines")
        ids = self._ids(split)
        image_id = ids[index] if ids else f"{split}-{index}"
        meta: dict[str, Any] = {"image_id": image_id, "captions": mine, "split": name}
        if split in self.caption_ids:
            meta["caption_ids"] = self.caption_ids[split][index]
        sample = {"__key__": f"{name}-{index:07d}", "regions.npy": _npy(features[row])}
        boxes = self._array(f"{split}_boxes.npy")
        boxes = boxes if boxes is not None else self._array(f"{split}_ims_bbx.npy")
        if boxes is not None:
            sample["boxes.npy"] = _npy(boxes[index])
        sizes = self._array(f"{split}_ims_size.npy")
        if sizes is not None:
            meta["width"], meta["height"] = (int(v) for v in sizes[index][:2])
        sample["json"] = json.dumps(meta).encode()
        return sample

    def _ids(self, split: str) -> list[str] | None:
        key = f"{split}_ids.txt"
        if key not in self._arrays:
            path = self.data_dir / key
            self._arrays[key] = read_text(path, "id file", MAX_ANNOTATION_BYTES).split() \
                if path.exists() else None
        return self._arrays[key]


@SHARD_SOURCES.register("entities")
class EntitiesSource(ShardSource):
    """Existing shards with Flickr30K Entities phrases and boxes (``entities_root``'s
    ``Sentences/`` and ``Annotations/``) joined into each sample's JSON as ``entities``, its
    captions matched case- and space-insensitively; a shard keeps its name.
    """

    def __init__(self, shards: str | list[str], entities_root: str) -> None:
        self.urls = expand_shards(shards)
        self.root = Path(entities_root)
        for sub in ("Sentences", "Annotations"):
            if not (self.root / sub).is_dir():
                raise FileNotFoundError(f"{self.root} has no {sub}/ folder; point "
                                        f"--entities-root at the Flickr30K Entities folder")
        self.prefixes = sorted({Path(u).name.rsplit("-", 1)[0] for u in self.urls})

    def splits(self) -> list[str]:
        return self.prefixes

    def items(self, split: str) -> list[str]:
        return [u for u in self.urls if Path(u).name.rsplit("-", 1)[0] == split]

    def plan(self, split: str, shard_size: int) -> list[list[tuple[str, str]]]:
        """One output shard per input shard, whatever ``shard_size`` says."""
        plans: list[list[tuple[str, str]]] = []
        for url in self.items(split):
            index = int(Path(url).stem.rsplit("-", 1)[1])
            while len(plans) < index:
                plans.append([])
            plans.append([(url, key) for key in sample_keys(url)])
        return plans

    def sample(self, split: str, item: tuple[str, str]) -> dict:
        url, key = item
        members = self._members(url).get(key, {})
        if "json" not in members:
            raise SkippedItem("no json member", f"{key} in {url}")
        meta = json.loads(members["json"])
        record = read_image_entities(self.root, meta.get("image_id", key))
        if record is not None:
            meta["entities"] = entities_for_captions(record, meta.get("captions", []),
                                                     fractions=False)
            meta.setdefault("width", record.get("width"))
            meta.setdefault("height", record.get("height"))
        return {"__key__": key, **{ext: data for ext, data in members.items() if ext != "json"},
                "json": json.dumps(meta).encode()}

    def _members(self, url: str) -> dict[str, dict[str, bytes]]:
        """Every member of ``url`` by sample key (one shard held at a time)."""
        if getattr(self, "_cached_url", None) != url:
            grouped = {sample.pop("__key__"): sample for sample in iter_samples(url, raise_problem)}
            for members in grouped.values():
                del members["__url__"]
            self._cached_url, self._cached = url, grouped
        return self._cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_cached")}
