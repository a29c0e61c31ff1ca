"""Layers shared by the model families: poolers (GPO)."""

from mmgoal.models.layers import gpo  # noqa: F401
