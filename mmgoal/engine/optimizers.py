"""Optimizers (registered under their torch names) and their parameter groups.

``build_optimizer`` reads an ``optimizer`` config such as::

    optimizer:
      type: AdamW
      lr: 5.0e-4
      weight_decay: 0.2
      paramwise:                          # module path prefix -> multipliers
        image_encoder.model: {lr_mult: 0.01}
        text_encoder: {lr_mult: 0.1}
      no_decay: [bias, norm, embedding, temperature, vector]
      layer_decay: {rate: 0.75, modules: [image_encoder]}

``paramwise``, ``no_decay`` and ``layer_decay`` are mmgoal's
(:class:`ParameterGroupOptions`); the other keys go to the torch optimizer. A
parameter's learning rate and weight decay are the base values times

- ``paramwise``: the multipliers of the longest module path that prefixes its
  name (VSE-infinity: BERT x0.1, backbone x0.01);
- ``no_decay``: weight decay 0 for the kinds of parameter listed
  (:data:`NO_DECAY_RULES`), as CLIP fine-tuning does (open_clip's ``exclude``
  rule, X-VLM's ``no_decay`` list);
- ``layer_decay``: lr x ``rate ** (L + 1 - layer)`` inside each named tower of L
  transformer blocks (:func:`transformer_layers`: embeddings are layer 0, block N
  layer N + 1, what follows the blocks layer L + 1; BEiT, MAE and timm's
  ``param_groups_layer_decay``).

The objective's parameters (InfoNCE's temperature) follow ``no_decay`` at the
base rate. Parameters with the same factors share a group, named after them
(:func:`group_name`); without ``no_decay`` and ``layer_decay`` there is one group
per ``paramwise`` prefix and ``objective``, as there always was. Parameters
frozen when the optimizer is built (a LoRA model's base weights: ``model.peft``,
docs/models.md "LoRA") are left out: the optimizer holds what trains. Parameters
frozen later (``FreezeSchedule``) stay in their groups, so unfreezing them needs no
new optimizer: optimizers skip parameters without a gradient.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from mmgoal.config import ConfigSection
from mmgoal.registry import OPTIMIZERS

for _cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
    OPTIMIZERS.register()(_cls)

MULTIPLIERS = ("lr_mult", "weight_decay_mult")
# BatchNorm*, SyncBatchNorm and InstanceNorm* derive from _NormBase.
NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def is_embedding(leaf: str) -> bool:
    """A parameter a model holds itself is an embedding by its name: timm's ``pos_embed``,
    ``cls_token``, ``reg_token``; open_clip's ``positional_embedding``, ``class_embedding``."""
    return "embed" in leaf or leaf.endswith("token")


# What ``no_decay`` may name: (its name in its module, the parameter, that module) -> excluded.
NO_DECAY_RULES: dict[str, Callable[[str, nn.Parameter, nn.Module], bool]] = {
    # Linear/conv biases, in_proj_bias (attention), bias_ih_l0 (GRU), logit_bias (SigLIP)
    "bias": lambda leaf, param, owner: "bias" in leaf,
    # every parameter of a normalisation layer, by its type
    "norm": lambda leaf, param, owner: isinstance(owner, NORM_LAYERS),
    # token/position tables (nn.Embedding) and the embeddings models hold themselves
    "embedding": lambda leaf, param, owner: isinstance(owner, nn.Embedding) or is_embedding(leaf),
    "temperature": lambda leaf, param, owner: leaf in ("logit_scale", "temperature"),
    # open_clip's ``p.ndim < 2``: also layer-scale gammas and any scalar
    "vector": lambda leaf, param, owner: param.ndim < 2,
}
NoDecayKind = Literal[tuple(NO_DECAY_RULES)]  # what the config checks no_decay's items against
# A transformer block's index in a parameter name: timm ``blocks.N.``, Hugging Face
# ``layer.N.`` (BERT) and ``layers.N.`` (CLIP), open_clip ``resblocks.N.``.
BLOCK_INDEX = re.compile(r"(?:^|\.)(blocks|layers?|resblocks)\.(\d+)\.")


@dataclass
class LayerDecay(ConfigSection):
    """``optimizer.layer_decay``: layer-wise learning-rate decay of transformer towers.

    Args:
        rate: the factor per layer, in (0, 1] (0.65-0.75 for ViT-B fine-tuning).
        modules: the towers' module paths (``[image_encoder]``); each holds one
            sequence of blocks (:func:`transformer_layers`).
    """

    rate: float
    modules: list[str]

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1:
            raise ValueError(f"optimizer.layer_decay.rate must lie in (0, 1], got {self.rate!r}")
        if not self.modules or not all(isinstance(m, str) and m for m in self.modules):
            raise ValueError(f"optimizer.layer_decay.modules must be a list of module paths "
                             f"(e.g. [image_encoder]), got {self.modules!r}")
        for inner in self.modules:
            for outer in self.modules:
                if inner.startswith(outer + "."):
                    raise ValueError(f"optimizer.layer_decay.modules: {inner!r} lies inside "
                                     f"{outer!r}; name each tower once")


@dataclass
class ParameterGroupOptions(ConfigSection):
    """The keys of ``optimizer`` that mmgoal reads itself (the module docstring shows them).

    Args:
        paramwise: module path -> ``{lr_mult, weight_decay_mult}``.
        no_decay: kinds of parameter without weight decay, keys of :data:`NO_DECAY_RULES`.
        layer_decay: layer-wise lr decay of transformer towers, or ``None``.
    """

    paramwise: dict | None = None
    no_decay: list[NoDecayKind] = field(default_factory=list)
    layer_decay: LayerDecay | None = None

    def __post_init__(self) -> None:
        for prefix, mults in (self.paramwise or {}).items():
            if not isinstance(mults, dict):
                raise ValueError(f"optimizer.paramwise.{prefix} must be a mapping such as "
                                 f"{{lr_mult: 0.1}}, got {mults!r}")
            unknown = sorted(set(mults) - set(MULTIPLIERS))
            if unknown:
                raise ValueError(f"optimizer.paramwise.{prefix}: unknown key(s) "
                                 f"{', '.join(unknown)}; known: {', '.join(MULTIPLIERS)}")


# the run schema checks these keys of an optimizer config with the rest of it
OPTIMIZERS.read_by_builder(ParameterGroupOptions)


def module_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def owned_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, nn.Module]]:
    """``(name, parameter, the module that holds it)``, in ``named_parameters()`` order."""
    seen: set[int] = set()
    for path, owner in module.named_modules():
        for leaf, param in owner.named_parameters(recurse=False):
            if id(param) not in seen:  # a tied weight counts once, as in named_parameters
                seen.add(id(param))
                yield f"{path}.{leaf}" if path else leaf, param, owner


def parameter_counts(*modules: nn.Module) -> dict[str, int]:
    """``{"trainable": N, "total": M}``: the parameters of ``modules`` (a shared one once)
    that are trainable now (what :func:`build_optimizer` gives the optimizer), and all."""
    params = {id(p): p for module in modules for p in module.parameters()}.values()
    return {"trainable": sum(p.numel() for p in params if p.requires_grad),
            "total": sum(p.numel() for p in params)}


def transformer_layers(tower: nn.Module, where: str) -> tuple[dict[str, int], int]:
    """The layer of each parameter of a tower (by its name in the tower), and its block count L.

    Block N (``blocks.N.``, ``layer.N.``, ``layers.N.`` or ``resblocks.N.`` in the
    name; the first such index where they nest) is layer N + 1. The others are
    layer 0 when they come before the blocks (patch, token and position
    embeddings, the class token, a pre-norm) and L + 1 after them (the final norm,
    a pooler or projection): see :func:`precedes_blocks`.

    Args:
        tower: the module whose layers decay.
        where: its module path, for the message.

    Raises:
        ValueError: no blocks, or more than one sequence of them (a whole dual encoder).
    """
    names = [name for name, _ in tower.named_parameters()]
    matches = [BLOCK_INDEX.search(name) for name in names]
    sequences = sorted({name[:match.end(1)] for name, match in zip(names, matches) if match})
    if len(sequences) != 1:
        found = (f"two or more sequences of blocks ({', '.join(sequences)}): name each tower "
                 f"that holds one" if sequences else
                 f"no transformer blocks (its parameters: {', '.join(names[:3]) or 'none'}...): "
                 f"it needs blocks named blocks.N (timm), layer.N or layers.N (Hugging Face) or "
                 f"resblocks.N (open_clip)")
        raise ValueError(f"optimizer.layer_decay: module {where!r} holds {found}")
    blocks = 1 + max(int(match.group(2)) for match in matches if match)
    return {name: int(match.group(2)) + 1 if match
            else 0 if precedes_blocks(tower, name, sequences[0]) else blocks + 1
            for name, match in zip(names, matches)}, blocks


def precedes_blocks(tower: nn.Module, name: str, sequence: str) -> bool:
    """Whether the parameter ``name`` (outside the blocks) comes before the block
    ``sequence`` (``model.blocks``) of ``tower``.

    At the deepest module holding both, the child that holds the parameter is
    compared with the one that leads to the blocks in registration order (timm's
    ``patch_embed`` before ``blocks``, ``norm`` after). A parameter that module
    holds itself, which ``named_parameters`` lists before every child's, is an
    embedding before the blocks by its name (``cls_token``, ``pos_embed``,
    ``class_embedding``) and a projection after them otherwise (open_clip's ``proj``).
    """
    path, towards = name.split("."), sequence.split(".")
    depth = 0
    while depth < min(len(path) - 1, len(towards)) and path[depth] == towards[depth]:
        depth += 1
    if depth == len(path) - 1:
        return is_embedding(path[-1])
    if depth == len(towards):  # inside the sequence, outside its numbered blocks
        return False
    children = [child for child, _ in tower.get_submodule(".".join(path[:depth])).named_children()]
    return children.index(path[depth]) < children.index(towards[depth])


def group_name(prefix: str, base_name: str, layer: tuple[str, int] | None,
               decays: bool) -> str:
    """``text_encoder``, ``image_encoder.layer_3``, ``base/no_decay``: the paramwise prefix
    (or ``base_name``), the tower's layer where it has one (the prefix is left out when it
    holds the tower), ``/no_decay`` for weight decay 0."""
    name = prefix
    if layer is not None:
        tower, index = layer
        place = f"{tower}.layer_{index}"
        inside = prefix == base_name or tower == prefix or tower.startswith(prefix + ".")
        name = place if inside else f"{prefix}/{place}"
    return name if decays else f"{name}/no_decay"


def parameter_groups(module: nn.Module, lr: float, weight_decay: float,
                     options: ParameterGroupOptions, base_name: str = "base") -> list[dict]:
    """Split a module's parameters into optimizer groups (the module docstring has the rules).

    Args:
        module: the model (or the objective).
        lr, weight_decay: the base values.
        options: ``paramwise``, ``no_decay`` and ``layer_decay``.
        base_name: the name of the group of parameters no paramwise prefix matches.

    Returns:
        Optimizer parameter groups in the order their first parameters come, each with
        a ``name`` (:func:`group_name`), ``params``, ``lr`` and ``weight_decay``; the
        parameters that are frozen now (``requires_grad`` false) are in none.

    Raises:
        ValueError: a paramwise prefix or layer-decay tower names no module; a tower
            without one sequence of transformer blocks.
    """
    paramwise = options.paramwise or {}
    towers = options.layer_decay.modules if options.layer_decay else []
    known = module_names(module)
    for path, where in [*((p, "paramwise") for p in paramwise),
                        *((t, "layer_decay.modules") for t in towers)]:
        if path not in known:
            top = sorted({m.split(".")[0] for m in known})
            raise ValueError(f"optimizer.{where}: the model has no module {path!r}; "
                             f"top-level modules: {', '.join(top)}")
    owned = [(name, param, owner) for name, param, owner in owned_parameters(module)
             if param.requires_grad]
    layer_of: dict[str, tuple[str, int]] = {}
    scale_of: dict[tuple[str, int], float] = {}
    for tower in towers:
        layers, blocks = transformer_layers(module.get_submodule(tower), tower)
        for name, layer in layers.items():
            layer_of[f"{tower}.{name}"] = (tower, layer)
            scale_of[tower, layer] = options.layer_decay.rate ** (blocks + 1 - layer)
    rules = [NO_DECAY_RULES[kind] for kind in options.no_decay]
    groups: dict[tuple, dict] = {}
    for name, param, owner in owned:
        matches = [p for p in paramwise if name == p or name.startswith(p + ".")]
        prefix = max(matches, key=len) if matches else base_name
        layer = layer_of.get(name)
        leaf = name.rsplit(".", 1)[-1]
        decays = not any(rule(leaf, param, owner) for rule in rules)
        key = (prefix, layer, decays)
        if key not in groups:
            mults = paramwise.get(prefix, {})
            groups[key] = {
                "name": group_name(prefix, base_name, layer, decays), "params": [],
                "lr": lr * mults.get("lr_mult", 1.0) * (scale_of[layer] if layer else 1.0),
                "weight_decay": (weight_decay * mults.get("weight_decay_mult", 1.0)
                                 if decays else 0.0)}
        groups[key]["params"].append(param)
    return list(groups.values())


def build_optimizer(cfg: dict, model: nn.Module, objective: nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer over the model's and the objective's parameters.

    The objective's parameters (InfoNCE's temperature) form their own groups
    (``objective``, ``objective/no_decay``) at the base rate.
    """
    cfg = dict(cfg)
    options = ParameterGroupOptions.from_dict(
        {key: cfg.pop(key) for key in ParameterGroupOptions.keys() if key in cfg}, "optimizer")
    defaults = inspect.signature(OPTIMIZERS.get(cfg.get("type", "AdamW"))).parameters
    lr = cfg.get("lr", defaults["lr"].default)
    weight_decay = cfg.get("weight_decay", defaults["weight_decay"].default)
    groups = parameter_groups(model, lr, weight_decay, options)
    groups += parameter_groups(objective, lr, weight_decay,
                               ParameterGroupOptions(no_decay=options.no_decay),
                               base_name="objective")
    return OPTIMIZERS.build(cfg, params=groups)
