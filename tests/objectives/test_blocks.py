"""Objectives in row blocks (mmgoal/objectives/blocks.py): the autograd formula's loss and
gradients, and no tensor of the score matrix's size beside the scores and one gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from script_modules import load_script

from mmgoal.objectives import mining, weights
from mmgoal.objectives.classic import multi_similarity_rows
from mmgoal.objectives.triplet import sum_of_hinges
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


def batch(n_img=6, seed=0):
    """Scores of ``n_img`` images against ``n_img + 2`` texts (image 1 and image 4 have two
    captions each), float64."""
    generator = torch.Generator().manual_seed(seed)
    groups = torch.tensor([*range(n_img), 1, 4])
    positives = torch.arange(n_img)[:, None] == groups[None, :]
    scores = torch.rand(n_img, len(groups), generator=generator, dtype=torch.float64) * 2 - 1
    return scores, positives


def infonce_reference(scores, positives, temperature):
    """Cross-entropy against targets spread over each anchor's positives, both directions."""
    def direction(s, p):
        target = p / p.sum(1, keepdim=True)
        return -(target * F.log_softmax(s / temperature, dim=1)).sum(1).mean()
    return (direction(scores, positives) + direction(scores.T, positives.T)) / 2


def hardest_reference(scores, positives, margin=0.2):
    """VSE++'s max-violation hinge of every positive pair, both directions."""
    def direction(s, p):
        hardest = s.masked_fill(p, float("-inf")).amax(1)
        return (margin + hardest[:, None] - s).clamp(min=0)[p].sum()
    return direction(scores, positives) + direction(scores.T, positives.T)


REFERENCES = {
    "InfoNCELoss": ({"temperature": 0.1}, lambda s, p, t: infonce_reference(s, p, t)),
    "TripletLoss": ({}, lambda s, p, t: hardest_reference(s, p)),
    "TripletLoss(all)": ({"max_violation": False}, lambda s, p, t: (
        sum_of_hinges(s, p, 0.2).sum() + sum_of_hinges(s.T, p.T, 0.2).sum())),
    "MultiSimilarityLoss": ({}, lambda s, p, t: (
        multi_similarity_rows(s, p, 2.0, 10.0, 0.5, 0.1).sum()
        + multi_similarity_rows(s.T, p.T, 2.0, 10.0, 0.5, 0.1).sum())),
}


@pytest.mark.parametrize("block_rows", [1, 3, 1024])
@pytest.mark.parametrize("name", list(REFERENCES))
def test_blocks_give_the_autograd_formulas_loss_and_gradients(name, block_rows):
    kwargs, reference = REFERENCES[name]
    kind = name.split("(")[0]
    objective = OBJECTIVES.build({"type": kind, **kwargs, "block_rows": block_rows}).double()
    scores, positives = batch()
    scores.requires_grad_()
    out = objective(ObjectiveInputs(scores, positives=positives))
    loss = next(v for k, v in out.items() if k.endswith("_loss"))
    grads = torch.autograd.grad(loss, [scores, *objective.parameters()])

    leaf = scores.detach().requires_grad_()
    temperature = (objective.temperature.detach().clone().requires_grad_() if kind == "InfoNCELoss"
                   else None)
    expected = reference(leaf, positives, temperature)
    expected_grads = torch.autograd.grad(expected, [leaf, temperature][:len(grads)])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):  # the scores', then the temperature's
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert any(g.abs().sum() > 0 for g in grads)


def peak_beside_scores(objective, n=64, reference=None):
    """Peak of matrix-sized tensors during a forward and backward, in score matrices."""
    scores = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).requires_grad_()
    positives = torch.eye(n, dtype=torch.bool)
    with load_script("bench/objective_memory.py").matrix_sized_tensors(n * n, 4 * n * n) \
            as counter:
        if reference is None:
            out = objective(ObjectiveInputs(scores, positives=positives))
            loss = sum(v for k, v in out.items() if k.endswith("_loss"))
        else:
            loss = reference(scores, positives)
        loss.backward()
    return counter.peak


@pytest.mark.parametrize("cfg", [
    {"type": "InfoNCELoss", "block_rows": 8},
    {"type": "SigLIPLoss", "block_rows": 8},
    {"type": "TripletLoss"},
    {"type": "TripletLoss", "max_violation": False, "block_rows": 8},
    {"type": "NTXentHardLoss"},
    {"type": "CircleLoss"},
    {"type": "MultiSimilarityLoss", "block_rows": 8},
    {"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"},
    {"type": "GoalObjective", "triplet": "nca", "pair": "lin_ms"},
], ids=lambda cfg: "-".join(str(v) for v in cfg.values()))
def test_no_tensor_of_the_matrix_size_beside_the_scores_and_their_gradient(cfg, monkeypatch):
    monkeypatch.setattr(mining, "MINING_BLOCK", 8 * 64)  # blocks of 8 rows, as block_rows
    monkeypatch.setattr(weights, "BLOCK", 8 * 64)
    assert peak_beside_scores(OBJECTIVES.build(cfg)) == 1.0  # the gradient, nothing else
    # what the counter sees: the autograd formulas hold several
    assert peak_beside_scores(None, reference=lambda s, p: infonce_reference(s, p, 0.1)) >= 3
    assert peak_beside_scores(None, reference=hardest_reference) >= 2
