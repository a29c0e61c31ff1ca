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
    assert curves["val"] == {"epoch": [0, 1], "rsum": [200.0, 300.0], "i2t_r1": [10.0, 20.0],
                             "t2i_r1": [8.0, 18.0]}
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
    assert curves["val"] == {"epoch": [-1, 0, 1], "rsum": [60.0, 100.0, 150.0],
                             "i2t_r1": [5.0, 10.0, 20.0], "t2i_r1": [4.0, 8.0, 18.0]}
    assert curves["train"]["step"] == [2, 4, 6]
    assert plot_curves.main([str(run), "--out", str(tmp_path / "curves.png")]) == 0
