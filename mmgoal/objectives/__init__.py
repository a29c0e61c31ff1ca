"""Objectives: hard-negative mining, GOAL gradient objectives, classic losses, CCR/CCS."""

from mmgoal.objectives import classic, constraints, goal, itm, mining, triplet, weights  # noqa: F401
