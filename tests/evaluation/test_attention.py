import math

import pytest
import torch

from mmgoal.data.flickr_entities import (
    entities_for_captions,
    parse_annotation,
    parse_sentence,
    read_image_entities,
)
from mmgoal.data.synthetic import make_scene, write_flickr_entities
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.evaluation.attention import AttentionScorer, word_f1, word_precision_recall

REGIONS = torch.tensor([[0, 0, 10, 10], [0, 0, 5, 10], [20, 20, 30, 30]], dtype=torch.float64)
TRUTH = torch.tensor([[0, 0, 10, 10]], dtype=torch.float64)  # IoU 1, 0.5, 0: relevant 0, 1


def test_word_precision_recall_on_a_hand_made_case():
    weights = torch.tensor([[0.5, 0.05, 0.45]], dtype=torch.float64)
    relevant = torch.tensor([[True, True, False]])
    precision, recall = word_precision_recall(weights, relevant, [0.0, 0.05, 0.5])
    # T=0: all three attended; T=0.05: regions 0 and 2 (0.05 is not above it); T=0.5: none.
    torch.testing.assert_close(precision, torch.tensor([[2 / 3, 1 / 2, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(recall, torch.tensor([[1.0, 1 / 2, 0.0]], dtype=torch.float64))


def test_word_f1_is_zero_where_precision_and_recall_are():
    f1 = word_f1(torch.tensor([[1.0, 0.0, 2 / 3]]), torch.tensor([[0.5, 0.0, 1.0]]))
    torch.testing.assert_close(f1, torch.tensor([[2 / 3, 0.0, 0.8]]))


def test_phrase_takes_the_best_word_of_each_metric_and_phrases_are_averaged():
    scorer = AttentionScorer(thresholds=[0.0, 0.05], t_iou=0.4)
    two_words = torch.tensor([[0.5, 0.05, 0.45], [0.2, 0.7, 0.1]], dtype=torch.float64)
    scorer.add_phrase(two_words, REGIONS, TRUTH)
    # A second phrase: one word on regions 0 (0.02) and 2 (0.98).
    scorer.add_phrase(torch.tensor([[0.02, 0.0, 0.98]], dtype=torch.float64), REGIONS, TRUTH)
    scorer.add_phrase(two_words, REGIONS, torch.zeros(0, 4))  # no box: left out
    scorer.add_phrase(two_words, REGIONS, torch.tensor([[50.0, 50, 60, 60]]))  # nothing relevant
    report = scorer.report()
    assert (report.phrases, report.phrases_without_box,
            report.phrases_without_relevant_region) == (2, 1, 1)
    # T=0: phrase 1's words both attend all three: AP 2/3, AR 1, AF 4/5; phrase 2
    # attends {0, 2}: AP 1/2, AR 1/2, AF 1/2.
    # T=0.05: phrase 1's first word attends {0, 2} (AP 1/2, AR 1/2, AF 1/2), its
    # second all three (AP 2/3, AR 1, AF 4/5); phrase 2 attends {2}: 0, 0, 0.
    assert math.isclose(report.precision[0], (2 / 3 + 1 / 2) / 2)
    assert math.isclose(report.recall[0], (1 + 1 / 2) / 2)
    assert math.isclose(report.f1[0], (4 / 5 + 1 / 2) / 2)  # 0.65; F1 of the means: 0.65625
    assert math.isclose(report.precision[1], (2 / 3 + 0) / 2)
    assert math.isclose(report.recall[1], (1 + 0) / 2)
    assert math.isclose(report.f1[1], (4 / 5 + 0) / 2)
    assert report.best == {"t_att": 0.0, "precision": report.precision[0],
                           "recall": report.recall[0], "f1": report.f1[0]}


def test_f1_is_per_word_not_of_the_phrase_best_precision_and_recall():
    """The paper's order (AP, AR, AF per word; max per phrase; mean over phrases)."""
    scorer = AttentionScorer(thresholds=[0.1], t_iou=0.4)
    # Relevant regions: 0 and 1. At T_att 0.1 the first word attends {0}: AP 1,
    # AR 1/2, AF 2/3; the second attends all three: AP 2/3, AR 1, AF 4/5. The
    # phrase: AP max(1, 2/3) = 1, AR max(1/2, 1) = 1, AF max(2/3, 4/5) = 4/5.
    scorer.add_phrase(torch.tensor([[0.9, 0.05, 0.05], [0.4, 0.3, 0.3]], dtype=torch.float64),
                      REGIONS, TRUTH)
    # A second phrase whose one word attends only the irrelevant region 2: 0, 0, 0.
    scorer.add_phrase(torch.tensor([[0.05, 0.05, 0.9]], dtype=torch.float64), REGIONS, TRUTH)
    report = scorer.report()
    # AP (1 + 0) / 2 = 1/2, AR (1 + 0) / 2 = 1/2, AF (4/5 + 0) / 2 = 0.4; the F1 of
    # the averaged AP and AR would be 2 (1/2)(1/2) / (1/2 + 1/2) = 0.5.
    assert report.precision == [0.5] and report.recall == [0.5]
    assert math.isclose(report.f1[0], 0.4)
    assert report.best["f1"] == report.f1[0]


SENTENCES = (
    "[/EN#18/people A child] in [/EN#19/clothing a pink dress] is climbing up "
    "[/EN#20/other a set of stairs] in [/EN#21/scene an entry way] .\n"
    "[/EN#18/people/bodyparts A little girl] climbs [/EN#20/other stairs] .\n"
)
ANNOTATION = """<annotation><filename>1000.jpg</filename>
<size><width>500</width><height>400</height><depth>3</depth></size>
<object><name>18</name><bndbox><xmin>10</xmin><ymin>20</ymin><xmax>110</xmax><ymax>220</ymax>
</bndbox></object>
<object><name>19</name><name>18</name><bndbox><xmin>50</xmin><ymin>60</ymin><xmax>150</xmax>
<ymax>160</ymax></bndbox></object>
<object><name>20</name><nobndbox>1</nobndbox></object>
<object><name>21</name><scene>1</scene></object>
</annotation>
"""


def test_flickr30k_entities_reader_on_files_in_the_real_format(tmp_path):
    (tmp_path / "Sentences").mkdir()
    (tmp_path / "Annotations").mkdir()
    (tmp_path / "Sentences" / "1000.txt").write_text(SENTENCES)
    (tmp_path / "Annotations" / "1000.xml").write_text(ANNOTATION)
    caption, phrases = parse_sentence(SENTENCES.splitlines()[0])
    assert caption == "A child in a pink dress is climbing up a set of stairs in an entry way ."
    assert [(p["first_word"], p["phrase"], p["entity_id"]) for p in phrases] == [
        (0, "A child", "18"), (3, "a pink dress", "19"), (9, "a set of stairs", "20"),
        (14, "an entry way", "21")]
    boxes = parse_annotation(tmp_path / "Annotations" / "1000.xml")
    assert boxes["boxes"] == {"18": [[10, 20, 110, 220], [50, 60, 150, 160]],
                              "19": [[50, 60, 150, 160]]}
    record = read_image_entities(tmp_path, 1000)
    assert record["captions"][1] == "A little girl climbs stairs ."
    girl = [e for e in record["entities"] if e["caption"] == 1][0]
    assert girl["type"] == "people/bodyparts" and len(girl["boxes"]) == 2
    assert read_image_entities(tmp_path, 999) is None
    (tmp_path / "Annotations" / "1001.xml").write_text("<annotation><object><name>1</name>")
    with pytest.raises(ValueError, match="1001.xml: not a readable Flickr30K Entities"):
        parse_annotation(tmp_path / "Annotations" / "1001.xml")
    # Joined to shard captions by text (order and case may differ), boxes as fractions.
    joined = entities_for_captions(record, ["a little girl climbs stairs .", "unrelated"])
    assert {e["caption"] for e in joined} == {0}
    assert joined[0]["boxes"][0] == [10 / 500, 20 / 400, 110 / 500, 220 / 400]


def test_synthetic_scenes_exported_as_flickr_entities_read_back_unchanged(tmp_path):
    scene = make_scene(seed=0, image_id=7, image_size=64)
    write_flickr_entities([scene], tmp_path)
    record = read_image_entities(tmp_path, 7)
    assert record["captions"] == scene.captions
    key = lambda e: (e["caption"], e["first_word"])  # noqa: E731
    for got, want in zip(sorted(record["entities"], key=key), sorted(scene.entities, key=key)):
        assert (got["phrase"].lower(), got["first_word"], got["entity_id"]) == (
            want["phrase"].lower(), want["first_word"], want["entity_id"])
        # The XML holds whole pixels.
        assert all(abs(a - b) <= 0.5 for a, b in zip(got["boxes"][0], want["boxes"][0]))


def test_word_token_spans_follow_the_tokenizer():
    tokenizer = WordTokenizer(max_length=6).fit(["a red circle, to the top-left of it"])
    spans = tokenizer.word_token_spans("a red circle, to the top-left of it")
    assert spans == [[0], [1], [2], [3], [4], [5], [], []]  # top-left is two tokens, cut at 6
