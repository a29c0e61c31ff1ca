"""Flickr30K Entities reader: phrases of ``Sentences/<id>.txt``, boxes of
``Annotations/<id>.xml``.

A sentence marks phrases as ``[/EN#<entity id>/<type>[/<type>...] words]``; an annotation's
``<object>`` has ``<name>`` entity ids and a ``<bndbox>`` (pixels) or ``<nobndbox>`` /
``<scene>``. Entities come out in the shards' JSON layout (``caption``, ``first_word``,
``phrase``, ``entity_id``, ``type``, ``boxes``), so the attention metrics read both alike.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from mmgoal.files import MAX_LIST_BYTES, read_bytes, read_text

_PHRASE = re.compile(r"\[/EN#(\d+)/(\S+) ([^\]]*)\]")


def normalise_caption(caption: str) -> str:
    """Lower case, single spaces: the key that joins a sentence to a shard caption."""
    return " ".join(caption.lower().split())


def parse_sentence(line: str) -> tuple[str, list[dict]]:
    """One marked-up sentence -> (plain caption, phrases with ``first_word`` indices into
    ``caption.split()``)."""
    words: list[str] = []
    phrases = []
    position = 0

    def add_text(text: str) -> None:
        parts = text.split()
        if parts and words and not text[0].isspace():  # "[... circle]," keeps its comma
            words[-1] += parts.pop(0)
        words.extend(parts)

    for match in _PHRASE.finditer(line):
        add_text(line[position:match.start()])
        phrase_words = match.group(3).split()
        phrases.append({"first_word": len(words), "phrase": " ".join(phrase_words),
                        "entity_id": match.group(1), "type": match.group(2)})
        words += phrase_words
        position = match.end()
    add_text(line[position:])
    return " ".join(words), phrases


def parse_annotation(path: str | Path) -> dict:
    """An ``Annotations/<id>.xml`` -> ``{"width", "height", "boxes": {entity id: [xyxy]}}``."""
    try:
        root = ElementTree.fromstring(read_bytes(path, "Flickr30K Entities annotation file",
                                                 MAX_LIST_BYTES))
        size = root.find("size")
        width = int(size.findtext("width")) if size is not None else None
        height = int(size.findtext("height")) if size is not None else None
        boxes: dict[str, list[list[float]]] = {}
        for obj in root.iter("object"):
            box = obj.find("bndbox")
            if box is None:  # <nobndbox> or <scene>: the phrase has no box
                continue
            xyxy = [float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")]
            for name in obj.findall("name"):
                boxes.setdefault(name.text.strip(), []).append(xyxy)
    except (ElementTree.ParseError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable Flickr30K Entities annotation ({error})") \
            from error
    return {"width": width, "height": height, "boxes": boxes}


def read_image_entities(root: str | Path, image_id: str | int) -> dict | None:
    """``{"captions", "width", "height", "entities"}`` of one image (boxes in pixels; a
    phrase without a box has ``boxes: []``), or ``None`` when its files are missing."""
    root = Path(root)
    sentences = root / "Sentences" / f"{image_id}.txt"
    annotation = root / "Annotations" / f"{image_id}.xml"
    if not sentences.is_file() or not annotation.is_file():
        return None
    boxes = parse_annotation(annotation)
    captions, entities = [], []
    for line in read_text(sentences, "Flickr30K Entities sentence file").splitlines():
        if not line.strip():
            continue
        caption, phrases = parse_sentence(line)
        for phrase in phrases:
            entities.append({"caption": len(captions), **phrase,
                             "boxes": boxes["boxes"].get(phrase["entity_id"], [])})
        captions.append(caption)
    return {"captions": captions, "width": boxes["width"], "height": boxes["height"],
            "entities": entities}


def entities_for_captions(record: dict, captions: list[str], fractions: bool = True
                          ) -> list[dict]:
    """The record's entities re-indexed to ``captions`` (joined by normalised text),
    boxes as fractions of the image size (or in pixels, as shards store them,
    without ``fractions``). Entities of sentences not among ``captions`` are dropped."""
    index = {normalise_caption(c): k for k, c in enumerate(captions)}
    scale = ([record["width"], record["height"], record["width"], record["height"]]
             if fractions else [1, 1, 1, 1])
    if not all(scale):
        raise ValueError("a Flickr30K Entities annotation has no <size>: cannot scale its boxes")
    out = []
    for entity in record["entities"]:
        target = index.get(normalise_caption(record["captions"][entity["caption"]]))
        if target is not None:
            out.append({**entity, "caption": target,
                        "boxes": [[v / s for v, s in zip(box, scale)] for box in entity["boxes"]]})
    return out
