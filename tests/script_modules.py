"""The repository's scripts (bench/*.py) and the modules of the ``mmgoal`` command's tools,
imported for tests that call their functions or ``main`` in-process, or the command run in
a fresh process (:func:`run_command`)."""

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """``load_script("bench/eval.py")``: the script's module, freshly executed."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_tool(command: str) -> ModuleType:
    """``load_tool("train")``: the module of ``mmgoal train`` (mmgoal/cli/train.py), whose
    ``main`` the repository's tools/finetune.py calls too."""
    from mmgoal.cli.main import COMMANDS

    return importlib.import_module(f"mmgoal.cli.{COMMANDS[command]}")


def run_command(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m mmgoal ARGS`` in a fresh process with the environment ``env``, from the
    repository's root (its mmgoal)."""
    return subprocess.run([sys.executable, "-m", "mmgoal", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
