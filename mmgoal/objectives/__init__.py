"""Objectives: hard-negative mining, GOAL gradient objectives, classic losses."""

from mmgoal.objectives import classic, goal, mining, triplet, weights  # noqa: F401
