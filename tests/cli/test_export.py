"""tools/export.py writes a new file or over an earlier export, never over a run's checkpoints."""

import math

import pytest
import torch
from script_modules import load_tool, run_command

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
        assert "Traceback" not in err and "--resume" not in err  # export has none
        assert err.rstrip().endswith("then run the export again")
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


TOKEN = "hf_mmgoal_test_token"


def push(run, out, repo_id: str, env: dict, *options: str):
    """``mmgoal export RUN --out OUT --push-to-hub REPO_ID OPTIONS`` in a fresh process."""
    return run_command(["export", str(run), "--out", str(out), "--push-to-hub", repo_id,
                        *options], env)


@pytest.mark.slow
def test_an_export_is_pushed_to_the_hub_byte_for_byte(tmp_path):
    from hub_server import client_env, serving

    run = good_run(tmp_path)
    first, second = tmp_path / "model.safetensors", tmp_path / "model.pt"
    with serving() as hub:
        hub.token = TOKEN  # every write must carry it
        env = client_env(hub, tmp_path / "hf", TOKEN)
        pushed = push(run, first, "mmgoal-test/goal", env, "--private", "--commit-message",
                      "GOAL fine-tune, epoch 0")
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        assert hub.hub == {"mmgoal-test/goal": {"model.safetensors": first.read_bytes()}}
        assert hub.created == {"mmgoal-test/goal": {"private": True}}
        assert hub.commits == [{"repo": "mmgoal-test/goal", "summary": "GOAL fine-tune, epoch 0",
                                "revision": "main", "files": ["model.safetensors"]}]
        assert "pushed model.safetensors to mmgoal-test/goal: " in pushed.stdout
        # to the repository it made: kept as it is, the new file added beside
        again = push(run, second, "mmgoal-test/goal", env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert hub.hub["mmgoal-test/goal"] == {"model.safetensors": first.read_bytes(),
                                               "model.pt": second.read_bytes()}
        assert hub.created == {"mmgoal-test/goal": {"private": True}}
        assert hub.commits[-1]["summary"] == "Upload mmgoal export, mmgoal format"
    assert torch.equal(load_checkpoint(second)["model"]["w"], torch.ones(2))


@pytest.mark.slow
def test_a_push_that_fails_says_why_and_leaves_the_export(tmp_path):
    from hub_server import client_env, serving

    run, out = good_run(tmp_path), tmp_path / "model.pt"
    with serving() as hub:
        hub.token = TOKEN
        refused = push(run, out, "mmgoal-test/a", client_env(hub, tmp_path / "hf"))  # no token
        assert refused.returncode == 1
        assert (f"error: {out} is exported, but pushing it to mmgoal-test/a on {hub.url} failed "
                f"(") in refused.stderr and "401 Unauthorized" in refused.stderr
        assert "no token was found: set HF_TOKEN or log in with `hf auth login`, then run the " \
               "command again" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert torch.equal(load_checkpoint(out)["model"]["w"], torch.ones(2))
        out.unlink()
        hub.fail["/api/models/mmgoal-test/b/commit/main"] = 500  # the hub breaks mid-push
        broken = push(run, out, "mmgoal-test/b", client_env(hub, tmp_path / "hf", TOKEN))
        assert broken.returncode == 1
        assert f"pushing it to mmgoal-test/b on {hub.url} failed (" in broken.stderr
        assert "500 Internal Server Error" in broken.stderr
        assert "check the repository name, the network and HF_ENDPOINT" in broken.stderr
        assert "Traceback" not in broken.stderr
        assert hub.hub == {"mmgoal-test/b": {}} and not hub.commits
    assert torch.equal(load_checkpoint(out)["model"]["w"], torch.ones(2))


def test_a_push_that_cannot_happen_is_refused_before_anything_is_exported(tmp_path, capsys,
                                                                          monkeypatch):
    main, run, out = export_tool().main, good_run(tmp_path), tmp_path / "model.pt"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(run), "--out", str(out), "--push-to-hub", "mmgoal-test/goal"]) == 2
    assert ("error: --push-to-hub uploads to the Hugging Face hub, and HF_HUB_OFFLINE is set, "
            "so nothing was exported: run it with HF_HUB_OFFLINE unset") in capsys.readouterr().err
    assert main([str(run), "--out", str(out), "--push-to-hub", "mmgoal test/goal!"]) == 2
    assert "error: --push-to-hub 'mmgoal test/goal!' is not a hub repository name (" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --offline (for a --wise-ft start) cannot push
        main([str(run), "--out", str(out), "--push-to-hub", "mmgoal-test/goal", "--offline"])
    assert "--offline downloads nothing and --push-to-hub uploads: give one of them" \
        in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit) as stopped:
        main([str(run), "--out", str(out), "--private"])
    assert stopped.value.code == 2
    assert "--private and --commit-message go with --push-to-hub" in capsys.readouterr().err
