"""Objectives: hard-negative mining, GOAL gradient objectives, classic losses, CCR/CCS."""

from mmgoal.objectives import classic, constraints, goal, mining, triplet, weights  # noqa: F401
