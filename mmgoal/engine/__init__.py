"""Trainer, training step, optimizers, schedules, hooks, loggers and strategies.

Its modules are imported where they are used; the registries import the ones that
register components the first time a name is asked for (mmgoal/registry.py).
"""
