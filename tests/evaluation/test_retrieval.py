import math

import pytest
import torch

from mmgoal.evaluation import retrieval_metrics

# 3 images, 2 captions each; the expected ranks are worked out in the comments.
SIMS = torch.tensor([
    [0.9, 0.1, 0.8, 0.2, 0.3, 0.0],  # image 0: best gt 0.9, no negative >= 0.9 -> rank 0
    [0.5, 0.7, 0.6, 0.4, 0.1, 0.2],  # image 1: best gt 0.6, text 1 (0.7) above -> rank 1
    [0.3, 0.2, 0.1, 0.9, 0.5, 0.5],  # image 2: best gt 0.5, text 3 (0.9) above -> rank 1
])
TEXT_TO_IMAGE = torch.tensor([0, 0, 1, 1, 2, 2])
# text -> image ranks: t0 0, t1 2 (0.7, 0.2 >= 0.1), t2 1, t3 1, t4 0, t5 0


def test_hand_computed_metrics_with_several_captions_per_image():
    m = retrieval_metrics(SIMS, TEXT_TO_IMAGE)
    assert m["i2t_r1"] == pytest.approx(100 / 3)
    assert m["i2t_r5"] == m["i2t_r10"] == 100
    assert m["i2t_medr"] == 2  # median of 0-based ranks [0, 1, 1] is 1
    assert m["i2t_meanr"] == pytest.approx(1 + 2 / 3)
    assert m["t2i_r1"] == 50
    assert m["t2i_r5"] == 100
    assert m["t2i_medr"] == 1  # median of [0, 0, 0, 1, 1, 2] is 0.5 -> floor 0
    assert m["t2i_meanr"] == pytest.approx(1 + 4 / 6)
    assert m["rsum"] == pytest.approx(100 / 3 + 200 + 50 + 200)


def test_ties_count_against_the_query():
    m = retrieval_metrics(torch.zeros(3, 3), torch.arange(3))
    assert m["i2t_r1"] == m["t2i_r1"] == 0
    assert m["i2t_medr"] == m["t2i_medr"] == 3
    sims = torch.tensor([[0.5, 0.5, 0.1], [0.0, 0.9, 0.0], [0.0, 0.0, 0.9]])
    m = retrieval_metrics(sims, torch.arange(3))
    assert m["i2t_r1"] == pytest.approx(200 / 3)  # image 0 ties with text 1: a miss


def test_ground_truth_ties_do_not_hurt():
    sims = torch.tensor([[0.7, 0.7, 0.2], [0.1, 0.1, 0.8]])
    m = retrieval_metrics(sims, torch.tensor([0, 0, 1]))
    assert m["i2t_r1"] == 100 and m["t2i_r1"] == 100


def test_folds_average_over_consecutive_image_blocks():
    sims = torch.eye(10)
    sims[2, 0] = 2.0  # confuses image 2 with text 0: different folds of 2 images
    sims[3, 2] = 5.0  # confuses image 3 with text 2: same fold
    one = retrieval_metrics(sims, torch.arange(10))
    assert one["i2t_r1"] == 80 and one["t2i_r1"] == 80
    five = retrieval_metrics(sims, torch.arange(10), folds=5)
    assert five["i2t_r1"] == 90 and five["t2i_r1"] == 90
    assert five["rsum"] == pytest.approx(90 + 100 + 100 + 90 + 100 + 100)
    assert math.isclose(five["t2i_meanr"], 1.1)


def test_bad_inputs_are_explained():
    with pytest.raises(ValueError, match="5 equal folds"):
        retrieval_metrics(torch.eye(6), torch.arange(6), folds=5)
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics(torch.full((2, 2), float("nan")), torch.arange(2))
    with pytest.raises(ValueError, match=r"images \[1\] have no caption"):
        retrieval_metrics(torch.eye(2), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="text_to_image"):
        retrieval_metrics(torch.eye(2), torch.arange(3))
