"""``GoalLoss``: GOAL in a plain training loop (mmgoal/objectives/goal_loss.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mmgoal
from mmgoal import GoalLoss
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs

COMBINATIONS = [("con", "con"), ("cir", "sig_ms"), ("nca", "lin"),
                ({"type": "cir", "tau": 5}, {"type": "sig", "lam": 0.3})]
IDS = [0, 0, 1, 2, 2, 2, 3, 4]


def raw_embeddings(n=8, dim=6, seed=0):
    """Leaf (N, D) float64 image and text embeddings, not yet normalised."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, dim, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(n, dim, generator=g, dtype=torch.float64, requires_grad=True))


def goal_objective(triplet, pair):
    return OBJECTIVES.build({"type": "GoalObjective", "triplet": triplet, "pair": pair})


def objective_gradient(triplet, pair, images, texts, positives):
    """d goal_loss / d (images, texts) by autograd through the registered objective."""
    sims = F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T
    loss = goal_objective(triplet, pair)(ObjectiveInputs(sims, positives))["goal_loss"]
    return torch.autograd.grad(loss, (images, texts))


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
@pytest.mark.parametrize("ids", [None, IDS], ids=["diagonal", "several_positives"])
def test_the_gradient_of_the_embeddings_is_the_objectives(triplet, pair, ids):
    images, texts = raw_embeddings()
    positives = None if ids is None else positives_from_groups(torch.tensor(ids))
    expected = objective_gradient(triplet, pair, images, texts, positives)
    loss = GoalLoss(triplet, pair)(F.normalize(images, dim=-1), F.normalize(texts, dim=-1),
                                   image_ids=None if ids is None else torch.tensor(ids))
    got = torch.autograd.grad(loss, (images, texts))
    assert expected[0].abs().sum() > 0 and expected[1].abs().sum() > 0
    for o, e in zip(got, expected):
        torch.testing.assert_close(o, e, atol=1e-6, rtol=0)


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
def test_the_gradient_of_normalised_embeddings_is_g_times_the_other_tower(triplet, pair):
    # S = X Y^T, so dl/dX = G Y and dl/dY = G^T X (GOAL's eq. 2-4)
    raw_images, raw_texts = raw_embeddings(seed=1)
    images = F.normalize(raw_images, dim=-1).detach().requires_grad_()
    texts = F.normalize(raw_texts, dim=-1).detach().requires_grad_()
    positives = positives_from_groups(torch.tensor(IDS))
    grad, *_ = goal_objective(triplet, pair).gradient(images @ texts.T, positives)
    loss = GoalLoss(triplet, pair)(images, texts, image_ids=IDS)
    d_images, d_texts = torch.autograd.grad(loss, (images, texts))
    torch.testing.assert_close(d_images, grad @ texts.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(d_texts, grad.T @ images.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("triplet,pair", COMBINATIONS)
def test_the_gradient_of_given_scores_is_g_and_the_value_the_objectives(triplet, pair):
    images, texts = raw_embeddings(seed=2)
    sims = (F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T).detach()
    positives = positives_from_groups(torch.tensor(IDS))
    objective = goal_objective(triplet, pair)
    grad, *_ = objective.gradient(sims, positives)
    expected_value = objective(ObjectiveInputs(sims, positives))["goal_loss"]
    scores = sims.clone().requires_grad_()
    loss = GoalLoss(triplet, pair)(scores=scores, image_ids=torch.tensor(IDS))
    (got,) = torch.autograd.grad(loss, scores)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(got, grad, atol=1e-6, rtol=0)
    assert loss.item() == pytest.approx(expected_value.item(), abs=1e-12)


def test_image_ids_of_any_kind_make_equal_ids_positives():
    images, texts = raw_embeddings(seed=3)
    expected = objective_gradient("nca", "lin", images, texts,
                                  positives_from_groups(torch.tensor(IDS)))
    diagonal = objective_gradient("nca", "lin", images, texts, None)
    goal = GoalLoss("nca", "lin")
    names = [f"COCO_{i:012d}.jpg" for i in IDS]  # ids of any kind: equal ids, equal hashes
    for ids in (torch.tensor(IDS), torch.tensor(IDS, dtype=torch.int32), IDS, names):
        loss = goal(F.normalize(images, dim=-1), F.normalize(texts, dim=-1), image_ids=ids)
        got = torch.autograd.grad(loss, (images, texts))
        for o, e in zip(got, expected):
            torch.testing.assert_close(o, e, atol=1e-6, rtol=0)
    assert not torch.allclose(expected[0], diagonal[0])  # the ids changed the positives


def test_last_stats_are_the_objectives_statistics():
    # 3 images x 3 captions (tests/objectives/test_goal.py's hand case): positives 0.9, 0.5,
    # 0.4 -> median 0.5; hardest negatives 0.7, 0.6, 0.8 (rows), 0.3, 0.8, 0.6 (columns) -> 0.6
    sims = torch.tensor([[0.9, 0.7, 0.1],
                         [0.2, 0.5, 0.6],
                         [0.3, 0.8, 0.4]], dtype=torch.float64)
    goal = GoalLoss("nca", "con")
    assert goal.last_stats == {}
    goal(scores=sims)
    expected = goal_objective("nca", "con")(ObjectiveInputs(sims))
    assert goal.last_stats == {key: pytest.approx(float(expected[key]))
                               for key in ("active_fraction", "positive_median",
                                           "negative_median")}
    assert goal.last_stats["positive_median"] == pytest.approx(0.5)
    assert goal.last_stats["negative_median"] == pytest.approx(0.6)
    assert all(isinstance(value, float) for value in goal.last_stats.values())
    # one pair has no negative: no medians, and the previous call's are gone
    goal(scores=torch.tensor([[0.5]]))
    assert set(goal.last_stats) == {"active_fraction"}


def test_embedding_stats_are_the_objectives_on_the_scores_with_lam_when_auto():
    images, texts = raw_embeddings(n=16, seed=4)
    images, texts = F.normalize(images, dim=-1).detach(), F.normalize(texts, dim=-1).detach()
    pair = {"type": "sig_ms", "lam": "auto", "lam_init": 0.3}
    goal = GoalLoss("cir", pair)
    goal(images, texts)
    expected = goal_objective("cir", pair)(ObjectiveInputs(images @ texts.T))
    assert set(goal.last_stats) == {"active_fraction", "positive_median", "negative_median",
                                    "lam"}
    for key, value in goal.last_stats.items():
        assert value == pytest.approx(float(expected[key]), abs=1e-12)
    assert goal.last_stats["lam"] == pytest.approx(0.3)


def unit_rows(n, dim=4):
    return F.normalize(torch.randn(n, dim, generator=torch.Generator().manual_seed(n)), dim=-1)


@pytest.mark.parametrize("call,message", [
    (lambda goal: goal(), r"GoalLoss takes image_embeds and text_embeds \(\(N, D\) each, "
                          r"L2-normalised, row i of each is pair i\) or scores=\(N, N\); got "
                          r"neither"),
    (lambda goal: goal(unit_rows(4)), r"or scores=\(N, N\); got only image_embeds"),
    (lambda goal: goal(text_embeds=unit_rows(4)), r"got only text_embeds"),
    (lambda goal: goal(unit_rows(4), unit_rows(4), scores=torch.zeros(4, 4)),
     r"or scores=\(N, N\), not both: scores are computed from the embeddings"),
    (lambda goal: goal(unit_rows(4), unit_rows(5)),
     r"image_embeds has 4 rows and text_embeds 5; row i of each is pair i, so they must match"
     r". With several captions per image, repeat the image's row once per caption and pass "
     r"image_ids"),
    (lambda goal: goal(unit_rows(4), unit_rows(4, dim=3)),
     r"image_embeds are 4-dimensional and text_embeds 3-dimensional"),
    (lambda goal: goal(unit_rows(4)[0], unit_rows(4)),
     r"image_embeds must be \(N, D\) with N >= 1, got shape \(4,\)"),
    (lambda goal: goal(unit_rows(4), unit_rows(4).double()),
     r"image_embeds are torch.float32 on cpu, text_embeds torch.float64 on cpu; cast or move "
     r"one"),
    (lambda goal: goal(3 * unit_rows(4), unit_rows(4)),
     r"image_embeds must be L2-normalised \(GOAL's weights are set for cosine scores\); its "
     r"row norms lie in \[3, 3\]: pass F.normalize\(image_embeds, dim=-1\)"),
    (lambda goal: goal(unit_rows(4), unit_rows(4), image_ids=torch.tensor([0, 0, 1])),
     r"image_ids has 3 ids for 4 pairs; give one id per pair"),
    (lambda goal: goal(scores=torch.zeros(4, 4), image_ids=[1, 2]),
     r"image_ids has 2 ids for 4 pairs"),
    (lambda goal: goal(unit_rows(4), unit_rows(4), image_ids=torch.zeros(4)),
     r"image_ids must be a 1-D integer tensor or a list of ids, got a torch.float32 tensor"),
    (lambda goal: goal(unit_rows(4), unit_rows(4), image_ids="0123"),
     r"image_ids must be a 1-D integer tensor or a list of ids \(ints, strings\), got str"),
    (lambda goal: goal(scores=torch.zeros(4, 5)),
     r"scores must be square, \(N, N\) with N >= 1.*got shape \(4, 5\)"),
    (lambda goal: GoalLoss(gather=True)(scores=torch.zeros(4, 4)),
     r"GoalLoss\(gather=True\) gathers the embeddings of every rank and scores them; with "
     r"scores= given there is nothing it can gather"),
])
def test_bad_inputs_say_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call(GoalLoss())


def test_a_bad_weight_is_the_objectives_error():
    with pytest.raises(KeyError, match="Did you mean 'sig_ms'"):
        GoalLoss(pair="sigms")


def test_gather_in_one_process_is_no_gather():
    images, texts = raw_embeddings(seed=5)
    grads = []
    for gather in (False, True):
        loss = GoalLoss("cir", "sig_ms", gather=gather)(
            F.normalize(images, dim=-1), F.normalize(texts, dim=-1), image_ids=IDS)
        grads.append(torch.autograd.grad(loss, (images, texts)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def synthetic_pairs(n=32, dim=16, seed=0):
    """Image and text features of ``n`` pairs: each text a fixed linear map of its image,
    plus noise, so two linear towers can learn to match them."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, dim, generator=g)
    texts = images @ torch.randn(dim, dim, generator=g) + 0.1 * torch.randn(n, dim, generator=g)
    return images, texts


def test_a_plain_loop_learns_to_match_pairs():
    """Two linear towers and AdamW, GoalLoss and nothing else of mmgoal."""
    images, texts = synthetic_pairs()
    torch.manual_seed(0)
    image_tower, text_tower = nn.Linear(16, 8), nn.Linear(16, 8)
    optimizer = torch.optim.AdamW([*image_tower.parameters(), *text_tower.parameters()],
                                  lr=0.05)
    goal = GoalLoss("nca", "con")

    def embed(rows):
        return (F.normalize(image_tower(images[rows]), dim=-1),
                F.normalize(text_tower(texts[rows]), dim=-1))

    def recall_at_1():
        with torch.no_grad():
            image, text = embed(slice(None))
        return (image @ text.T).argmax(dim=1).eq(torch.arange(len(images))).float().mean()

    first_batch = slice(0, 8)
    with torch.no_grad():
        first_loss = goal(*embed(first_batch))
    before = recall_at_1()
    for _ in range(30):
        for start in range(0, len(images), 8):
            loss = goal(*embed(slice(start, start + 8)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert before < 0.1  # chance is 1/32
    assert recall_at_1() > 0.6
    with torch.no_grad():
        assert goal(*embed(first_batch)) < first_loss - 0.5


def lam_auto_loop(goal, steps, step_after=False):
    """``steps`` steps of a linear image tower under ``goal``; the ``lam`` of each call and
    the midpoint of each call's medians."""
    images, texts = synthetic_pairs(n=8, seed=1)
    torch.manual_seed(1)
    tower = nn.Linear(16, 16)
    optimizer = torch.optim.SGD(tower.parameters(), lr=0.1)
    text = F.normalize(texts, dim=-1)
    used, midpoints = [], []
    for _ in range(steps):
        loss = goal(F.normalize(tower(images), dim=-1), text)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step_after:
            goal.step()
        stats = goal.last_stats
        used.append(stats["lam"])
        midpoints.append((stats["positive_median"] + stats["negative_median"]) / 2)
    return used, midpoints


def test_lam_auto_follows_the_scores_in_a_plain_loop():
    pair = {"type": "sig", "lam": "auto", "lam_init": 0.9, "lam_momentum": 0.5, "lam_steps": 3}
    goal = GoalLoss("con", pair)
    used, midpoints = lam_auto_loop(goal, 5)
    # step 1 uses lam_init and its midpoint becomes lam; then lam <- 0.5 lam + 0.5 c_t,
    # for lam_steps = 3 updates, after which it holds
    lam_2 = midpoints[0]
    lam_3 = 0.5 * lam_2 + 0.5 * midpoints[1]
    lam_4 = 0.5 * lam_3 + 0.5 * midpoints[2]
    assert used == pytest.approx([0.9, lam_2, lam_3, lam_4, lam_4])
    assert abs(lam_2 - 0.9) > 0.1
    assert goal.objective.adaptive_lam.value == pytest.approx(lam_4)
    assert float(goal.state_dict()["objective.adaptive_lam.lam"]) == pytest.approx(lam_4)


def test_lam_auto_with_explicit_steps_and_in_eval_mode():
    pair = {"type": "sig", "lam": "auto", "lam_init": 0.9, "lam_momentum": 0.5}
    every_call = lam_auto_loop(GoalLoss("con", pair), 3)
    explicit = GoalLoss("con", pair, step_each_call=False)
    # one call per step, ended by step(): the same lam as ending each call
    assert lam_auto_loop(explicit, 3, step_after=True) == every_call
    forgotten = GoalLoss("con", pair, step_each_call=False)
    assert lam_auto_loop(forgotten, 3)[0] == pytest.approx([0.9] * 3)  # lam waits for step()
    evaluating = GoalLoss("con", pair).eval()
    assert lam_auto_loop(evaluating, 2)[0] == pytest.approx([0.9] * 2)  # eval records nothing
    evaluating.step()
    assert evaluating.objective.adaptive_lam.value == 0.9


def test_goal_loss_is_exported_and_not_a_config_objective():
    assert mmgoal.GoalLoss is GoalLoss and "GoalLoss" in mmgoal.__all__
    assert mmgoal.objectives.GoalLoss is GoalLoss
    assert "GoalLoss" not in OBJECTIVES.names()
    assert not list(GoalLoss("cir", "sig_ms").parameters())



def with_value(rows, value, at):
    """``rows`` with ``value`` written at each ``(row, column)`` of ``at``."""
    rows = rows.clone()
    for row, column in at:
        rows[row, column] = value
    return rows


@pytest.mark.parametrize("call,message", [
    (lambda goal: goal(with_value(unit_rows(4), float("nan"), [(2, 0)]), unit_rows(4)),
     r"image_embeds holds NaN or inf in 1 of its 4 rows \(row 2 first\), which would make the "
     r"loss NaN: the model's outputs are not finite; check the model and its loss scale .*"
     r"GoalLoss\(check_values=False\) leaves this check out"),
    (lambda goal: goal(unit_rows(4), with_value(unit_rows(4), float("inf"), [(1, 0), (3, 2)])),
     r"text_embeds holds NaN or inf in 2 of its 4 rows \(row 1 first\)"),
    (lambda goal: goal(scores=with_value(torch.zeros(4, 4), float("nan"), [(0, 1), (2, 2)]),
                       image_ids=[0, 1, 2, 3]),
     r"scores hold NaN or inf in 2 of their 16 entries, which would make the loss NaN: check "
     r"the model that scored them and its loss scale, or skip the batch. "
     r"GoalLoss\(check_values=False\)"),
], ids=["nan_image_row", "inf_text_rows", "nan_scores"])
def test_non_finite_inputs_are_refused_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call(GoalLoss())


def count_waits(monkeypatch):
    """A list that grows by one at each ``bool(tensor)``: where a call waits for the GPU."""
    waits = []
    to_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: waits.append(1) or to_bool(t))
    return waits


def test_the_value_checks_cost_one_wait_per_tensor_and_can_be_left_out(monkeypatch):
    images, texts = unit_rows(4), unit_rows(4)
    waits = count_waits(monkeypatch)
    GoalLoss("cir", "sig_ms")(images, texts)
    checked = len(waits)
    GoalLoss("cir", "sig_ms", check_values=False)(images, texts)
    assert checked - (len(waits) - checked) == 2  # one for each tower's norms and finiteness
    waits.clear()
    GoalLoss()(scores=images @ texts.T)
    checked = len(waits)
    GoalLoss(check_values=False)(scores=images @ texts.T)
    assert checked - (len(waits) - checked) == 1
    monkeypatch.undo()
    # left out, a NaN gives a NaN loss, as documented, and unnormalised rows pass
    unchecked = GoalLoss(check_values=False)
    assert torch.isnan(unchecked(with_value(images, float("nan"), [(0, 0)]), texts))
    assert torch.isfinite(unchecked(3 * images, texts))
    assert "check_values=False" in repr(unchecked)


@pytest.mark.parametrize("ids,message", [
    ([1, "1", 2, 3], r"image_ids\[1\] is '1', a string, while image_ids\[0\] is 1, an integer; "
                     r"a list of image ids must be all integers or all strings \(not None, bool "
                     r"or float, and not both kinds: 1 and '1' would name one image\)"),
    ([1, 2, 1.0, 3], r"image_ids\[2\] is 1.0 \(float\), which is no image id"),
    ([1, 2, 3, True], r"image_ids\[3\] is True \(bool\), which is no image id"),
    ([1, None, 2, None], r"image_ids\[1\] is None \(NoneType\), which is no image id; .* pass "
                         r"a 1-D integer tensor"),
], ids=["int_and_str", "float", "bool", "none"])
def test_a_list_of_ids_is_all_integers_or_all_strings(ids, message):
    # hashed by their text, these would make 1, '1', 1.0 and True one image, and two Nones
    # positives of each other
    with pytest.raises(ValueError, match=message):
        GoalLoss()(unit_rows(4), unit_rows(4), image_ids=ids)


def test_integer_string_and_numpy_ids_name_the_same_groups():
    np = pytest.importorskip("numpy")
    images, texts = unit_rows(4), unit_rows(4)
    expected = GoalLoss()(images, texts, image_ids=torch.tensor([7, 7, 8, 9]))
    for ids in ([7, 7, 8, 9], ["a", "a", "b", "c"], list(np.array([7, 7, 8, 9])),
                (7, 7, 8, 9)):
        assert GoalLoss()(images, texts, image_ids=ids) == expected
    assert GoalLoss()(images, texts, image_ids=[7, 8, 9, 10]) != expected


def test_the_open_clip_example_of_docs_objectives_runs_as_written():
    """docs/objectives.md's loop over open_clip's towers, run as a user would paste it."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("open_clip")
    page = (Path(__file__).resolve().parents[2] / "docs" / "objectives.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S)
                   if "import open_clip" in block and "goal = GoalLoss(" in block)
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = re.findall(r"^goal_loss (\S+) \{'active_fraction': (\S+),", result.stdout, re.M)
    assert len(printed) == 3  # one line per batch of the loader
    assert all(float(loss) >= 0 and 0 <= float(active) <= 1 for loss, active in printed)


def test_the_transformers_trainer_example_of_docs_objectives_steps_by_goal_loss_gradient(
        tmp_path):
    """docs/objectives.md's GoalTrainer, run as written (tests/objectives/goal_trainer_step.py),
    then one SGD step of it: every parameter moves by GoalLoss's gradient through the
    model's get_image_features / get_text_features."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    page = (Path(__file__).resolve().parents[2] / "docs" / "objectives.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S)
                   if "class GoalTrainer(Trainer)" in block)
    (tmp_path / "example.py").write_text(example)
    step = Path(__file__).with_name("goal_trainer_step.py")
    # one process, as a user runs the page: no launcher's variables (accelerate, under the
    # Trainer, would join a process group they describe)
    launched = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launched}
    result = subprocess.run([sys.executable, str(step), "example.py", str(tmp_path / "sgd")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    # the example's print(goal.last_stats), with lam: auto's lam
    assert re.search(r"^\{'active_fraction': \S+, 'positive_median': \S+, "
                     r"'negative_median': \S+, 'lam': \S+\}$", result.stdout, re.M)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # one loss logged per batch of the example's 24 pairs, 8 a batch
    assert len(report["logged_losses"]) == 3
    assert all(loss >= 0 for loss in report["logged_losses"])
    assert report["max_update"] > 1e-3 and report["all_finite"]
    assert report["max_difference"] <= 1e-5 * report["max_update"]
    assert not report["logit_scale_moved"]  # frozen: GOAL has no temperature
