"""Checkpoints: written atomically, read with ``weights_only=True``.

A checkpoint is a plain dict of tensors and Python primitives. It is written to
a temporary file in the same folder, flushed to disk and renamed over the
target, so a run killed while saving leaves the previous checkpoint intact and
never a truncated file under the real name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT = "mmgoal-checkpoint/1"


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomically write ``state`` (plus a format tag) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as stream:
            torch.save({"format": FORMAT, **state}, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors and primitives only).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a readable mmgoal checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"checkpoint {path} cannot be read ({error}); it may be corrupt or "
                         f"not an mmgoal checkpoint") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an mmgoal checkpoint (expected format {FORMAT!r})")
    return state


def model_from_checkpoint(cfg: dict, state: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer of ``cfg`` with the weights and vocabulary of ``state``.

    Returns:
        (model in eval mode, tokenizer).
    """
    from mmgoal.registry import MODELS, TOKENIZERS, import_custom_modules

    import_custom_modules(cfg.get("custom_imports", []))
    tokenizer = TOKENIZERS.build(cfg["data"]["tokenizer"])
    tokenizer.load_state_dict(state["tokenizer"])
    model = MODELS.build(cfg["model"], tokenizer=tokenizer)
    model.load_state_dict(state["model"])
    return model.eval(), tokenizer
