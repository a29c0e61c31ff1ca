"""Checkpoints: plain dicts of tensors and primitives, written atomically (a run killed
while saving leaves the previous one), read with ``weights_only=True``; an export may be
``.safetensors``. Weights holding NaN or inf are never checkpointed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from mmgoal import strict_json
from mmgoal.config import config_changes, first_line
from mmgoal.files import LinkedPathError, check_regular, write_atomically

logger = logging.getLogger(__name__)

FORMAT = "mmgoal-checkpoint/1"
CONFIG_SUFFIXES = (".yaml", ".yml")
SAFETENSORS_FORMAT = "mmgoal-safetensors/1"  # an export (mmgoal export --out FILE.safetensors)
SHOWN_NAMES = 3  # tensor names an error message lists before "and N more"


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating tensors in ``tensors`` holding NaN or inf (one device sync)."""
    floating = [(name, value) for name, value in tensors.items()
                if isinstance(value, torch.Tensor) and value.is_floating_point()]
    if not floating:
        return []
    device = floating[0][1].device
    finite = torch.stack([torch.isfinite(value).all().to(device) for _, value in floating])
    return [name for (name, _), ok in zip(floating, finite.tolist()) if not ok]


def describe_tensors(names: list[str]) -> str:
    """``8 tensors (a.running_var, b.running_var, c.running_var and 5 more)``."""
    shown = ", ".join(names[:SHOWN_NAMES])
    more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} ({shown}{more})"


class NonFiniteStateError(FloatingPointError):
    """The model holds NaN or inf in the tensors ``names``: the run stops before evaluating
    or checkpointing it (``resumable``: an earlier finite checkpoint is there)."""

    def __init__(self, names: list[str], checkpoint_dir: Path, step: int,
                 resumable: bool) -> None:
        self.names = names
        advice = ("lower the learning rate (optimizer.lr), clip gradients (train.clip_grad) "
                  "or check the data")
        then = (f"the last good checkpoint in {checkpoint_dir} is intact: {advice}, then "
                f"continue from it with --resume --cfg-options optimizer.lr=<lower>"
                if resumable else f"no checkpoint was written before: {advice} and start again")
        super().__init__(f"the model holds NaN or inf in {describe_tensors(names)} at step "
                         f"{step} (the run diverged); it is neither evaluated nor checkpointed, "
                         f"and {then}")


def check_finite_weights(weights: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights holding NaN or inf (a checkpoint an older mmgoal wrote as its run
    diverged)."""
    names = nonfinite_tensors(weights)
    if names:
        raise ValueError(f"{source} holds NaN or inf in {describe_tensors(names)}: its run had "
                         f"diverged when it was written; use an earlier checkpoint of the run "
                         f"(best.pt) or train again with a lower learning rate")


class CheckpointWriteError(RuntimeError):
    """A checkpoint or export could not be written (a full disk, a lost mount); the file it
    would have replaced is intact."""


# What a failed checkpoint write tells the user to do once the space is there
RESUME = "continue with --resume"


def _write_atomically(path: str | os.PathLike, write: Any, then: str = RESUME) -> None:
    """``write(temporary_path)``, then renamed over ``path``
    (:func:`mmgoal.files.write_atomically`; stale temporaries removed first). A failure is a
    :class:`CheckpointWriteError` saying ``then``, what to do once the folder has room."""
    try:
        write_atomically(path, write, remove_stale=True)
    except LinkedPathError:
        raise
    except Exception as error:  # torch's, safetensors' (a Rust error) and the OS's own
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        kept = ("the file it would replace is intact" if Path(path).exists()
                else "nothing was written")
        raise CheckpointWriteError(
            f"could not write {path} ({reason}); {kept}: a checkpoint is written to a "
            f"temporary file and renamed only once complete. Free space (or fix the folder), "
            f"then {then}") from error


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike, then: str = RESUME) -> None:
    """Atomically write ``state`` (plus a format tag) to ``path`` (``then``: as
    :func:`_write_atomically`)."""
    _write_atomically(path, lambda tmp: torch.save({"format": FORMAT, **state}, tmp), then)


def copy_checkpoint(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """Atomically write a copy of the checkpoint file ``source`` (the same bytes) to ``path``."""
    _write_atomically(path, lambda tmp: shutil.copyfile(source, tmp))


def save_safetensors(state: dict[str, Any], path: str | os.PathLike, then: str = RESUME) -> None:
    """Atomically write an exported model as safetensors: ``state["model"]`` as the tensors,
    every other entry JSON in the metadata. Tied weights are written once; the metadata's
    ``aliases`` maps the other names to it."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state["model"].items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().cpu().contiguous()
    metadata = {"format": SAFETENSORS_FORMAT, "aliases": json.dumps(aliases)}
    metadata.update({key: strict_json.dumps(value) for key, value in state.items()
                     if key != "model"})
    _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), then)


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as opened:
            metadata = opened.metadata() or {}
            model = {name: opened.get_tensor(name) for name in opened.keys()}
        extra = {key: json.loads(value) for key, value in metadata.items() if key != "format"}
    except Exception as error:
        raise ValueError(f"checkpoint {path} cannot be read ({error}); it may be corrupt or "
                         f"not an mmgoal export") from error
    if metadata.get("format") != SAFETENSORS_FORMAT:
        raise ValueError(f"{path} is a safetensors file but not an mmgoal export (its metadata "
                         f"has no format {SAFETENSORS_FORMAT!r}); write one with "
                         f"mmgoal export RUN --out FILE.safetensors")
    aliases = extra.pop("aliases", {})
    if not isinstance(aliases, dict) or not all(
            isinstance(name, str) and target in model for name, target in aliases.items()):
        raise ValueError(f"checkpoint {path}: its metadata's aliases name no tensors of the "
                         f"file; it may be corrupt or not an mmgoal export")
    for name, target in aliases.items():
        model[name] = model[target]
    return check_state({"format": FORMAT, "model": model, **extra}, path)


# What every mmgoal checkpoint entry is, where it has it: a file whose entries are of other
# kinds is refused when read, not when a tokenizer or config later trips on them.
STATE_TYPES = {"model": dict, "tokenizer": dict, "config": (dict, type(None)),
               "epoch": (int, type(None))}


def check_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state`` when its entries are of the kinds an mmgoal checkpoint holds, else a
    ValueError naming the entry."""
    for key, kind in STATE_TYPES.items():
        if key in state and not isinstance(state[key], kind):
            raise ValueError(f"checkpoint {path}: its {key!r} is a {type(state[key]).__name__}, "
                             f"not what an mmgoal checkpoint holds there; the file may be corrupt "
                             f"or written by something else")
    tensors = [name for name, value in state.get("model", {}).items()
               if not isinstance(value, torch.Tensor)]
    if tensors:
        raise ValueError(f"checkpoint {path}: its model entry {tensors[0]!r} is not a tensor; "
                         f"the file may be corrupt or written by something else")
    return state


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors and primitives only),
    or an export written by :func:`save_safetensors`."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} is a folder, not a checkpoint file; give "
                                f"a file such as {path / 'checkpoints' / 'best.pt'}")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    check_regular(path, "checkpoint")  # a FIFO or device: never opened
    if path.suffix in CONFIG_SUFFIXES:
        raise ValueError(f"{path} is a config, not a checkpoint: a tool that takes both wants "
                         f"[CONFIG] CHECKPOINT, the config first")
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's first line says what; the rest is its advice
        reason = first_line(error)
        raise ValueError(f"checkpoint {path} cannot be read ({reason}); it may be corrupt, "
                         f"not an mmgoal checkpoint, or a pickle that mmgoal will not run "
                         f"(every checkpoint is read weights-only)") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an mmgoal checkpoint (expected format {FORMAT!r})")
    return check_state(state, path)


def peek_checkpoint(path: str | os.PathLike) -> dict | None:
    """The state a checkpoint file holds, its tensors memory-mapped, not read (its epoch,
    step or metrics are); None where torch cannot read it weights-only."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # anything torch cannot read
        return None
    return state if isinstance(state, dict) else None


def checkpoint_progress(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(epochs done, step)`` that the resumable checkpoint ``path`` holds
    (:func:`peek_checkpoint`); None where it cannot be read or holds no progress."""
    state = peek_checkpoint(path)
    progress = (state.get("epoch"), state.get("step")) if state is not None else ()
    if len(progress) != 2 or not all(isinstance(v, int) for v in progress):
        return None
    return progress


def shape_mismatches(own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> list[str]:
    """``name (checkpoint shape) vs (model shape)`` for each shared name whose shapes differ."""
    return [f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}" for k in weights
            if k in own and weights[k].shape != own[k].shape]


def config_differences(saved: Any, wanted: Any, name: str) -> list[str]:
    """Where two config sections differ: ``model.embed_dim: 1024 in the checkpoint, 16 here``."""
    return [f"{key}: {old!r} in the checkpoint, {new!r} here"
            for key, (old, new) in config_changes(saved, wanted, name).items()]


def load_matching_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor],
                          source: str = "the checkpoint") -> dict[str, list[str]]:
    """Load the weights ``model`` shares with ``weights`` (a pretraining checkpoint starting a
    finetuning model). Returns ``{"dropped": keys, "missing": keys}``; a shared key of
    another shape, or no key in common, is a ValueError."""
    own = model.state_dict()
    shared = [k for k in weights if k in own]
    mismatched = shape_mismatches(own, weights)
    if mismatched or not shared:
        detail = (f"shapes differ: {'; '.join(mismatched[:SHOWN_NAMES])}" if mismatched
                  else "no weight name in common")
        raise ValueError(f"{source}: the checkpoint's model does not match this config's model "
                         f"({detail}); it was trained with another architecture or size: start "
                         f"from a checkpoint of this model, or give the model section that "
                         f"run's settings")
    check_finite_weights(weights, source)
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
