"""The ``mmgoal`` command: its commands, the shipped configs it finds by name, the tools/
shims, and the launchers' argument forms (docs/getting_started.md)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmgoal.cli import configs as configs_tool
from mmgoal.cli.arguments import summary
from mmgoal.cli.main import COMMANDS, main, take_local_rank
from mmgoal.config import SHIPPED_CONFIGS, find_config, load_config, shipped_configs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mmgoal"


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()))


def test_help_lists_every_command_with_its_modules_first_paragraph(capsys):
    assert main(["--help"]) == 0
    listed = {line.split()[0]: line.split(None, 1)[1] for line in
              capsys.readouterr().out.split("commands:\n")[1].split("\n\n")[0].splitlines()}
    assert list(listed) == list(COMMANDS)
    for command, module in COMMANDS.items():
        assert listed[command] == summary(docstring(PACKAGE / "cli" / f"{module}.py"))
    # no command at all: the same list, on stderr, and a usage error
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_an_unknown_command_names_the_closest(capsys):
    assert main(["trian", "quickstart"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: mmgoal has no command 'trian' (did you mean train?); mmgoal --help lists them")


def test_every_tool_is_a_shim_of_one_command_and_every_command_has_one():
    shims = {}
    for path in sorted((ROOT / "tools").glob("*.py")):
        if path.name == "check_install.py":  # the check of an installed mmgoal, not a command
            continue
        imports = [node.module for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.ImportFrom)]
        assert len(imports) == 1 and imports[0].startswith("mmgoal.cli."), path
        shims[path.name] = imports[0].removeprefix("mmgoal.cli.")
    assert sorted(shims.values()) == sorted(m for m in COMMANDS.values() if m != "configs")


def test_the_deepspeed_launchers_local_rank_before_the_command_is_taken(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # recorded as it was: restored (absent) after
    monkeypatch.delenv("LOCAL_RANK")
    assert take_local_rank(["--local_rank=1", "train", "q.yaml"]) == ["train", "q.yaml"]
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv("LOCAL_RANK")
    assert take_local_rank(["--local-rank", "3", "eval", "x"]) == ["eval", "x"]
    assert os.environ["LOCAL_RANK"] == "3"
    # after the command it is the command's own option (train takes --local_rank)
    assert take_local_rank(["train", "--local_rank=0"]) == ["train", "--local_rank=0"]


def test_a_shipped_config_is_found_by_name_and_a_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = SHIPPED_CONFIGS / "clip" / "clip_tiny_synthetic.yaml"
    for name in ("clip/clip_tiny_synthetic", "clip/clip_tiny_synthetic.yaml",
                 "configs/clip/clip_tiny_synthetic.yaml"):
        assert find_config(name) == shipped
    assert find_config("quickstart") == SHIPPED_CONFIGS / "quickstart.yaml"
    # a file that exists wins: a clone's configs/, then a file of the name itself
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").write_text("model: {type: Clone}\n")
    assert find_config("quickstart") == Path("configs/quickstart.yaml")
    (tmp_path / "quickstart.yaml").write_text("model: {type: Mine}\n")
    assert find_config("quickstart") == Path("quickstart.yaml")
    assert find_config("configs/quickstart.yaml") == Path("configs/quickstart.yaml")
    with pytest.raises(FileNotFoundError) as error:
        find_config("quickstrat")
    assert "mmgoal ships no config named 'quickstrat' (did you mean quickstart" in str(error.value)
    # a shipped DeepSpeed JSON (mmgoal train --deepspeed configs/distributed/zero3_bf16.json)
    assert find_config("configs/distributed/zero3_bf16.json") == (
        SHIPPED_CONFIGS / "distributed" / "zero3_bf16.json")
    # the fragments under _base_ are not configs of their own
    assert not any(name.startswith("_base_") for name in shipped_configs())
    assert "_base_/data/synthetic" not in shipped_configs()


def test_train_prints_a_shipped_config_by_name_from_any_folder(tmp_path):
    by_name = subprocess.run([sys.executable, "-m", "mmgoal", "train", "goal/quickstart_goal",
                              "--print-config", "--cfg-options", "train.epochs=2"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert by_name.returncode == 0, by_name.stderr
    printed = yaml.safe_load(by_name.stdout)
    assert printed["objective"]["type"] == "GoalObjective" and printed["train"]["epochs"] == 2
    # which file it used, in the log; the usage line names the command
    assert f"mmgoal's shipped {SHIPPED_CONFIGS / 'goal' / 'quickstart_goal.yaml'}" in \
        by_name.stderr
    usage = subprocess.run([sys.executable, "-m", "mmgoal", "train", "--help"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert usage.stdout.startswith("usage: mmgoal train [-h]")


def test_configs_lists_by_pattern_each_with_its_first_sentence_whole(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert configs_tool.main(["clip/clip_vit_b_16*"]) == 0
    rows = capsys.readouterr().out.split("\n\n")[0].splitlines()
    expected = {name: path for name, path in shipped_configs().items()
                if name.startswith("clip/clip_vit_b_16")}
    named = [row.split()[0] for row in rows if not row.startswith(" ")]
    assert named == list(expected) and len(expected) >= 6
    # the first sentence, over two comment lines in the file, wrapped to 100 columns
    second = next(k for k, row in enumerate(rows) if k and not row.startswith(" "))
    first = " ".join(rows[:second]).split(None, 1)[1]
    assert " ".join(first.split()) == (
        "Fine-tune OpenAI's CLIP ViT-B-16 for retrieval on MS-COCO (Karpathy split, 5K test) "
        "under InfoNCE, the temperature being CLIP's own logit_scale, with open_clip's "
        "fine-tuning recipe (_base_/schedules/clip_finetune.yaml); zero-shot recalls first "
        "(epoch -1).")
    assert max(map(len, rows)) <= 100
    assert configs_tool.main(["nothing-like-this"]) == 2
    assert "no shipped config's name matches 'nothing-like-this'" in capsys.readouterr().err


def test_a_copied_config_stands_alone_and_is_not_overwritten(tmp_path, capsys):
    assert configs_tool.main(["--copy", "scan/scan_ccr_synthetic", str(tmp_path)]) == 0
    copy = tmp_path / "scan_ccr_synthetic.yaml"
    assert "_base_" not in yaml.safe_load(copy.read_text())
    assert load_config(copy) == load_config(SHIPPED_CONFIGS / "scan" / "scan_ccr_synthetic.yaml")
    assert copy.read_text().startswith("# ")  # the original's description comes along
    copy.write_text("mine: true\n")
    assert configs_tool.main(["--copy", "scan/scan_ccr_synthetic", str(copy)]) == 2
    assert f"{copy} exists; give another file name, or --force" in capsys.readouterr().err
    assert copy.read_text() == "mine: true\n"
    assert configs_tool.main(["--copy", "scan/scan_ccr_synthetic", str(copy), "--force"]) == 0
    # a folder not made yet: named with a slash, or without a .yaml name
    for folder in (f"{tmp_path}/new/", f"{tmp_path}/other"):
        assert configs_tool.main(["--copy", "scan/scan_ccr_synthetic", folder]) == 0
        assert Path(folder, "scan_ccr_synthetic.yaml").is_file()
    assert configs_tool.main(["--copy", "scan/nope", str(tmp_path / "x.yaml")]) == 2


def test_check_installs_guard_refuses_every_file_of_the_clone(tmp_path):
    from script_modules import load_script

    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(load_script("tools/check_install.py").GUARD)
    clone, elsewhere = tmp_path / "clone", tmp_path / "elsewhere"
    for folder in (clone, elsewhere):
        folder.mkdir()
        (folder / "a.yaml").write_text("x: 1\n")
    code = ("import os, sys\nfor path in sys.argv[1:]:\n    try:\n        open(path).read(); "
            "print('read', path)\n    except PermissionError as error:\n        print(error)\n"
            "try:\n    os.listdir(sys.argv[1].rsplit('/', 1)[0])\nexcept PermissionError:\n"
            "    print('no listing')\n")
    result = subprocess.run([sys.executable, "-c", code, str(clone / "a.yaml"),
                             str(elsewhere / "a.yaml")], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(guard),
                                 "MMGOAL_CHECK_CLONE": str(clone)}, timeout=60)
    assert result.stdout.splitlines() == [
        f"check-install: the installed mmgoal reached into the clone: open {clone / 'a.yaml'}",
        f"read {elsewhere / 'a.yaml'}", "no listing"]


HELP_OF_EVERY_COMMAND = """
import contextlib, io, sys
from mmgoal.cli.main import COMMANDS, main
for argv in (["--help"], ["--version"], ["configs"], *([c, "--help"] for c in COMMANDS)):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert out.getvalue(), argv
print(sorted(m for m in ("torch", "timm", "webdataset") if m in sys.modules))
"""


def test_the_front_door_imports_no_torch():
    """``mmgoal --help``, ``--version``, ``configs`` and every ``COMMAND --help`` answer
    without importing torch (bench/startup.py times them)."""
    out = subprocess.run([sys.executable, "-c", HELP_OF_EVERY_COMMAND], capture_output=True,
                         text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"


EVALUATE_A_DUAL_ENCODER = """
import sys
from mmgoal.cli.evaluate import main
assert main([sys.argv[1], "--device", "cpu"]) == 0
print(sorted(m for m in sys.modules if m.startswith("mmgoal.engine")
             or m in ("deepspeed", "accelerate", "open_clip", "transformers")))
"""


def test_evaluating_a_dual_encoder_loads_no_training_engine(tiny_quickstart_run, tmp_path):
    import json
    import shutil

    run = shutil.copytree(tiny_quickstart_run[0], tmp_path / "run")
    out = subprocess.run([sys.executable, "-c", EVALUATE_A_DUAL_ENCODER, str(run)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    assert out.splitlines()[-1] == "[]"
    # a run directory's metrics land in it, beside its config.yaml, not in checkpoints/
    written = json.loads((run / "eval_test.json").read_text())
    assert written["checkpoint"] == str(run / "checkpoints" / "best.pt")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "last.pt"]


def test_a_listing_cut_short_by_its_reader_ends_quietly():
    """`mmgoal configs | head -1`: no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # as head does once it has its line: every write meets a closed pipe
    done = subprocess.run([sys.executable, "-m", "mmgoal", "configs"], stdout=write,
                          stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          timeout=60)
    os.close(write)
    assert (done.returncode, done.stderr) == (141, b"")
