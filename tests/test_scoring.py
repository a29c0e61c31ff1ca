"""Objectives over score tiles (mmgoal/scoring.py): every objective gives its dense
formula's loss and the gradients of the features and of every parameter it reads, to
1e-10 in float64, whatever the tiles (1, 3, 7 and 1,024 rows), with several captions of one
image among the pairs; and no tensor larger than one tile is ever made."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from script_modules import load_script

from mmgoal.objectives.classic import multi_similarity_rows
from mmgoal.objectives.triplet import sum_of_hinges
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS
from mmgoal.scoring import DotScorer, GumbelMax, MatrixScorer, ScoreTiles, entry_uniforms
from mmgoal.structures import ObjectiveInputs

# Pairs of a batch: images 1 and 6 are one image (two captions), so are 4 and 9
GROUPS = torch.tensor([0, 1, 2, 3, 4, 5, 1, 7, 8, 4, 10])
TILES = [1, 3, 7, 1024]


def features(seed: int = 0, n: int = len(GROUPS), dim: int = 5):
    """L2-normalised float64 image and text embeddings of ``n`` pairs (a repeated image has
    one embedding)."""
    generator = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=-1)
    images = images[GROUPS[:n].clamp(max=n - 1)] if n == len(GROUPS) else images
    texts = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=-1)
    return images.clone(), texts


def positives_of(groups: torch.Tensor) -> torch.Tensor:
    return groups[:, None] == groups[None, :]


# ----------------------------------------------------------------- dense references
def hardest(s, p):
    """(the argmax, valid) of every row's negatives."""
    masked = s.masked_fill(p, -math.inf)
    return masked.argmax(1), torch.isfinite(masked.amax(1))


def triplet_reference(triplet_loss):
    def loss(s, p, params):
        total = 0
        for scores, positives in ((s, p), (s.T, p.T)):
            anchors, others = positives.nonzero(as_tuple=True)
            index, valid = hardest(scores.detach(), positives)
            s_p, s_n = scores[anchors, others], scores[anchors, index[anchors]]
            total = total + (triplet_loss(s_p, s_n) * valid[anchors]).sum()
        return total
    return loss


def infonce_reference(s, p, params):
    (temperature,) = params

    def direction(scores, positives):
        target = positives / positives.sum(1, keepdim=True)
        return -(target * F.log_softmax(scores / temperature, dim=1)).sum(1).mean()
    return (direction(s, p) + direction(s.T, p.T)) / 2


def siglip_reference(s, p, params):
    scale, bias = params
    signs = p.to(s.dtype) * 2 - 1
    return -F.logsigmoid(signs * (scale.exp() * s + bias)).sum() / len(s)


def dense_relative(scores, positives, anchors, s_p, s_n, negatives, all_positive, eps):
    """R+ and R- of a direction's triplets by masks over the dense matrix."""
    class Dense:
        def pos_mean_exp(self, scale, empty=1.0):
            values = [torch.exp(scale * (s_p[k] - all_positive[m]))
                      for k in range(len(s_p)) for m in [None]] and None
            del values
            return self._pos(lambda k, r: torch.exp(scale * (s_p[k] - r)), empty)

        def pos_mean_diff(self, empty=0.0):
            return self._pos(lambda k, r: s_p[k] - r, empty)

        def _pos(self, f, empty):
            out = []
            for k in range(len(s_p)):
                chosen = [f(k, r) for m, r in enumerate(s_p_all) if m != own[k]
                          and r <= s_n[k] + eps]
                out.append(torch.stack(chosen).mean() if chosen else s_p.new_tensor(empty))
            return torch.stack(out)

        def _neg(self, f, empty):
            threshold = all_positive.min() - eps
            out = []
            for k in range(len(s_p)):
                row = scores[anchors[k]]
                mask = ~positives[anchors[k]] & (row >= threshold)
                mask[negatives[k]] = False
                out.append(f(k, row[mask]).mean() if mask.any() else s_p.new_tensor(empty))
            return torch.stack(out)

        def neg_mean_exp(self, scale, empty=1.0):
            return self._neg(lambda k, r: torch.exp(-scale * (s_n[k] - r)), empty)

        def neg_mean_diff(self, empty=0.0):
            return self._neg(lambda k, r: s_n[k] - r, empty)

    # every positive pair, once, and which of them each triplet's own positive is
    s_p_all = all_positive.tolist()
    own = list(range(len(s_p)))
    return Dense()


def goal_reference(triplet, pair):
    """GOAL's G by dense masks, as the surrogate sum(G S) whose gradient is G."""
    t_fn, t_opts = TRIPLET_WEIGHTS.get(triplet), {}
    p_fn = PAIR_WEIGHTS.get(pair)

    def loss(s, p, params):
        detached = s.detach()
        all_positive = detached[p]
        grad = torch.zeros_like(detached)
        for direction, scores, positives in (("i2t", detached, p), ("t2i", detached.T, p.T)):
            anchors, others = positives.nonzero(as_tuple=True)
            index, valid = hardest(scores, positives)
            negatives = index[anchors]
            s_p, s_n = scores[anchors, others], scores[anchors, negatives]
            if direction == "t2i":  # the batch's positives in this direction's order
                order = all_positive
            else:
                order = s_p
            t = t_fn(s_p, s_n, **t_opts) * valid[anchors]
            kwargs = {}
            if pair.endswith("_ms"):
                kwargs["relative"] = dense_relative(scores, positives, anchors, s_p, s_n,
                                                    negatives, s_p, 0.1)
                del order
            w_pos, w_neg = p_fn(s_p, s_n, **kwargs)
            g = torch.zeros_like(scores)
            g.index_put_((anchors, others), -t * w_pos, accumulate=True)
            g.index_put_((anchors, negatives), t * w_neg, accumulate=True)
            grad += g if direction == "i2t" else g.T
        return (grad * s).sum()
    return loss


REFERENCES = {
    "InfoNCELoss": ({"temperature": 0.1}, infonce_reference),
    "SigLIPLoss": ({}, siglip_reference),
    "TripletLoss": ({}, triplet_reference(lambda sp, sn: (0.2 + sn - sp).clamp(min=0))),
    "TripletLoss(all)": ({"max_violation": False}, lambda s, p, params: (
        sum_of_hinges(s, p, 0.2).sum() + sum_of_hinges(s.T, p.T, 0.2).sum())),
    "NTXentHardLoss": ({}, triplet_reference(lambda sp, sn: F.softplus(10.0 * (sn - sp)))),
    "BinomialDevianceLoss": ({}, triplet_reference(
        lambda sp, sn: F.softplus(-2 * (sp - 0.5)) / 2 + F.softplus(10 * (sn - 0.5)) / 10)),
    "CircleLoss": ({}, triplet_reference(lambda sp, sn: F.softplus(64.0 * (
        (sn.detach() + 0.25).clamp(min=0) * (sn - 0.25)
        - (1.25 - sp.detach()).clamp(min=0) * (sp - 0.75))))),
    "MultiSimilarityLoss": ({}, lambda s, p, params: (
        multi_similarity_rows(s, p, 2.0, 10.0, 0.5, 0.1).sum()
        + multi_similarity_rows(s.T, p.T, 2.0, 10.0, 0.5, 0.1).sum())),
    **{f"GoalObjective({t} x {p})": ({"triplet": t, "pair": p}, goal_reference(t, p))
       for t, p in itertools.product(("con", "nca", "cir"),
                                     ("con", "lin", "sig", "lin_ms", "sig_ms"))},
}


def build(name: str):
    kwargs, _ = REFERENCES[name]
    return OBJECTIVES.build({"type": name.split("(")[0], **kwargs}).double()


def loss_of(outputs: dict) -> torch.Tensor:
    return next(value for key, value in outputs.items() if key.endswith("_loss"))


def reference_params(objective) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in objective.parameters()]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("name", list(REFERENCES))
def test_every_objective_on_tiles_is_its_dense_formula(name, tile):
    objective = build(name)
    images, texts = features(seed=hash(name) % 1000)
    images.requires_grad_()
    texts.requires_grad_()
    tiles = ScoreTiles(DotScorer(images, texts), len(GROUPS), len(GROUPS), GROUPS,
                       tile_rows=tile, tile_cols=tile + 1)
    loss = loss_of(objective(ObjectiveInputs(None, tiles=tiles)))
    params = list(objective.parameters())
    grads = torch.autograd.grad(loss, [images, texts, *params])

    leaves = [images.detach().clone().requires_grad_(), texts.detach().clone().requires_grad_()]
    theirs = reference_params(objective)
    _, reference = REFERENCES[name]
    expected = reference(leaves[0] @ leaves[1].T, positives_of(GROUPS), theirs)
    expected_grads = torch.autograd.grad(expected, [*leaves, *theirs])
    if not name.startswith("GoalObjective"):  # GOAL's value is the violation, not sum(G S)
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads):  # images', texts', then each parameter's
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0


@pytest.mark.parametrize("name", ["InfoNCELoss", "TripletLoss(all)",
                                  "GoalObjective(cir x sig_ms)"])
def test_a_matrix_given_whole_takes_the_same_tiles(name):
    objective = build(name)
    images, texts = features(seed=3)
    scores = (images @ texts.T).requires_grad_()
    outputs = objective(ObjectiveInputs(scores, positives_of(GROUPS)))
    (grad,) = torch.autograd.grad(loss_of(outputs), scores)
    leaf = scores.detach().clone().requires_grad_()
    _, reference = REFERENCES[name]
    (expected,) = torch.autograd.grad(reference(leaf, positives_of(GROUPS),
                                                reference_params(objective)), leaf)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


def test_gumbel_max_draws_each_rows_negative_from_its_softmax_whatever_the_tiles():
    images, texts = features(seed=4)
    scores = images @ texts.T
    positives = positives_of(GROUPS)
    draws = []
    for tile in TILES:
        statistic = GumbelMax(0.5, seed=123, n_cols=len(GROUPS), n_rows=len(GROUPS))
        ScoreTiles(DotScorer(images, texts), len(GROUPS), len(GROUPS), GROUPS,
                   tile_rows=tile, tile_cols=tile + 1).statistics(statistic)
        draws.append((statistic.row_index, statistic.col_index))
    for rows, cols in draws[1:]:  # the noise is the entries', not the tiles'
        assert torch.equal(rows, draws[0][0]) and torch.equal(cols, draws[0][1])
    # the dense Gumbel-max draw with the same noise
    n = len(GROUPS)
    index = torch.arange(n)
    gumbel = -torch.log(-torch.log(entry_uniforms(123, index, index, n)))
    rows = (scores / 0.5 + gumbel).masked_fill(positives, -math.inf).argmax(1)
    gumbel_t = -torch.log(-torch.log(entry_uniforms(124, index, index, n)))
    cols = (scores.T / 0.5 + gumbel_t).masked_fill(positives.T, -math.inf).argmax(1)
    assert torch.equal(draws[0][0], rows) and torch.equal(draws[0][1], cols)
    assert not positives[index, rows].any() and not positives[cols, index].any()
    # the distribution: a row's draw frequencies are its softmax over its negatives
    many = torch.stack([torch.tensor(0.0)] * 0 + [scores[2]] * 4000)
    statistic = GumbelMax(0.5, seed=9, n_cols=n, n_rows=4000)
    mask = positives[2].expand(4000, n)
    ScoreTiles(MatrixScorer(many), 4000, n, positives=mask).statistics(statistic)
    frequencies = torch.bincount(statistic.row_index, minlength=n).double() / 4000
    expected = torch.softmax((scores[2] / 0.5).masked_fill(positives[2], -math.inf), 0)
    assert (frequencies - expected).abs().max() < 0.03


def test_no_tensor_larger_than_a_tile_is_made(monkeypatch):
    """A dispatch-level count: forward and backward of every objective on 64 pairs in tiles
    of 8 x 8 make no tensor larger than the features of the positive pairs (128 x 4) or a
    tile, where the score matrix is 64 x 64."""
    counter_of = load_script("bench/tiles.py").matrix_sized_tensors
    generator = torch.Generator().manual_seed(0)
    n, dim = 64, 4
    groups = torch.arange(n) // 2  # every image twice: two positives a row, 128 pairs
    bound = 2 * n * dim * 8 + 1  # bytes: past the positive pairs' features
    for name in REFERENCES:
        if name.startswith("GoalObjective") and not name.endswith(("sig_ms)", "lin_ms)")):
            continue  # the others read less
        objective = build(name)
        images = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=-1)
        texts = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=-1)
        images.requires_grad_()
        texts.requires_grad_()
        with counter_of(bound, n * n * 8) as counter:
            tiles = ScoreTiles(DotScorer(images, texts), n, n, groups, tile_rows=8, tile_cols=8)
            loss_of(objective(ObjectiveInputs(None, tiles=tiles))).backward()
        assert counter.peak == 0, name  # nothing past the pairs' features
        assert images.grad.abs().sum() > 0, name
    # what the counter sees: the dense formula holds whole matrices
    with counter_of(bound, n * n * 8) as counter:
        infonce_reference(images.detach() @ texts.detach().T, positives_of(groups),
                          [torch.tensor(0.1, dtype=torch.float64)])
    assert counter.peak >= 2


def test_the_plug_in_of_docs_plugins_md_is_infonce(monkeypatch):
    """docs/plugins.md's objective on tiles, run as written: InfoNCE's loss and gradients."""
    from script_modules import ROOT

    page = (ROOT / "docs" / "plugins.md").read_text()
    block = next(part.split("```", 1)[0] for part in page.split("```python\n")
                 if "class TiledInfoNCE" in part)
    monkeypatch.setattr(OBJECTIVES, "_entries", dict(OBJECTIVES._entries))  # registered anew
    monkeypatch.setattr(OBJECTIVES, "_origins", dict(OBJECTIVES._origins))
    exec(compile(block, "docs/plugins.md", "exec"), {})
    groups = torch.arange(9)
    images, texts = features(seed=6, n=9)
    for name in ("TiledInfoNCE", "InfoNCELoss"):
        config = {"type": name, "temperature": 0.125}  # one float32 and float64 hold alike
        if name == "InfoNCELoss":
            config["learnable"] = False
        objective = OBJECTIVES.build(config).double()
        leaves = [images.clone().requires_grad_(), texts.clone().requires_grad_()]
        tiles = ScoreTiles(DotScorer(*leaves), 9, 9, groups, tile_rows=2, tile_cols=4)
        loss = objective(ObjectiveInputs(None, tiles=tiles))["infonce_loss"]
        result = (loss, *torch.autograd.grad(loss, leaves))
        if name == "TiledInfoNCE":
            theirs = result
    for got, want in zip(theirs, result):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
