"""Plain PyTorch strategies: one process (``single``) and data parallel (``ddp``, torchrun)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mmgoal.engine.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.strategies.base import Strategy, launched_world_size, rng_state
from mmgoal.registry import STRATEGIES

logger = logging.getLogger(__name__)

LAST = "last.pt"


@STRATEGIES.register("single")
class SingleProcess(Strategy):
    """One process: a torch optimizer, gradient accumulation and clipping by hand.

    ``checkpoints/last.pt`` holds model, objective, optimizer and the trainer's state.
    """

    def __init__(self, timeout_minutes: float = 60.0) -> None:
        super().__init__(timeout_minutes)
        self._window_ok = True
        self._accumulate = 1

    def join_process_group(self, timeout_minutes: float) -> None:
        if launched_world_size() > 1:
            raise ValueError("strategy 'single' was started by a launcher with WORLD_SIZE="
                             f"{launched_world_size()}; use strategy ddp or deepspeed")

    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        self.module = module
        self.optimizer = build_optimizer(optimizer_cfg, module.model, module.objective)
        self._accumulate = accumulate_steps
        self.clip_grad = clip_grad or math.inf

    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def forward(self, batch: dict, objective: nn.Module) -> dict[str, torch.Tensor]:
        return self.module(batch, objective)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self._accumulate).backward()

    def drop_micro_batch(self) -> None:
        self._window_ok = False

    def reduce_gradients(self) -> None:
        """Make every rank's gradients the mean over ranks (nothing to do in one process)."""

    def step(self) -> bool:
        window_ok, self._window_ok = self._window_ok, True
        if not window_ok:
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.reduce_gradients()
        # A NaN/inf gradient under a finite loss skips the step like a non-finite loss.
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad)
        applied = bool(torch.isfinite(norm))
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return applied

    def save(self, directory: Path, state: dict) -> None:
        rngs = self.gather_objects(rng_state())
        if self.is_main:
            save_checkpoint({**state, "rng": rngs, "model": self.module.model.state_dict(),
                             "objective": self.module.objective.state_dict(),
                             "optimizer": self.optimizer.state_dict(),
                             "world_size": self.world_size}, directory / LAST)
        self.barrier()

    def read_state(self, directory: Path) -> dict:
        path = directory / LAST
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}; start without --resume "
                                    f"or point --work-dir at the interrupted run")
        return load_checkpoint(path)

    def load(self, directory: Path, state: dict | None = None) -> dict:
        state = state if state is not None else self.read_state(directory)
        self.module.model.load_state_dict(state["model"])
        self.module.objective.load_state_dict(state["objective"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.restore_rng(state["rng"])
        return state


@STRATEGIES.register("ddp")
class DataParallel(SingleProcess):
    """Data parallel over the processes of ``torchrun`` (or any launcher setting WORLD_SIZE).

    Rank 0's initial weights are broadcast; after the local backward the
    gradients are averaged with one all-reduce per flat bucket, so models whose
    trainable set changes between epochs (``FreezeSchedule``) need nothing
    special. Every rank holds the whole optimizer; rank 0 writes ``last.pt``
    with the RNG states of all ranks.

    Args:
        bucket_mb: size of the flat buffers gradients are averaged in.
        timeout_minutes: how long a collective waits for a rank before failing.
    """

    def __init__(self, bucket_mb: float = 25.0, timeout_minutes: float = 60.0) -> None:
        self.bucket_bytes = int(bucket_mb * 2**20)
        super().__init__(timeout_minutes)

    def join_process_group(self, timeout_minutes: float) -> None:
        Strategy.join_process_group(self, timeout_minutes)

    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        super().setup(module, optimizer_cfg, micro_batch, accumulate_steps, clip_grad)
        if self.world_size > 1:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
                logger.warning("BatchNorm statistics are computed per rank (%d samples), not over "
                               "the global batch", micro_batch)

    def reduce_gradients(self) -> None:
        if self.world_size == 1:
            return
        # Every rank must reduce the same tensors: a parameter that got a gradient on
        # some rank joins as zeros where it got none; one unused on every rank keeps
        # None, so the optimizer skips it as in one process.
        params = [p for p in self.module.parameters() if p.requires_grad]
        used = torch.tensor([float(p.grad is not None) for p in params])
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        params = [p for p, u in zip(params, used) if u]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in [*params, None]:
            if p is not None:
                bucket.append(p.grad)
                size += p.grad.numel() * p.grad.element_size()
            if bucket and (p is None or size >= self.bucket_bytes):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat)
                flat /= self.world_size
                offset = 0
                for grad in bucket:
                    grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
                bucket, size = [], 0
