"""Hooks that inject faults into a training run, shared by the trainer and CLI tests."""

import math

from mmgoal.engine.hooks import Hook


class InfRunningVariances(Hook):
    """After ``steps`` steps every BatchNorm running variance is inf while the loss stays
    finite (what lr 1e6 does to the tiny model)."""

    def __init__(self, steps):
        self.steps = steps

    def after_step(self, trainer, outputs):
        if trainer.step == self.steps:
            for name, buffer in trainer.model.named_buffers():
                if name.endswith("running_var"):
                    buffer.fill_(math.inf)
