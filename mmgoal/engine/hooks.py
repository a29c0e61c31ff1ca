"""Hooks: small objects the trainer calls at fixed points; users register their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mmgoal.objectives.adaptive_lam import AdaptiveLam
from mmgoal.registry import HOOKS, OBJECTIVES

if TYPE_CHECKING:
    from mmgoal.engine.trainer import Trainer


class Hook:
    """Base class: every method is a no-op; override the ones you need.

    The trainer calls them in this order (docs/plugins.md):

    * ``before_train``: once per ``fit()``, also when a resumed run starts.
    * ``before_epoch``: ``trainer.epoch`` is the epoch about to run (after the
      model is put in train mode; on a resume, before the epoch's rest).
    * ``after_step``: ``trainer.step`` counts the step just taken; ``outputs``
      are its losses averaged over the accumulation window, plus ``nonfinite``.
    * ``after_epoch``: ``trainer.epoch`` is still the epoch just trained; after
      validation (``metrics``; empty when it did not run) and best.pt, before
      the epoch counter moves and the epoch's checkpoint is written.
    * ``after_train``: after the last epoch, before the test evaluation.
    """

    def before_train(self, trainer: Trainer) -> None: ...

    def before_epoch(self, trainer: Trainer) -> None: ...

    def after_step(self, trainer: Trainer, outputs: dict[str, Any]) -> None: ...

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None: ...

    def after_train(self, trainer: Trainer) -> None: ...


@HOOKS.register()
class ObjectiveWarmup(Hook):
    """Train with another objective, or other objective attributes, in the first epochs.

    VSE-infinity's warm-up sums the hinges over all negatives before the
    hardest negative takes over; either of these does it:
    ``{type: ObjectiveWarmup, epochs: 1, attributes: {max_violation: false}}``
    changes attributes of the configured objective; ``{type: ObjectiveWarmup,
    epochs: 1, objective: {type: TripletLoss, max_violation: false}}`` swaps in
    a whole objective (so it works whatever the configured objective is, e.g. a
    ``GoalObjective``). A warm-up objective's own parameters are not trained.

    Args:
        epochs: how many epochs the warm-up holds.
        attributes: attribute name -> value during the warm-up.
        objective: config of the objective used during the warm-up.
    """

    def __init__(self, epochs: int, attributes: dict[str, Any] | None = None,
                 objective: dict[str, Any] | None = None) -> None:
        if (attributes is None) == (objective is None):
            raise ValueError("ObjectiveWarmup needs exactly one of attributes or objective")
        self.epochs = epochs
        self.attributes = attributes
        self.warmup_objective = OBJECTIVES.build(objective) if objective is not None else None
        self._saved: dict[str, Any] | None = None
        self._main_objective = None

    def before_epoch(self, trainer: Trainer) -> None:
        warming = trainer.epoch < self.epochs
        if self.warmup_objective is not None:
            if self._main_objective is None:
                self._main_objective = trainer.objective
            trainer.objective = self.warmup_objective if warming else self._main_objective
            return
        objective = trainer.objective
        # lam: auto measures the objective's own first steps, after the warm-up
        for module in objective.modules():
            if isinstance(module, AdaptiveLam):
                module.paused = warming
        if self._saved is None:
            missing = [k for k in self.attributes if not hasattr(objective, k)]
            if missing:
                raise ValueError(f"ObjectiveWarmup: {type(objective).__name__} has no attribute(s) "
                                 f"{', '.join(missing)}; use objective: {{...}} to swap in a "
                                 f"whole objective instead")
            self._saved = {k: getattr(objective, k) for k in self.attributes}
        for key, value in (self.attributes if warming else self._saved).items():
            setattr(objective, key, value)


@HOOKS.register()
class FreezeSchedule(Hook):
    """Freeze modules, then unfreeze parts of them at given epochs.

    VSE++'s first stage freezes the backbone for the whole run
    (``frozen: [image_encoder.model]``); VSE-infinity's embedding warm-up
    freezes it for the first epochs and then unfreezes it block by block::

        {type: FreezeSchedule, frozen: [image_encoder.model],
         unfreeze: {1: [image_encoder.model.layer4], 2: [image_encoder.model]}}

    The state follows from the epoch alone, so a resumed run freezes the same
    parameters. Frozen modules also keep their normalisation statistics
    (batch norm in eval mode) when ``freeze_norm``. What the model froze itself (a
    LoRA model's base weights: ``model.peft``) stays frozen when its module thaws: the
    optimizer does not hold it.

    Args:
        frozen: module paths frozen from the first epoch.
        unfreeze: epoch -> module paths made trainable from that epoch on.
        freeze_norm: put the frozen modules' norm layers in eval mode.
    """

    def __init__(self, frozen: list[str], unfreeze: dict[int, list[str]] | None = None,
                 freeze_norm: bool = True) -> None:
        self.frozen = list(frozen)
        self.unfreeze = {int(epoch): list(paths) for epoch, paths in (unfreeze or {}).items()}
        self.freeze_norm = freeze_norm
        self._model_frozen: set[int] | None = None  # ids, seen before the first epoch froze any

    def _module(self, trainer: Trainer, path: str):
        try:
            return trainer.model.get_submodule(path)
        except AttributeError as error:
            top = sorted(name for name, _ in trainer.model.named_children())
            raise ValueError(f"FreezeSchedule: the model has no module {path!r}; its top-level "
                             f"modules are {', '.join(top)}") from error

    def frozen_modules(self, trainer: Trainer, epoch: int) -> list:
        """The modules that are frozen (not trainable) during ``epoch``."""
        released = {p for e, paths in self.unfreeze.items() if e <= epoch for p in paths}
        thawed = {id(m) for p in released for m in self._module(trainer, p).modules()}
        return [module for path in self.frozen for module in self._module(trainer, path).modules()
                if id(module) not in thawed]

    def before_train(self, trainer: Trainer) -> None:
        for path in [*self.frozen, *(p for paths in self.unfreeze.values() for p in paths)]:
            self._module(trainer, path)

    def before_epoch(self, trainer: Trainer) -> None:
        if self._model_frozen is None:
            self._model_frozen = {id(p) for p in trainer.model.parameters() if not p.requires_grad}
        for path in self.frozen:
            for param in self._module(trainer, path).parameters():
                if id(param) not in self._model_frozen:
                    param.requires_grad_(True)
        for module in self.frozen_modules(trainer, trainer.epoch):
            for param in module.parameters(recurse=False):
                param.requires_grad_(False)
            if self.freeze_norm and isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()
