"""Registries: one build contract (``type`` + keyword arguments) for every component.

``@OBJECTIVES.register()`` registers a class or function under its own name;
``OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2})`` builds it. A built-in name's
module is imported when first asked for (docs/architecture.md, "What is loaded when");
third-party components come from ``custom_imports`` or entry points (docs/plugins.md).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from mmgoal.config import ConfigProblems, check_value, close_match_hints, is_choice, raise_problems

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "mmgoal.plugins"


class ConfigError(ValueError, TypeError):
    """A component config that cannot be built: an unknown or missing key, a bad value. A
    ``ValueError`` (tools report it and exit 2) and, as a call's arguments, a ``TypeError``."""


class ConfigErrors(ConfigProblems, ConfigError):
    """Several problems of one component config, said together (a ``ConfigError`` too)."""


class UnknownNameError(ConfigError, KeyError):
    """A ``type`` that is not in the registry (also a ``KeyError``, as a lookup)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry:
    """A named mapping from component names to classes or functions.

    Args:
        name: what the registry holds, for messages (``"objective"``).
        inputs: parameters its entries receive when called, never config keys.
        locations: the module that registers each built-in name, imported on first ask.
        builder: the module declaring :attr:`builder_keys`, the keys its builder reads
            itself (``optimizer.paramwise``).
    """

    def __init__(self, name: str, inputs: tuple[str, ...] = (),
                 locations: Mapping[str, str] | None = None, builder: str | None = None
                 ) -> None:
        self.name = name
        self.inputs = inputs  # call-time parameters of its entries, never config keys
        self.locations = dict(locations or {})
        self._builder = builder
        self._builder_keys: type | None = None
        self._entries: dict[str, Callable[..., Any]] = {}
        self._origins: dict[str, str] = {}  # name -> the module that registered it

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self.locations

    def __len__(self) -> int:
        return len(self._entries.keys() | self.locations.keys())

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {self.names()})"

    def names(self) -> list[str]:
        """Sorted names of every component: the built-ins (imported or not) and those
        registered."""
        return sorted(self._entries.keys() | self.locations.keys())

    def origin(self, name: str) -> str | None:
        """The module that registered ``name`` (None: not registered yet)."""
        return self._origins.get(name)

    def _load(self, name: str) -> None:
        """Import the module that registers the built-in ``name``, if it has not run yet."""
        if name not in self._entries and name in self.locations:
            importlib.import_module(self.locations[name])

    @property
    def builder_keys(self) -> type | None:
        """The schema (a :class:`~mmgoal.config.ConfigSection`) of the keys that the code
        building this registry's components reads itself (see :meth:`read_by_builder`)."""
        if self._builder_keys is None and self._builder is not None:
            importlib.import_module(self._builder)
        return self._builder_keys

    def register(self, name: str | None = None, force: bool = False) -> Callable:
        """Decorator registering a class or function under ``name`` (default: its own name);
        a name already taken is refused unless ``force=True``."""

        def decorator(obj: Callable[..., Any]) -> Callable[..., Any]:
            key = name or obj.__name__
            registering = sys._getframe(1).f_globals.get("__name__", "")
            if registering != self.locations.get(key):
                self._load(key)  # a built-in of that name registers first: taken is taken
            if key in self._entries and not force:
                existing = self._entries[key]
                raise KeyError(
                    f"{key!r} is already registered in the {self.name} registry "
                    f"(by {existing.__module__}.{existing.__qualname__}); pick another "
                    f"name or pass force=True to replace it"
                )
            self._entries[key] = obj
            self._origins[key] = registering
            return _checking_choices(obj) if isinstance(obj, type) else obj

        return decorator

    def read_by_builder(self, section: type) -> None:
        """Declare the keys the builder of this registry's components reads itself
        (``section``: a ``ConfigSection`` of them; see :attr:`builder_keys`)."""
        self._builder_keys = section

    def get(self, name: str) -> Callable[..., Any]:
        """The component registered under ``name`` (a built-in's module imported the first
        time); an unknown name lists the choices."""
        self._load(name)
        if name not in self._entries:
            load_plugins()
        if name not in self._entries:
            available = self.names()
            close = difflib.get_close_matches(name, available, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(
                f"{name!r} is not in the {self.name} registry.{hint} Available: "
                f"{', '.join(available) or '(none)'}. A component of your own must be "
                f"imported first: list its module under custom_imports in the config."
            )
        return self._entries[name]

    def parameters(self, name: str) -> tuple[list[str], bool]:
        """The keyword parameters of the component ``name``, and whether it takes any: an
        ``__init__`` passing ``**kwargs`` on takes its bases' too, up the MRO."""
        params, takes_any = _keyword_parameters(self.get(name))
        return [p.name for p in params if p.name not in self.inputs], takes_any

    def required(self, name: str) -> list[str]:
        """The config keys of ``name`` that have no default (never a call-time input)."""
        return [p.name for p in _keyword_parameters(self.get(name))[0]
                if p.default is p.empty and p.name not in self.inputs]

    def defaults(self, name: str) -> dict[str, Any]:
        """The config keys of ``name`` that have a default, with it."""
        return {p.name: p.default for p in _keyword_parameters(self.get(name))[0]
                if p.default is not p.empty and p.name not in self.inputs}

    def inputs_of(self, name: str) -> list[str]:
        """The call-time inputs (of :attr:`inputs`) that the component ``name`` takes."""
        return [p.name for p in _keyword_parameters(self.get(name))[0] if p.name in self.inputs]

    def check(self, cfg: Mapping[str, Any], where: str | None = None,
              provided: Iterable[str] = ()) -> None:
        """Check a component config without building it: a registered ``type``, known keys
        of the right simple types, every required key given but those the caller passes
        itself (``provided``: the tokenizer). ``where``: the config path for messages."""
        prefix = f"{where}: " if where else ""
        if not isinstance(cfg, Mapping) or "type" not in cfg:
            raise ConfigError(f"{prefix}a {self.name} config must be a mapping with a 'type' "
                              f"key, got {cfg!r}")
        type_name = cfg["type"]
        target = self.get(type_name)
        accepted, takes_any = self.parameters(type_name)
        keys = [k for k in cfg if k != "type"]
        unknown = [] if takes_any else [k for k in keys if k not in accepted]
        problems: list[Exception] = []  # said together
        if unknown:
            takes = f"it accepts: {', '.join(accepted)}" if accepted else "it takes none"
            problems.append(ConfigError(f"{prefix}{self.name} {type_name!r} got unknown config "
                                        f"key(s) {close_match_hints(unknown, accepted)}; "
                                        f"{takes}"))
        try:
            check_arguments(target, {key: cfg[key] for key in keys if key not in unknown},
                            where)
        except ValueError as error:
            problems += [ConfigError(str(problem) if where else
                                     f"{self.name} {type_name!r}: {problem}")
                         for problem in getattr(error, "problems", [error])]
        missing = [] if takes_any else [n for n in self.required(type_name)
                                        if n not in keys and n not in provided]
        if missing:
            problems.append(ConfigError(f"{prefix}{self.name} {type_name!r} needs config "
                                        f"key(s) {', '.join(missing)}"))
        raise_problems(problems, ConfigErrors)

    def build(self, cfg: Mapping[str, Any], **context: Any) -> Any:
        """Build the component described by ``cfg``, checked first (:meth:`check`).
        ``context`` (the tokenizer) is passed where the component has a parameter of that
        name and the config does not set it."""
        accepted = self.parameters(cfg["type"])[0] if isinstance(cfg, Mapping) and \
            "type" in cfg else []
        # Context goes to named parameters only: a class without its own __init__
        # (nn.Module's *args, **kwargs) must not receive the tokenizer.
        context = {k: v for k, v in context.items() if k in accepted and k not in cfg}
        self.check(cfg, provided=context)
        kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k != "type"})
        return self.get(cfg["type"])(**kwargs, **context)


def _initialisers(target: Callable[..., Any]) -> list[Callable[..., Any]]:
    """A function itself; a class's own ``__init__`` and those up its MRO (not object's),
    unwrapped (:func:`_checking_choices`)."""
    if not isinstance(target, type):
        return [target]
    return [inspect.unwrap(cls.__dict__["__init__"]) for cls in target.__mro__
            if cls is not object and "__init__" in cls.__dict__]


def _checking_choices(cls: type) -> type:
    """``cls`` with its own ``__init__`` refusing a value outside a ``Literal`` parameter's
    choices, however it is built (the registry checks a config's values before building;
    this is the same check for code that constructs the class itself)."""
    init = cls.__dict__.get("__init__")
    if not inspect.isfunction(init) or hasattr(init, "__wrapped__"):
        return cls  # none of its own, a built-in type's, or already wrapped
    signature = inspect.signature(init)
    choices: dict[str, Any] | None = None  # resolved at the first construction

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        nonlocal choices
        if choices is None:
            choices = {name: hint for name, hint in _parameter_hints(init).items()
                       if is_choice(hint) and name in signature.parameters}
        if choices:
            given = signature.bind_partial(self, *args, **kwargs).arguments
            for name, hint in choices.items():
                if name in given:
                    check_value(name, given[name], hint)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def check_arguments(target: Callable[..., Any], arguments: Mapping[str, Any],
                    where: str | None = None) -> None:
    """A ``ValueError`` (several: ``ConfigProblems``) for those of ``arguments`` that their
    parameters' type hints refuse (:func:`mmgoal.config.check_value`), ``where`` prefixing
    the names: :meth:`Registry.check` for config values another library takes."""
    hints = _parameter_hints(target)
    problems: list[Exception] = []
    for key, value in arguments.items():
        if key in hints:
            try:
                check_value(f"{where}.{key}" if where else key, value, hints[key])
            except ValueError as error:
                problems.append(error)
    raise_problems(problems)


def _parameter_hints(target: Callable[..., Any]) -> dict[str, Any]:
    """The resolvable type hints of the keyword parameters (up the MRO for a class);
    a hint that names something not importable here is left out."""
    hints: dict[str, Any] = {}
    for init in _initialisers(target):
        namespace = getattr(init, "__globals__", {})
        for name, hint in getattr(init, "__annotations__", {}).items():
            if name in hints or name == "return":
                continue
            if isinstance(hint, str):
                try:
                    hint = eval(hint, namespace)  # noqa: S307  (a type hint of our own code)
                except Exception:  # a name only imported for type checking
                    continue
            hints[name] = hint
    return hints


def _keyword_parameters(target: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool]:
    """The keyword parameters of a function, or of a class's ``__init__`` and, while it
    passes ``**kwargs`` on, of the ``__init__`` up its MRO; and whether any keyword goes."""
    inits = _initialisers(target)
    params: dict[str, inspect.Parameter] = {}
    for init in inits:
        signature = inspect.signature(init).parameters.values()
        params.update({p.name: p for p in signature if p.name not in params and p.name != "self"
                       and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)})
        if not any(p.kind is p.VAR_KEYWORD for p in signature):
            return list(params.values()), False
    return list(params.values()), bool(inits)


# Where each built-in component is registered: the module a lookup of its name imports.
_MODELS, _ENCODERS = "mmgoal.models", "mmgoal.models.encoders"
_OBJECTIVES, _ENGINE, _DATA = "mmgoal.objectives", "mmgoal.engine", "mmgoal.data"


def _at(module: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, module)


MODELS = Registry("model", locations={
    **_at(f"{_MODELS}.dual_encoder", "DualEncoder"), **_at(f"{_MODELS}.scan", "SCAN"),
    **_at(f"{_MODELS}.xvlm", "XVLM"), **_at(f"{_MODELS}.clip", "OpenCLIP", "HFCLIP")})
ENCODERS = Registry("encoder", locations={
    **_at(f"{_ENCODERS}.gru_text", "GRUTextEncoder"),
    **_at(f"{_ENCODERS}.hf_text", "HFTextEncoder"),
    **_at(f"{_ENCODERS}.regions", "PrecomputedRegionEncoder", "RoIRegionEncoder"),
    **_at(f"{_ENCODERS}.timm_image", "TimmImageEncoder")})
# parameter-efficient fine-tuning of a model's own weights (model.peft: LoRA)
ADAPTERS = Registry("adapter", locations=_at(f"{_MODELS}.lora", "lora"))
POOLERS = Registry("pooler", locations=_at(f"{_MODELS}.layers.gpo", "GPO", "MaxPool",
                                           "MeanPool"))
OBJECTIVES = Registry("objective", locations={
    **_at(f"{_OBJECTIVES}.classic", "BinomialDevianceLoss", "CircleLoss", "InfoNCELoss",
          "MultiSimilarityLoss", "NTXentHardLoss"),
    **_at(f"{_OBJECTIVES}.goal", "GoalObjective"),
    **_at(f"{_OBJECTIVES}.itm", "ITMLoss", "ObjectiveSum"),
    **_at(f"{_OBJECTIVES}.pretraining", "BoxGroundingLoss", "MLMLoss"),
    **_at(f"{_OBJECTIVES}.siglip", "SigLIPLoss"),
    **_at(f"{_OBJECTIVES}.triplet", "TripletLoss")})
CONSTRAINTS = Registry("constraint", locations=_at(f"{_OBJECTIVES}.constraints",
                                                   "CCRConstraint", "CCSConstraint"))
DATASETS = Registry("dataset", locations=_at(f"{_DATA}.pipeline", "ShardDataset",
                                             "MixtureDataset"))
TOKENIZERS = Registry("tokenizer", locations=_at(f"{_DATA}.tokenizers", "WordTokenizer",
                                                 "HFTokenizer", "OpenCLIPTokenizer"))
TRANSFORMS = Registry("transform", locations={
    **_at(f"{_DATA}.transforms", "CenterCrop", "ColorJitter", "Normalize", "RandomErasing",
          "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "TimmTransform", "ToTensor"),
    **_at(f"{_MODELS}.clip", "HFImageProcessor", "OpenCLIPTransform")})
HOOKS = Registry("hook", locations=_at(f"{_ENGINE}.hooks", "FreezeSchedule",
                                       "ObjectiveWarmup"))
LOGGERS = Registry("logger", locations=_at(f"{_ENGINE}.loggers", "TensorBoardLogger",
                                           "WandbLogger"))
STRATEGIES = Registry("strategy", locations={
    **_at(f"{_ENGINE}.strategies.torch_native", "torch", "single", "ddp"),
    **_at(f"{_ENGINE}.strategies.deepspeed", "deepspeed"),
    **_at(f"{_ENGINE}.strategies.accelerate", "accelerate")})
OPTIMIZERS = Registry("optimizer", locations=_at(f"{_ENGINE}.optimizers", "Adam", "AdamW",
                                                 "SGD"),
                      builder=f"{_ENGINE}.optimizers")
SCHEDULES = Registry("schedule", locations=_at(f"{_ENGINE}.schedules", "constant", "cosine",
                                               "linear", "step"))
TRIPLET_WEIGHTS = Registry("triplet weight", inputs=("s_p", "s_n"),
                           locations=_at(f"{_OBJECTIVES}.weights", "con", "nca", "cir"))
PAIR_WEIGHTS = Registry("pair weight", inputs=("s_p", "s_n", "relative"),
                        locations=_at(f"{_OBJECTIVES}.weights", "con", "lin", "sig", "lin_ms",
                                      "sig_ms"))
CHECKPOINT_REMAPS = Registry("checkpoint remap", locations=_at(
    f"{_MODELS}.pretrained", "efficientnet_pytorch", "timm"))
TEXT_AUGMENTS = Registry("text augment", locations=_at(f"{_DATA}.tokenizers", "TokenAugment"))
SHARD_SOURCES = Registry("shard source", locations={
    **_at(f"{_DATA}.sources", "entities", "karpathy", "precomputed"),
    **_at(f"{_DATA}.caption_sources", "csv", "folder", "hf")})

_plugins_loaded = False


def import_custom_modules(modules: Iterable[str], beside: str | os.PathLike | None = None
                          ) -> None:
    """Import the modules a config names under ``custom_imports``, each logged with its file
    (its code runs: the log says whose). A module not importable otherwise is looked for
    ``beside`` the config (the folder joins ``sys.path``), so a plug-in can sit next to it.
    """
    if isinstance(modules, str):
        modules = [modules]
    for module in modules:
        new = module not in sys.modules
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing_itself = error.name is not None and module.startswith(error.name)
            if beside is None or not missing_itself:
                raise _custom_import_error(module, error, beside) from error
            folder = str(Path(beside).resolve())
            if folder not in sys.path:
                sys.path.append(folder)
            try:
                imported = importlib.import_module(module)
            except ImportError as error:
                raise _custom_import_error(module, error, beside) from error
        if new:
            logger.info("custom_imports: imported %s from %s", module,
                        getattr(imported, "__file__", None) or "a namespace package")


def _custom_import_error(module: str, error: ImportError,
                         beside: str | os.PathLike | None) -> ImportError:
    where = f" (also looked beside the config, in {beside})" if beside is not None else ""
    return ImportError(f"custom_imports lists {module!r}, which cannot be imported: "
                       f"{error}{where}; put the module beside the config, install its "
                       f"package, or add its folder to PYTHONPATH")


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
