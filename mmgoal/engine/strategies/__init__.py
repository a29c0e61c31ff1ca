"""Strategies: how a run uses its processes (registered in ``STRATEGIES``)."""

from mmgoal.engine.strategies import accelerate, deepspeed, torch_native  # noqa: F401
from mmgoal.engine.strategies.base import Strategy, launched_world_size
from mmgoal.runs.run_dir import has_checkpoint

__all__ = ["Strategy", "has_checkpoint", "launched_world_size"]
