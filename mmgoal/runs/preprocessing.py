"""The one place that decides a run's preprocessing, from the config and the model's own.

A model class may say, as plain data, how its inputs are prepared: a classmethod
``preprocessing(cfg, image_size) -> Preprocessing`` (docs/architecture.md). A value the
config gives always wins; ``data.tokenizer``, ``data.train_transforms`` and
``data.eval_transforms`` left null are the model's own, else the ImageNet default. It is
resolved when a run is built, never written into the config, so that a config changed
later (another model) carries no stale transforms (docs/models.md, "CLIP-family models").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mmgoal.data.transforms import default_transforms
from mmgoal.registry import MODELS
from mmgoal.structures import Preprocessing

if TYPE_CHECKING:
    from mmgoal.runs.schema import RunConfig

logger = logging.getLogger(__name__)


def model_preprocessing(model_cfg: dict, image_size: int | None) -> Preprocessing:
    """The preprocessing the model of ``model_cfg`` brings (empty when its class has none)."""
    own = getattr(MODELS.get(model_cfg["type"]), "preprocessing", None)
    return Preprocessing() if own is None else own(model_cfg, image_size)


def resolve_preprocessing(cfg: Mapping[str, Any] | RunConfig) -> Preprocessing:
    """The preprocessing of a resolved run or model config (its dict, or the typed
    ``RunConfig``), every field set (see the module docstring)."""
    data, model_cfg = cfg["data"], cfg["model"]
    own = model_preprocessing(model_cfg, data.get("image_size"))
    default = default_transforms(data.get("image_size"))
    chosen = {}
    for key in ("train_transforms", "eval_transforms", "tokenizer"):
        given, model_value = data.get(key), getattr(own, key)
        if given is None and model_value is not None:
            logger.info("data.%s: %s's own, %s", key, model_cfg["type"], model_value)
        chosen[key] = given if given is not None else model_value
    if chosen["tokenizer"] is None:
        raise ValueError(f"the config has no data.tokenizer and {model_cfg['type']} has no "
                         f"tokenizer of its own: name the tokenizer the model reads (e.g. "
                         f"{{type: HFTokenizer, path: FOLDER}} or {{type: WordTokenizer}})")
    return Preprocessing(
        train_transforms=default if chosen["train_transforms"] is None
        else chosen["train_transforms"],
        eval_transforms=default if chosen["eval_transforms"] is None
        else chosen["eval_transforms"],
        tokenizer=chosen["tokenizer"])
