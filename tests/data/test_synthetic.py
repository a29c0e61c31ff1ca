import re
import xml.etree.ElementTree as ET

import numpy as np

from mmgoal.data.synthetic import (
    COLOURS,
    SHAPES,
    SceneObject,
    make_scene,
    position_phrase,
    relation_phrase,
    write_flickr_entities,
)


def test_scenes_are_a_pure_function_of_seed_and_index():
    a, b = make_scene(0, 17), make_scene(0, 17)
    assert a.captions == b.captions
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert make_scene(1, 17).captions != a.captions or not np.array_equal(
        np.asarray(make_scene(1, 17).image), np.asarray(a.image))


def test_every_caption_names_every_object_and_entities_point_at_its_words():
    for index in range(60):
        scene = make_scene(5, index)
        assert 1 <= len(scene.objects) <= 4
        assert len(scene.captions) == 5 and len(set(scene.captions)) >= 3
        for c, caption in enumerate(scene.captions):
            words = [w.strip(",.:").lower() for w in caption.split()]
            mentions = [e for e in scene.entities if e["caption"] == c]
            assert len(mentions) == len(scene.objects)
            for entity in mentions:
                phrase = entity["phrase"].lower().split()
                assert words[entity["first_word"]:entity["first_word"] + len(phrase)] == phrase
                obj = scene.objects[int(entity["entity_id"]) - index * 10]
                assert obj.colour in phrase and obj.shape in phrase
                assert entity["boxes"] == [[round(v, 2) for v in obj.box]]
            if len(scene.objects) == 1:  # a lone object is placed in the caption
                assert position_phrase(scene.objects[0], 64) in caption


def test_images_show_the_objects_in_their_colours():
    scene = make_scene(2, 3)
    pixels = np.asarray(scene.image).astype(float)
    for obj in scene.objects:
        x1, y1, x2, y2 = obj.box
        cx, cy = int((x1 + x2) / 2), int((y1 + y2) / 2)
        centre = pixels[cy - 1:cy + 2, cx - 1:cx + 2].reshape(-1, 3).mean(0)
        distances = {name: np.linalg.norm(centre - rgb) for name, rgb in COLOURS.items()}
        assert min(distances, key=distances.get) == obj.colour, (obj, centre)
    assert pixels[0, 0].max() < 90  # dark background


def test_vocabulary_covers_shapes_colours_and_relations():
    assert len(SHAPES) >= 6 and len(COLOURS) >= 8
    left = SceneObject("circle", "red", "small", (0, 20, 10, 30))
    right = SceneObject("square", "blue", "small", (40, 22, 50, 32))
    top = SceneObject("star", "green", "large", (20, 0, 30, 10))
    assert relation_phrase(left, right) == "to the left of"
    assert relation_phrase(right, left) == "to the right of"
    assert relation_phrase(top, right) == "above"
    assert position_phrase(left, 64) == "on the left"
    assert position_phrase(top, 64) == "at the top"


def test_flickr_entities_export(tmp_path):
    scenes = [make_scene(0, i) for i in range(5)]
    write_flickr_entities(scenes, tmp_path)
    for scene in scenes:
        lines = (tmp_path / "Sentences" / f"{scene.image_id}.txt").read_text().splitlines()
        assert len(lines) == 5
        for line, caption in zip(lines, scene.captions):
            # removing the markup gives the caption back
            assert re.sub(r"\[/EN#\d+/\w+ ([^\]]+)\]", r"\1", line) == caption
            marked = re.findall(r"\[/EN#(\d+)/(\w+) ([^\]]+)\]", line)
            assert len(marked) == len(scene.objects)
        root = ET.parse(tmp_path / "Annotations" / f"{scene.image_id}.xml").getroot()
        boxes = {o.find("name").text: [int(o.find("bndbox").find(k).text)
                                       for k in ("xmin", "ymin", "xmax", "ymax")]
                 for o in root.iter("object")}
        assert len(boxes) == len(scene.objects)
        for k, obj in enumerate(scene.objects):
            assert boxes[str(scene.image_id * 10 + k)] == [int(round(v)) for v in obj.box]


def test_benchmark_shards(tiny_benchmark):
    out, summary = tiny_benchmark
    assert summary["splits"]["train"]["images"] == 96
    assert summary["splits"]["train"]["shards"] == [f"train-00000{i}.tar" for i in range(3)]
    assert (out / "meta.json").is_file()
