"""Layers shared by the model families: poolers (GPO), SCAN's cross attention."""

from mmgoal.models.layers import cross_attention, gpo  # noqa: F401
