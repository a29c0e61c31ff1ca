"""Synthetic scenes: a retrieval benchmark that needs no download (docs/synthetic.md):
1-4 coloured shapes on a dark, noisy background, five captions from different templates
with entity annotations (phrase -> box); a scene is a pure function of ``(seed, index)``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mmgoal import strict_json
from mmgoal.console import progress_bar
from mmgoal.files import write_text

SHAPES = ("circle", "square", "triangle", "diamond", "cross", "star")
COLOURS = {
    "red": (225, 35, 35),
    "green": (40, 200, 40),
    "blue": (45, 90, 255),
    "yellow": (240, 230, 40),
    "purple": (165, 60, 225),
    "cyan": (40, 220, 220),
    "orange": (255, 140, 10),
    "white": (235, 235, 235),
}
SIZES = {"small": 0.19, "large": 0.34}  # side of the shape's box, in image widths
OBJECT_COUNT_PROBS = (0.1, 0.3, 0.3, 0.3)  # 1, 2, 3, 4 objects
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
SPLITS = ("train", "val", "test")
# Split seeds are offset so no scene repeats across splits.
SPLIT_OFFSETS = {"train": 0, "val": 10_000_000, "test": 20_000_000}


@dataclass
class SceneObject:
    shape: str
    colour: str
    size: str
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 in pixels

    @property
    def centre(self) -> tuple[float, float]:
        return (self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2


@dataclass
class Scene:
    image_id: int
    image: Image.Image
    objects: list[SceneObject]
    captions: list[str] = field(default_factory=list)
    entities: list[dict] = field(default_factory=list)


def _polygon(shape: str, box: tuple[float, float, float, float]) -> list[tuple[float, float]]:
    x1, y1, x2, y2 = box
    cx, cy, w = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1
    if shape == "triangle":
        return [(cx, y1), (x2, y2), (x1, y2)]
    if shape == "diamond":
        return [(cx, y1), (x2, cy), (cx, y2), (x1, cy)]
    if shape == "star":
        points = []
        for k in range(10):
            radius = (w / 2) if k % 2 == 0 else (w / 2) * 0.45
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        return points
    if shape == "cross":
        t = w / 6
        return [
            (cx - t, y1), (cx + t, y1), (cx + t, cy - t), (x2, cy - t), (x2, cy + t),
            (cx + t, cy + t), (cx + t, y2), (cx - t, y2), (cx - t, cy + t), (x1, cy + t),
            (x1, cy - t), (cx - t, cy - t),
        ]
    raise ValueError(f"no polygon for shape {shape!r}")


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, colour: tuple, scale: int) -> None:
    box = tuple(v * scale for v in obj.box)
    if obj.shape == "circle":
        draw.ellipse(box, fill=colour)
    elif obj.shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon(_polygon(obj.shape, box), fill=colour)


def place_objects(rng: np.random.Generator, n: int, image_size: int) -> list[SceneObject]:
    objects: list[SceneObject] = []
    for _ in range(n):
        for _attempt in range(100):
            size = str(rng.choice(list(SIZES)))
            side = SIZES[size] * image_size * rng.uniform(0.9, 1.1)
            x1 = rng.uniform(1, image_size - side - 1)
            y1 = rng.uniform(1, image_size - side - 1)
            box = (x1, y1, x1 + side, y1 + side)
            gap = 2.0
            if all(
                box[2] + gap <= o.box[0] or o.box[2] + gap <= box[0]
                or box[3] + gap <= o.box[1] or o.box[3] + gap <= box[1]
                for o in objects
            ):
                objects.append(SceneObject(
                    shape=str(rng.choice(SHAPES)),
                    colour=str(rng.choice(list(COLOURS))),
                    size=size,
                    box=box,
                ))
                break
    return objects


def render_scene(rng: np.random.Generator, objects: list[SceneObject],
                 image_size: int) -> Image.Image:
    """Draw objects (4x supersampled, then downsampled) on a dark noisy background."""
    scale = 4
    background = tuple(int(v) for v in rng.integers(0, 60, size=3))
    canvas = Image.new("RGB", (image_size * scale, image_size * scale), background)
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        jitter = rng.integers(-20, 21, size=3)
        colour = tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(COLOURS[obj.colour], jitter))
        _draw_object(draw, obj, colour, scale)
    image = canvas.resize((image_size, image_size), Image.Resampling.BOX)
    pixels = np.asarray(image, dtype=np.float32)
    pixels += rng.normal(0.0, 6.0, size=pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def position_phrase(obj: SceneObject, image_size: int) -> str:
    """Where the object's centre lies on a 3x3 grid ("in the top left corner")."""
    cx, cy = obj.centre
    col = min(int(3 * cx / image_size), 2)
    row = min(int(3 * cy / image_size), 2)
    vertical = ("top", "middle", "bottom")[row]
    horizontal = ("left", "centre", "right")[col]
    if row == 1 and col == 1:
        return "in the middle"
    if row == 1:
        return f"on the {horizontal}"
    if col == 1:
        return f"at the {vertical}"
    return f"in the {vertical} {horizontal} corner"


def relation_phrase(a: SceneObject, b: SceneObject) -> str:
    """How ``a`` lies relative to ``b``, along the axis where they differ most."""
    dx = a.centre[0] - b.centre[0]
    dy = a.centre[1] - b.centre[1]
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "above" if dy < 0 else "below"


class CaptionWriter:
    """Builds a caption from pieces, tracking which words name which object."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, int | None]] = []

    def text(self, words: str) -> CaptionWriter:
        self.pieces.append((words, None))
        return self

    def entity(self, words: str, index: int) -> CaptionWriter:
        self.pieces.append((words, index))
        return self

    def finish(self) -> tuple[str, list[tuple[int, str, int]]]:
        """The caption and, per object mention, (first word index, phrase, object index)."""
        words: list[str] = []
        mentions = []
        for text, index in self.pieces:
            piece_words = text.split()
            if piece_words and piece_words[0] in {",", ":", "."} and words:
                words[-1] += piece_words.pop(0)  # punctuation sticks to the word before
            if index is not None:
                mentions.append((len(words), text.strip(" ,."), index))
            words.extend(piece_words)
        caption = " ".join(words)
        return caption[0].upper() + caption[1:], mentions


def _noun_phrase(rng: np.random.Generator, obj: SceneObject, size_prob: float) -> str:
    words = []
    if rng.random() < size_prob:
        words.append(obj.size)
    words += [obj.colour, obj.shape]
    article = "an" if words[0][0] in "aeiou" else "a"
    return f"{article} {' '.join(words)}"


def _join(writer: CaptionWriter, rng: np.random.Generator, parts: list[tuple[str, int]],
          suffixes: list[str] | None = None) -> None:
    for k, (phrase, index) in enumerate(parts):
        if k > 0:
            writer.text("and" if k == len(parts) - 1 else ",")
        writer.entity(phrase, index)
        if suffixes:
            writer.text(suffixes[k])


def write_captions(rng: np.random.Generator, objects: list[SceneObject], image_size: int,
                   n_captions: int = 5) -> list[tuple[str, list[tuple[int, str, int]]]]:
    """``n_captions`` captions from different templates, each naming every object."""
    n = len(objects)
    templates = ["list", "there_is", "positions", "relation", "count", "scene"]
    chosen = rng.permutation(templates)[:n_captions]
    captions = []
    for template in chosen:
        order = [int(i) for i in rng.permutation(n)]
        phrases = [(_noun_phrase(rng, objects[i], 0.8), i) for i in order]
        where = [position_phrase(objects[i], image_size) for i in order]
        # One object alone is identified by its place in the image.
        lone_suffix = [where[0]] if n == 1 else None
        w = CaptionWriter()
        if template == "list":
            w.text(str(rng.choice(["", "an image of", "a picture of", "a photo showing"])))
            _join(w, rng, phrases, lone_suffix)
        elif template == "there_is":
            w.text(str(rng.choice(["there is", "in this picture there is"])))
            _join(w, rng, phrases, lone_suffix)
            w.text(str(rng.choice(["", "on a dark background"])))
        elif template == "positions":
            _join(w, rng, phrases, where)
        elif template == "relation" and n >= 2:
            a, b = order[0], order[1]
            w.entity(phrases[0][0], a).text(relation_phrase(objects[a], objects[b]))
            w.entity(phrases[1][0], b)
            if n > 2:
                w.text(str(rng.choice(["with", "next to", "plus"])))
                _join(w, rng, phrases[2:])
        elif template == "count" and n >= 2:
            w.text(f"{NUMBER_WORDS[n]} {rng.choice(['shapes', 'objects'])}:")
            _join(w, rng, phrases)
        elif template == "scene":
            w.text(str(rng.choice(["a dark scene with", "a noisy background with"])))
            _join(w, rng, phrases, lone_suffix)
        else:  # relation and count need two objects; a lone object gets its place
            w.text(str(rng.choice(["a single", "just one"])))
            obj = objects[0]
            size = f"{obj.size} " if rng.random() < 0.8 else ""
            w.entity(f"{size}{obj.colour} {obj.shape}", 0).text(where[0])
        captions.append(w.finish())
    return captions


def make_scene(seed: int, image_id: int, image_size: int = 64, n_captions: int = 5) -> Scene:
    """The scene ``image_id`` of the benchmark with ``seed``: always the same."""
    rng = np.random.default_rng([seed, image_id])
    n_objects = int(rng.choice(len(OBJECT_COUNT_PROBS), p=OBJECT_COUNT_PROBS)) + 1
    objects = place_objects(rng, n_objects, image_size)
    image = render_scene(rng, objects, image_size)
    scene = Scene(image_id=image_id, image=image, objects=objects)
    for caption_index, (caption, mentions) in enumerate(
        write_captions(rng, objects, image_size, n_captions)
    ):
        scene.captions.append(caption)
        for first_word, phrase, index in mentions:
            obj = objects[index]
            scene.entities.append({
                "caption": caption_index,
                "first_word": first_word,
                "phrase": phrase,
                "entity_id": str(image_id * 10 + index),
                "type": "shapes",
                "boxes": [[round(v, 2) for v in obj.box]],
            })
    return scene


def scene_sample(scene: Scene, split: str) -> dict:
    """The scene as a shard sample (``__key__``, ``png``, ``json``)."""
    buffer = io.BytesIO()
    scene.image.save(buffer, format="PNG")
    meta = {
        "image_id": scene.image_id,
        "captions": scene.captions,
        "width": scene.image.width,
        "height": scene.image.height,
        "split": split,
        "entities": scene.entities,
        "objects": [
            {"shape": o.shape, "colour": o.colour, "size": o.size,
             "box": [round(v, 2) for v in o.box]}
            for o in scene.objects
        ],
    }
    return {"__key__": f"{scene.image_id:09d}", "png": buffer.getvalue(),
            "json": json.dumps(meta).encode()}


def iter_scenes(split: str, count: int, seed: int = 0, image_size: int = 64) -> Iterator[Scene]:
    """The scenes of one split, in order."""
    offset = SPLIT_OFFSETS[split]
    for index in range(count):
        yield make_scene(seed, offset + index, image_size)


def write_flickr_entities(scenes: list[Scene], out_dir: str | Path) -> None:
    """Export scenes in the Flickr30K Entities layout (``Sentences/``, ``Annotations/``)."""
    out_dir = Path(out_dir)
    (out_dir / "Sentences").mkdir(parents=True, exist_ok=True)
    (out_dir / "Annotations").mkdir(parents=True, exist_ok=True)
    for scene in scenes:
        lines = []
        for caption_index, caption in enumerate(scene.captions):
            words = caption.split()
            mentions = sorted(
                (e for e in scene.entities if e["caption"] == caption_index),
                key=lambda e: e["first_word"],
            )
            for entity in reversed(mentions):
                start = entity["first_word"]
                end = start + len(entity["phrase"].split())
                tail = words[end - 1][len(entity["phrase"].split()[-1]):]  # keeps "," / "."
                inner = " ".join(words[start:end - 1] + [entity["phrase"].split()[-1]])
                marked = f"[/EN#{entity['entity_id']}/{entity['type']} {inner}]{tail}"
                words[start:end] = [marked]
            lines.append(" ".join(words))
        # two files a scene, thousands in a folder: not fsynced (make-synthetic writes them again)
        write_text(out_dir / "Sentences" / f"{scene.image_id}.txt", "\n".join(lines) + "\n",
                   durable=False)
        objects_xml = "".join(
            f"<object><name>{scene.image_id * 10 + k}</name><bndbox>"
            f"<xmin>{int(round(o.box[0]))}</xmin><ymin>{int(round(o.box[1]))}</ymin>"
            f"<xmax>{int(round(o.box[2]))}</xmax><ymax>{int(round(o.box[3]))}</ymax>"
            f"</bndbox></object>"
            for k, o in enumerate(scene.objects)
        )
        write_text(out_dir / "Annotations" / f"{scene.image_id}.xml",
                   f"<annotation><filename>{scene.image_id}.png</filename><size>"
                   f"<width>{scene.image.width}</width><height>{scene.image.height}</height>"
                   f"<depth>3</depth></size>{objects_xml}</annotation>\n", durable=False)


def write_benchmark(out_dir: str | Path, counts: dict[str, int] | None = None, seed: int = 0,
                    image_size: int = 64, shard_size: int = 500,
                    flickr_entities: bool = False, progress: bool = True) -> dict:
    """Write the train/val/test shards of the benchmark (and optionally the Entities layout);
    return the summary written to ``out_dir/meta.json``: per split, its shards and counts."""

    from mmgoal.data.shards import ShardWriter

    counts = counts or {"train": 5000, "val": 500, "test": 1000}
    unknown = set(counts) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; splits are {', '.join(SPLITS)}")
    out_dir = Path(out_dir)
    summary: dict = {"seed": seed, "image_size": image_size, "splits": {}}
    for split, count in counts.items():
        scenes_for_entities = []
        with ShardWriter(out_dir, split, max_count=shard_size) as writer:
            for scene in progress_bar(iter_scenes(split, count, seed, image_size), total=count,
                                      desc=f"synthetic {split}", show=progress, leave=False):
                writer.write(scene_sample(scene, split))
                if flickr_entities:
                    scenes_for_entities.append(scene)
        if flickr_entities:
            write_flickr_entities(scenes_for_entities, out_dir / "flickr30k_entities")
        summary["splits"][split] = {
            "images": count,
            "captions": count * 5,
            "shards": [p.name for p in writer.paths],
            "pattern": f"{split}-{{000000..{len(writer.paths) - 1:06d}}}.tar",
        }
    write_text(out_dir / "meta.json", strict_json.dumps(summary, indent=2))
    return summary
