"""Optimizers (registered under their torch names) and their parameter groups: the
``paramwise``, ``no_decay`` and ``layer_decay`` keys of ``optimizer`` (docs/models.md,
"Training schedules" and "Parameter groups for CLIP fine-tuning"); the other keys go to
the torch optimizer.

Parameters frozen when the optimizer is built (a LoRA model's base weights) are left
out; those frozen later (``FreezeSchedule``) stay in their groups, so unfreezing needs no
new optimizer (optimizers skip parameters without a gradient).
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
    """``optimizer.layer_decay``: the factor per layer ``rate`` in (0, 1] (0.65-0.75 for
    ViT-B fine-tuning) inside each tower of ``modules`` (module paths)."""

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
    """The keys of ``optimizer`` that mmgoal reads itself; ``paramwise``: module path ->
    ``{lr_mult, weight_decay_mult}``; ``no_decay``: keys of :data:`NO_DECAY_RULES`."""

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
    # ZeRO-3 leaves a partitioned parameter empty and keeps its size as ds_numel
    sizes = [(getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for p in params]
    return {"trainable": sum(size for size, trainable in sizes if trainable),
            "total": sum(size for size, _ in sizes)}


def transformer_layers(tower: nn.Module, where: str) -> tuple[dict[str, int], int]:
    """The layer of each parameter of a tower (by its name in the tower), and its block
    count L: block N is layer N + 1 (the outer index where blocks nest), what precedes
    the blocks layer 0 and what follows them L + 1 (:func:`precedes_blocks`). ``where``
    names the tower in the ``ValueError`` for no blocks or two sequences of them."""
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
    ``sequence`` (``model.blocks``) of ``tower``: by registration order at the deepest
    module holding both; one that module holds itself by its name (:func:`is_embedding`:
    before; else a projection after, like open_clip's ``proj``)."""
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
    """A module's trainable parameters as optimizer groups (``name``, ``params``, ``lr``,
    ``weight_decay``) in the order of their first parameters: one group per combination
    of factors, named by :func:`group_name` (``base_name`` where no paramwise prefix
    matches). ``ValueError`` for a prefix or tower that names no module."""
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
    """The configured optimizer over the model's and the objective's parameters; the
    objective's (InfoNCE's temperature) form their own groups at the base rate."""
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
