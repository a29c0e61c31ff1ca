"""Layers shared by the model families: poolers (GPO), SCAN's cross attention, fusion layers."""

from mmgoal.models.layers import cross_attention, fusion, gpo  # noqa: F401
