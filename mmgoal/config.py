"""YAML configs with ``_base_`` inheritance, ``_delete_`` and command-line overrides.

A config is plain data: it is read with ``yaml.safe_load`` and never runs code.

* ``_base_: path`` or ``_base_: [a, b]`` (relative to the file) are loaded
  first, merged left to right, then the file itself is deep-merged on top.
* A mapping with ``_delete_: true`` replaces the inherited mapping instead of
  merging into it.
* ``overrides`` (``--cfg-options``) are ``dotted.key=value`` strings; values are
  parsed as Python literals (``1``, ``1e-3``, ``[1, 2]``, ``'a'``; ``true``,
  ``false``, ``null`` too), anything else stays a string. Overriding a key that
  does not exist is an error, so a typo never passes silently.
"""

from __future__ import annotations

import ast
import copy
import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

BASE_KEY = "_base_"
DELETE_KEY = "_delete_"
_YAML_WORDS = {"true": True, "false": False, "null": None, "none": None, "~": None}


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> dict:
    """Load a YAML config, resolve ``_base_``/``_delete_`` and apply overrides.

    Args:
        path: the YAML file.
        overrides: ``["a.b=1", "c=[1, 2]"]``.

    Returns:
        The resolved config as a plain dict.

    Raises:
        FileNotFoundError: the file or one of its bases is missing.
        ValueError: malformed YAML, a cycle of bases, or an override of a key
            that does not exist.
    """
    cfg = _load_with_bases(Path(path), chain=())
    for override in overrides:
        apply_override(cfg, override)
    return cfg


def _load_with_bases(path: Path, chain: tuple[Path, ...]) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ValueError(f"config _base_ files form a cycle: {cycle}")
    if not path.is_file():
        where = f" (a _base_ of {chain[-1]})" if chain else ""
        raise FileNotFoundError(f"config file {path} does not exist{where}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"config {path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must hold a mapping at the top, got {type(data).__name__}")
    bases = data.pop(BASE_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    merged: dict = {}
    for base in bases:
        merged = merge_configs(merged, _load_with_bases(path.parent / base, (*chain, path)))
    return strip_delete_keys(merge_configs(merged, data))


def merge_configs(base: Mapping, update: Mapping) -> dict:
    """Deep-merge ``update`` into a copy of ``base``.

    Mappings merge key by key; a mapping in ``update`` with ``_delete_: true``
    replaces the one in ``base``; any other value replaces.
    """
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
    """A command-line value as a Python literal, YAML word, or else a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    lowered = text.strip().lower()
    if lowered in _YAML_WORDS:
        return _YAML_WORDS[lowered]
    return text


def apply_override(cfg: dict, override: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the key must exist."""
    if "=" not in override:
        raise ValueError(f"override {override!r} must look like key.subkey=value")
    dotted, text = override.split("=", 1)
    keys = dotted.strip().split(".")
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
            if key not in node:
                close = difflib.get_close_matches(key, [str(k) for k in node], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"override {dotted!r}: no key {key!r} under {where}.{hint} "
                    f"Keys there: {', '.join(sorted(map(str, node)))}"
                )
        else:
            raise ValueError(f"override {dotted!r}: {where} is a value, not a mapping or list")
        if last:
            node[key] = parse_value(text)
        else:
            node = node[key]


def dump_config(cfg: Mapping, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (what was run, reloadable with load_config)."""
    Path(path).write_text(yaml.safe_dump(dict(cfg), sort_keys=False))
