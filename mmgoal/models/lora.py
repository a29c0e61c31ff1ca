"""LoRA adapters on a CLIP model's own weights, through peft (``model.peft``).

LoRA (Hu et al., ICLR 2022, eq. 3): ``h = W x + (alpha / r) B A x``, ``W`` frozen, ``B``
zero at the start. :meth:`LoRA.apply` puts the adapters into the library's model in place
(peft's ``inject_adapter_in_model``: names stay, checkpoints hold ``base_layer`` and the
adapters); :func:`merge_adapters` folds them back for an export. Which weights can be
adapted, and why a ``nn.MultiheadAttention``'s ``out_proj`` cannot: docs/models.md, "LoRA".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from torch import nn

from mmgoal.config import BuiltBy, PositiveInt
from mmgoal.extras import require_extra
from mmgoal.registry import ADAPTERS

logger = logging.getLogger(__name__)

# The type hint of a model's ``peft`` argument: a config section ADAPTERS builds, checked
# with the rest of the config (keys, their types) before the model is built.
PeftSection = Annotated[dict, BuiltBy(ADAPTERS)] | None
SHOWN_NAMES = 8  # names an error lists before "..."


@dataclass(frozen=True)
class LoRATargets:
    """What a model family adapts when ``model.peft`` names neither ``target_modules`` nor
    ``target_parameters`` (name suffixes, as peft matches them), and what it keeps
    ``trainable`` (those the model has) when it names none."""

    target_modules: tuple[str, ...] = ()
    target_parameters: tuple[str, ...] = ()
    trainable: tuple[str, ...] = ()


def suffix_matches(names: Iterable[str], entry: str) -> list[str]:
    """The ``names`` that are ``entry`` or end in ``.entry`` (peft's ``target_modules`` rule:
    ``q_proj`` is every ``...self_attn.q_proj``)."""
    return [name for name in names if name == entry or name.endswith(f".{entry}")]


def short_names(names: Iterable[str]) -> str:
    """The last two parts of each name, once each (``mlp.c_fc, attn.in_proj_weight``)."""
    shown = sorted({".".join(name.split(".")[-2:]) for name in names})
    return ", ".join(shown[:SHOWN_NAMES]) + (", ..." if len(shown) > SHOWN_NAMES else "")


def multihead_parts(model: nn.Module) -> dict[str, str]:
    """Name -> what it is, for every ``nn.MultiheadAttention`` of ``model`` and its
    ``out_proj``: the layers whose LoRA would drift or be ignored (docs/models.md, "LoRA")."""
    parts = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            parts[name] = "a torch nn.MultiheadAttention"
            parts[f"{name}.out_proj"] = "the out_proj of a torch nn.MultiheadAttention"
    return parts


@ADAPTERS.register("lora")
class LoRA:
    """LoRA's hyperparameters and targets (``model.peft: {type: lora, ...}``); docs/models.md,
    "LoRA", says what each key does and each family's defaults."""

    def __init__(self, r: PositiveInt = 8, alpha: float = 16.0, dropout: float = 0.0,
                 target_modules: list[str] | None = None,
                 target_parameters: list[str] | None = None,
                 trainable: list[str] | None = None) -> None:
        if alpha <= 0:
            raise ValueError(f"model.peft.alpha must be above 0 (the update is scaled by "
                             f"alpha / r), got {alpha!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"model.peft.dropout must lie in [0, 1), got {dropout!r}")
        self.r, self.alpha, self.dropout = r, alpha, dropout
        self.target_modules, self.target_parameters = target_modules, target_parameters
        self.trainable = trainable

    def apply(self, model: nn.Module, defaults: LoRATargets, where: str) -> None:
        """Put the adapters into ``model`` (the library's model) in place and freeze every
        other parameter but the ``trainable`` ones; ``where`` names the model in messages
        (``OpenCLIP ViT-B-32``). Needs peft (the ``lora`` extra)."""
        require_extra("peft", "model.peft")
        from peft import LoraConfig, inject_adapter_in_model

        given = self.target_modules is not None or self.target_parameters is not None
        modules = self._targets(model, "target_modules", dict(model.named_modules()),
                                (self.target_modules or []) if given else
                                defaults.target_modules, where)
        parameters = self._targets(model, "target_parameters", dict(model.named_parameters()),
                                   (self.target_parameters or []) if given else
                                   defaults.target_parameters, where)
        if not modules and not parameters:
            raise ValueError(f"model.peft of {where}: target_modules and target_parameters are "
                             f"both empty, so LoRA would adapt nothing; name the layers or "
                             f"weights to adapt, or leave both out for the model's default")
        if parameters and self.dropout:
            raise ValueError(f"model.peft of {where}: dropout {self.dropout} with "
                             f"target_parameters ({short_names(parameters)}): peft applies no "
                             f"dropout to an adapted parameter; set dropout: 0, or adapt "
                             f"layers only (target_parameters: [])")
        inject_adapter_in_model(LoraConfig(r=self.r, lora_alpha=self.alpha,
                                           lora_dropout=self.dropout, target_modules=modules,
                                           target_parameters=parameters or None), model)
        kept = self._keep_trainable(model, defaults, where)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("model.peft of %s: LoRA r %d, alpha %g on %d layer(s) and %d weight(s) "
                    "(%s); trained: the adapters%s, %d parameters", where, self.r, self.alpha,
                    len(modules), len(parameters), short_names([*modules, *parameters]),
                    f" and {', '.join(kept)}" if kept else "", trainable)

    def _targets(self, model: nn.Module, key: str, named: dict, entries: Iterable[str],
                 where: str) -> list[str]:
        """The full names of what ``entries`` of ``target_modules`` / ``target_parameters``
        name in ``named`` (``model``'s modules or parameters), each entry naming some."""
        refused = multihead_parts(model) if key == "target_modules" else {}
        found: list[str] = []
        for entry in entries:
            matches = suffix_matches(named, entry)
            if not matches:
                kinds = ((nn.Linear, nn.Conv2d, nn.Embedding) if key == "target_modules"
                         else ())
                candidates = [name for name, value in named.items()
                              if (isinstance(value, kinds) if kinds else value.ndim == 2)]
                raise ValueError(f"model.peft.{key} of {where}: {entry!r} names nothing in the "
                                 f"model; its {'layers' if kinds else '2-D weights'} end in "
                                 f"{short_names(candidates)}")
            bad = [name for name in matches if name in refused]
            if bad:
                raise ValueError(
                    f"model.peft.{key} of {where}: {entry!r} names {refused[bad[0]]} "
                    f"({bad[0]}), which LoRA through peft cannot adapt (docs/models.md, "
                    f"'LoRA'): adapt its queries, keys and values with target_parameters: "
                    f"[attn.in_proj_weight], and name the layers you mean by a longer suffix "
                    f"where others share their name (self_attn.out_proj)")
            found += [name for name in matches if name not in found]
        return found

    def _keep_trainable(self, model: nn.Module, defaults: LoRATargets, where: str) -> list[str]:
        """Make the ``trainable`` parameters (default: the family's that ``model`` has)
        trainable again after peft froze them; the entries kept."""
        named = dict(model.named_parameters())
        entries = (self.trainable if self.trainable is not None else
                   [entry for entry in defaults.trainable if entry in named])
        for entry in entries:
            matches = [name for name in named if name == entry or name.startswith(f"{entry}.")]
            if not matches:
                raise ValueError(f"model.peft.trainable of {where}: the model has no parameter "
                                 f"or module {entry!r} (its top-level parameters and modules: "
                                 f"{', '.join(sorted({n.split('.')[0] for n in named}))})")
            for name in matches:
                named[name].requires_grad_(True)
        return list(entries)


def has_adapters(config: dict | None) -> bool:
    """Whether a run's config trains adapters (``model.peft``), which an export or a
    WiSE-FT mix merges first."""
    return bool(((config or {}).get("model") or {}).get("peft"))


def merge_adapters(model: nn.Module) -> int:
    """Fold every LoRA adapter of ``model`` into the weight it adapts and put the plain layer
    back (peft's ``merge_and_unload``, for a model adapted in place, ``safe_merge``): the
    model built without ``peft``, same names. Returns how many adapted layers it merged."""
    require_extra("peft", "merging model.peft's adapters")
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [name for name, module in model.named_modules()
               if isinstance(module, BaseTunerLayer)]
    # the outermost wrapper of nested ones (two ParamWrappers on one module) merges them all
    outermost = [name for name in adapted
                 if not any(name.startswith(f"{other}.") for other in adapted)]
    for name in outermost:
        layer = model.get_submodule(name)
        if hasattr(layer, "unload_and_optionally_merge_module"):  # ParamWrapper
            plain = layer.unload_and_optionally_merge_module(merge=True, safe_merge=True,
                                                             adapter_names=None)
        else:
            layer.merge(safe_merge=True)
            plain = layer.get_base_layer()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, plain)
    if hasattr(model, "peft_config"):  # inject_adapter_in_model's record of the adapters
        del model.peft_config
    return len(outermost)
