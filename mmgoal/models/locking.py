"""Freezing a tower but its last layer groups (``train.lock_image``, ``train.lock_text``:
open_clip_train's ``--lock-image``/``--lock-text``, LiT's locked image tower), with open_clip's
grouping: the stem, each block, the last block with the final norm, the projection."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

STEM = ("embeddings", "pre_layrnorm")


def check_unlocked(groups: int, unlocked: int, where: str) -> None:
    """Refuse ``unlocked`` groups of a tower of ``groups``: all of them lock none."""
    if unlocked >= groups:
        raise ValueError(f"{where} has {groups} layer groups; {unlocked} unlocked would "
                         f"lock none: give fewer, or leave the tower unlocked")


def freezing_only(model: nn.Module, lock: Callable[[], None]) -> None:
    """Run a library's tower ``lock`` so that it only freezes: what was frozen before
    (LoRA's base weights) stays frozen, though the lock sets its unlocked groups
    trainable (open_clip's does)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    lock()
    for parameter in frozen:
        parameter.requires_grad_(False)


def lock_groups(groups: Sequence[Sequence[nn.Module | None]], unlocked: int, where: str) -> None:
    """Freeze every group of ``groups`` (first to last) but the last ``unlocked``."""
    check_unlocked(len(groups), unlocked, where)
    for group in groups[:len(groups) - unlocked]:
        for module in group:
            if module is not None:
                module.requires_grad_(False)


def hf_tower_groups(tower: nn.Module, projection: nn.Module | None) -> list[list[nn.Module]]:
    """A Hugging Face vision or text transformer's groups: its embeddings (and pre-norm),
    each encoder layer, the last layer with what follows it (final norm, head), the
    model's projection of that tower."""
    children = dict(tower.named_children())
    layers = list(children.pop("encoder").layers)
    stem = [children.pop(name) for name in STEM if name in children]
    return [stem, *([layer] for layer in layers[:-1]), [layers[-1], *children.values()],
            *([[projection]] if projection is not None else [])]
