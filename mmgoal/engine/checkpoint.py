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


def load_matching_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor],
                          source: str = "the checkpoint") -> dict[str, list[str]]:
    """Load the weights ``model`` shares with ``weights``; list what is left on either side.

    A pretraining checkpoint starts a finetuning model: heads the finetuning
    model lacks (MLM, box) are dropped, parts the checkpoint lacks keep their
    initial values.

    Returns:
        ``{"dropped": checkpoint keys the model has no place for, "missing":
        model keys the checkpoint does not fill}``.

    Raises:
        ValueError: a shared key with another shape, or no key in common (another
            architecture).
    """
    own = model.state_dict()
    shared = [k for k in weights if k in own]
    mismatched = [f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}" for k in shared
                  if weights[k].shape != own[k].shape]
    if mismatched or not shared:
        detail = (f"shapes differ: {'; '.join(mismatched[:3])}" if mismatched
                  else "no weight name in common")
        raise ValueError(f"{source}: the checkpoint's model does not match this config's model "
                         f"({detail}); it was trained with another architecture or size")
    model.load_state_dict({k: weights[k] for k in shared}, strict=False)
    return {"dropped": sorted(k for k in weights if k not in own),
            "missing": sorted(k for k in own if k not in weights)}


def summarise_keys(keys: list[str]) -> str:
    """Keys grouped by top-level module: ``mlm_decoder (2), box_head (3)``."""
    counts: dict[str, int] = {}
    for key in keys:
        prefix = key.split(".")[0]
        counts[prefix] = counts.get(prefix, 0) + 1
    return ", ".join(f"{prefix} ({n})" for prefix, n in counts.items())


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
