"""Hooks: small objects the trainer calls at fixed points; users register their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mmgoal.objectives.adaptive_lam import AdaptiveLam
from mmgoal.registry import HOOKS, OBJECTIVES

if TYPE_CHECKING:
    from mmgoal.engine.trainer import Trainer


class Hook:
    """Base class: every method is a no-op; override the ones you need. When the trainer
    calls each, and what ``trainer`` holds then: docs/plugins.md, "3. Hooks"."""

    def before_train(self, trainer: Trainer) -> None: ...

    def before_epoch(self, trainer: Trainer) -> None: ...

    def after_step(self, trainer: Trainer, outputs: dict[str, Any]) -> None: ...

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None: ...

    def after_train(self, trainer: Trainer) -> None: ...


@HOOKS.register()
class ObjectiveWarmup(Hook):
    """For the first ``epochs``, set ``attributes`` of the configured objective
    (``{max_violation: false}``: VSE-infinity's sum of hinges) or swap in the
    ``objective`` config, whose own parameters are not trained."""

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
    """Freeze the ``frozen`` module paths, then unfreeze parts of them from the epochs of
    ``unfreeze`` (epoch -> paths); ``freeze_norm`` keeps frozen batch norms in eval mode
    (docs/models.md, "Training schedules"). The state follows from the epoch alone;
    what the model froze itself (LoRA's base weights) stays frozen."""

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
