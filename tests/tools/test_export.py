"""tools/export.py writes a new file or over an earlier export, never over a run's checkpoints."""

import math

import torch
from script_modules import load_script

from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint


def export_tool():
    return load_script("tools/export.py")


def test_export_refuses_folders_run_checkpoints_and_nonfinite_weights(tmp_path, capsys):
    main = export_tool().main
    checkpoints = tmp_path / "run" / "checkpoints"
    good = {"model": {"w": torch.ones(2)}, "tokenizer": {"words": ["a"]}, "config": {}}
    save_checkpoint({**good, "step": 6}, checkpoints / "last.pt")
    save_checkpoint({**good, "model": {"w": torch.zeros(2)}, "epoch": 0}, checkpoints / "best.pt")
    best = (checkpoints / "best.pt").read_bytes()

    assert main([str(tmp_path / "run"), "--out", str(checkpoints / "best.pt")]) == 2
    assert "best.pt exists and is not an earlier export" in capsys.readouterr().err
    assert (checkpoints / "best.pt").read_bytes() == best
    assert main([str(tmp_path / "run"), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder; give a file name, e.g. {tmp_path / 'model.pt'}" \
        in capsys.readouterr().err

    out = tmp_path / "run.pt"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    assert torch.equal(load_checkpoint(out)["model"]["w"], torch.ones(2))
    assert main([str(tmp_path / "run"), "--best", "--out", str(out)]) == 0  # an earlier export
    assert torch.equal(load_checkpoint(out)["model"]["w"], torch.zeros(2))

    # a last.pt an older mmgoal wrote as its run diverged
    diverged = {**good, "model": {"w": torch.tensor([1.0, math.inf])}}
    save_checkpoint(diverged, checkpoints / "last.pt")
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "bad.pt")]) == 2
    assert "last.pt holds NaN or inf in 1 tensor (w)" in capsys.readouterr().err
    assert not (tmp_path / "bad.pt").exists()
