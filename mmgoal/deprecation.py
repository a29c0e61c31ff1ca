"""Old import paths that keep working for one release, with a warning that names the new one.

A module that moved leaves a small module at its old path whose ``__getattr__`` is
:func:`moved_module`: the first name taken from it warns once (``DeprecationWarning``),
and every name is the new module's own object (docs/plugins.md lists the new paths).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_module(old: str, new: str, release: str = "0.2") -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``old``, a path that moved to ``new``.

    Args:
        old: the old dotted path (the shim's ``__name__``).
        new: the dotted path of the module that holds the names now.
        release: the release that removes ``old``.
    """
    warned = False

    def __getattr__(name: str) -> Any:
        nonlocal warned
        if name.startswith("__"):  # module protocol lookups (__path__, __file__...)
            raise AttributeError(name)
        target = importlib.import_module(new)
        if not hasattr(target, name):
            raise AttributeError(f"module {old!r} (now {new!r}) has no attribute {name!r}")
        if not warned:
            warned = True
            warnings.warn(f"{old} moved to {new}: import {name} from {new} (the old path goes "
                          f"in mmgoal {release}; docs/plugins.md)", DeprecationWarning,
                          stacklevel=2)
        return getattr(target, name)

    return __getattr__
