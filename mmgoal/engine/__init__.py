"""Trainer, optimizers, schedules, hooks, loggers and checkpoints."""

from mmgoal.engine import hooks, loggers, optimizers, schedules, strategies  # noqa: F401
