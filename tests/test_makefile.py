"""The Makefile's install stamp follows the content of what the install reads, so a clone
sharing another clone's VENV does not reinstall into it."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READ = ("Makefile", "setup.cfg", "pyproject.toml", "constraints.txt")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def clone(folder: Path) -> Path:
    folder.mkdir()
    for name in READ:
        shutil.copy(ROOT / name, folder / name)  # new times: a fresh clone's
    return folder


def up_to_date(folder: Path, venv: Path) -> bool:
    """``make -q venv``: 0 when nothing would be installed."""
    return subprocess.run(["make", "-q", "venv", f"VENV={venv}"], cwd=folder,
                          capture_output=True).returncode == 0


def test_a_clone_sharing_a_venv_does_not_reinstall_into_it(tmp_path):
    first, venv = clone(tmp_path / "first"), tmp_path / "venv"
    stamp = subprocess.run(["make", "-s", "--eval", "stamp: ; @echo $(STAMP)", "stamp",
                            f"VENV={venv}"], cwd=first, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert not up_to_date(first, venv)  # nothing installed yet
    venv.mkdir()
    Path(stamp).touch()  # what the install leaves
    time.sleep(0.01)
    second = clone(tmp_path / "second")  # newer files, the same content
    assert up_to_date(first, venv) and up_to_date(second, venv)
    with open(second / "constraints.txt", "a") as file:  # other pins: install again
        file.write("\nsomething==1.0\n")
    assert not up_to_date(second, venv)
