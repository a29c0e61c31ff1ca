"""Objectives: hard-negative mining and the triplet loss (GOAL objectives build on them)."""

from mmgoal.objectives import mining, triplet  # noqa: F401
