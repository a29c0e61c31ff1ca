"""Registries: one build contract (``type`` + keyword arguments) for every component.

Every registry of the package lives in this module. ``@OBJECTIVES.register()``
registers a class or function under its own name; ``OBJECTIVES.build({"type":
"TripletLoss", "margin": 0.2})`` builds it. Importing :mod:`mmgoal` registers
every built-in component, so a name is never missing because a module was not
imported. Third-party components come from ``custom_imports`` in a config or
from the ``mmgoal.plugins`` entry-point group; nothing else is ever imported.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "mmgoal.plugins"


class Registry:
    """A named mapping from component names to classes or functions.

    Args:
        name: what the registry holds, used in error messages (``"objective"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._entries: dict[str, Callable[..., Any]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {sorted(self._entries)})"

    def names(self) -> list[str]:
        """Sorted names of every registered component."""
        return sorted(self._entries)

    def register(self, name: str | None = None, force: bool = False) -> Callable:
        """Decorator registering a class or function under ``name`` (default: its own name).

        A name that is already taken is refused unless ``force=True``.
        """

        def decorator(obj: Callable[..., Any]) -> Callable[..., Any]:
            key = name or obj.__name__
            if key in self._entries and not force:
                existing = self._entries[key]
                raise KeyError(
                    f"{key!r} is already registered in the {self.name} registry "
                    f"(by {existing.__module__}.{existing.__qualname__}); pick another "
                    f"name or pass force=True to replace it"
                )
            self._entries[key] = obj
            return obj

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        """The component registered under ``name``; an unknown name lists the choices."""
        if name not in self._entries:
            load_plugins()
        if name not in self._entries:
            available = self.names()
            close = difflib.get_close_matches(name, available, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(
                f"{name!r} is not in the {self.name} registry.{hint} Available: "
                f"{', '.join(available) or '(none)'}. A component of your own must be "
                f"imported first: list its module under custom_imports in the config."
            )
        return self._entries[name]

    def build(self, cfg: Mapping[str, Any], **context: Any) -> Any:
        """Build the component described by ``cfg`` (``type`` plus keyword arguments).

        ``context`` holds values the caller knows (e.g. the tokenizer); each is
        passed only when the component accepts a parameter of that name and the
        config does not set it.
        """
        if not isinstance(cfg, Mapping) or "type" not in cfg:
            raise TypeError(
                f"a {self.name} config must be a mapping with a 'type' key, got {cfg!r}"
            )
        kwargs = copy.deepcopy(dict(cfg))
        type_name = kwargs.pop("type")
        target = self.get(type_name)
        signature = inspect.signature(target)
        params = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        # Context goes to named parameters only: a class without its own __init__
        # (nn.Module's *args, **kwargs) must not receive the tokenizer.
        named = {n for n, p in params.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs.update({k: v for k, v in context.items() if k in named and k not in kwargs})
        if not takes_any:
            accepted = [
                n for n, p in params.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
            unknown = [k for k in kwargs if k not in accepted]
            if unknown:
                hints = []
                for key in unknown:
                    close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
                    hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
                raise TypeError(
                    f"{self.name} {type_name!r} got unknown config key(s) {', '.join(hints)}; "
                    f"it accepts: {', '.join(accepted)}"
                )
            missing = [
                n for n, p in params.items()
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and n not in kwargs
            ]
            if missing:
                raise TypeError(
                    f"{self.name} {type_name!r} needs config key(s) {', '.join(missing)}"
                )
        return target(**kwargs)


def accepted_kwargs(target: Callable[..., Any], candidates: Mapping[str, Any]) -> dict[str, Any]:
    """The ``candidates`` that ``target`` accepts: all of them when it takes ``**kwargs``,
    else those it names as parameters."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(candidates)
    return {k: v for k, v in candidates.items() if k in params}


MODELS = Registry("model")
ENCODERS = Registry("encoder")
POOLERS = Registry("pooler")
OBJECTIVES = Registry("objective")
CONSTRAINTS = Registry("constraint")
DATASETS = Registry("dataset")
TOKENIZERS = Registry("tokenizer")
TRANSFORMS = Registry("transform")
HOOKS = Registry("hook")
STRATEGIES = Registry("strategy")
OPTIMIZERS = Registry("optimizer")
TRIPLET_WEIGHTS = Registry("triplet weight")
PAIR_WEIGHTS = Registry("pair weight")
CHECKPOINT_REMAPS = Registry("checkpoint remap")
TEXT_AUGMENTS = Registry("text augment")
SHARD_SOURCES = Registry("shard source")

_plugins_loaded = False


def import_custom_modules(modules: Iterable[str]) -> None:
    """Import the modules a config names under ``custom_imports``.

    Raises:
        ImportError: a module cannot be imported; the message names it.
    """
    if isinstance(modules, str):
        modules = [modules]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(
                f"custom_imports lists {module!r}, which cannot be imported ({error}); "
                f"check the module path and that its package is installed or on PYTHONPATH"
            ) from error


def load_plugins() -> None:
    """Import every module of the ``mmgoal.plugins`` entry-point group, once."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry_point in metadata.entry_points(group=PLUGIN_GROUP):
        try:
            entry_point.load()
        except Exception as error:  # a broken plugin must not break mmgoal itself
            logger.warning("mmgoal plugin %r failed to load: %s", entry_point.name, error)
