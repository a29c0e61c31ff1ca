"""Hugging Face Accelerate: ``accelerate launch -m mmgoal train CONFIG`` (DDP with unused
parameters allowed, mixed precision; FSDP from an accelerate config). On CPU it sets
``ACCELERATE_USE_CPU`` (else each process is silently its own run) and checks the world.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from typing import Literal

import torch
from torch import nn

from mmgoal.config import Precision
from mmgoal.distributed import launched_world_size, world_info
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.strategies.torch_native import TorchStrategy, trainable_parameters
from mmgoal.extras import require_extra
from mmgoal.registry import STRATEGIES

# train.precision -> Accelerate's mixed_precision
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@STRATEGIES.register("accelerate")
class AccelerateStrategy(TorchStrategy):
    """Train through ``accelerate.Accelerator`` (the ``accelerate`` extra), which places
    the model itself (``device: cpu`` sets its ``cpu`` option). ``mixed_precision``
    (``no``, ``bf16``, ``fp16``), when given, replaces ``train.precision``."""

    def __init__(self, device: str | torch.device = "auto", precision: Precision = "fp32",
                 mixed_precision: Literal["no", "bf16", "fp16"] | None = None,
                 timeout_minutes: float = 60.0) -> None:
        require_extra("accelerate", "strategy: {type: accelerate}")
        if mixed_precision is not None:
            precision = {v: k for k, v in MIXED_PRECISION.items()}[mixed_precision]
        super().__init__(device, precision, timeout_minutes=timeout_minutes)

    def join_process_group(self, timeout_minutes: float) -> None:
        from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

        launched = launched_world_size()
        if launched > 1 and self.device.type == "cpu":
            os.environ["ACCELERATE_USE_CPU"] = "true"  # else N one-process runs
        self.accelerator = Accelerator(
            mixed_precision=MIXED_PRECISION[self.precision], cpu=self.device.type == "cpu",
            kwargs_handlers=[
                InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=timeout_minutes)),
                DistributedDataParallelKwargs(find_unused_parameters=True)])
        if self.accelerator.num_processes != launched:
            raise RuntimeError(
                f"the launcher started {launched} processes but Accelerate joined "
                f"{self.accelerator.num_processes}; on CPU launch with `accelerate launch "
                f"--multi_gpu --num_processes N` (a CPU-only accelerate config starts one "
                f"process)")
        self.device = self.accelerator.device

    def describe(self) -> str:
        return (f"Accelerate {self.accelerator.distributed_type.value} "
                f"(mixed precision {MIXED_PRECISION[self.precision]}), {world_info()[1]} "
                f"process(es)")

    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        self.module = module
        self.accumulate_steps = accumulate_steps
        self.clip_grad = clip_grad or math.inf
        self.wrapped, self.optimizer = self.accelerator.prepare(
            module, build_optimizer(optimizer_cfg, module.model, module.objective))
        self.scaler = torch.amp.GradScaler(enabled=False)  # Accelerate scales fp16 itself

    def wrap_for(self) -> None:
        """Nothing: ``Accelerator.prepare`` wrapped the module once, in ``setup``."""

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.wrapped)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def loss_scale(self) -> float:
        scaler = self.accelerator.scaler
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0

    def clip_and_check(self) -> bool:
        norm = self.accelerator.clip_grad_norm_(trainable_parameters(self.module),
                                                self.clip_grad)
        return bool(torch.isfinite(torch.as_tensor(norm, device=self.device)))

    def apply_step(self, window_ok: bool) -> bool:
        applied = window_ok and self.clip_and_check()
        if applied or (window_ok and self.precision == "fp16"):
            # Accelerate's optimizer skips an fp16 overflow step itself and lowers the scale.
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return applied
