"""LoRA adapters on a CLIP model's own weights, through peft (``model.peft``).

LoRA (Hu et al., ICLR 2022, eq. 3): ``h = W x + (alpha / r) B A x``, ``W`` frozen, ``B``
zero at the start. :meth:`LoRA.apply` puts the adapters into the library's model in place
(peft's ``inject_adapter_in_model``); :func:`merge_adapters` folds them back for an export,
:func:`save_adapters` writes peft's adapter folder. Which weights can be adapted:
docs/models.md, "LoRA".
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from torch import nn

from mmgoal.config import BuiltBy, PositiveInt, first_line
from mmgoal.extras import require_extra
from mmgoal.files import read_text
from mmgoal.paths import resolve_path
from mmgoal.registry import ADAPTERS

logger = logging.getLogger(__name__)

# The type hint of a model's ``peft`` argument: a config section ADAPTERS builds, checked
# with the rest of the config (keys, their types) before the model is built.
PeftSection = Annotated[dict, BuiltBy(ADAPTERS)] | None
SHOWN_NAMES = 8  # names an error lists before "..."
# peft's adapter folder (PeftModel.save_pretrained): its config, and its weights as
# safetensors (peft's default) or, written by an older peft, a torch file
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_TORCH_WEIGHTS = "adapter_model.bin"
# the adapter name inject_adapter_in_model gives, which checkpoints hold (lora_A.default)
ADAPTER_NAME = "default"
# the prefix of every key of an adapter file: PeftModel's own (base_model.model.<path>)
PEFT_PREFIX = "base_model.model."
# adapter_config.json keys whose settings change what an adapter computes and mmgoal's LoRA
# does not reproduce (DoRA, rsLoRA's scale, per-layer ranks, biases, whole trained
# modules...): a folder that sets one is refused rather than loaded as another model
UNSUPPORTED_SETTINGS = ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "bias",
                        "lora_bias", "fan_in_fan_out", "modules_to_save", "layers_to_transform",
                        "layers_pattern", "exclude_modules", "trainable_token_indices",
                        "layer_replication", "use_qalora", "alora_invocation_tokens",
                        "megatron_config", "velora_config", "kasa_config",
                        "monteclora_config", "arrow_config", "use_bdlora")
# the defaults of r, alpha and dropout where neither the section nor a folder says them
DEFAULT_R, DEFAULT_ALPHA = 8, 16.0


@dataclass(frozen=True)
class AdapterCount:
    """How many layers (``target_modules``) and weights (``target_parameters``) of a model
    carry LoRA adapters: what a run's log says as it starts and an export as it merges."""

    layers: int = 0
    weights: int = 0

    def __bool__(self) -> bool:
        return bool(self.layers or self.weights)

    def __str__(self) -> str:
        return f"{self.layers} layer(s) and {self.weights} weight(s)"


def adapter_count(model: nn.Module) -> AdapterCount:
    """The layers and weights of ``model`` that carry adapters: peft's tuner layers, a
    ``ParamWrapper`` counted as the one weight it adapts (nested ones each)."""
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuned = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    weights = sum(isinstance(module, ParamWrapper) for module in tuned)
    return AdapterCount(layers=len(tuned) - weights, weights=weights)


@dataclass(frozen=True)
class AdapterFolder:
    """A peft LoRA adapter folder (``PeftModel.save_pretrained``, ``mmgoal export --format
    peft``): its ``adapter_config.json`` read and checked, and its weights file."""

    path: Path
    config: dict
    weights_file: Path

    @classmethod
    def read(cls, folder: str, what: str) -> AdapterFolder:
        """The folder ``folder`` (``pkg://`` too); ``what`` names it in messages.

        Raises:
            FileNotFoundError: no such folder, or no config or weights in it.
            ValueError: a config that is not LoRA's, or sets what mmgoal does not reproduce.
        """
        path = Path(resolve_path(folder)).expanduser()
        config_file = path / ADAPTER_CONFIG
        if not config_file.is_file():
            found = "does not exist" if not path.exists() else f"holds no {ADAPTER_CONFIG}"
            raise FileNotFoundError(f"{what} {folder}: {path} {found}; give a peft adapter "
                                    f"folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}), as "
                                    f"mmgoal export RUN --format peft or peft's "
                                    f"PeftModel.save_pretrained writes it")
        try:
            config = json.loads(read_text(config_file, "peft adapter config"))
        except ValueError as error:
            raise ValueError(f"{what}: {config_file} is not JSON ({first_line(error)})") from None
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            kind = config.get("peft_type") if isinstance(config, dict) else None
            raise ValueError(f"{what}: {config_file} describes {kind or 'no'} adapters "
                             f"(peft_type), not LoRA's (LORA), which model.peft trains")
        unsupported = [f"{key}: {json.dumps(config[key])}" for key in UNSUPPORTED_SETTINGS
                       if config.get(key) not in (None, False, "none", {}, [])]
        if isinstance(config.get("target_modules"), str):
            unsupported.append(f"target_modules: {json.dumps(config['target_modules'])} (a "
                               f"pattern; mmgoal names targets by a list of names)")
        if unsupported:
            raise ValueError(f"{what}: {config_file} sets {', '.join(unsupported)}, which "
                             f"model.peft's LoRA does not reproduce (the update is (lora_alpha "
                             f"/ r) B A on the targets alone); start from adapters trained "
                             f"without them, or from the base model")
        for weights_file in (path / ADAPTER_WEIGHTS, path / ADAPTER_TORCH_WEIGHTS):
            if weights_file.is_file():
                return cls(path, config, weights_file)
        raise FileNotFoundError(f"{what}: {path} holds {ADAPTER_CONFIG} but no adapter "
                                f"weights ({ADAPTER_WEIGHTS}, or an older peft's "
                                f"{ADAPTER_TORCH_WEIGHTS})")

    def weights(self) -> dict[str, torch.Tensor]:
        """The adapter tensors, read weights-only (safetensors, or ``weights_only`` torch)."""
        if self.weights_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(self.weights_file), device="cpu")
        return torch.load(self.weights_file, map_location="cpu", weights_only=True)


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
    """LoRA's hyperparameters and targets (``model.peft: {type: lora, ...}``), or the peft
    adapter folder to start from (``pretrained``, whose ``adapter_config.json`` gives them);
    docs/models.md, "LoRA", says what each key does and each family's defaults."""

    def __init__(self, r: PositiveInt | None = None, alpha: float | None = None,
                 dropout: float | None = None, target_modules: list[str] | None = None,
                 target_parameters: list[str] | None = None,
                 trainable: list[str] | None = None, pretrained: str | None = None) -> None:
        check_scale(alpha, dropout, "model.peft.alpha", "model.peft.dropout")
        self.r, self.alpha, self.dropout = r, alpha, dropout
        self.target_modules, self.target_parameters = target_modules, target_parameters
        self.trainable, self.pretrained = trainable, pretrained

    def apply(self, model: nn.Module, defaults: LoRATargets, where: str) -> None:
        """Put the adapters into ``model`` in place (from ``pretrained`` where named) and freeze
        every other parameter but the ``trainable`` ones; ``where`` names the model in
        messages. Needs peft (the ``lora`` extra)."""
        require_extra("peft", "model.peft")
        from peft import LoraConfig, inject_adapter_in_model

        modules, parameters = self._all_targets(model, self.target_modules,
                                                self.target_parameters, defaults, where)
        r, alpha, dropout = (self.r or DEFAULT_R, DEFAULT_ALPHA if self.alpha is None else
                             self.alpha, self.dropout or 0.0)
        folder = None
        if self.pretrained is not None:
            folder = AdapterFolder.read(self.pretrained, f"model.peft.pretrained of {where}")
            r, alpha, dropout, modules, parameters = self._folder_settings(
                folder, model, (modules, parameters), defaults, where)
        if parameters and dropout:
            raise ValueError(f"model.peft of {where}: dropout {dropout} with "
                             f"target_parameters ({short_names(parameters)}): peft applies no "
                             f"dropout to an adapted parameter; set dropout: 0, or adapt "
                             f"layers only (target_parameters: [])")
        inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                           target_modules=modules,
                                           target_parameters=parameters or None), model)
        if folder is not None:
            load_adapters(model, folder, where)
        kept = self._keep_trainable(model, defaults, where)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("model.peft of %s: LoRA r %d, alpha %g on %s (%s)%s; trained: the "
                    "adapters%s, %d parameters", where, r, alpha, adapter_count(model),
                    short_names([*modules, *parameters]),
                    "" if folder is None else f", started from {folder.path}",
                    f" and {', '.join(kept)}" if kept else "", trainable)

    def _all_targets(self, model: nn.Module, target_modules: list[str] | None,
                     target_parameters: list[str] | None, defaults: LoRATargets,
                     where: str) -> tuple[list[str], list[str]]:
        """The full names of the layers and weights to adapt: those the two lists name, or
        the family's ``defaults`` where both are None."""
        given = target_modules is not None or target_parameters is not None
        modules = self._targets(model, "target_modules", dict(model.named_modules()),
                                (target_modules or []) if given else defaults.target_modules,
                                where)
        parameters = self._targets(model, "target_parameters", dict(model.named_parameters()),
                                   (target_parameters or []) if given else
                                   defaults.target_parameters, where)
        if not modules and not parameters:
            raise ValueError(f"model.peft of {where}: target_modules and target_parameters are "
                             f"both empty, so LoRA would adapt nothing; name the layers or "
                             f"weights to adapt, or leave both out for the model's default")
        return modules, parameters

    def _folder_settings(self, folder: AdapterFolder, model: nn.Module,
                         targets: tuple[list[str], list[str]], defaults: LoRATargets,
                         where: str) -> tuple[int, float, float, list[str], list[str]]:
        """r, alpha, dropout and the targets of ``folder``'s ``adapter_config.json``; what the
        section sets beside ``pretrained`` must match it (its adapters have those shapes),
        but for dropout, a training choice the section may change."""
        config, what = folder.config, f"model.peft.pretrained of {where}: " \
                                      f"{folder.path / ADAPTER_CONFIG}"
        r, alpha = config.get("r"), config.get("lora_alpha")
        dropout = config.get("lora_dropout") or 0.0
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"{what} gives r {r!r}: the adapters' rank is a whole number, at "
                             f"least 1")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise ValueError(f"{what} gives lora_alpha {alpha!r}: a number is needed")
        check_scale(alpha, dropout, f"{what} lora_alpha", f"{what} lora_dropout")
        lists = [config.get(key) or [] for key in ("target_modules", "target_parameters")]
        if not all(isinstance(entries, list) and all(isinstance(e, str) for e in entries)
                   for entries in lists):
            raise ValueError(f"{what} gives target_modules {lists[0]!r} and target_parameters "
                             f"{lists[1]!r}: lists of names are needed")
        saved = self._all_targets(model, *lists, defaults,
                                  f"{where}, as {folder.path / ADAPTER_CONFIG} names them")
        set_here = {"r": (self.r, r), "alpha": (self.alpha, alpha)}
        if self.target_modules is not None or self.target_parameters is not None:
            set_here["target_modules"] = (sorted(targets[0]), sorted(saved[0]))
            set_here["target_parameters"] = (sorted(targets[1]), sorted(saved[1]))
        differing = [key for key, (own, theirs) in set_here.items()
                     if own is not None and own != theirs]
        if differing:
            said = "; ".join(f"{key} {set_here[key][0]!r} where it has {set_here[key][1]!r}"
                             for key in differing)
            raise ValueError(f"model.peft of {where} sets {said}, beside pretrained "
                             f"{self.pretrained}, whose adapters ({folder.path / ADAPTER_CONFIG}) "
                             f"have their own; leave {', '.join(differing)} out "
                             f"(--cfg-options model.peft.{differing[0]}=null) to take the "
                             f"folder's")
        return r, alpha, dropout if self.dropout is None else self.dropout, *saved

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


def check_scale(alpha: float | None, dropout: float | None, alpha_name: str,
                dropout_name: str) -> None:
    """A ``ValueError`` for an ``alpha`` at or below 0 or a ``dropout`` outside [0, 1)
    (None: not given), named ``alpha_name`` and ``dropout_name`` in it."""
    if alpha is not None and alpha <= 0:
        raise ValueError(f"{alpha_name} must be above 0 (the update is scaled by alpha / r), "
                         f"got {alpha!r}")
    if dropout is not None and not 0 <= dropout < 1:
        raise ValueError(f"{dropout_name} must lie in [0, 1), got {dropout!r}")


def load_adapters(model: nn.Module, folder: AdapterFolder, where: str) -> None:
    """Set the adapters just put into ``model`` to those of ``folder``, as peft's
    ``PeftModel.from_pretrained`` sets them (``set_peft_model_state_dict``): every adapter
    tensor of the model from the file, and every tensor of the file in the model."""
    from peft import set_peft_model_state_dict

    weights = folder.weights()
    what = f"model.peft.pretrained of {where}: {folder.weights_file}"
    try:
        loaded = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    except RuntimeError as error:  # torch's "size mismatch for ...lora_A.default.weight: ..."
        mismatches = [line.strip().rstrip(".") for line in str(error).splitlines()
                      if "size mismatch" in line]
        raise ValueError(f"{what} holds adapters of other shapes than this model's "
                         f"({'; '.join(mismatches[:2]) or first_line(error)}"
                         f"{', ...' if len(mismatches) > 2 else ''}); they were trained on "
                         f"another base model: start from the one they were trained on"
                         ) from None
    own = {name for name, _ in model.named_parameters() if ".lora_" in name}
    missing = sorted(name for name in loaded.missing_keys if name in own)
    if missing or loaded.unexpected_keys:
        unexpected = sorted(loaded.unexpected_keys)
        said = [f"{len(missing)} adapter tensors of the model are not in it "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                if missing else "",
                f"{len(unexpected)} of its tensors have no place in the model "
                f"({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''})"
                if unexpected else ""]
        raise ValueError(f"{what} does not hold this model's adapters: "
                         f"{'; '.join(filter(None, said))}; its keys are "
                         f"{PEFT_PREFIX}<the library model's path>.lora_A.weight and "
                         f"lora_B.weight: give adapters trained on this model")


def adapted_model(model: nn.Module) -> nn.Module:
    """The module of ``model`` holding peft's ``peft_config``, whose parameter names are the
    keys of peft's folder; a ``ValueError`` where ``model`` carries no adapters."""
    found = next((module for module in model.modules() if hasattr(module, "peft_config")),
                 None)
    if found is None:
        raise ValueError(f"the {type(model).__name__} model carries no LoRA adapters "
                         f"(model.peft)")
    return found


def save_adapters(model: nn.Module, folder: Path, base_model: str | None) -> list[str]:
    """Write the adapters of ``model`` as ``PeftModel.save_pretrained`` does
    (``adapter_config.json``, ``base_model_name_or_path``: ``base_model``, and
    ``adapter_model.safetensors``), for ``PeftModel.from_pretrained``. Returns the files."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = copy.deepcopy(model.peft_config[ADAPTER_NAME])
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    weights = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"{PEFT_PREFIX}{name}": value.detach().float().contiguous()
               for name, value in weights.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    # what PeftModel.save_pretrained records of a model no task type describes
    config.save_pretrained(str(folder), auto_mapping_dict={
        "base_model_class": type(model).__name__, "parent_library": type(model).__module__})
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def has_adapters(config: dict | None) -> bool:
    """Whether a run's config trains adapters (``model.peft``), which an export or a
    WiSE-FT mix merges first."""
    return bool(((config or {}).get("model") or {}).get("peft"))


def merge_adapters(model: nn.Module) -> AdapterCount:
    """Fold every LoRA adapter of ``model`` into its weight and put the plain layer back
    (peft's ``merge_and_unload``, ``safe_merge``): the model without ``peft``, same names.
    Returns what it merged (:func:`adapter_count`)."""
    require_extra("peft", "merging model.peft's adapters")
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = adapter_count(model)
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
    return merged
