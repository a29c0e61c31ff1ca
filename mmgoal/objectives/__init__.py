"""Objectives: hard-negative mining, GOAL gradient objectives, classic losses, CCR/CCS,
the cross encoder's ITM, MLM and box grounding; and ``GoalLoss``, GOAL for a training loop
of your own."""

from mmgoal.objectives import (  # noqa: F401
    classic,
    constraints,
    goal,
    itm,
    mining,
    pretraining,
    triplet,
    weights,
)
from mmgoal.objectives.goal_loss import GoalLoss

__all__ = ["GoalLoss"]
