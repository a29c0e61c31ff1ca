"""``lam: auto``: mmgoal's adaptive lambda (mmgoal/objectives/adaptive_lam.py)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmgoal.objectives.adaptive_lam import step_midpoint
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS
from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.runs.schema import load_run_config
from mmgoal.structures import ObjectiveInputs

QUICKSTART_GOAL = Path(__file__).resolve().parents[2] / "configs" / "goal" / "quickstart_goal.yaml"
# 3 x 3, diagonal positives 0.9, 0.7, 0.6 (median 0.7). Hardest negatives: of rows
# (i2t) 0.4, 0.3, 0.5; of columns (t2i) 0.5, 0.2, 0.4; sorted 0.2 0.3 0.4 0.4 0.5 0.5,
# lower median 0.4. Midpoint (0.7 + 0.4) / 2 = 0.55.
HAND = torch.tensor([[0.9, 0.2, 0.4],
                     [0.1, 0.7, 0.3],
                     [0.5, 0.0, 0.6]], dtype=torch.float64)


def auto(pair="sig_ms", triplet="cir", **options):
    return OBJECTIVES.build({"type": "GoalObjective", "triplet": triplet,
                             "pair": {"type": pair, "lam": "auto", **options}})


def cosine_scores(n=16, dim=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n, dim, generator=g, dtype=dtype), dim=-1)
    texts = F.normalize(torch.randn(n, dim, generator=g, dtype=dtype), dim=-1)
    return images @ texts.T


def brute_force_midpoint(sims, positives):
    """The statistics by a loop over the positives: their scores, and the hardest negative
    of each one's row (i2t) and column (t2i)."""
    pos, neg = [], []
    for i, j in positives.nonzero().tolist():
        pos.append(sims[i, j])
        neg.append(max(sims[i, k] for k in range(sims.shape[1]) if not positives[i, k]))
        neg.append(max(sims[k, j] for k in range(sims.shape[0]) if not positives[k, j]))
    return float((torch.stack(pos).median() + torch.stack(neg).median()) / 2)


def run_step(objective, *score_matrices, positives=None, applied=True):
    """One optimisation step: one call per micro-batch, then the step ends. Returns the
    ``lam`` each call logged."""
    logged = [float(objective(ObjectiveInputs(sims, positives))["lam"])
              for sims in score_matrices]
    objective.finish_step(applied)
    return logged


def test_lam_starts_at_lam_init_takes_the_first_midpoint_then_averages():
    objective = auto(lam_init=0.3, lam_momentum=0.9)
    assert brute_force_midpoint(HAND, torch.eye(3, dtype=torch.bool)) == pytest.approx(0.55)
    assert run_step(objective, HAND) == [pytest.approx(0.3)]  # no statistics yet
    assert objective.adaptive_lam.value == pytest.approx(0.55, abs=1e-12)
    # every score 0.1 higher: midpoint 0.65, lam = 0.9 * 0.55 + 0.1 * 0.65
    assert run_step(objective, HAND + 0.1) == [pytest.approx(0.55)]
    assert objective.adaptive_lam.value == pytest.approx(0.56, abs=1e-12)
    assert objective.adaptive_lam.updates == 2


@pytest.mark.parametrize("groups", [list(range(16)), [0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7, 8,
                                                      9, 9, 10]], ids=["diagonal", "groups"])
def test_the_statistics_are_every_positive_and_every_triplets_hardest_negative(groups):
    sims = cosine_scores()
    positives = positives_from_groups(torch.tensor(groups))
    objective = auto()
    run_step(objective, sims, positives=positives)
    assert objective.adaptive_lam.value == pytest.approx(brute_force_midpoint(sims, positives),
                                                         abs=1e-12)


def test_lam_holds_after_lam_steps_updates_and_resumes_holding():
    objective = auto(lam_init=0.3, lam_momentum=0.9, lam_steps=2)
    run_step(objective, HAND)
    run_step(objective, HAND + 0.1)
    assert objective.adaptive_lam.value == pytest.approx(0.56, abs=1e-12)  # as above
    assert objective.adaptive_lam.holding
    # the scores keep moving, lam holds (and records nothing)
    assert run_step(objective, HAND + 0.3) == [pytest.approx(0.56)]
    assert objective.adaptive_lam.value == pytest.approx(0.56, abs=1e-12)
    assert objective.adaptive_lam.updates == 2 and not objective.adaptive_lam._positives
    resumed = auto(lam_init=0.3, lam_momentum=0.9, lam_steps=2)
    resumed.load_state_dict(objective.state_dict())
    run_step(resumed, HAND - 0.2)
    assert resumed.adaptive_lam.value == pytest.approx(0.56, abs=1e-12)
    # the default holds after 10 updates
    default = auto()
    for t in range(12):
        run_step(default, HAND + 0.01 * t)
    assert default.adaptive_lam.updates == 10 and default.adaptive_lam.steps == 10


@pytest.mark.parametrize("positive_drift,negative_drift", [(0.01, 0.01), (0.01, -0.004)])
def test_lam_follows_a_moving_score_distribution_with_the_lag_of_the_average(positive_drift,
                                                                               negative_drift):
    """Positives move by ``a`` and negatives by ``c`` per step (the mined negatives stay the
    same), so the midpoint moves by ``b = (a + c) / 2``: ``c_t = c_0 + b t``. The average
    starts at ``c_0`` and then lags by ``b m (1 - m^t) / (1 - m)``, ``b m / (1 - m)`` for
    large ``t`` (0.04 for the parallel drift at ``m`` 0.8)."""
    base = cosine_scores(seed=1)
    positives = torch.eye(16, dtype=torch.bool)
    momentum, drift = 0.8, (positive_drift + negative_drift) / 2
    objective = auto(lam_momentum=momentum, lam_steps=None)  # follows for the whole run
    start = brute_force_midpoint(base, positives)
    for t in range(40):
        shift = torch.full_like(base, negative_drift).masked_fill(positives, positive_drift)
        sims = base + shift * t
        run_step(objective, sims)
        lag = drift * momentum * (1 - momentum ** t) / (1 - momentum)
        assert objective.adaptive_lam.value == pytest.approx(start + drift * t - lag, abs=1e-9)
    assert objective.adaptive_lam.value - (start + drift * 39) == pytest.approx(
        -drift * momentum / (1 - momentum), abs=1e-4)


def test_the_update_depends_only_on_the_union_of_the_steps_statistics():
    """Accumulation: the micro-batches of a step count together, in any order (and ranks
    that do not gather features are micro-batches of another process: tests/engine/
    test_gather.py checks it with 2 processes)."""
    batches = [cosine_scores(n=8, seed=seed) for seed in range(6)]
    forward, backward = auto(lam_momentum=0.5), auto(lam_momentum=0.5)
    for step in range(3):
        first, second = batches[2 * step], batches[2 * step + 1]
        run_step(forward, first, second)
        run_step(backward, second, first)
        assert forward.adaptive_lam.value == backward.adaptive_lam.value
    # not the mean of per-micro-batch midpoints: those are not the union's
    union = auto(lam_momentum=0.0)
    run_step(union, batches[0], batches[1])
    eye = torch.eye(8, dtype=torch.bool)
    halves = [brute_force_midpoint(b, eye) for b in batches[:2]]
    assert union.adaptive_lam.value != pytest.approx(sum(halves) / 2, abs=1e-6)


@pytest.mark.parametrize("n", [5, 6])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_gathered_batch_reported_by_every_rank_has_the_midpoint_of_one_copy(n, world):
    """With gathered features every rank holds the same global batch; the all-gathered
    statistics are ``world`` copies, whose lower median is that of one copy, bit for bit."""
    g = torch.Generator().manual_seed(n + world)
    positive, negative = torch.rand(n, generator=g), torch.rand(2 * n - 1, generator=g)
    assert step_midpoint(positive.repeat(world), negative.repeat(world)) == \
        step_midpoint(positive, negative)


@pytest.mark.parametrize("pair", ["sig", "sig_ms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gradient_is_the_fixed_weights_at_the_running_lam(pair, dtype):
    objective = auto(pair=pair, lam_momentum=0.7)
    for seed in range(3):
        run_step(objective, cosine_scores(seed=seed, dtype=dtype))
    lam = objective.adaptive_lam.value
    fixed = OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir",
                              "pair": {"type": pair, "lam": lam}})
    sims = cosine_scores(seed=10, dtype=dtype)
    grads, losses = [], []
    for o in (objective, fixed):
        leaf = sims.clone().requires_grad_()
        loss = o(ObjectiveInputs(leaf, None))["goal_loss"]
        grads.append(torch.autograd.grad(loss, leaf)[0])
        losses.append(loss.detach())
    assert torch.equal(grads[0], grads[1]) and torch.equal(losses[0], losses[1])


def test_a_skipped_step_and_evaluation_calls_leave_lam_alone():
    objective = auto(lam_init=0.2)
    run_step(objective, HAND + 0.3, applied=False)  # a non-finite step: forgotten
    assert (objective.adaptive_lam.value, objective.adaptive_lam.updates) == (0.2, 0)
    objective.eval()
    run_step(objective, HAND + 0.3)
    assert objective.adaptive_lam.updates == 0
    objective.train()
    run_step(objective, HAND)
    assert objective.adaptive_lam.value == pytest.approx(0.55, abs=1e-12)  # HAND's alone


def test_the_state_is_checkpointed_and_a_resumed_objective_continues_exactly(tmp_path):
    objective = auto(lam_momentum=0.6)
    run_step(objective, cosine_scores(seed=0))
    run_step(objective, cosine_scores(seed=1))
    save_checkpoint({"objective": objective.state_dict()}, tmp_path / "last.pt")
    resumed = auto(lam_momentum=0.6)
    resumed.load_state_dict(load_checkpoint(tmp_path / "last.pt")["objective"])  # weights-only
    assert resumed.adaptive_lam.updates == 2
    for o in (objective, resumed):
        run_step(o, cosine_scores(seed=2))
    assert resumed.adaptive_lam.value == objective.adaptive_lam.value
    state = objective.state_dict()
    assert state["adaptive_lam.lam"].dtype == torch.float64  # never cast with the module
    assert resumed.bfloat16().state_dict()["adaptive_lam.lam"] == state["adaptive_lam.lam"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) .*adaptive_lam.updates"):
        resumed.load_state_dict({"adaptive_lam.lam": torch.tensor(0.5)})
    # a fixed lam keeps no state: checkpoints of fixed-lam runs are unchanged
    fixed = OBJECTIVES.build({"type": "GoalObjective", "pair": "sig_ms"})
    assert fixed.state_dict() == {} and fixed.adaptive_lam is None


def test_lam_auto_and_its_options_are_checked():
    with pytest.raises(ValueError, match=r"objective.pair.lam must be a number or auto, got "
                                         r"'autoo' \(did you mean auto\?\)"):
        auto(lam="autoo")
    with pytest.raises(ValueError, match=r"lam_momentum \(option\(s\) of lam: auto, mmgoal's "
                                         r"adaptive lambda\) would apply to nothing with lam: "
                                         r"0.5; remove them or set lam: auto"):
        OBJECTIVES.build({"type": "GoalObjective", "pair": {"type": "sig", "lam_momentum": 0.5}})
    with pytest.raises(ValueError, match=r"lam_momentum must be a number in \[0, 1\)"):
        auto(lam_momentum=1.0)
    with pytest.raises(ValueError, match="lam_init must be a number"):
        auto(lam_init="half")
    for steps in (0, 2.5, True, "10"):
        with pytest.raises(ValueError, match=r"lam_steps must be (an integer or null|a whole "
                                             r"number >= 1 .* or null)"):
            auto(lam_steps=steps)
    with pytest.raises(ValueError, match="'lin' got unknown config key.* it accepts: lin_shift"):
        OBJECTIVES.build({"type": "GoalObjective", "pair": {"type": "lin", "lam": "auto"}})


def test_a_weight_of_ones_own_declares_the_options_of_lam_auto():
    @PAIR_WEIGHTS.register("step")
    def pair_weight_step(s_p, s_n, lam=0.5):
        return (s_p < lam).double(), (s_n > lam).double()

    @TRIPLET_WEIGHTS.register("gate")
    def triplet_weight_gate(s_p, s_n, lam=0.5, *, lam_momentum=0.9, lam_init=0.5,
                            lam_steps=10):
        return (s_n > lam).double()

    try:
        with pytest.raises(ValueError, match=r"'step' takes lam but not lam_momentum, lam_init, "
                                             r"lam_steps, which lam: auto reads"):
            OBJECTIVES.build({"type": "GoalObjective", "pair": {"type": "step", "lam": "auto"}})
        with pytest.raises(ValueError, match="objective.triplet: lam: auto .* for pair weights "
                                             "only"):
            OBJECTIVES.build({"type": "GoalObjective", "triplet": {"type": "gate", "lam": "auto"}})
    finally:
        PAIR_WEIGHTS._entries.pop("step")
        TRIPLET_WEIGHTS._entries.pop("gate")


def test_lam_auto_from_the_command_line():
    cfg = load_run_config(QUICKSTART_GOAL, [
        "objective.pair={'type': 'sig_ms'}", "objective.pair.lam=auto",
        "objective.pair.lam_momentum=0.99"])
    objective = OBJECTIVES.build(cfg["objective"])
    assert (objective.adaptive_lam.momentum, objective.adaptive_lam.value) == (0.99, 0.5)
    with pytest.raises(ValueError, match=r"got 'atuo' \(did you mean auto\?\)"):
        OBJECTIVES.build(load_run_config(QUICKSTART_GOAL, [
            "objective.pair={'type': 'sig'}", "objective.pair.lam=atuo"])["objective"])


def test_lam_auto_inside_an_objective_sum_updates_as_alone():
    # X-VLM's ITC slot holding GOAL beside another term: the sum passes the step's end on
    alone = auto(lam_init=0.3, lam_momentum=0.9)
    summed = OBJECTIVES.build({"type": "ObjectiveSum", "terms": [
        {"type": "GoalObjective", "triplet": "cir",
         "pair": {"type": "sig_ms", "lam": "auto", "lam_init": 0.3, "lam_momentum": 0.9}},
        {"type": "InfoNCELoss"}]})
    for scores in (HAND, HAND + 0.1):
        assert run_step(summed, scores) == run_step(alone, scores)
    assert summed.terms[0].adaptive_lam.value == alone.adaptive_lam.value == \
        pytest.approx(0.56, abs=1e-12)


@pytest.mark.parametrize("warmup", [
    {"objective": {"type": "TripletLoss", "max_violation": False}},  # another objective
    {"attributes": {"reduction": "mean"}},  # GOAL itself, other attributes
], ids=["swap", "attributes"])
def test_lam_auto_measures_goals_own_first_steps_after_a_warm_up(warmup, tiny_benchmark,
                                                                 tmp_path):
    """An ObjectiveWarmup's epoch, then GOAL: lam is lam_init at GOAL's first step and
    then the midpoint of that step's medians (lam_steps 1: held), whatever the warm-up
    did to the scores."""
    from mmgoal.engine.trainer import Trainer

    out, _ = tiny_benchmark
    cfg = load_run_config(QUICKSTART_GOAL.parent.parent / "quickstart.yaml", [
        "model.embed_dim=16", "model.image_encoder.model_kwargs.widths=[8, 16]",
        "model.text_encoder.word_dim=8", "model.text_encoder.hidden_size=16",
        "data.image_size=32", "data.num_workers=0", "train.epochs=2", "train.progress=False",
        "train.log_every=1", "train.eval_every=0", "data.train.batch_size=32",
        f"data.train.shards={out}/train-{{000000..000002}}.tar", "data.val=None",
        "data.test=None",
        "objective={'type': 'GoalObjective', 'triplet': 'cir', 'pair': {'type': 'sig_ms', "
        "'lam': 'auto', 'lam_init': 0.3, 'lam_steps': 1}}",
        f"hooks=[{ {'type': 'ObjectiveWarmup', 'epochs': 1, **warmup}!r}]"])
    Trainer(cfg, tmp_path / "run").fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    goal = [r for r in records if r.get("type") == "train" and r["epoch"] == 1]
    warm = [r for r in records if r.get("type") == "train" and r["epoch"] == 0]
    assert len(goal) == len(warm) == 3
    assert all(r.get("lam", 0.3) == pytest.approx(0.3) for r in warm)  # nothing measured
    first = goal[0]
    assert first["lam"] == pytest.approx(0.3)
    midpoint = (first["positive_median"] + first["negative_median"]) / 2
    assert [r["lam"] for r in goal[1:]] == [pytest.approx(midpoint, abs=1e-6)] * 2
    assert abs(midpoint - 0.3) > 1e-3  # the test could tell lam_init from the midpoint
