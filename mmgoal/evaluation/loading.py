"""A trained model ready to evaluate: weights, vocabulary, eval transforms and config.

Every tool that evaluates a checkpoint (tools/evaluate.py, plot_attention.py,
score_stats.py) builds it here, so the model, its preprocessing and the
defaults they fall back on are the trainer's own (:mod:`mmgoal.engine.schema`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmgoal.data.transforms import build_transforms
from mmgoal.devices import resolve_device
from mmgoal.engine.checkpoint import load_checkpoint, model_from_checkpoint
from mmgoal.engine.schema import load_run_config, with_overrides
from mmgoal.evaluation.gallery import Member


@dataclass
class LoadedModel(Member):
    """A model in eval mode on its device with its eval transform and tokenizer.

    Attributes:
        config: the resolved run config it was built from.
        checkpoint: the file its weights came from.
        epoch: the epoch the checkpoint was written after (``None`` when it does not say).
    """

    config: dict
    checkpoint: Path
    epoch: int | None = None


def load_for_evaluation(checkpoint: str | os.PathLike, config: str | os.PathLike | None = None,
                        overrides: Iterable[str] = (), device: str | torch.device = "auto"
                        ) -> LoadedModel:
    """Build the model of a checkpoint for evaluation.

    Args:
        checkpoint: ``best.pt``, ``last.pt`` or another mmgoal checkpoint.
        config: the YAML config to build with (default: the config saved in the
            checkpoint).
        overrides: ``--cfg-options`` on top of that config.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        FileNotFoundError: a missing checkpoint or config.
        ValueError: an unreadable checkpoint, a checkpoint without a config when
            none is given, a bad config or override, a device this machine lacks,
            weights holding NaN/inf or of another model than the config builds.
    """
    target = resolve_device(device, name="device")
    state = load_checkpoint(checkpoint)
    if config is not None:
        cfg = load_run_config(config, overrides)
    elif state.get("config"):
        cfg = with_overrides(state["config"], overrides)
    else:
        raise ValueError(f"{checkpoint} holds no config to build its model from; give the "
                         f"config it was trained with")
    model, tokenizer = model_from_checkpoint(cfg, state, f"checkpoint {checkpoint}")
    data = cfg["data"]
    transform = build_transforms(data["eval_transforms"], data["image_size"])
    return LoadedModel(model.to(target), transform, tokenizer, config=cfg,
                       checkpoint=Path(checkpoint), epoch=state.get("epoch"))

