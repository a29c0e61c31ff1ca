"""Trainer, optimizers, schedules, hooks and checkpoints."""

from mmgoal.engine import hooks, optimizers, schedules, strategies  # noqa: F401
