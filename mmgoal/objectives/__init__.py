"""Objectives: hard-negative mining, GOAL gradient objectives, classic losses, CCR/CCS,
the cross encoder's ITM, MLM and box grounding; and ``GoalLoss``, GOAL for a training loop
of your own (imported the first time it is asked for)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GoalLoss"]


def __getattr__(name: str) -> Any:
    if name == "GoalLoss":
        return importlib.import_module("mmgoal.objectives.goal_loss").GoalLoss
    raise AttributeError(f"module 'mmgoal.objectives' has no attribute {name!r}")
