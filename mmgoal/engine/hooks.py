"""Hooks: small objects the trainer calls at fixed points; users register their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmgoal.registry import HOOKS

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
    """Give objective attributes other values during the first epochs.

    E.g. VSE-infinity's warm-up: ``{type: ObjectiveWarmup, epochs: 1,
    attributes: {max_violation: false}}`` sums the hinges over all negatives in
    the first epoch, then goes back to the hardest negative.

    Args:
        epochs: how many epochs the warm-up values hold.
        attributes: attribute name -> value during the warm-up.
    """

    def __init__(self, epochs: int, attributes: dict[str, Any]) -> None:
        self.epochs = epochs
        self.attributes = attributes
        self._saved: dict[str, Any] | None = None

    def before_epoch(self, trainer: Trainer) -> None:
        objective = trainer.objective
        if self._saved is None:
            missing = [k for k in self.attributes if not hasattr(objective, k)]
            if missing:
                raise ValueError(f"ObjectiveWarmup: {type(objective).__name__} has no attribute(s) "
                                 f"{', '.join(missing)}")
            self._saved = {k: getattr(objective, k) for k in self.attributes}
        values = self.attributes if trainer.epoch < self.epochs else self._saved
        for key, value in values.items():
            setattr(objective, key, value)
