"""Deprecated: moved to :mod:`mmgoal.distributed`; the old path works,
with a warning, until mmgoal 0.2."""

from mmgoal.deprecation import moved_module

__getattr__ = moved_module(__name__, "mmgoal.distributed")
