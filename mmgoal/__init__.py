"""mmgoal: registry-based, config-driven image-text matching with GOAL gradient objectives.

Importing the package is light: it loads no torch. Each built-in component's module is
imported the first time a registry is asked for its name (mmgoal/registry.py), and the
Python API below the first time it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that holds it: the Python API (mmgoal/api.py), GoalLoss (GOAL in a
# training loop of your own)
_LAZY = {"Retriever": "mmgoal.api", "from_config": "mmgoal.api", "load": "mmgoal.api",
         "GoalLoss": "mmgoal.objectives.goal_loss"}

__all__ = ["GoalLoss", "Retriever", "from_config", "load"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    raise AttributeError(f"module 'mmgoal' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
