"""Trainer, optimizers, schedules, hooks and checkpoints."""

from mmgoal.engine import hooks, optimizers, strategies  # noqa: F401
