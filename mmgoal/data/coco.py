"""COCO caption annotation ids for the sentences of other files (docs/data.md, "COCO ids").

Karpathy's split file has sentence ids of its own; ECCV Caption, CxC and PM-COCO
(docs/reference/retrieval.md) key captions by the ids only COCO's
``captions_{train,val}2014.json`` hold. :class:`CaptionIds` matches each sentence to one of
its image's annotations by text.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from mmgoal.data.remote import expand_shards, iter_samples, raise_problem
from mmgoal.extras import require_extra
from mmgoal.files import MAX_ANNOTATION_BYTES, read_text

logger = logging.getLogger(__name__)


def caption_text_keys(text: str) -> tuple[str, str]:
    """The two keys a sentence is matched by: casefolded with spaces collapsed, and that
    with only letters and digits kept."""
    spaced = " ".join(text.casefold().split())
    return spaced, re.sub(r"[\W_]+", "", spaced)


class CaptionIds:
    """The caption annotations of COCO files (a list, or comma-separated), by image id, to
    match sentences to."""

    def __init__(self, paths: str | Sequence[str]) -> None:
        files = [p for p in paths.split(",") if p] if isinstance(paths, str) else list(paths)
        if not files:
            raise ValueError("no COCO caption annotation file given (--coco-captions "
                             "captions_val2014.json)")
        self.by_image: dict[int, list[tuple[int, str]]] = {}
        for name in files:
            path = Path(name)
            if not path.is_file():
                raise FileNotFoundError(f"COCO caption annotations {path} do not exist; they "
                                        f"are annotations/captions_val2014.json (and _train2014) "
                                        f"of COCO's 2014 annotations")
            try:
                annotations = json.loads(read_text(path, "COCO caption annotation file",
                                                   MAX_ANNOTATION_BYTES))["annotations"]
                for annotation in annotations:
                    self.by_image.setdefault(int(annotation["image_id"]), []).append(
                        (int(annotation["id"]), str(annotation["caption"])))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path} is not COCO caption annotations (an 'annotations' "
                                 f"list of image_id, id, caption): {error!r}") from error

    def match(self, image_id, sentences: Iterable[str]) -> list[int | None]:
        """The annotation id of each of an image's sentences, ``None`` where no annotation
        of the image has its text (or every one that has was taken by an earlier sentence)."""
        try:
            annotations = self.by_image.get(int(image_id), [])
        except (TypeError, ValueError):  # not a COCO image id (a Flickr file name)
            annotations = []
        keys = [caption_text_keys(text) for _, text in annotations]
        taken: set[int] = set()
        ids: list[int | None] = []
        for sentence in sentences:
            wanted = caption_text_keys(sentence)
            found = None
            for level in (0, 1):
                found = next((i for i, key in enumerate(keys)
                              if i not in taken and key[level] == wanted[level]), None)
                if found is not None:
                    break
            if found is not None:
                taken.add(found)
            ids.append(None if found is None else annotations[found][0])
        return ids

    def match_images(self, images: Iterable[tuple], where: str) -> list[list[int | None]]:
        """:meth:`match` for each ``(image_id, sentences)`` of ``images``; a warning gives
        how many sentences of ``where`` found no annotation, with examples."""
        matched, unmatched, sentences = [], [], 0
        for image_id, texts in images:
            matched.append(self.match(image_id, texts))
            sentences += len(texts)
            unmatched += [f"{image_id}: {text!r}"
                          for text, found in zip(texts, matched[-1]) if found is None]
        if unmatched:
            logger.warning("%s: %d of %d sentences match no COCO caption annotation of their "
                           "image (their caption id is null), e.g. %s", where, len(unmatched),
                           sentences, "; ".join(unmatched[:5]))
        else:
            logger.info("%s: every one of %d sentences has its COCO caption id", where,
                        sentences)
        return matched


def package_data_dir() -> Path:
    """The data folder of the installed ``eccv_caption`` (found, not imported): the COCO
    protocols' ids and positives (docs/reference/retrieval.md, "COCO protocols")."""
    require_extra("eccv_caption", "evaluation.protocols eccv, cxc and pm (the COCO protocols)")
    spec = importlib.util.find_spec("eccv_caption")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def check_caption_ids(shards: str | Sequence[str], protocols: Sequence[str]) -> None:
    """What a test split needs for the protocols beyond ``coco``, before training:
    eccv_caption installed, and COCO caption ids in the first sample of the first local
    shard (remote shards, and the whole COCO 5K check, come with the test itself)."""
    if all(protocol == "coco" for protocol in protocols):
        return
    package_data_dir()
    first = next((url for url in expand_shards(shards) if Path(url).is_file()), None)
    if first is None:
        return
    sample = next(iter_samples(first, raise_problem,
                               select_files=lambda name: name.endswith(".json")), {})
    if json.loads(sample.get("json", b"{}")).get("caption_ids") is None:
        raise ValueError(f"evaluation.protocols {list(protocols)} scores the test split by "
                         f"COCO caption ids, and {first} has none: make the shards with "
                         f"mmgoal make-shards karpathy ... --coco-captions "
                         f"captions_val2014.json (docs/data.md, 'COCO ids'), or set "
                         f"evaluation.protocols=[coco]")
