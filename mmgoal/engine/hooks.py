"""Hooks: small objects the trainer calls at fixed points; users register their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmgoal.registry import HOOKS, OBJECTIVES

if TYPE_CHECKING:
    from mmgoal.engine.trainer import Trainer


class Hook:
    """Base class: every method is a no-op; override the ones you need."""

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
        if self._saved is None:
            missing = [k for k in self.attributes if not hasattr(objective, k)]
            if missing:
                raise ValueError(f"ObjectiveWarmup: {type(objective).__name__} has no attribute(s) "
                                 f"{', '.join(missing)}; use objective: {{...}} to swap in a "
                                 f"whole objective instead")
            self._saved = {k: getattr(objective, k) for k in self.attributes}
        for key, value in (self.attributes if warming else self._saved).items():
            setattr(objective, key, value)
