import itertools

import pytest
import torch
import torch.nn.functional as F

from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS
from mmgoal.structures import ObjectiveInputs

TRIPLETS = ("con", "nca", "cir")
PAIRS = ("con", "lin", "sig", "lin_ms", "sig_ms")
GROUPS = {
    "diagonal": list(range(8)),
    "several_positives": [0, 0, 1, 2, 2, 2, 3, 4],
}


def cosine_scores(n_img=8, n_txt=8, dim=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n_img, dim, generator=g, dtype=dtype), dim=-1)
    texts = F.normalize(torch.randn(n_txt, dim, generator=g, dtype=dtype), dim=-1)
    return images @ texts.T


def grad_of(objective, sims, positives, key):
    sims = sims.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(objective(ObjectiveInputs(sims, positives))[key], sims)
    return grad


def goal(**kwargs):
    return OBJECTIVES.build({"type": "GoalObjective", **kwargs})


@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
def test_con_con_is_the_hardest_negative_triplet_gradient(groups):
    sims = cosine_scores()
    positives = positives_from_groups(torch.tensor(groups))
    expected = grad_of(OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2}), sims,
                       positives, "triplet_loss")
    got = grad_of(goal(triplet={"type": "con", "margin": 0.2}, pair="con"), sims, positives,
                  "goal_loss")
    assert expected.abs().sum() > 0
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("tau", [1.0, 10.0])
def test_nca_con_is_hard_ntxent_over_tau(groups, tau):
    sims = cosine_scores(seed=1)
    positives = positives_from_groups(torch.tensor(groups))
    ntxent = grad_of(OBJECTIVES.build({"type": "NTXentHardLoss", "tau": tau}), sims, positives,
                     "ntxent_loss")
    got = grad_of(goal(triplet={"type": "nca", "tau": tau}, pair="con"), sims, positives,
                  "goal_loss")
    torch.testing.assert_close(got, ntxent / tau, atol=1e-6, rtol=0)


@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
def test_con_sig_with_every_triplet_active_is_binomial_deviance(groups):
    sims = cosine_scores(seed=2)
    positives = positives_from_groups(torch.tensor(groups))
    hp = {"alpha": 2.0, "beta": 10.0, "lam": 0.5}
    expected = grad_of(OBJECTIVES.build({"type": "BinomialDevianceLoss", **hp}), sims,
                       positives, "binomial_loss")
    got = grad_of(goal(triplet={"type": "con", "margin": 10.0}, pair={"type": "sig", **hp}),
                  sims, positives, "goal_loss")
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("margin,gamma", [(0.25, 64.0), (0.4, 16.0)])
def test_cir_lin_is_circle_loss_over_gamma(groups, margin, gamma):
    sims = cosine_scores(seed=3)
    positives = positives_from_groups(torch.tensor(groups))
    circle = grad_of(OBJECTIVES.build({"type": "CircleLoss", "margin": margin, "gamma": gamma}),
                     sims, positives, "circle_loss")
    got = grad_of(goal(triplet={"type": "cir", "tau": gamma, "cir_offset": 1 - 2 * margin ** 2},
                       pair={"type": "lin", "lin_shift": margin}), sims, positives, "goal_loss")
    torch.testing.assert_close(got, circle / gamma, atol=1e-6, rtol=0)


def pml_bidirectional(loss_fn, images, texts, labels):
    """pytorch-metric-learning run with images as anchors, then texts as anchors."""
    from pytorch_metric_learning.miners import BatchHardMiner

    miner = BatchHardMiner()
    total = 0
    for anchors, refs in ((images, texts), (texts, images)):
        triplets = miner(anchors, labels, refs, labels.clone())
        total = total + loss_fn(anchors, labels, triplets, refs, labels.clone())
    return total


def test_against_pytorch_metric_learning():
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.losses import CircleLoss, TripletMarginLoss
    from pytorch_metric_learning.reducers import SumReducer

    g = torch.Generator().manual_seed(4)
    images = torch.randn(8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    texts = torch.randn(8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.arange(8)
    cases = [
        (TripletMarginLoss(margin=0.2, distance=CosineSimilarity(), reducer=SumReducer()),
         goal(triplet={"type": "con", "margin": 0.2}, pair="con"), 1.0),
        (CircleLoss(m=0.25, gamma=64, reducer=SumReducer()),
         goal(triplet={"type": "cir", "tau": 64, "cir_offset": 1 - 2 * 0.25 ** 2},
              pair={"type": "lin", "lin_shift": 0.25}), 64.0),
    ]
    for pml_loss, goal_objective, factor in cases:
        expected = torch.autograd.grad(pml_bidirectional(pml_loss, images, texts, labels),
                                       (images, texts))
        sims = F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T
        got = torch.autograd.grad(goal_objective(ObjectiveInputs(sims))["goal_loss"],
                                  (images, texts))
        assert expected[0].abs().sum() > 0
        for e, o in zip(expected, got):
            torch.testing.assert_close(o, e / factor, atol=1e-6, rtol=0)


COMBINATIONS = list(itertools.product(TRIPLETS, PAIRS))


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
def test_every_combination_pulls_positives_and_pushes_negatives(triplet, pair, groups):
    sims = cosine_scores(seed=5)
    positives = positives_from_groups(torch.tensor(groups))
    objective = goal(triplet=triplet, pair=pair)
    grad = grad_of(objective, sims, positives, "goal_loss")
    assert torch.isfinite(grad).all()
    assert (grad[positives] <= 0).all()  # descent raises positive scores
    assert (grad[~positives] >= 0).all()  # and lowers negative ones
    assert grad[positives].sum() < 0 and grad[~positives].sum() > 0


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
def test_every_combination_is_invariant_to_batch_order(triplet, pair):
    sims = cosine_scores(seed=6)
    groups = torch.tensor(GROUPS["several_positives"])
    positives = positives_from_groups(groups)
    objective = goal(triplet=triplet, pair=pair)
    grad = grad_of(objective, sims, positives, "goal_loss")
    row_perm, col_perm = torch.randperm(8, generator=torch.Generator().manual_seed(1)), \
        torch.randperm(8, generator=torch.Generator().manual_seed(2))
    permuted = grad_of(objective, sims[row_perm][:, col_perm],
                       positives[row_perm][:, col_perm], "goal_loss")
    torch.testing.assert_close(permuted, grad[row_perm][:, col_perm], atol=1e-12, rtol=0)


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
def test_bf16_scores_get_float32_weights(triplet, pair):
    sims = cosine_scores(seed=7, dtype=torch.float32).to(torch.bfloat16)
    positives = positives_from_groups(torch.tensor(GROUPS["several_positives"]))
    objective = goal(triplet=triplet, pair=pair)
    weights_bf16, *_ = objective.gradient(sims, positives)
    weights_f32, *_ = objective.gradient(sims.float(), positives)
    assert weights_bf16.dtype == torch.float32
    torch.testing.assert_close(weights_bf16, weights_f32, atol=0, rtol=0)
    grad = grad_of(objective, sims, positives, "goal_loss")
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, weights_f32.to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
def test_backward_is_scaled_by_the_incoming_gradient(triplet, pair):
    """Loss scaling and accumulation over two half batches match separate runs."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(6, 6, dtype=torch.float64)
    images = torch.randn(8, 6, dtype=torch.float64)
    texts = F.normalize(torch.randn(8, 6, dtype=torch.float64), dim=-1)
    objective = goal(triplet=triplet, pair=pair)

    def loss(rows):
        sims = F.normalize(encoder(images[rows]), dim=-1) @ texts[rows].T
        return objective(ObjectiveInputs(sims))["goal_loss"]

    halves = (slice(0, 4), slice(4, 8))
    separate = [torch.autograd.grad(loss(h), encoder.weight)[0] for h in halves]
    encoder.zero_grad()
    for h in halves:
        (0.5 * loss(h)).backward()
    torch.testing.assert_close(encoder.weight.grad, (separate[0] + separate[1]) / 2)
    scaled = torch.autograd.grad(1024.0 * loss(halves[0]), encoder.weight)[0]
    torch.testing.assert_close(scaled, 1024.0 * separate[0])


def test_mean_reduction_and_logged_value():
    sims = cosine_scores(seed=8)
    summed = goal(triplet="nca", pair="lin")
    meaned = goal(triplet="nca", pair="lin", reduction="mean")
    torch.testing.assert_close(grad_of(meaned, sims, None, "goal_loss"),
                               grad_of(summed, sims, None, "goal_loss") / 8)
    out = goal(triplet={"type": "con", "margin": 0.2}, pair="con")(ObjectiveInputs(sims))
    hinge = OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2})(
        ObjectiveInputs(sims))["triplet_loss"]
    # con x con logs sum T (s_n - s_p) = triplet loss - margin * number of active triplets
    active = out["active_fraction"] * 16
    assert out["goal_loss"].item() == pytest.approx(hinge.item() - 0.2 * active.item())


def test_logged_score_medians():
    # 3 images x 3 captions, captions i the positives of image i
    sims = torch.tensor([[0.9, 0.7, 0.1],
                         [0.2, 0.5, 0.6],
                         [0.3, 0.8, 0.4]])
    out = goal(triplet="con", pair="con")(ObjectiveInputs(sims))
    # positives 0.9, 0.5, 0.4 -> median 0.5; hardest negatives: image rows 0.7, 0.6, 0.8,
    # caption columns 0.3, 0.8, 0.6 -> the lower middle of six, 0.6 (torch.median)
    assert out["positive_median"].item() == pytest.approx(0.5)
    assert out["negative_median"].item() == pytest.approx(0.6)
    assert "positive_median" not in goal()(ObjectiveInputs(torch.tensor([[0.5]])))


def test_relative_terms_fall_back_when_empty():
    # two pairs only: with eps = -10 the relative sets are empty, so *_ms equals the plain weight
    sims = cosine_scores(2, 2, seed=9)
    for ms, plain in (("sig_ms", "sig"), ("lin_ms", "lin")):
        a = grad_of(goal(pair={"type": ms, "eps": -10.0}, triplet="nca"), sims, None,
                    "goal_loss")
        b = grad_of(goal(pair=plain, triplet="nca"), sims, None, "goal_loss")
        torch.testing.assert_close(a, b)


def brute_force_relative(sims, positives, eps, direction):
    """m+, l+, m-, l- of every triplet by explicit loops over the sets of docs/reference/goal.md,
    the triplets mined by argmax over the dense matrix."""
    block, block_positives = (sims, positives) if direction == "i2t" else (sims.T, positives.T)
    anchors, others = block_positives.nonzero(as_tuple=True)
    negatives = block.masked_fill(block_positives, float("-inf")).argmax(1)[anchors]
    s_p, s_n = block[anchors, others], block[anchors, negatives]
    all_positives = sims[positives]

    def mean(values, empty):
        return sum(values) / len(values) if values else torch.tensor(empty)

    out = []
    for k in range(len(s_p)):
        # every positive pair of the batch is one triplet's: the others but its own
        r_pos = [s_p[m] for m in range(len(s_p)) if m != k and s_p[m] <= s_n[k] + eps]
        a = anchors[k]
        r_neg = [block[a, c] for c in range(block.shape[1]) if not block_positives[a, c]
                 and c != negatives[k] and block[a, c] >= all_positives.min() - eps]
        out.append([mean([torch.exp(2.0 * (s_p[k] - r)) for r in r_pos], 1.0),
                    mean([s_p[k] - r for r in r_pos], 0.0),
                    mean([torch.exp(-10.0 * (s_n[k] - r)) for r in r_neg], 1.0),
                    mean([s_n[k] - r for r in r_neg], 0.0)])
    return torch.tensor(out, dtype=sims.dtype), anchors, s_p, s_n


@pytest.mark.parametrize("direction", ["i2t", "t2i"])
@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("tile", [1, 3, 1024])
def test_relative_terms_match_a_loop_over_the_reference_sets(direction, groups, tile):
    from mmgoal.objectives.weights import (
        NegativeSums,
        RelativeScores,
        negative_set_statistics,
        negative_sums,
    )
    from mmgoal.scoring import HardestNegative, MatrixScorer, ScoreTiles

    sims = cosine_scores(seed=10, dim=3)
    positives = positives_from_groups(torch.tensor(groups))
    expected, anchors, s_p, s_n = brute_force_relative(sims, positives, 0.1, direction)
    asked = NegativeSums()
    one = sims.new_zeros(1)
    for ask in (lambda r: r.neg_mean_exp(10.0), lambda r: r.neg_mean_diff()):
        ask(RelativeScores(one, one, one, 0.1, asked))
    assert asked.scales == [10.0] and asked.wants_total
    tiles = ScoreTiles(MatrixScorer(sims), *sims.shape, positives=positives, tile_rows=tile,
                       tile_cols=tile + 1)
    statistics = negative_set_statistics(asked, sims[positives].min() - 0.1)
    tiles.statistics(HardestNegative(), *statistics.values())
    rel = RelativeScores(s_p, s_n, sims[positives], 0.1,
                         negative_sums(asked, statistics, direction == "i2t", anchors))
    got = torch.stack([rel.pos_mean_exp(2.0), rel.pos_mean_diff(), rel.neg_mean_exp(10.0),
                       rel.neg_mean_diff()], dim=1)
    assert (expected[:, 0] != 1).any() and (expected[:, 2] != 1).any()  # sets are not all empty
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_unknown_weights_list_the_choices():
    with pytest.raises(KeyError, match="Did you mean 'sig_ms'"):
        goal(pair="sigms")
    with pytest.raises(KeyError, match="Available: cir, con, nca"):
        goal(triplet="arc")
    with pytest.raises(KeyError, match="'arc' is not in the triplet weight registry"):
        goal(triplet={"type": "arc", "tau": 5})
    with pytest.raises(ValueError, match="objective.triplet must be a triplet weight name"):
        goal(triplet={"tau": 5})
    assert sorted(TRIPLETS) == TRIPLET_WEIGHTS.names()
    assert sorted(PAIRS) == PAIR_WEIGHTS.names()


def test_an_option_the_weight_does_not_take_is_an_error():
    # the registry's check (Registry.check): the weight's options and the closest one
    with pytest.raises(ValueError, match=r"objective.triplet: triplet weight 'con' got unknown "
                                         r"config key\(s\) 'tau'; it accepts: margin$"):
        goal(triplet={"type": "con", "tau": 5}, pair="con")
    with pytest.raises(ValueError, match=r"'cir' got unknown config key\(s\) 'cir_ofset' \(did "
                                         r"you mean 'cir_offset'\?\); it accepts: tau, cir_offset"):
        goal(triplet={"type": "cir", "cir_ofset": 0.0})
    with pytest.raises(ValueError, match=r"objective.pair: pair weight 'con' got unknown config "
                                         r"key\(s\) 'eps'; it takes none"):
        goal(pair={"type": "con", "eps": 0.1})
    with pytest.raises(ValueError, match="'sig' got unknown config key.* it accepts: alpha, beta, "
                                         "lam, lam_momentum, lam_init, lam_steps$"):
        goal(pair={"type": "sig", "eps": 0.1})  # eps belongs to the *_ms weights only
    with pytest.raises(ValueError, match=r"objective.triplet.tau must be a number, got 'ten'"):
        goal(triplet={"type": "nca", "tau": "ten"})


def test_flat_options_say_where_they_go():
    with pytest.raises(ValueError, match=r"move each under its weight: tau -> "
                                         r"triplet: \{type: cir, tau: 5\}"):
        goal(triplet="cir", pair="con", tau=5)
    # the chosen weight does not take it: the message names one that does
    with pytest.raises(ValueError, match=r"eps -> pair: \{type: lin_ms, eps: 0.2\} \(eps is an "
                                         r"option of the pair weight\(s\) lin_ms, sig_ms\)"):
        goal(pair="sig", eps=0.2)
    with pytest.raises(ValueError, match=r"unknown config key\(s\) 'reductoin' \(did you mean "
                                         r"'reduction'\?\)"):
        goal(reductoin="mean")


def test_options_are_bound_once_with_their_defaults_and_nothing_is_checkpointed():
    objective = goal(triplet={"type": "cir", "tau": 5}, pair="sig_ms")
    assert objective.triplet_weight.options == {"tau": 5, "cir_offset": 0.5}
    assert objective.pair_weight.options == {"alpha": 2.0, "beta": 10.0, "lam": 0.5, "eps": 0.1,
                                             "lam_momentum": 0.9, "lam_init": 0.5, "lam_steps": 10}
    # lam: auto's options are shown only with it
    assert "triplet=cir(tau=5, cir_offset=0.5), pair=sig_ms(alpha=2.0, beta=10.0, lam=0.5, " \
        "eps=0.1)" in repr(objective)
    assert objective.state_dict() == {} and not list(objective.parameters())


@pytest.fixture
def scaled_pair_weight():
    """A user's pair weight with an option of its own: P+ = gamma (1 - s_p), P- = gamma s_n."""

    @PAIR_WEIGHTS.register("scaled")
    def pair_weight_scaled(s_p, s_n, gamma=1.0):
        return gamma * (1 - s_p), gamma * s_n

    yield pair_weight_scaled
    PAIR_WEIGHTS._entries.pop("scaled")


def test_a_registered_weight_takes_its_own_option(scaled_pair_weight):
    sims = torch.tensor([[0.9, 0.3], [0.5, 0.8]], dtype=torch.float64)
    # margin 1: all four triplets active (T = 1). Row 0: s_p 0.9, hardest negatives 0.3 (i2t,
    # text 1) and 0.5 (t2i, image 1); row 1: s_p 0.8, negatives 0.5 (text 0) and 0.3 (image 0).
    # G[i, i] = -2 gamma (1 - s_p); each negative is the hardest of its row and of its column,
    # so G[i, j] = 2 gamma s_n.
    gamma = 3.0
    expected = torch.tensor([[-2 * gamma * 0.1, 2 * gamma * 0.3],
                             [2 * gamma * 0.5, -2 * gamma * 0.2]], dtype=torch.float64)
    all_active = {"type": "con", "margin": 1.0}
    objective = goal(triplet=all_active, pair={"type": "scaled", "gamma": gamma})
    torch.testing.assert_close(grad_of(objective, sims, None, "goal_loss"), expected)
    default = goal(triplet=all_active, pair="scaled")
    torch.testing.assert_close(grad_of(default, sims, None, "goal_loss"), expected / gamma)
    with pytest.raises(ValueError, match="'scaled' got unknown config key.* it accepts: gamma"):
        goal(pair={"type": "scaled", "tau": 3.0})


def test_a_pair_weight_with_comparison_sets_declares_eps():
    @PAIR_WEIGHTS.register("ms_without_eps")
    def pair_weight_ms_without_eps(s_p, s_n, relative):
        return torch.ones_like(s_p), torch.ones_like(s_n)

    try:
        with pytest.raises(ValueError, match="give it an eps parameter"):
            goal(pair="ms_without_eps")
    finally:
        PAIR_WEIGHTS._entries.pop("ms_without_eps")


