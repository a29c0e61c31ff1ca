"""The COCO protocols (mmgoal/evaluation/protocols.py) against the eccv_caption package, the
reference: its Metrics on the same rankings, compared to 1e-9."""

import random
import sys
import warnings

import numpy as np
import pytest
import torch

from mmgoal.evaluation.protocols import (
    load_reference,
    protocol_metrics,
    protocol_rankings,
    ranking_metrics,
)
from mmgoal.evaluation.retrieval import protocol_rows, retrieval_metrics

PACKAGE_METRICS = ("eccv_r1", "eccv_map_at_r", "eccv_rprecision", "coco_5k_recalls",
                   "cxc_recalls")


@pytest.fixture(scope="module")
def reference():
    return load_reference(("eccv", "cxc"))


@pytest.fixture(scope="module")
def package():
    with warnings.catch_warnings():  # it warns that ujson is not installed
        warnings.simplefilter("ignore")
        from eccv_caption import Metrics
        return Metrics()


def package_scores(package, rankings):
    return package.compute_all_metrics(rankings["i2t"], rankings["t2i"],
                                       target_metrics=PACKAGE_METRICS, Ks=(1, 5, 10))


def coco_gallery(reference, seed=0):
    """The 5K test ids in a shuffled gallery order, with COCO's labels as text_to_image."""
    rng = random.Random(seed)
    images, captions = list(reference.image_ids), list(reference.caption_ids)
    rng.shuffle(images)
    rng.shuffle(captions)
    row = {image: r for r, image in enumerate(images)}
    return images, captions, [row[reference.caption_image[c]] for c in captions]


def compare(ours, theirs, protocols=("eccv", "cxc")):
    for protocol, names in (("eccv", ("map_at_r", "rprecision", "r1")),
                            ("cxc", ("r1", "r5", "r10"))):
        if protocol not in protocols:
            continue
        for name in names:
            for direction in ("i2t", "t2i"):
                assert ours[f"{protocol}_{direction}_{name}"] == pytest.approx(
                    100 * theirs[f"{protocol}_{name}"][direction], abs=1e-9), \
                    (protocol, direction, name)


def test_ranking_metrics_by_hand():
    hits = torch.tensor([[True, False, True, False], [False, True, True, False]])
    values = ranking_metrics(hits, torch.tensor([2, 3]))
    # query 0: R=2, top 2 holds 1 positive; precision 1 at rank 1. query 1: R=3, 2 of 3;
    # precisions 1/2 at rank 2 and 2/3 at rank 3
    assert values["rprecision"] == pytest.approx(100 * (1 / 2 + 2 / 3) / 2)
    assert values["map_at_r"] == pytest.approx(100 * ((1 + 0) / 2 + (0 + 1 / 2 + 2 / 3) / 3) / 2)
    assert (values["r1"], values["r5"]) == (50.0, 100.0)


def test_a_model_s_rankings_give_the_package_s_metrics(reference, package):
    images, captions, text_to_image = coco_gallery(reference)
    g = torch.Generator().manual_seed(0)
    image_emb = torch.randn(5000, 16, generator=g)
    text_emb = torch.randn(25000, 16, generator=g) + 1.5 * image_emb[torch.tensor(text_to_image)]
    sims = image_emb @ text_emb.T
    ours = protocol_metrics(sims, images, captions, text_to_image, ["coco", "eccv", "cxc"])
    rankings = protocol_rankings(sims, images, captions, text_to_image, ["eccv", "cxc"])
    # the rankings themselves, against a plain argsort of the rows of some queries
    for row, image in enumerate(images[:50]):
        order = sims[row].topk(len(rankings["i2t"][image])).indices
        assert rankings["i2t"][image] == [captions[c] for c in order.tolist()]
    theirs = package_scores(package, rankings)
    compare(ours, theirs)
    coco = retrieval_metrics(sims, text_to_image)
    for k in (1, 5, 10):
        for direction in ("i2t", "t2i"):
            assert coco[f"{direction}_r{k}"] == pytest.approx(
                100 * theirs[f"coco_5k_r{k}"][direction], abs=1e-9)
    assert 0 < ours["eccv_i2t_map_at_r"] < 100 and 0 < ours["cxc_t2i_r1"] < 100
    rows = protocol_rows(ours)
    assert rows[0].split() == ["ECCV", "Caption", "mAP@R", "R-P", "R@1"]
    assert rows[1].split()[1] == f"{ours['eccv_i2t_map_at_r']:.2f}"


def positives_matrix(reference, protocol, direction, images, captions, demote=()):
    """1 for each positive (rows: images, columns: captions), 0 elsewhere; the queries in
    ``demote`` (ids) get their first positive's score at -1, below every negative."""
    row = {image: r for r, image in enumerate(images)}
    column = {caption: c for c, caption in enumerate(captions)}
    sims = torch.zeros(len(images), len(captions))
    for query, items in reference.positives[protocol][direction].items():
        for rank, item in enumerate(items):
            image, caption = (query, item) if direction == "i2t" else (item, query)
            if caption in column:
                sims[row[image], column[caption]] = -1.0 if (rank == 0 and query in demote) \
                    else 1.0 + 0.001 * rank
    return sims


def test_the_package_s_positives_score_100_and_known_misses_what_it_computes(reference,
                                                                          package):
    images, captions, text_to_image = coco_gallery(reference, seed=1)
    i2t = positives_matrix(reference, "eccv", "i2t", images, captions)
    t2i = positives_matrix(reference, "eccv", "t2i", images, captions)
    perfect = protocol_metrics(i2t, images, captions, text_to_image, ["eccv"], sims_t2i=t2i)
    assert perfect["eccv_t2i_map_at_r"] == perfect["eccv_t2i_rprecision"] == 100.0
    # two ECCV image queries have a positive caption outside the 25,000 test captions (R
    # counts it, as the package does): their R-1 reachable positives score (R-1)/R
    test_captions = set(reference.caption_ids)
    outside = {q: items for q, items in reference.positives["eccv"]["i2t"].items()
               if any(c not in test_captions for c in items)}
    assert len(outside) == 2
    n = len(reference.positives["eccv"]["i2t"])
    expected = 100 * (n - sum(1 / len(items) for items in outside.values())) / n
    assert perfect["eccv_i2t_map_at_r"] == pytest.approx(expected, abs=1e-9)
    assert perfect["eccv_i2t_rprecision"] == pytest.approx(expected, abs=1e-9)
    assert perfect["eccv_i2t_r1"] == perfect["eccv_t2i_r1"] == 100.0
    # misses: every third query's first positive ranked last
    demoted = {"i2t": set(list(reference.positives["eccv"]["i2t"])[::3]),
               "t2i": set(list(reference.positives["eccv"]["t2i"])[::3])}
    i2t = positives_matrix(reference, "eccv", "i2t", images, captions, demoted["i2t"])
    t2i = positives_matrix(reference, "eccv", "t2i", images, captions, demoted["t2i"])
    ours = protocol_metrics(i2t, images, captions, text_to_image, ["eccv"], sims_t2i=t2i)
    theirs = package_scores(package, protocol_rankings(i2t, images, captions, text_to_image,
                                                       ["eccv"], sims_t2i=t2i))
    compare(ours, theirs, ["eccv"])  # the negatives' ties fall either way: eccv is blind to
    # them here, CxC (whose positives score 0 in this matrix) is not
    assert ours["eccv_t2i_map_at_r"] < 99 and ours["eccv_t2i_rprecision"] < 99


def test_ties_count_against_the_query(reference):
    images, captions, text_to_image = coco_gallery(reference, seed=2)
    constant = torch.zeros(len(images), len(captions))
    metrics = protocol_metrics(constant, images, captions, text_to_image, ["eccv", "cxc"])
    assert set(metrics.values()) == {0.0}


def test_pm_reads_the_files_the_user_points_at(reference, tmp_path):
    """PM-COCO's positives do not ship: pm_dir's files are read (CxC's, as a stand-in)."""
    import json
    import shutil

    from mmgoal.data.coco import package_data_dir

    for direction in ("image_to_caption", "caption_to_image"):
        shutil.copy(package_data_dir() / f"cxc_{direction}.json",
                    tmp_path / f"pm_{direction}.json")
    images, captions, text_to_image = coco_gallery(reference, seed=3)
    g = torch.Generator().manual_seed(3)
    sims = torch.randn(len(images), len(captions), generator=g)
    ours = protocol_metrics(sims, images, captions, text_to_image, ["pm"], pm_dir=str(tmp_path))
    assert set(ours) == {"pm_i2t_rprecision", "pm_t2i_rprecision"}
    # R-Precision by hand for the image queries
    row = {image: r for r, image in enumerate(images)}
    gts = json.loads((tmp_path / "pm_image_to_caption.json").read_text())
    queries = list(gts)
    tops = sims[torch.tensor([row[int(q)] for q in queries])].topk(
        max(len(v) for v in gts.values()), dim=1).indices.tolist()
    precisions = [len({captions[c] for c in top[:len(gts[q])]} & set(gts[q])) / len(gts[q])
                  for q, top in zip(queries, tops)]
    assert ours["pm_i2t_rprecision"] == pytest.approx(100 * np.mean(precisions), abs=1e-9)
    with pytest.raises(ValueError, match="set evaluation.pm_dir"):
        protocol_metrics(sims, images, captions, text_to_image, ["pm"])
    with pytest.raises(FileNotFoundError, match=r"lacks pm_image_to_caption\.json, "
                                                r"pm_caption_to_image\.json: download"):
        protocol_metrics(sims, images, captions, text_to_image, ["pm"],
                         pm_dir=str(tmp_path / "elsewhere"))


def test_a_gallery_that_is_not_coco_5k_test_gets_a_message(reference):
    images, captions, text_to_image = coco_gallery(reference, seed=4)
    sims = torch.zeros(len(images), len(captions))
    with pytest.raises(ValueError, match=r"its captions have no COCO caption ids\. .*"
                                         r"--coco-captions captions_val2014\.json"):
        protocol_metrics(sims, images, [None] * len(captions), text_to_image, ["eccv"])
    with pytest.raises(ValueError, match=r"it lacks 1 of the 5,000 test images \(e\.g\. "
                                         rf"{images[0]}\) and holds 1 others \(e\.g\. 7\)"):
        protocol_metrics(sims, [7] + images[1:], captions, text_to_image, ["cxc"])
    with pytest.raises(ValueError, match=r"1 of them are not in the gallery \(e\.g\. caption "
                                         rf"ids {captions[5]}\)"):
        protocol_metrics(sims, images, captions[:5] + [None] + captions[6:], text_to_image,
                         ["eccv"])
    moved = list(text_to_image)
    moved[0] = (moved[0] + 1) % len(images)
    with pytest.raises(ValueError, match=r"1 captions are in the gallery under another image"):
        protocol_metrics(sims, images, captions, moved, ["eccv"])
    # COCO's own metrics need none of it
    assert protocol_metrics(sims[:4], images[:4], [None], [0], ["coco"]) == {}


def test_without_eccv_caption_the_message_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "eccv_caption", None)
    load_reference.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'mmgoal\[coco\]'"):
            load_reference(("eccv",))
    finally:
        load_reference.cache_clear()
