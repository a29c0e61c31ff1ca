"""The one place that decides a run's preprocessing, from the config and the model's own.

A model class may say how its inputs are prepared with a classmethod
``preprocessing(cfg, image_size) -> Preprocessing`` (:class:`mmgoal.structures.Preprocessing`,
plain data): given its config section and ``data.image_size`` (``None``: not set),
its train and eval transforms (lists of ``TRANSFORMS`` configs) and its tokenizer
(a ``TOKENIZERS`` config), each ``None`` where it has none of its own. An open_clip
model brings open_clip's transforms and tokenizer; a dual encoder with a pretrained
timm tower brings timm's statistics. The models say it in data; this module, above
both the models and the data pipeline, reads it (neither imports the other).

:func:`resolve_preprocessing` decides what a run (the trainer), an evaluation and
the Python API use: a value the config gives always wins; ``data.tokenizer``,
``data.train_transforms`` and ``data.eval_transforms`` left null are the model's
own; transforms that neither gives are the ImageNet default at ``data.image_size``
(:func:`~mmgoal.data.transforms.default_transforms`).

The model's preprocessing is resolved when a run is built, not written into the
config: null keeps its meaning, "the model's own", in ``config.yaml`` and in a
checkpoint. A config resolved once and changed after (``--cfg-options`` naming
another model, a checkpoint's config evaluated with another model section) would
otherwise carry the transforms of the model it no longer builds. What the model
gave is logged.
"""

from __future__ import annotations

import logging

from mmgoal.data.transforms import default_transforms
from mmgoal.registry import MODELS
from mmgoal.structures import Preprocessing

logger = logging.getLogger(__name__)


def model_preprocessing(model_cfg: dict, image_size: int | None) -> Preprocessing:
    """The preprocessing the model of ``model_cfg`` brings (empty when its class has none)."""
    own = getattr(MODELS.get(model_cfg["type"]), "preprocessing", None)
    return Preprocessing() if own is None else own(model_cfg, image_size)


def resolve_preprocessing(cfg: dict) -> Preprocessing:
    """The preprocessing of a resolved run or model config (see the module docstring).

    Returns:
        A ``Preprocessing`` with every field set.

    Raises:
        ValueError: the config has no ``data.tokenizer`` and the model none of its own.
    """
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
