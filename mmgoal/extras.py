"""Optional dependencies: the packages of ``pip install 'mmgoal[EXTRA]'``.

Each is imported only where it is used, after :func:`require_extra` checked it is
installed, so a missing one is reported with the extra that installs it, not a bare
``ModuleNotFoundError`` from deep inside a run.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# module name -> the extra of setup.cfg that installs it
EXTRAS = {
    "deepspeed": "deepspeed",
    "accelerate": "accelerate",
    "matplotlib": "plot",
    "tensorboard": "tracking",
    "wandb": "tracking",
    "eccv_caption": "coco",
    "peft": "lora",
    "datasets": "hf",
    "sentencepiece": "hf",
}


def require_extra(module: str, purpose: str) -> None:
    """Check that the optional package ``module`` (a key of :data:`EXTRAS`) is installed,
    without importing it; ``purpose`` is what needs it (``"strategy: {type: deepspeed}"``)."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{purpose} needs {module}, which is not installed; install it with "
            f"pip install 'mmgoal[{EXTRAS[module]}]' (or 'mmgoal[all]')")


def pyplot(purpose: str) -> ModuleType:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend: no display needed)."""
    require_extra("matplotlib", purpose)
    importlib.import_module("matplotlib").use("Agg")
    return importlib.import_module("matplotlib.pyplot")
