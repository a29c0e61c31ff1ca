"""Hugging Face Accelerate: ``accelerate launch tools/finetune.py CONFIG`` (DDP, mixed precision).

``Accelerator.prepare`` wraps the training module in DistributedDataParallel
(``find_unused_parameters``, since objectives use different heads in
different epochs) and the optimizer; gradients are averaged in the backward.
FSDP and DeepSpeed plugins come from the accelerate config file as usual
(``accelerate config``); the DeepSpeed path of mmgoal itself is the
``deepspeed`` strategy.

On CPU, ``accelerate launch --multi_gpu --num_processes N`` starts N processes
that each build a one-process Accelerator unless ``ACCELERATE_USE_CPU`` is set:
N independent runs, silently. The strategy sets it before the Accelerator
exists and checks that the Accelerator sees every process the launcher started.
"""

from __future__ import annotations

import datetime
import math
import os

import torch
from torch import nn

from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.strategies.base import launched_world_size
from mmgoal.engine.strategies.torch_native import SingleProcess
from mmgoal.objectives.gather import world_info
from mmgoal.registry import STRATEGIES


@STRATEGIES.register("accelerate")
class AccelerateStrategy(SingleProcess):
    """Train through ``accelerate.Accelerator`` (see the module docstring).

    Args:
        mixed_precision: ``no``, ``bf16`` or ``fp16`` (Accelerate's autocast).
        timeout_minutes: how long a collective waits for a rank before failing.
    """

    def __init__(self, mixed_precision: str = "no", timeout_minutes: float = 60.0) -> None:
        self.mixed_precision = mixed_precision
        super().__init__(timeout_minutes)

    def join_process_group(self, timeout_minutes: float) -> None:
        from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

        launched = launched_world_size()
        if launched > 1 and not torch.cuda.is_available():
            os.environ["ACCELERATE_USE_CPU"] = "true"  # else N one-process runs
        self.accelerator = Accelerator(
            mixed_precision=self.mixed_precision,
            kwargs_handlers=[
                InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=timeout_minutes)),
                DistributedDataParallelKwargs(find_unused_parameters=True)])
        if self.accelerator.num_processes != launched:
            raise RuntimeError(
                f"the launcher started {launched} processes but Accelerate joined "
                f"{self.accelerator.num_processes}; on CPU launch with `accelerate launch "
                f"--multi_gpu --num_processes N` (a CPU-only accelerate config starts one "
                f"process)")

    def describe(self) -> str:
        return (f"Accelerate {self.accelerator.distributed_type.value} "
                f"(mixed precision {self.mixed_precision}), {world_info()[1]} process(es)")

    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        self.module = module
        self._accumulate = accumulate_steps
        self.clip_grad = clip_grad or math.inf
        self.wrapped, self.optimizer = self.accelerator.prepare(
            module, build_optimizer(optimizer_cfg, module.model, module.objective))

    def forward(self, batch: dict, objective: nn.Module) -> dict[str, torch.Tensor]:
        return self.wrapped(batch, objective)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss / self._accumulate)
