"""tools/export.py writes a new file or over an earlier export, never over a run's checkpoints."""

import math

import pytest
import torch
from script_modules import load_tool

from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint


def export_tool():
    return load_tool("export")


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
    assert main([str(tmp_path / "run"), "--latest", "--out", str(out)]) == 0
    assert torch.equal(load_checkpoint(out)["model"]["w"], torch.ones(2))
    # by default the checkpoint mmgoal eval takes: best.pt where the run has one
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0  # over an earlier export
    assert torch.equal(load_checkpoint(out)["model"]["w"], torch.zeros(2))

    # a last.pt an older mmgoal wrote as its run diverged
    diverged = {**good, "model": {"w": torch.tensor([1.0, math.inf])}}
    save_checkpoint(diverged, checkpoints / "last.pt")
    assert main([str(tmp_path / "run"), "--latest", "--out", str(tmp_path / "bad.pt")]) == 2
    assert "last.pt holds NaN or inf in 1 tensor (w)" in capsys.readouterr().err
    assert not (tmp_path / "bad.pt").exists()


def good_run(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    save_checkpoint({"model": {"w": torch.ones(2)}, "tokenizer": {"words": ["a"]}, "config": {},
                     "epoch": 0}, checkpoints / "best.pt")
    return tmp_path / "run"


def test_a_full_disk_ends_an_export_in_a_sentence_and_leaves_the_old_file(tmp_path, capsys,
                                                                         monkeypatch):
    import errno

    from mmgoal.runs import checkpoint

    run, out = good_run(tmp_path), tmp_path / "run.safetensors"
    main = export_tool().main
    assert main([str(run), "--best", "--out", str(out)]) == 0
    before = out.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    for target in (out, tmp_path / "new.pt"):
        assert main([str(run), "--best", "--out", str(target)]) == 1
        err = capsys.readouterr().err
        assert f"error: could not write {target} (No space left on device)" in err
        assert "Traceback" not in err
    assert out.read_bytes() == before and not (tmp_path / "new.pt").exists()
    assert not list(tmp_path.glob(".*.tmp-*"))  # no temporary file left behind


def test_an_export_gets_the_umask_permissions_and_clears_a_killed_exports_leftovers(tmp_path):
    import os
    import subprocess
    import sys

    run = good_run(tmp_path)
    out = tmp_path / "model.safetensors"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    leftover = tmp_path / f".model.safetensors.tmp-{int(dead.stdout)}"
    leftover.write_bytes(b"x" * 1000)  # what a SIGKILLed export leaves
    mine = tmp_path / f".model.safetensors.tmp-{os.getppid()}"  # a live writer's: kept
    mine.write_bytes(b"y")
    assert export_tool().main([str(run), "--best", "--out", str(out)]) == 0
    assert not leftover.exists() and mine.exists()
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' own 0600


def test_a_corrupt_exports_metadata_is_refused_with_a_sentence(tmp_path):
    import json

    from safetensors.torch import save_file

    from mmgoal.runs.checkpoint import SAFETENSORS_FORMAT

    def export(**metadata):
        path = tmp_path / "x.safetensors"
        save_file({"w": torch.ones(2)}, str(path), metadata={
            "format": SAFETENSORS_FORMAT, **{k: json.dumps(v) for k, v in metadata.items()}})
        return path

    for metadata, message in [
            ({"aliases": "w"}, "its metadata's aliases name no tensors of the file"),
            ({"aliases": {"v": "nowhere"}}, "its metadata's aliases name no tensors"),
            ({"tokenizer": ["a"]}, "its 'tokenizer' is a list, not what an mmgoal checkpoint "
                                   "holds there"),
            ({"config": "model: x"}, "its 'config' is a str"),
            ({"epoch": "one"}, "its 'epoch' is a str")]:
        with pytest.raises(ValueError, match=message):
            load_checkpoint(export(**metadata))
    broken = export()
    metadata_text = broken.read_bytes().replace(b'"format"', b'"config":"{", "format"', 1)
    broken.write_bytes(metadata_text)  # a header that is no longer JSON
    with pytest.raises(ValueError, match="cannot be read"):
        load_checkpoint(broken)
