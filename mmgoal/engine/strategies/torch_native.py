"""Plain PyTorch: one process, or torch DDP over a launcher's processes, ``no_sync()``
inside accumulation windows, ``torch.autocast`` and fp16's ``GradScaler``
(docs/distributed.md, the ``torch`` strategy).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from mmgoal.config import Precision
from mmgoal.devices import autocast
from mmgoal.distributed import all_objects, rng_state
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.strategies.base import Strategy, flag_last
from mmgoal.registry import STRATEGIES
from mmgoal.runs.checkpoint import copy_checkpoint, load_checkpoint, save_checkpoint
from mmgoal.runs.run_dir import (
    LAST,
    clear_unfinished_copies,
    epoch_checkpoint_name,
    epoch_checkpoints_by_progress,
    prune_epoch_checkpoints,
)

logger = logging.getLogger(__name__)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@STRATEGIES.register("torch")
@STRATEGIES.register("ddp")
@STRATEGIES.register("single")
class TorchStrategy(Strategy):
    """One process or torch DDP; a torch optimizer, accumulation, clipping, autocast;
    ``checkpoints/last.pt`` holds every state, every rank's RNG included.

    Args:
        bucket_mb: DDP's gradient buckets.
        find_unused_parameters: ``auto`` searches after the trainable set or objective
            changes, while some parameter gets no gradient (docs/distributed.md).
        sync_bn: ``SyncBatchNorm`` on several GPUs; ignored on CPUs.
    """

    supports_grad_cache = True
    supports_epoch_checkpoints = True

    def __init__(self, device: str | torch.device = "auto", precision: Precision = "fp32",
                 bucket_mb: float = 25.0,
                 find_unused_parameters: bool | Literal["auto"] = "auto",
                 sync_bn: bool = False, timeout_minutes: float = 60.0) -> None:
        super().__init__(device, precision, timeout_minutes)
        self.bucket_mb = bucket_mb
        self.find_unused = find_unused_parameters
        self.sync_bn = sync_bn
        self.accumulate_steps = 1
        # (trainable flags, objective swaps so far) that the DDP wrapper was made for
        self._graph: tuple | None = None
        self._objective_swaps = 0
        self._probing = False

    def describe(self) -> str:
        parallel = "DDP" if self.world_size > 1 else "one process"
        autocast_name = "" if self.precision == "fp32" else f", {self.precision} autocast"
        return f"torch {parallel} on {self.device}{autocast_name}, {self.world_size} process(es)"

    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        self.module = self.prepare_module(module, micro_batch)
        self.optimizer = build_optimizer(optimizer_cfg, module.model, module.objective)
        self.accumulate_steps = accumulate_steps
        self.clip_grad = clip_grad or math.inf
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.wrapped = self.module

    def prepare_module(self, module: nn.Module, micro_batch: int) -> nn.Module:
        """The training module on the device, with SyncBatchNorm where asked and possible."""
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
        if self.sync_bn and has_bn and self.world_size > 1:
            if self.device.type == "cuda":
                module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
            else:
                logger.warning("train.sync_bn is ignored on CPUs (SyncBatchNorm runs on GPUs "
                               "only): BatchNorm statistics are per rank")
        elif has_bn and self.world_size > 1:
            logger.warning("BatchNorm statistics are computed per rank (%d samples), not over "
                           "the global batch; train.sync_bn: true syncs them on GPUs",
                           micro_batch)
        return module.to(self.device)

    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    # ------------------------------------------------------------ DDP wrapper
    def set_objective(self, objective: nn.Module) -> None:
        """As :meth:`Strategy.set_objective`; another objective may use other parameters, so
        DDP is wrapped again (and probed: ``find_unused_parameters``) at the next step."""
        if objective is not self.objective:
            self._objective_swaps += 1
        super().set_objective(objective)

    def wrap_for(self) -> None:
        """(Re)wrap in DDP when the trainable set or the objective changed, or a probe ended."""
        if self.world_size == 1:
            return
        graph = (tuple(p.requires_grad for p in self.module.parameters()), self._objective_swaps)
        if graph == self._graph and not self._probing:
            return
        if graph == self._graph:  # the probe step is over: every parameter got a gradient
            find_unused, self._probing = False, False
        elif self.find_unused == "auto":
            find_unused, self._probing = True, True
        else:
            find_unused = self.find_unused
        first = self._graph is None
        self._graph = graph
        self.wrapped = nn.parallel.DistributedDataParallel(
            self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb, find_unused_parameters=find_unused,
            init_sync=first)  # rank 0's initial weights; later wrappers find them equal

    def _end_probe(self) -> None:
        """After the probe's backward: keep the unused-parameter search only if needed."""
        if not self._probing:
            return
        unused = [p for p in trainable_parameters(self.module) if p.grad is None]
        if unused:  # DDP leaves the gradient of a parameter no rank used as None
            self._probing = False
            logger.info("DDP: %d trainable parameter(s) got no gradient in a step; keeping "
                        "find_unused_parameters on", len(unused))
        # else: wrap_for rewraps without the search at the next step

    # -------------------------------------------------------------- training
    def train_step(self, micro_batches):
        self.wrap_for()
        if not self._probing:
            return super().train_step(micro_batches)
        with warnings.catch_warnings():
            # the probe searches on purpose, once: DDP's warning that it found no unused
            # parameter is the answer it waits for (the next wrapper does not search)
            warnings.filterwarnings("ignore", message=r".*find_unused_parameters=True was "
                                                      r"specified")
            return super().train_step(micro_batches)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Inside an accumulation window gradients stay local; the last micro-batch reduces."""
        if last or self.wrapped is self.module:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def micro_step(self, batch: dict, objective: nn.Module,
                   last: bool) -> tuple[dict[str, torch.Tensor], bool]:
        """Each part of the micro-batch (:meth:`TrainingStep.parts`: the batch, or the
        gradient cache's chunks, computed outside DDP) through the wrapper, all but the
        window's last under ``no_sync`` (one all-reduce a step)."""
        with autocast(self.device, self.precision):
            parts = self.module.parts(batch, objective, self.loss_scale())
        outputs = parts.outputs
        nonfinite = outputs is not None and self.loss_is_nonfinite(outputs["loss"])
        for replay, last_part in flag_last(parts.replays):
            with self.no_sync(last and last_part):
                with autocast(self.device, self.precision):
                    loss = self.wrapped(batch, objective, replay=replay)
                if outputs is None:
                    outputs, nonfinite = loss, self.loss_is_nonfinite(loss["loss"])
                # Every rank runs every backward, also of a non-finite loss, so DDP's
                # reduction completes; the window is then skipped and its gradients dropped.
                self.backward(loss["loss"] / self.accumulate_steps)
        return outputs, nonfinite

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def clip_and_check(self) -> bool:
        """Clip the gradient norm; False when it is non-finite."""
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.module), self.clip_grad)
        return bool(torch.isfinite(norm))

    def apply_step(self, window_ok: bool) -> bool:
        self._end_probe()
        applied = window_ok and self.clip_and_check()
        if applied:
            self.scaler.step(self.optimizer)
        if self.scaler.is_enabled() and window_ok:
            # After an overflow the scale halves; the skipped step counts as non-finite.
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return applied

    # ------------------------------------------------------------ checkpoints
    def save(self, directory: Path, state: dict) -> None:
        self.check_finite(directory, state["step"])
        rngs = all_objects(rng_state())
        if self.is_main:
            save_checkpoint({**state, "rng": rngs, "model": self.module.model.state_dict(),
                             "objective": self.module.objective.state_dict(),
                             "optimizer": self.optimizer.state_dict(),
                             "scaler": self.scaler.state_dict(),
                             "world_size": self.world_size}, directory / LAST)
        self.barrier()

    def keep_epoch(self, directory: Path, epoch: int, keep: int) -> None:
        if self.is_main:
            clear_unfinished_copies(directory)
            copy_checkpoint(directory / LAST, directory / epoch_checkpoint_name(epoch))
            for path in prune_epoch_checkpoints(directory, keep):
                logger.info("train.keep_epochs %d: deleted %s", keep, path.name)
        self.barrier()

    def read_state(self, directory: Path) -> dict:
        """The newest checkpoint by the training progress it holds: ``last.pt``, or the
        newest ``epoch_<E>.pt`` where last.pt is missing or older (whatever the files' names
        and times say)."""
        last = directory / LAST
        if self.is_main:
            clear_unfinished_copies(directory)
        kept = epoch_checkpoints_by_progress(directory)
        if not last.is_file() and not kept:
            raise FileNotFoundError(f"--resume: no checkpoint at {last}; start without --resume "
                                    f"or point --work-dir at the interrupted run")
        state = load_checkpoint(last) if last.is_file() else None
        # a last.pt at the same progress was written then or since
        if kept and (state is None or (state["epoch"], state["step"]) < kept[-1][0]):
            (epochs, step), path = kept[-1]
            logger.info("--resume: %s (the end of epoch %d, step %d) is the newest checkpoint; "
                        "%s", path.name, epochs - 1, step, f"{LAST} is older (epoch "
                        f"{state['epoch']}, step {state['step']})" if state is not None
                        else f"there is no {LAST}")
            state = load_checkpoint(path)
        return state

    def load(self, directory: Path, state: dict | None = None) -> dict:
        state = state if state is not None else self.read_state(directory)
        self.module.model.load_state_dict(state["model"])
        self.module.objective.load_state_dict(state["objective"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.restore_rng(state["rng"])
        return state
