"""Objectives: hard-negative mining, GOAL gradient objectives, classic losses, CCR/CCS,
and the cross encoder's ITM, MLM and box grounding."""

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
