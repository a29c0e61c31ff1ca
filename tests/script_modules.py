"""The repository's scripts (tools/*.py, bench/*.py) imported as modules, for tests that call
their functions or ``main`` in-process."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """``load_script("tools/export.py")``: the script's module, freshly executed."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
