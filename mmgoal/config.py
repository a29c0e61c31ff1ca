"""YAML configs with ``_base_`` inheritance, ``_delete_`` and command-line overrides.

A config is plain data, read with a ``yaml.SafeLoader``: it never runs code. Inheritance,
overrides and the shipped configs :func:`find_config` finds by name: docs/configs.md.
:class:`ConfigSection` is the base of a section's schema: a dataclass whose fields are the
section's keys with their defaults (the run's: :mod:`mmgoal.runs.schema`).
"""

from __future__ import annotations

import ast
import collections.abc
import copy
import dataclasses
import difflib
import fnmatch
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from mmgoal.files import OversizedFileError, read_text

BASE_KEY = "_base_"
# The configs shipped with the package (the repository's configs/ is a link to it); the
# _base_ fragments under it are not configs of their own.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
_FRAGMENTS = "_base_"
# YAML 1.1 reads 1e-3 as a string (it wants 1.0e-3); configs mean a number.
_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data, no tags that run code) that reads ``1e-3`` as a
    number and refuses a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping, on lines "
                    f"{seen[key]} and {line}: YAML would silently keep the second; merge them",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
# What YAML aliases (&name / *name) may expand a config to: a config is a few hundred
# values, and nested aliases grow exponentially (9 levels of 10 are 10**9 values).
MAX_EXPANDED_VALUES = 100_000


class _SelfContaining(ValueError):
    """An alias inside the value its anchor names (``a: &x {b: *x}``)."""


def _expanded_values(node: yaml.Node, seen: dict[int, int], limit: int,
                     inside: set[int] | None = None) -> int:
    """How many values ``node`` stands for once every alias is copied out (stops counting
    past ``limit``); ``seen`` holds the nodes counted so far (an alias is its anchor's node
    object), ``inside`` the nodes ``node`` lies in, where an alias raises _SelfContaining."""
    inside = set() if inside is None else inside
    if id(node) in inside:
        raise _SelfContaining(node.start_mark.line + 1)
    if id(node) in seen:
        return seen[id(node)]
    inside.add(id(node))
    total = 1
    children = node.value if isinstance(node, yaml.SequenceNode) else \
        [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) \
        else []
    for child in children:
        total += _expanded_values(child, seen, limit, inside)
        if total > limit:
            break
    inside.discard(id(node))
    seen[id(node)] = total
    return total


def read_yaml(text: str, where: str) -> Any:
    """``text`` as plain data (:class:`ConfigLoader`); a ValueError for aliases that expand
    it past :data:`MAX_EXPANDED_VALUES` values (a YAML alias bomb)."""
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        seen: dict[int, int] = {}
        expanded = _expanded_values(node, seen, MAX_EXPANDED_VALUES)
        if expanded > MAX_EXPANDED_VALUES and expanded > len(seen):
            raise ValueError(f"{where} ({len(text)} bytes) expands through YAML aliases "
                             f"(&name / *name) to more than {MAX_EXPANDED_VALUES} values, "
                             f"which mmgoal refuses to build; write the repeated parts out, "
                             f"or share them through _base_ files")
        return loader.construct_document(node)
    except _SelfContaining as error:
        raise ValueError(f"{where}: the value anchored on line {error} holds an alias of "
                         f"itself (a: &x {{b: *x}}), a value with no end that no config is; "
                         f"write the inner value out") from None
    except RecursionError:
        raise ValueError(f"{where} nests its values too deeply to be a config") from None
    finally:
        loader.dispose()
DELETE_KEY = "_delete_"
_YAML_WORDS = {"true": True, "false": False, "null": None, "none": None, "~": None}


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> dict:
    """A YAML config as a plain dict, ``_base_``/``_delete_`` resolved and ``overrides``
    (``["a.b=1", "c=[1, 2]"]``) applied."""
    cfg = _load_with_bases(Path(path), chain=(), loaded={})
    for override in overrides:
        apply_override(cfg, override)
    return cfg


def shipped_configs(pattern: str = "*") -> dict[str, Path]:
    """The configs shipped with mmgoal whose name matches ``pattern`` (``fnmatch``, e.g.
    ``clip/*``, ``*goal*``), by name: ``{"quickstart": .../configs/quickstart.yaml, ...}``,
    sorted; the ``_base_`` fragments are left out."""
    found = {}
    for path in sorted(SHIPPED_CONFIGS.rglob("*.yaml")):
        name = path.relative_to(SHIPPED_CONFIGS).with_suffix("").as_posix()
        if not name.startswith(f"{_FRAGMENTS}/") and fnmatch.fnmatchcase(name, pattern):
            found[name] = path
    return found


def shipped_config_name(text: str | os.PathLike) -> str:
    """``configs/clip/x.yaml``, ``clip/x.yaml`` and ``clip/x`` all name ``clip/x``."""
    name = Path(text).as_posix().removeprefix("configs/")
    return name.removesuffix(".yaml")


def find_config(text: str | os.PathLike) -> Path:
    """The config ``text`` names: a file that exists always wins (``text``, ``text.yaml``,
    ``configs/<name>.yaml``), then the shipped config of that name (a shipped DeepSpeed JSON
    too), so the documented commands run from any folder (docs/configs.md, "The shipped
    configs")."""
    given = Path(text)
    relative = given.as_posix().removeprefix("configs/")
    # a name without a suffix is a YAML config's; other files (a DeepSpeed JSON) keep theirs
    suffix = "" if given.suffix else ".yaml"
    for path in (given, Path(f"{text}{suffix}"), Path("configs", f"{relative}{suffix}"),
                 SHIPPED_CONFIGS / f"{relative}{suffix}"):
        if path.exists():
            return path
    name = shipped_config_name(text)
    shipped = shipped_configs()
    close = difflib.get_close_matches(name, list(shipped), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise FileNotFoundError(f"config {text}: no such file, and mmgoal ships no config named "
                            f"{name!r}{hint}; `mmgoal configs` lists the shipped ones")


# A config is a few KB (the largest shipped one is under 4 KB); a file far larger is not one,
# and is refused before it is read (a received _base_ of 1 GB would take 3 GB to parse).
MAX_CONFIG_BYTES = 1 << 20


def read_config_text(path: Path, where: str = "") -> str:
    """The text of the config file ``path``, refused unread past :data:`MAX_CONFIG_BYTES`
    (:func:`mmgoal.files.read_text`: a device or FIFO is never opened)."""
    try:
        return read_text(path, "config", MAX_CONFIG_BYTES)
    except OversizedFileError:
        raise ValueError(f"config {path}{where} is larger than {MAX_CONFIG_BYTES:,} bytes, and "
                         f"a config is a few KB: it is not read (is it the right file?)") from None


def _load_with_bases(path: Path, chain: tuple[Path, ...], loaded: dict[Path, dict]) -> dict:
    """The file ``path`` merged over its bases; ``loaded`` keeps every file resolved so far,
    so each file is read and merged once however many files name it (a chain whose every
    file names one base twice would otherwise be read 2**depth times)."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ValueError(f"config _base_ files form a cycle: {cycle}")
    if path in loaded:
        return loaded[path]
    where = f" (a _base_ of {chain[-1]})" if chain else ""
    if path.is_dir():
        raise FileNotFoundError(f"config {path} is a folder, not a YAML file{where}; a run "
                                f"folder's own config is {path / 'config.yaml'}")
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist{where}")
    try:
        data = read_yaml(read_config_text(path, where), f"config {path}") or {}
    except yaml.YAMLError as error:
        raise ValueError(f"config {path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must hold a mapping at the top, got {type(data).__name__}")
    bases = data.pop(BASE_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(base, str) for base in bases):
        raise ValueError(f"config {path}: _base_ must be a file name or a list of them, got "
                         f"{bases!r}")
    # a base named twice is merged once, at its last place: merging it again there
    # changes nothing, as the later merge wins
    resolved = [(path.parent / base).resolve() for base in bases]
    merged: dict = {}
    for index, base in enumerate(resolved):
        if base not in resolved[index + 1:]:
            merged = merge_configs(merged, _load_with_bases(base, (*chain, path), loaded))
    loaded[path] = strip_delete_keys(merge_configs(merged, data))
    return loaded[path]


def merge_configs(base: Mapping, update: Mapping) -> dict:
    """Deep-merge ``update`` into a copy of ``base``: mappings key by key, unless ``update``'s
    has ``_delete_: true``; any other value replaces."""
    result = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and not value.get(DELETE_KEY, False) and isinstance(
            result.get(key), Mapping
        ):
            result[key] = merge_configs(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def strip_delete_keys(cfg: Any) -> Any:
    """Remove the ``_delete_`` markers once merging is done."""
    if isinstance(cfg, Mapping):
        return {k: strip_delete_keys(v) for k, v in cfg.items() if k != DELETE_KEY}
    if isinstance(cfg, list):
        return [strip_delete_keys(v) for v in cfg]
    return cfg


def parse_value(text: str) -> Any:
    """A command-line value as a Python literal, a YAML flow mapping or list (``{type: ddp}``,
    ``[a, b]``: as a config file writes them), a YAML word, or else a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    if text.strip()[:1] in ("{", "["):
        try:
            return read_yaml(text, "the --cfg-options value")
        except (yaml.YAMLError, ValueError):
            pass
    lowered = text.strip().lower()
    if lowered in _YAML_WORDS:
        return _YAML_WORDS[lowered]
    return text


KnownKeys = Callable[[list[str], dict], Iterable[str]]


def override_key(override: str) -> str:
    """The dotted key a ``dotted.key=value`` override sets (``data.test.shards``)."""
    return override.split("=", 1)[0].strip()


def apply_override(cfg: dict, override: str, known_keys: KnownKeys | None = None) -> None:
    """Apply one ``dotted.key=value`` override in place. The key must exist, or
    ``known_keys(path, mapping)`` (``path``: the keys leading to ``mapping``) must name it."""
    if "=" not in override:
        raise ValueError(f"override {override!r} must look like key.subkey=value")
    dotted, text = override_key(override), override.split("=", 1)[1]
    keys = dotted.split(".")
    node: Any = cfg
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth]) or "the top level"
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.lstrip("-").isdigit() or not -len(node) <= int(key) < len(node):
                raise ValueError(
                    f"override {dotted!r}: {where} is a list of {len(node)} items; "
                    f"{key!r} is not a valid index"
                )
            key = int(key)
        elif isinstance(node, dict):
            # what a schema knows is asked only for a key the mapping does not hold
            allowed = set(known_keys(keys[:depth], node)) if known_keys and key not in node \
                else set()
            if key not in node and not (last and key in allowed):
                choices = sorted({str(k) for k in node} | allowed)
                close = difflib.get_close_matches(key, choices, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"override {dotted!r}: no key {key!r} under {where}.{hint} "
                    f"Keys there: {', '.join(choices)}"
                )
        else:
            raise ValueError(f"override {dotted!r}: {where} is a value, not a mapping or list")
        if last:
            node[key] = parse_value(text)
        else:
            node = node[key]


def config_text(cfg: Mapping) -> str:
    """The resolved config as YAML: what was run, which :func:`load_config` reads back."""
    return yaml.safe_dump(dict(cfg), sort_keys=False)


def config_changes(old: Any, new: Any, prefix: str = "") -> dict[str, list]:
    """Dotted key -> ``[old value, new value]`` for every place two configs differ: mappings
    key by key (a missing key reads as ``None``), anything else, lists included, whole."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        changes: dict[str, list] = {}
        for key in [*old, *(k for k in new if k not in old)]:
            changes.update(config_changes(old.get(key), new.get(key),
                                          f"{prefix}.{key}" if prefix else str(key)))
        return changes
    return {} if old == new else {prefix: [old, new]}


def describe_changes(changes: dict[str, list], limit: int | None = None) -> str:
    """``model.embed_dim: 16 -> 8; train.seed: 0 -> 1`` of :func:`config_changes`' result
    (the first ``limit`` of them, then how many more)."""
    shown = list(changes.items())[:limit]
    listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in shown)
    more = len(changes) - len(shown)
    return listed + (f" (and {more} more)" if more else "")


def close_match_hints(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``'epoch' (did you mean 'epochs'?), 'sed'``: each unknown key with its closest known one."""
    known = list(known)
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)


def first_line(error: BaseException) -> str:
    """An exception's first line, where libraries say what went wrong (their advice, a
    traceback of a subprocess, follows it), or its ``repr`` when it has no text."""
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


def unknown_key_error(where: str, unknown: Iterable[str], known: Iterable[str]) -> ValueError:
    """The error for keys a section does not have, with the closest known key for each."""
    known = sorted(known)
    return ValueError(f"unknown key(s) {close_match_hints(sorted(unknown), known)} in "
                      f"'{where}'; known keys: {', '.join(known)}")


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """The least value a number may take, said in its type hint: ``Annotated[int,
    AtLeast(1)]``, which :func:`check_value` enforces; a component's config is checked
    against its constructor's hints (:meth:`mmgoal.registry.Registry.check`)."""

    minimum: float


@dataclasses.dataclass(frozen=True)
class BuiltBy:
    """A config value that a registry builds, said in its type hint: ``Annotated[dict,
    BuiltBy(ADAPTERS)] | None`` (a model's ``peft`` section) is checked by that registry's
    ``check`` (its ``type``, keys and their types) with the rest of the config, where
    :func:`check_value` meets it, rather than only when the model builds it."""

    registry: Any  # a mmgoal.registry.Registry (which imports this module)


# A width, a length, a count of layers or heads: a size that zero or less would not mean,
# which a config (or a checkpoint's stored config) setting -1 would otherwise turn into a
# "negative dimension" deep inside torch, or a silently shorter caption (``[:-1]``).
PositiveInt = Annotated[int, AtLeast(1)]
NonNegativeInt = Annotated[int, AtLeast(0)]  # a count that may be none (warm-up steps)
# What a run trains in (train.precision, strategy.precision), and torch's float32 matmul
# precision (train.matmul_precision, evaluation.matmul_precision): typed here, below torch,
# so the run schema checks them without importing it.
Precision = Literal["fp32", "bf16", "fp16"]
MatmulPrecision = Literal["highest", "high", "medium"]

_KINDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def check_value(where: str, value: Any, hint: Any) -> None:
    """A ``ValueError`` when a config value (plain data) cannot be of the type ``hint``.

    Simple types exactly (a bool is neither a number nor an integer); a list's items against
    the item type (``list[str]``); a class (``torch.Tensor``) only its instances; a hint this
    cannot read (``Any``, callables) allows anything. :data:`PositiveInt` bounds, in a union
    or list too. A ``Literal`` lists its values and the closest: the one check of a choice.
    """
    members = _union_members(hint)
    fitting = next((member for member in members if suits(value, member)), None)
    if fitting is not None:
        _check_within(where, value, fitting)
        return
    options = [_unannotated(member) for member in members]
    choices = [str(c) for option in options if typing.get_origin(option) is typing.Literal
               for c in typing.get_args(option)]
    named = ([_KINDS[t] for t in options if t in _KINDS] + choices or [
        getattr(t, "__name__", str(t)) for t in options if t is not type(None)]) + (
        ["null"] if type(None) in options else [])
    wanted = " or ".join(filter(None, [", ".join(named[:-1]), named[-1]]))
    close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.6) \
        if isinstance(value, str) else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"{where} must be {wanted}, got {value!r}{hint}")


def suits(value: Any, hint: Any) -> bool:
    """Whether plain config data ``value`` can be of the type ``hint`` (one member of a
    union): ``float`` takes any number, ``int`` a whole number, neither a bool. Only the
    type: bounds and items are :func:`check_value`'s."""
    hint = _unannotated(hint)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    origin = typing.get_origin(hint) or hint
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.Iterable):
        return isinstance(value, (list, tuple)) or (origin is collections.abc.Iterable
                                                    and isinstance(value, str))
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    if isinstance(origin, type) and origin.__module__ not in ("builtins", "typing",
                                                             "collections.abc"):
        return isinstance(value, origin)  # a tensor, a module: never plain config data
    return True


def check_minimum(where: str, value: Any, minimum: float) -> None:
    """A ``ValueError`` when a number is below ``minimum`` (``None`` passes)."""
    if value is not None and value < minimum:
        raise ValueError(f"{where} must be at least {minimum}, got {value!r}")


def is_choice(hint: Any) -> bool:
    """Whether ``hint`` is a choice: a ``Literal``, or one or null (``Literal[...] | None``)."""
    members = [_unannotated(member) for member in _union_members(hint)]
    return any(typing.get_origin(m) is typing.Literal for m in members) and all(
        typing.get_origin(m) is typing.Literal or m is type(None) for m in members)


def _union_members(hint: Any) -> tuple:
    """The members of a union hint (``int | None``: ``int``, ``None``); another hint alone."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _unannotated(hint: Any) -> Any:
    """``T`` of ``Annotated[T, ...]``; any other hint as it is."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _check_within(where: str, value: Any, hint: Any) -> None:
    """What a value of the right type must also be: within the bounds of an ``Annotated``
    hint, and, for a list, each item of the item type of a sequence hint."""
    if typing.get_origin(hint) is Annotated:
        hint, *marks = typing.get_args(hint)
        for mark in marks:
            if isinstance(mark, AtLeast):
                check_minimum(where, value, mark.minimum)
            elif isinstance(mark, BuiltBy) and isinstance(value, Mapping):
                mark.registry.check(value, where)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    homogeneous = origin in (list, collections.abc.Sequence, collections.abc.Iterable) or \
        (origin is tuple and len(args) == 2 and args[1] is Ellipsis)
    if homogeneous and args and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_value(f"{where}[{index}]", item, args[0])


@dataclasses.dataclass
class ConfigProblems(ValueError):
    """Several problems of one config, each said on a line of its own: a config's problems
    are reported together, not one per run."""

    def __init__(self, problems: list[Exception]) -> None:
        self.problems = problems
        super().__init__(f"the config has {len(problems)} problems:\n"
                         + "\n".join(f"- {problem}" for problem in problems))


def raise_problems(problems: list[Exception], kind: type[ConfigProblems] = ConfigProblems
                   ) -> None:
    """Raise nothing, the one problem as it is, or several as ``kind``."""
    flat = [inner for problem in problems for inner in
            (problem.problems if isinstance(problem, ConfigProblems) else [problem])]
    if len(flat) == 1:
        raise flat[0]
    if flat:
        raise kind(flat)


class ConfigSection:
    """A config section's schema: subclasses are dataclasses whose fields are its keys. A
    field typed ``ConfigSection`` (or ``X | None``) is a nested section; other fields are
    type-checked, ``MINIMUM`` (field -> least value) bounds numbers, and a subclass's
    ``__post_init__`` checks the rest."""

    MINIMUM: typing.ClassVar[dict[str, float]] = {}

    @classmethod
    def from_dict(cls, given: Mapping[str, Any] | None, where: str):
        """The section from ``given`` as written (``None``: every default), ``where`` its
        dotted name (``""``: the whole config); an unknown key is a ``ValueError``."""
        if given is not None and not isinstance(given, Mapping):
            raise ValueError(f"'{where or 'the config'}' must be a mapping, got {given!r}")
        given = dict(given or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        problems: list[Exception] = []  # every one said, not the first alone
        unknown = set(given) - set(fields)
        if unknown:
            problems.append(unknown_key_error(where or "the top level", unknown, fields))
        prefix = f"{where}." if where else ""
        hints = typing.get_type_hints(cls, include_extras=True)  # PositiveInt keeps its bound
        values = {}
        for name, value in given.items():
            if name in unknown:
                continue
            try:
                section = _section_type(hints[name])
                if section is not None and value is not None:
                    value = section.from_dict(value, prefix + name)
                else:
                    check_value(prefix + name, value, hints[name])
                    if name in cls.MINIMUM:
                        check_minimum(prefix + name, value, cls.MINIMUM[name])
                values[name] = value
            except ValueError as error:
                problems.append(error)
        missing = sorted(name for name, f in fields.items() if name not in given
                         and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            problems.append(ValueError(f"the config has no "
                                       f"{', '.join(prefix + m for m in missing)}"))
        raise_problems(problems)
        return cls(**values)

    @classmethod
    def keys(cls) -> list[str]:
        """The keys this section may hold."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def sections(cls, prefix: str = "") -> dict[str, type[ConfigSection]]:
        """Dotted path -> schema of this section (at ``prefix``) and of every section nested
        in it, from its fields' types: the one map of a schema's sections."""
        found: dict[str, type[ConfigSection]] = {prefix: cls}
        hints = typing.get_type_hints(cls)
        for name in cls.keys():
            section = _section_type(hints[name])
            if section is not None:
                found.update(section.sections(f"{prefix}.{name}" if prefix else name))
        return found

    @classmethod
    def components(cls, prefix: str = "") -> dict[str, Any]:
        """Dotted path -> registry of every field (here and in nested sections) that holds a
        component's config, as declared by :func:`component`."""
        found: dict[str, Any] = {}
        for path, section in cls.sections(prefix).items():
            for f in dataclasses.fields(section):
                if "registry" in f.metadata:
                    found[f"{path}.{f.name}" if path else f.name] = f.metadata["registry"]
        return found

    def __getitem__(self, key: str) -> Any:
        """``section[key]`` as a resolved dict reads it, so a reader of config data takes
        the typed section as it is (mmengine's Config reads both ways too)."""
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def to_dict(self) -> dict[str, Any]:
        """The section as plain config data, defaults included."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def component(registry: Any, **default: Any) -> Any:
    """A schema field holding the config of a component that ``registry`` builds (``type``
    and the keyword arguments of the class registered under that name; a list field: each
    of its items); ``default``: ``default_factory=...`` where it has one."""
    return dataclasses.field(metadata={"registry": registry}, **default)


def _section_type(hint: Any) -> type[ConfigSection] | None:
    """The ``ConfigSection`` class a field's type names, directly or as ``X | None``."""
    candidates = typing.get_args(hint) or (hint,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, ConfigSection):
            return candidate
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, ConfigSection):
        return value.to_dict()
    return copy.deepcopy(value)
