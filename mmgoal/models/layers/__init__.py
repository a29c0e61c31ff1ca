"""Layers shared by the model families: poolers (GPO), SCAN's cross attention, fusion layers."""
