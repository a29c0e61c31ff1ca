import json
from pathlib import Path

from PIL import Image
from script_modules import load_tool

plot_curves = load_tool("plot-curves")


def write_run(folder: Path, scale: float) -> Path:
    folder.mkdir()
    records = [{"type": "train", "epoch": 0, "step": 2, "lr": 1e-3, "loss": 2.0 * scale,
                "triplet_loss": 2.0 * scale},
               {"type": "train", "epoch": 0, "step": 4, "lr": 5e-4, "loss": None,  # NaN step
                "triplet_loss": None},
               {"type": "val", "epoch": 0, "step": 4, "rsum": 100.0 * scale, "i2t_r1": 10.0,
                "t2i_r1": 8.0},
               {"type": "train", "epoch": 1, "step": 6, "lr": 1e-4, "loss": 1.0 * scale,
                "triplet_loss": 1.0 * scale},
               {"type": "val", "epoch": 1, "step": 6, "rsum": 150.0 * scale, "i2t_r1": 20.0,
                "t2i_r1": 18.0},
               {"type": "test", "step": 6, "rsum": 140.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_curves_are_read_per_step_and_epoch_and_drawn_overlaid(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", 1.0), write_run(tmp_path / "b", 2.0)
    curves = plot_curves.read_curves(b)
    assert curves["train"] == {"step": [2, 4, 6], "loss": [4.0, None, 2.0],
                               "lr": [1e-3, 5e-4, 1e-4], "triplet_loss": [4.0, None, 2.0]}
    assert curves["val"] == {"epoch": [0, 1], "step": [4, 6], "rsum": [200.0, 300.0],
                             "i2t_r1": [10.0, 20.0], "t2i_r1": [8.0, 18.0]}
    out = tmp_path / "curves.png"
    assert plot_curves.main([str(a), str(b), "--out", str(out)]) == 0
    assert "curves of 2 run(s) written" in capsys.readouterr().out
    low, high = Image.open(out).convert("L").getextrema()
    assert high - low > 100  # something was drawn
    assert plot_curves.main([str(a), "--labels", "x", "y", "--out", str(out)]) == 2
    assert "--labels names 2 runs, 1 are given" in capsys.readouterr().err
    assert plot_curves.main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist; give a run directory" in capsys.readouterr().err


def test_the_evaluation_before_training_is_the_first_point_at_epoch_minus_one(tmp_path):
    run = write_run(tmp_path / "run", 1.0)
    before = {"type": "val", "epoch": -1, "step": 0, "rsum": 60.0, "i2t_r1": 5.0, "t2i_r1": 4.0}
    metrics = run / "metrics.jsonl"
    metrics.write_text(json.dumps(before) + "\n" + metrics.read_text())
    curves = plot_curves.read_curves(run)
    assert curves["val"] == {"epoch": [-1, 0, 1], "step": [0, 4, 6],
                             "rsum": [60.0, 100.0, 150.0], "i2t_r1": [5.0, 10.0, 20.0],
                             "t2i_r1": [4.0, 8.0, 18.0]}
    assert curves["train"]["step"] == [2, 4, 6]
    assert plot_curves.main([str(run), "--out", str(tmp_path / "curves.png")]) == 0
    [rsum] = plot_curves.chosen_panels([("run", curves)])[2:3]
    assert (rsum.x_label, rsum.series[0].x) == ("epoch", [-1, 0, 1])
    # validations every N steps: several an epoch, drawn by step
    curves["val"].update(epoch=[-1, 0, 0], step=[0, 2, 4])
    [rsum] = plot_curves.chosen_panels([("run", curves)])[2:3]
    assert (rsum.x_label, rsum.series[0].x) == ("step", [0, 2, 4])


def write_goal_run(folder: Path) -> Path:
    """A GOAL run with lam: auto and a zero-shot set: the total is the single term's."""
    folder.mkdir()
    records = [{"type": "val", "epoch": -1, "step": 0, "rsum": 50.0, "i2t_r1": 4.0,
                "t2i_r1": 3.0, "zeroshot_top1": 40.0},
               {"type": "train", "epoch": 0, "step": 2, "lr": 1e-3, "loss": 0.5,
                "goal_loss": 0.5, "positive_median": 0.3, "negative_median": 0.2, "lam": 0.25},
               {"type": "train", "epoch": 0, "step": 4, "lr": 1e-3, "loss": 0.4,
                "goal_loss": 0.4, "positive_median": 0.4, "negative_median": 0.1, "lam": 0.3},
               {"type": "val", "epoch": 0, "step": 4, "rsum": 90.0, "i2t_r1": 9.0,
                "t2i_r1": 7.0, "zeroshot_top1": 35.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def lines(panel) -> list[tuple[str, list]]:
    return [(series.label, series.y) for series in panel.series]


def test_a_single_terms_loss_is_one_line_and_zero_shot_and_goal_scores_get_panels(tmp_path):
    goal = write_goal_run(tmp_path / "goal")
    triplet = write_run(tmp_path / "triplet", 1.0)
    panels = plot_curves.chosen_panels([("goal", plot_curves.read_curves(goal)),
                                        ("triplet", plot_curves.read_curves(triplet))])
    assert [(p.title, p.x_label) for p in panels] == [
        ("training loss", "step"), ("learning rate", "step"), ("validation rsum", "epoch"),
        ("validation R@1", "epoch"), ("zero-shot top-1 (%)", "epoch"),
        ("GOAL scores: medians and lam", "step")]
    loss, zeroshot, scores = panels[0], panels[4], panels[5]
    assert lines(loss) == [("goal: loss = goal_loss", [0.5, 0.4]),
                           ("triplet: loss = triplet_loss", [2.0, None, 1.0])]
    assert lines(zeroshot) == [("goal", [40.0, 35.0])]  # the triplet run has none
    assert zeroshot.series[0].x == [-1, 0]
    assert lines(scores) == [("goal: positive median", [0.3, 0.4]),
                             ("goal: negative median", [0.2, 0.1]), ("goal: lam", [0.25, 0.3])]
    # without those keys, the four panels alone
    only = plot_curves.chosen_panels([("triplet", plot_curves.read_curves(triplet))])
    assert [p.title for p in only] == [p.title for p in panels[:4]]


def test_terms_that_differ_from_the_total_are_drawn_each(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"type": "train", "step": s, "lr": 1e-3, "loss": 3.0 / s, "infonce_loss": 2.0 / s,
                "itm_loss": 1.0 / s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = plot_curves.read_curves(run)
    assert plot_curves.distinct_losses(curves["train"]) == [["loss"], ["infonce_loss"],
                                                            ["itm_loss"]]
    # equal up to float32 rounding is one line; a null at another step is not
    assert plot_curves.same_values([1.0, None], [1.0 + 1e-8, None])
    assert not plot_curves.same_values([1.0, None], [1.0, 2.0])


def test_the_picture_goes_into_the_run_folder_or_to_out(tmp_path, monkeypatch, capsys):
    goal = write_goal_run(tmp_path / "goal")
    triplet = write_run(tmp_path / "triplet", 1.0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert plot_curves.main([str(goal)]) == 0
    assert f"written to {goal / 'curves.png'}" in capsys.readouterr().out
    # two runs: the first one's folder, named by both, not over its own picture
    assert plot_curves.main([str(goal), str(triplet / "metrics.jsonl")]) == 0
    assert plot_curves.main([str(goal), str(triplet), "--labels", "a b", "c/d"]) == 0
    out = tmp_path / "ab.png"
    assert plot_curves.main([str(triplet), str(goal), "--out", str(out)]) == 0
    assert sorted(p.name for p in goal.iterdir()) == [
        "curves.png", "curves_a-b_c-d.png", "curves_goal_triplet.png", "metrics.jsonl"]
    assert list(elsewhere.iterdir()) == [] and out.is_file()
    panels = plot_curves.plot_curves([goal], ["goal"], tmp_path / "goal.png")
    assert len(panels) == 6
    low, high = Image.open(tmp_path / "goal.png").convert("L").getextrema()
    assert high - low > 100
