"""Learning-rate schedules: a factor of the base rate for every optimisation step."""

from __future__ import annotations

import math
from collections.abc import Sequence


class LRSchedule:
    """Linear warm-up, then cosine or linear decay, step decay or a constant rate.

    Args:
        kind: ``cosine``, ``linear`` (to zero at the end, X-VLM), ``step`` or ``constant``.
        total_steps: steps of the whole run (cosine decays to ``min_ratio`` there).
        steps_per_epoch: to place ``milestones`` (``step``).
        warmup_steps: steps of the linear warm-up from 0.
        warmup_ratio: instead of ``warmup_steps``, that share of ``total_steps``
            (X-VLM: 0.1).
        milestones: epochs after which the rate is multiplied by ``gamma`` (``step``).
        gamma: step-decay factor.
        min_ratio: final factor of the cosine.
    """

    KINDS = ("cosine", "linear", "step", "constant")

    def __init__(self, kind: str = "cosine", total_steps: int = 1, steps_per_epoch: int = 1,
                 warmup_steps: int = 0, milestones: Sequence[int] = (), gamma: float = 0.1,
                 min_ratio: float = 0.0, warmup_ratio: float = 0.0) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"schedule type must be one of {', '.join(self.KINDS)}, got {kind!r}")
        if warmup_ratio and warmup_steps:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if not 0 <= warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must lie in [0, 1), got {warmup_ratio}")
        self.kind = kind
        self.total_steps = max(total_steps, 1)
        self.steps_per_epoch = max(steps_per_epoch, 1)
        self.warmup_steps = warmup_steps or round(warmup_ratio * self.total_steps)
        self.milestones = sorted(milestones)
        self.gamma = gamma
        self.min_ratio = min_ratio

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate at (0-based) ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            epoch = step // self.steps_per_epoch
            return self.gamma ** sum(epoch >= m for m in self.milestones)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        if self.kind == "linear":
            return self.min_ratio + (1 - self.min_ratio) * (1 - progress)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
