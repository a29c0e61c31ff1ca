"""Learning-rate schedules: a factor of the base rate for every optimisation step
(``schedule:``, docs/configs.md, "Sections"). A schedule of your own::

    @SCHEDULES.register("exponential")
    class ExponentialSchedule(LRSchedule):
        def __init__(self, rate: float = 0.999, **common) -> None:
            super().__init__(**common)
            self.rate = rate

        def decay(self, step: int) -> float:
            return self.rate ** (step - self.warmup_steps)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mmgoal.config import NonNegativeInt
from mmgoal.registry import SCHEDULES


class LRSchedule:
    """A linear warm-up from 0 over ``warmup_steps`` (or ``warmup_ratio`` of the run;
    X-VLM: 0.1), then ``decay(step)``; the trainer sets ``total_steps`` and
    ``steps_per_epoch``."""

    def __init__(self, total_steps: int = 1, steps_per_epoch: int = 1,
                 warmup_steps: NonNegativeInt = 0, warmup_ratio: float = 0.0) -> None:
        if warmup_ratio and warmup_steps:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if not 0 <= warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must lie in [0, 1), got {warmup_ratio}")
        self.total_steps = max(total_steps, 1)
        self.steps_per_epoch = max(steps_per_epoch, 1)
        self.warmup_steps = warmup_steps or round(warmup_ratio * self.total_steps)

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate at (0-based) ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return self.decay(step)

    def decay(self, step: int) -> float:
        """The factor after the warm-up (``step >= warmup_steps``)."""
        raise NotImplementedError

    def progress(self, step: int) -> float:
        """Share of the post-warm-up steps done at ``step``, in [0, 1]."""
        span = max(self.total_steps - self.warmup_steps, 1)
        return min((step - self.warmup_steps) / span, 1.0)


@SCHEDULES.register("constant")
class ConstantSchedule(LRSchedule):
    """The base rate after the warm-up."""

    def decay(self, step: int) -> float:
        return 1.0


class AnnealingSchedule(LRSchedule):
    """From the base rate down to ``min_ratio`` of it at the last step, along ``curve``."""

    def __init__(self, min_ratio: float = 0.0, **common) -> None:
        super().__init__(**common)
        self.min_ratio = min_ratio

    def curve(self, progress: float) -> float:
        """1 at ``progress`` 0, 0 at ``progress`` 1."""
        raise NotImplementedError

    def decay(self, step: int) -> float:
        return self.min_ratio + (1 - self.min_ratio) * self.curve(self.progress(step))


@SCHEDULES.register("cosine")
class CosineSchedule(AnnealingSchedule):
    """Half a cosine from the base rate to ``min_ratio`` of it."""

    def curve(self, progress: float) -> float:
        return 0.5 * (1 + math.cos(math.pi * progress))


@SCHEDULES.register("linear")
class LinearSchedule(AnnealingSchedule):
    """A straight line from the base rate to ``min_ratio`` of it (X-VLM)."""

    def curve(self, progress: float) -> float:
        return 1 - progress


@SCHEDULES.register("step")
class StepSchedule(LRSchedule):
    """The rate times ``gamma`` after each of the ``milestones`` epochs (VSE++, SCAN)."""

    def __init__(self, milestones: Sequence[int] = (), gamma: float = 0.1, **common) -> None:
        super().__init__(**common)
        self.milestones = sorted(milestones)
        self.gamma = gamma

    def decay(self, step: int) -> float:
        epoch = step // self.steps_per_epoch
        return self.gamma ** sum(epoch >= m for m in self.milestones)
