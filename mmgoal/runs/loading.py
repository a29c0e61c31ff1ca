"""A trained model ready to evaluate: weights, vocabulary, eval transforms and config, built
here for every command and the Python API, so its preprocessing is the trainer's own.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from mmgoal.config import config_changes, describe_changes, first_line, override_key
from mmgoal.data.remote import check_trusted_locations, split_folder
from mmgoal.data.transforms import build_transforms
from mmgoal.devices import module_device, resolve_device
from mmgoal.registry import MODELS, TOKENIZERS, UnknownNameError
from mmgoal.runs.checkpoint import (
    SHOWN_NAMES,
    check_finite_weights,
    config_differences,
    load_checkpoint,
    shape_mismatches,
    summarise_keys,
)
from mmgoal.runs.preprocessing import resolve_preprocessing
from mmgoal.runs.run_dir import EXPORT_FOLDERS, export_folder_format, weights_file
from mmgoal.runs.schema import ModelConfig, load_model_config, with_overrides
from mmgoal.structures import Member, Preprocessing

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel(Member):
    """A model in eval mode on its device with its eval transform and tokenizer.

    Attributes:
        checkpoint: the file its weights came from (``None``: built from a config alone).
        config_source: where ``config`` came from (``the config stored in best.pt``).
        given_keys: the dotted keys the caller's ``--cfg-options`` set.
    """

    config: dict
    checkpoint: Path | None
    epoch: int | None = None
    config_source: str = "the config"
    given_keys: tuple[str, ...] = ()

    def split(self, name: str, shards: str | list[str] | None = None,
              trust_data_paths: bool = False) -> dict:
        """The ``data.<name>`` section to evaluate on, with the caller's ``shards`` in place
        of the config's; the config's ``pipe:`` commands and URLs are refused unless the
        caller set them or ``trust_data_paths`` (docs/received_files.md)."""
        section = dict(self.config["data"].get(name) or {})
        if shards is not None:  # a folder: its <name>-*.tar
            return {"folds": 1, "caption_key": None, **section,
                    "shards": split_folder(shards, name)}
        if not section:
            raise ValueError(f"{self.config_source} has no data.{name} section to evaluate "
                             f"on; give the shards with --shards PATTERN")
        key = f"data.{name}.shards"
        given = any(key == k or key.startswith(f"{k}.") for k in self.given_keys)
        if not (given or trust_data_paths):
            check_trusted_locations(section["shards"], key, self.config_source)
        return section


def load_for_evaluation(checkpoint: str | os.PathLike, config: str | os.PathLike | None = None,
                        overrides: Iterable[str] = (), device: str | torch.device = "auto",
                        *, trust_custom_imports: bool = False) -> LoadedModel:
    """Build the model of a checkpoint for evaluation.

    Args:
        checkpoint: an mmgoal checkpoint, an export (file or folder), or a run directory
            (its best checkpoint, else its latest).
        config: the config to build with (default: the checkpoint's): a training config,
            or only the model's sections (:class:`~mmgoal.runs.schema.ModelConfig`).
        trust_custom_imports: import that config's ``custom_imports`` (a checkpoint's may
            come from anyone); without, they are left out with a warning.
    """
    target = resolve_device(device, name="device")
    fmt = export_folder_format(checkpoint) if config is None else None
    if fmt is not None:  # mmgoal export --format open_clip / hf: the library's own folder
        return _from_export_folder(Path(checkpoint), fmt, overrides, target,
                                   trust_custom_imports)
    checkpoint = weights_file(checkpoint)
    state = load_checkpoint(checkpoint)
    if config is not None:
        cfg = load_model_config(config, overrides, trust_custom_imports=trust_custom_imports)
        if cfg["data"]["tokenizer"] is None and state.get("config"):
            # a model-only config: the vocabulary, and so its tokenizer, is the checkpoint's
            cfg["data"]["tokenizer"] = state["config"]["data"]["tokenizer"]
    elif state.get("config"):
        cfg = with_overrides(state["config"], overrides, trust_custom_imports=trust_custom_imports,
                             source=f"the config stored in {checkpoint}", checked=ModelConfig)
    else:
        raise ValueError(f"{checkpoint} holds no config to build its model from; give the "
                         f"config it was trained with")
    warn_preprocessing_changes(state.get("config"), cfg, checkpoint)
    preprocessing = resolve_preprocessing(cfg)
    model, tokenizer = model_from_checkpoint(cfg, state, f"checkpoint {checkpoint}",
                                             preprocessing)
    return _loaded(cfg, preprocessing, model, tokenizer, target, checkpoint, state.get("epoch"),
                   _origin(config, overrides, checkpoint))


def check_same_model(model: torch.nn.Module, state: dict[str, Any], model_cfg: dict,
                     source: str) -> None:
    """Refuse checkpoint weights that do not fit ``model`` (built from ``model_cfg``)
    exactly, saying where the checkpoint's model config differs, then which tensors."""
    own, weights = model.state_dict(), state["model"]
    mismatched = shape_mismatches(own, weights)
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    if not (mismatched or missing or unexpected):
        check_same_dtypes(own, weights, source)
        return
    saved_cfg = (state.get("config") or {}).get("model")
    details = []
    if saved_cfg and saved_cfg.get("type") != model_cfg.get("type"):
        details.append(f"it holds a {saved_cfg.get('type')} model, this config builds a "
                       f"{model_cfg.get('type')}")
    elif saved_cfg:
        details += config_differences(saved_cfg, model_cfg, "model")[:SHOWN_NAMES]
    if mismatched:
        details.append(f"shapes differ: {'; '.join(mismatched[:SHOWN_NAMES])}")
    if missing:
        details.append(f"{len(missing)} tensors of this model are not in it: "
                       f"{summarise_keys(missing)}")
    if unexpected:
        details.append(f"{len(unexpected)} of its tensors have no place in this model: "
                       f"{summarise_keys(unexpected)}")
    raise ValueError(f"{source} does not fit the model this config builds ({'; '.join(details)});"
                     f" give the config it was trained with (its run's config.yaml)")


def check_same_dtypes(own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
                      source: str) -> None:
    """Refuse a tensor whose dtype is not its model tensor's, but for two floating dtypes
    (converted with a warning): a float32 weight relabelled int32 in a safetensors header
    would load as numbers no training made."""
    differing = [k for k in weights if k in own and weights[k].dtype != own[k].dtype]
    refused = [f"{k} is {str(weights[k].dtype).removeprefix('torch.')} where the model holds "
               f"{str(own[k].dtype).removeprefix('torch.')}" for k in differing
               if not (weights[k].is_floating_point() and own[k].is_floating_point())]
    if refused:
        more = len(refused) - SHOWN_NAMES
        raise ValueError(f"{source}: {'; '.join(refused[:SHOWN_NAMES])}"
                         f"{f' (and {more} more)' if more > 0 else ''}: its values would "
                         f"not be the weights it names (a header altered, "
                         f"or a file written by something else); use the run's own checkpoint "
                         f"or export it again")
    if differing:
        logger.warning("%s: %d tensors are of another floating type than the model's (%s is "
                       "%s, the model %s); they are converted", source, len(differing),
                       differing[0], weights[differing[0]].dtype, own[differing[0]].dtype)


def model_from_checkpoint(cfg: dict, state: dict[str, Any], source: str = "the checkpoint",
                          preprocessing: Preprocessing | None = None
                          ) -> tuple[torch.nn.Module, Any]:
    """The model (in eval mode) and tokenizer of the resolved ``cfg`` with the weights and
    vocabulary of ``state`` (``preprocessing``: ``cfg``'s, if resolved already); first
    built on the meta device and checked against the file's tensors, so an oversized config
    takes no memory."""
    check_finite_weights(state["model"], source)
    preprocessing = preprocessing or resolve_preprocessing(cfg)
    tokenizer = built_from_config(lambda: TOKENIZERS.build(preprocessing.tokenizer),
                                  "tokenizer", source)
    tokenizer.load_state_dict(state["tokenizer"])
    skeleton = meta_model(cfg["model"], tokenizer)
    if skeleton is not None:
        check_same_model(skeleton, state, cfg["model"], source)
    model = built_from_config(lambda: MODELS.build(cfg["model"], tokenizer=tokenizer), "model",
                              source)
    check_same_model(model, state, cfg["model"], source)
    model.load_state_dict(state["model"])
    return model.eval(), tokenizer


Built = TypeVar("Built")


def built_from_config(build: Callable[[], Built], what: str, source: str) -> Built:
    """``build()`` of the ``what`` (``model``, ``tokenizer``) of a config that may be anyone's:
    an error deep in a layer becomes a ``ValueError`` naming ``source``."""
    try:
        return build()
    except UnknownNameError:
        raise
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"{source}: the config it is loaded with cannot build the {what} "
                         f"({type(error).__name__}: {first_line(error)}); correct that value "
                         f"(--cfg-options), or give the config it was trained with") from error


def meta_model(model_cfg: dict, tokenizer: Any) -> torch.nn.Module | None:
    """The model of ``model_cfg`` on the meta device: its shapes, no memory. ``None`` where a
    component cannot be built there (``from_pretrained``, open_clip's ``create_model``
    read real files); the caller then checks the real model."""
    try:
        # a pretrained tower's weights copied onto meta tensors warn at every tensor
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return MODELS.build(model_cfg, tokenizer=tokenizer)
    except Exception as error:  # a bad config too: the real build then says why
        logger.debug("the model of %s cannot be built on the meta device (%s)",
                     model_cfg.get("type"), error)
        return None


# What turns captions and images into the model's inputs: evaluated otherwise than trained,
# a model scores other inputs (a shorter max_length cuts captions its weights saw whole).
PREPROCESSING_KEYS = ("tokenizer", "image_size", "eval_transforms")


def warn_preprocessing_changes(trained: dict | None, cfg: dict, checkpoint: Path) -> None:
    """Warn, naming each change, where ``cfg`` prepares inputs otherwise than the config the
    checkpoint was trained with (``trained``; nothing to compare where it has none)."""
    if not trained:
        return
    changes = {key: change for name in PREPROCESSING_KEYS
               for key, change in config_changes((trained.get("data") or {}).get(name),
                                                 cfg["data"].get(name), f"data.{name}").items()}
    if changes:
        logger.warning("%s is evaluated with other preprocessing than it was trained with "
                       "(%s): its scores are of other inputs than training's", checkpoint,
                       describe_changes(changes))


def build_from_config(config: str | os.PathLike | dict, overrides: Iterable[str] = (),
                      device: str | torch.device = "auto", *,
                      trust_custom_imports: bool = False) -> LoadedModel:
    """The model of a config with the weights its own sections name (pretrained towers, a
    CLIP checkpoint), no mmgoal checkpoint: a pretrained model as it is. A tokenizer fitted
    on training captions is refused (its vocabulary is only in a checkpoint)."""
    target = resolve_device(device, name="device")
    cfg = load_model_config(config, overrides, trust_custom_imports=trust_custom_imports)
    return _build_resolved(cfg, target, _origin(config, overrides))


def _from_export_folder(folder: Path, fmt: str, overrides: Iterable[str], target: torch.device,
                       trust_custom_imports: bool) -> LoadedModel:
    """The model of an ``mmgoal export --format`` folder, built by its family from the folder
    alone (weights and preprocessing: the library's own files)."""
    family = MODELS.get(EXPORT_FOLDERS[fmt][1])
    cfg = load_model_config({"model": family.export_folder_section(folder)}, overrides,
                            trust_custom_imports=trust_custom_imports)
    return _build_resolved(cfg, target, _origin(None, overrides, folder), folder)


def _build_resolved(cfg: dict, target: torch.device, origin: dict,
                    checkpoint: Path | None = None) -> LoadedModel:
    """:func:`build_from_config` of a config already resolved (its imports done); with
    ``checkpoint``, the export folder it was read from."""
    preprocessing = resolve_preprocessing(cfg)
    tokenizer_cfg = preprocessing.tokenizer
    tokenizer = TOKENIZERS.build(tokenizer_cfg)
    if not tokenizer.fitted:
        raise ValueError(f"data.tokenizer {tokenizer_cfg['type']!r} learns its "
                         f"vocabulary from the training captions, so a model built from the "
                         f"config alone has none; load a trained run's checkpoint with it "
                         f"(checkpoint=..., or mmgoal.load(RUN_DIR))")
    model = MODELS.build(cfg["model"], tokenizer=tokenizer).eval()
    return _loaded(cfg, preprocessing, model, tokenizer, target, checkpoint, None, origin)


def pretrained_weights(cfg: dict) -> str | None:
    """What the model section of a resolved config loads weights from, as its class says
    (``pretrained_weights``: a CLIP file or tag, a hub name, the towers' files); None
    where it names none, or the class does not say."""
    said = getattr(MODELS.get(cfg["model"]["type"]), "pretrained_weights", None)
    return said(cfg["model"]) if said is not None else None


def load_pretrained_start(loaded: LoadedModel) -> LoadedModel:
    """The model of ``loaded``'s config with the pretrained weights the config names, on
    its device: where a fine-tune of it started (WiSE-FT's zero-shot end)."""
    cfg = loaded.config
    if not pretrained_weights(cfg):
        raise ValueError(f"{loaded.config_source}: its {cfg['model']['type']} section names no "
                         f"pretrained weights, so the run has no pretrained start to "
                         f"interpolate with; WiSE-FT mixes a fine-tune with the weights it "
                         f"started from (model.pretrained, a hub name, a tower's weights file)")
    return _build_resolved(cfg, module_device(loaded.model),
                           {"config_source": loaded.config_source,
                            "given_keys": loaded.given_keys})


def load_zero_shot(config: str | os.PathLike, overrides: Iterable[str] = (),
                   device: str | torch.device = "auto", *,
                   trust_custom_imports: bool = False) -> tuple[LoadedModel, str]:
    """The model of a config with the pretrained weights its sections name, for zero-shot
    evaluation, and what it loaded them from (none: a ValueError, as random weights'
    metrics mean nothing)."""
    cfg = load_model_config(config, overrides, trust_custom_imports=trust_custom_imports)
    source = pretrained_weights(cfg)
    if not source:
        raise ValueError(f"{config}: its {cfg['model']['type']} section names no pretrained "
                         f"weights, so it would be evaluated with random weights, whose "
                         f"metrics mean nothing; give a checkpoint ([CONFIG] CHECKPOINT), or "
                         f"the weights the model should load (model.pretrained, a hub name, a "
                         f"tower's weights file)")
    return _build_resolved(cfg, resolve_device(device, name="device"),
                           _origin(config, overrides)), source


def _origin(config: str | os.PathLike | dict | None, overrides: Iterable[str],
            checkpoint: Path | None = None) -> dict:
    """Where a loaded model's config came from, and which of its keys the caller set:
    :class:`LoadedModel`'s ``config_source`` and ``given_keys``."""
    source = (f"the config stored in {checkpoint}" if config is None else
              "the config given" if isinstance(config, dict) else f"config {config}")
    return {"config_source": source, "given_keys": tuple(map(override_key, overrides))}


def _loaded(cfg: dict, preprocessing: Preprocessing, model: torch.nn.Module, tokenizer,
            device: torch.device, checkpoint: Path | None, epoch: int | None, origin: dict
            ) -> LoadedModel:
    transform = build_transforms(preprocessing.eval_transforms, cfg["data"]["image_size"])
    return LoadedModel(model.to(device), transform, tokenizer, config=cfg,
                       checkpoint=checkpoint, epoch=epoch, **origin)
