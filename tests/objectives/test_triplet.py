import itertools

import pytest
import torch

from mmgoal.objectives.mining import hardest_negatives, positives_from_groups
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


def reference_triplet(sims, positives, margin, max_violation):
    """Triplets enumerated one by one with Python loops: the independent reference."""
    n_img, n_txt = sims.shape
    total = sims.new_zeros(())
    for i, j in itertools.product(range(n_img), range(n_txt)):
        if not positives[i, j]:
            continue
        i2t = [margin + sims[i, k] - sims[i, j] for k in range(n_txt) if not positives[i, k]]
        t2i = [margin + sims[k, j] - sims[i, j] for k in range(n_img) if not positives[k, j]]
        for costs in (i2t, t2i):
            costs = [c.clamp(min=0) for c in costs]
            if not costs:
                continue
            total = total + (max(costs, key=lambda c: c.item()) if max_violation else sum(costs))
    return total


@pytest.mark.parametrize("max_violation", [True, False])
@pytest.mark.parametrize("groups", [[0, 1, 2, 3, 4, 5], [0, 1, 1, 2, 3, 3], [7, 7, 7, 7, 2, 2]])
def test_triplet_matches_loop_reference_in_value_and_gradient(max_violation, groups):
    torch.manual_seed(0)
    sims = (torch.rand(6, 6) * 2 - 1).requires_grad_()
    positives = positives_from_groups(torch.tensor(groups))
    loss = OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2,
                             "max_violation": max_violation})(
        ObjectiveInputs(sims, positives))["triplet_loss"]
    (grad,) = torch.autograd.grad(loss, sims)
    ref_sims = sims.detach().clone().requires_grad_()
    ref = reference_triplet(ref_sims, positives, 0.2, max_violation)
    (ref_grad,) = torch.autograd.grad(ref, ref_sims) if ref.requires_grad else (
        torch.zeros_like(sims),)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(grad, ref_grad)


def test_duplicate_images_are_never_negatives():
    # texts 0 and 1 both describe image id 4 (rows 0 and 1): each is a positive of both rows
    sims = torch.tensor([[0.5, 0.9, 0.1], [0.9, 0.5, 0.1], [0.0, 0.0, 0.8]])
    positives = positives_from_groups(torch.tensor([4, 4, 9]))
    text_of_image, image_of_text, row_valid, col_valid = hardest_negatives(sims, positives)
    assert text_of_image.tolist() == [2, 2, 0]
    assert image_of_text.tolist() == [2, 2, 0]
    assert row_valid.all() and col_valid.all()
    out = OBJECTIVES.build({"type": "TripletLoss", "margin": 0.5})(ObjectiveInputs(sims, positives))
    # active hinges: i2t (0, 0) and (1, 1) against text 2: 0.5 + 0.1 - 0.5 each; all other
    # hinges are <= 0. Treating text 1 as a negative of row 0 would add 0.5 + 0.9 - 0.5.
    assert out["triplet_loss"].item() == pytest.approx(0.2)


def test_mean_reduction_and_diagonal_default():
    sims = torch.tensor([[0.1, 0.3], [0.2, 0.0]])
    total = OBJECTIVES.build({"type": "TripletLoss"})(ObjectiveInputs(sims))["triplet_loss"]
    # (0.2 + 0.3 - 0.1) + (0.2 + 0.2 - 0.1) + (0.2 + 0.2 - 0.0) + (0.2 + 0.3 - 0.0)
    assert total.item() == pytest.approx(0.4 + 0.3 + 0.4 + 0.5)
    mean = OBJECTIVES.build({"type": "TripletLoss", "reduction": "mean"})(
        ObjectiveInputs(sims))["triplet_loss"]
    assert mean.item() == pytest.approx(total.item() / 2)


def test_bad_arguments_are_explained():
    triplet = OBJECTIVES.build({"type": "TripletLoss"})
    with pytest.raises(ValueError, match="non-square"):
        triplet(ObjectiveInputs(torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="must match"):
        triplet(ObjectiveInputs(torch.zeros(2, 2), torch.ones(3, 3).bool()))
    with pytest.raises(TypeError, match=r"an objective takes one ObjectiveInputs "
                                        r"\(mmgoal.structures\), got Tensor: call "
                                        r"objective\(ObjectiveInputs\(sims, "):
        triplet(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="reduction"):
        OBJECTIVES.build({"type": "TripletLoss", "reduction": "avg"})
