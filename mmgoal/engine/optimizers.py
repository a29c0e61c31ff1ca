"""Optimizers (registered under their torch names) and per-module parameter groups.

``build_optimizer`` reads an ``optimizer`` config such as::

    optimizer:
      type: AdamW
      lr: 5.0e-4
      weight_decay: 1.0e-4
      paramwise:                          # module path prefix -> multipliers
        image_encoder.model: {lr_mult: 0.01}
        text_encoder: {lr_mult: 0.1}

Each parameter joins the group of the longest module path that prefixes its
name (VSE-infinity: BERT x0.1, backbone x0.01); the rest keep the base rate.
Frozen parameters stay in their groups, so unfreezing them later (``FreezeSchedule``)
needs no new optimizer: optimizers skip parameters without a gradient.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from mmgoal.registry import OPTIMIZERS

for _cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
    OPTIMIZERS.register()(_cls)

MULTIPLIERS = ("lr_mult", "weight_decay_mult")


def module_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def parameter_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], lr: float,
                     weight_decay: float, paramwise: dict[str, dict] | None,
                     known_modules: list[str]) -> list[dict]:
    """Split parameters into groups by module-path prefix.

    Args:
        named_parameters: ``(name, parameter)`` pairs.
        lr, weight_decay: the base values.
        paramwise: module path -> ``{lr_mult, weight_decay_mult}``.
        known_modules: module paths a prefix may name (for the error message).

    Returns:
        Optimizer parameter groups, each with a ``name`` (the prefix, or ``base``).

    Raises:
        ValueError: a prefix names no module, or an unknown multiplier key.
    """
    paramwise = paramwise or {}
    for prefix, mults in paramwise.items():
        unknown = sorted(set(mults) - set(MULTIPLIERS))
        if unknown:
            raise ValueError(f"optimizer.paramwise.{prefix}: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(MULTIPLIERS)}")
        if prefix not in known_modules:
            top = sorted({m.split(".")[0] for m in known_modules})
            raise ValueError(f"optimizer.paramwise: the model has no module {prefix!r}; "
                             f"top-level modules: {', '.join(top)}")
    groups: dict[str, dict] = {}
    for name, param in named_parameters:
        matches = [p for p in paramwise if name == p or name.startswith(p + ".")]
        prefix = max(matches, key=len) if matches else "base"
        if prefix not in groups:
            mults = paramwise.get(prefix, {})
            groups[prefix] = {"name": prefix, "params": [],
                              "lr": lr * mults.get("lr_mult", 1.0),
                              "weight_decay": weight_decay * mults.get("weight_decay_mult", 1.0)}
        groups[prefix]["params"].append(param)
    return list(groups.values())


def build_optimizer(cfg: dict, model: nn.Module, objective: nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer over the model's and the objective's parameters.

    The objective's parameters (InfoNCE's temperature) form their own group
    at the base rate.
    """
    cfg = dict(cfg)
    paramwise = cfg.pop("paramwise", None)
    defaults = inspect.signature(OPTIMIZERS.get(cfg.get("type", "AdamW"))).parameters
    lr = cfg.get("lr", defaults["lr"].default)
    weight_decay = cfg.get("weight_decay", defaults["weight_decay"].default)
    groups = parameter_groups(model.named_parameters(), lr, weight_decay, paramwise,
                              module_names(model))
    objective_params = list(objective.parameters())
    if objective_params:
        groups.append({"name": "objective", "params": objective_params, "lr": lr,
                       "weight_decay": weight_decay})
    return OPTIMIZERS.build(cfg, params=groups)
