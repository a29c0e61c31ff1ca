import math

import pytest
import torch

from mmgoal.objectives.constraints import sample_fragments
from mmgoal.registry import CONSTRAINTS
from mmgoal.structures import Attention

E0, E1 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])


def hand_attention(weights, queries=None, lambda_softmax=9.0):
    """One item pair: keys e0, e1; queries e0 (and e1); the given attention rows."""
    weights = torch.tensor(weights, requires_grad=True)
    queries = torch.stack(queries or [E0, E1][:len(weights)])[None]
    keys = torch.stack([E0, E1])[None]
    scores = (queries @ keys.transpose(1, 2)).clamp(min=0)
    return Attention(queries, keys, weights[None], scores,
                     torch.ones(1, len(weights), dtype=torch.bool),
                     torch.ones(1, 2, dtype=torch.bool), "t2i", lambda_softmax), weights


@pytest.mark.parametrize("margin", [0.0, 0.2])
def test_ccr_is_zero_on_the_right_key_and_one_plus_margin_on_the_wrong_one(margin):
    ccr = CONSTRAINTS.build({"type": "CCRConstraint", "margin": margin, "weight": 1.0})
    right, _ = hand_attention([[1.0, 0.0]])
    assert ccr(right)["ccr_loss"].item() == 0.0
    wrong, weights = hand_attention([[0.0, 1.0]])
    out = ccr(wrong)
    # attended e1 (cos 0 with the query e0), reversed e0 (cos 1): margin - 0 + 1.
    assert math.isclose(out["ccr_loss"].item(), margin + 1.0, abs_tol=1e-6)
    assert out["ccr_active"].item() == 1.0
    out["ccr_loss"].backward()
    assert weights.grad.abs().sum() > 0


def test_ccr_soft_attention_and_the_weight_and_negated_softmax_option():
    # w = (0.8, 0.2): attended (0.8, 0.2), complement (0.2, 0.8) -> cos 0.970 and 0.243.
    soft, _ = hand_attention([[0.8, 0.2]])
    expected = 0.2 - 0.8 / math.sqrt(0.68) + 0.2 / math.sqrt(0.68)
    ccr = CONSTRAINTS.build({"type": "CCRConstraint", "margin": 0.2, "weight": 0.5})
    assert expected < 0 and ccr(soft)["ccr_loss"].item() == 0.0
    big_margin = CONSTRAINTS.build({"type": "CCRConstraint", "margin": 1.0, "weight": 0.5})
    assert math.isclose(big_margin(soft)["ccr_loss"].item(), 0.5 * (expected + 0.8),
                        rel_tol=1e-6)
    # negated softmax over scores (1, 0) with lambda 9: reversed weights (e^-9, 1) / Z.
    neg = CONSTRAINTS.build({"type": "CCRConstraint", "margin": 1.0,
                             "reverse": "negated_softmax"})
    w_hat = torch.softmax(torch.tensor([-9.0, 0.0]), 0)
    cos_reversed = (w_hat[0] / w_hat.norm()).item()
    assert math.isclose(neg(soft)["ccr_loss"].item(),
                        1.0 - 0.8 / math.sqrt(0.68) + cos_reversed, rel_tol=1e-6)


def test_ccs_compares_the_attended_content_with_a_sibling_fragment():
    ccs = CONSTRAINTS.build({"type": "CCSConstraint", "margin": 0.1})
    right, _ = hand_attention([[1.0, 0.0], [0.0, 1.0]])  # q0 -> k0, q1 -> k1
    wrong, weights = hand_attention([[0.0, 1.0], [1.0, 0.0]])  # swapped
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):  # whichever query is drawn
        assert ccs(right, generator)["ccs_loss"].item() == 0.0
        assert math.isclose(ccs(wrong, generator)["ccs_loss"].item(), 1.1, abs_tol=1e-6)
    ccs(wrong)["ccs_loss"].backward()
    assert weights.grad.abs().sum() > 0


def test_ccs_ignores_items_with_a_single_fragment():
    ccs = CONSTRAINTS.build({"type": "CCSConstraint", "margin": 0.5})
    single, _ = hand_attention([[0.0, 1.0]])
    out = ccs(single)
    assert out["ccs_loss"].item() == 0.0 and out["ccs_active"].item() == 0.0


def test_sampled_fragments_are_real_uniform_and_avoid_the_excluded_one():
    mask = torch.tensor([[True, True, True, False]] * 3000)
    generator = torch.Generator().manual_seed(0)
    index, valid = sample_fragments(mask, generator)
    assert valid.all() and (index < 3).all()
    counts = torch.bincount(index, minlength=3).float() / 3000
    assert (counts - 1 / 3).abs().max() < 0.03
    sibling, valid = sample_fragments(mask, generator, exclude=index)
    assert valid.all() and (sibling != index).all() and (sibling < 3).all()


def test_constraint_config_errors_name_the_choices():
    with pytest.raises(ValueError, match="reverse must be complement or negated_softmax, "
                                         "got 'flip'"):
        CONSTRAINTS.build({"type": "CCRConstraint", "reverse": "flip"})
    with pytest.raises(TypeError, match="did you mean 'margin'"):
        CONSTRAINTS.build({"type": "CCSConstraint", "margn": 0.1})
