"""What every strategy does: it owns the device, the process group, the optimizer and
gradient reduction, mixed precision and the checkpoint files (docs/distributed.md).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmgoal.config import Precision
from mmgoal.contract import StepAwareObjective
from mmgoal.devices import check_precision, move_to_device, resolve_device
from mmgoal.distributed import (
    all_objects,
    init_process_group,
    leave_process_group,
    set_rng_state,
    wire_dtype,
    world_info,
)
from mmgoal.runs.checkpoint import NonFiniteStateError, nonfinite_tensors
from mmgoal.runs.run_dir import has_checkpoint

logger = logging.getLogger(__name__)


def flag_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, is_last) pairs; looks one item ahead, so a window cut short still ends."""
    iterator = iter(items)
    end = object()
    current = next(iterator, end)
    while current is not end:
        following = next(iterator, end)
        yield current, following is end
        current = following


@dataclass
class StepResult:
    """What one optimisation step did: ``nonfinite``, a loss or gradient was NaN/inf (the
    step skipped on every rank); ``outputs``, the objective's, averaged over the window."""

    applied: bool
    nonfinite: bool
    outputs: dict[str, torch.Tensor]
    micro_batches: int


def prune_except(directory: Path, keep: str) -> None:
    """Remove every checkpoint folder in ``directory`` but ``keep`` (and unfinished ones)."""
    for child in directory.iterdir():
        if child.is_dir() and child.name != keep:
            shutil.rmtree(child, ignore_errors=True)


def cpu_float_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict on the CPU with floating tensors in float32 (what weight files hold)."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu()
            for k, v in state.items()}


class Strategy:
    """Base class; subclasses implement the training calls. ``device``: as ``train.device``;
    ``timeout_minutes``: how long a collective waits for a rank. ``plain_module``: the
    wrapped model holds full float32 weights on every rank, so it can evaluate itself.
    """

    plain_module = True
    # TrainingStep.cache_gradients' two passes fit its micro-batch frame (train.grad_cache_chunk)
    supports_grad_cache = False
    # its resumable checkpoint is one file, kept of an epoch's end as epoch_<E>.pt
    # (train.keep_epochs: keep_epoch)
    supports_epoch_checkpoints = False

    def __init__(self, device: str | torch.device = "auto", precision: Precision = "fp32",
                 timeout_minutes: float = 60.0) -> None:
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        check_precision(precision, self.device)
        self.precision = precision
        self.join_process_group(timeout_minutes)
        self.rank, self.world_size = world_info()
        self.module: nn.Module | None = None
        self._swapped_objective: nn.Module | None = None  # set_objective's, None: the module's

    def join_process_group(self, timeout_minutes: float) -> None:
        init_process_group(timeout_minutes, self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"{type(self).__name__}, {self.world_size} process(es)"

    # ------------------------------------------------------------- collectives
    def agree(self, *flags: bool) -> list[bool]:
        """Each flag is True on every rank when it is True on any (one all-reduce)."""
        if self.world_size == 1:
            return [bool(f) for f in flags]
        values = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return [bool(v) for v in values]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_weights(self, weights: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's state dict on every rank (``None`` elsewhere): one ``broadcast`` per
        tensor on the device, so a large model is never pickled whole."""
        if self.world_size == 1:
            return weights
        spec = [None]
        if self.rank == 0:
            spec = [{name: (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
                     else ("object", value) for name, value in weights.items()}]
        dist.broadcast_object_list(spec, src=0)
        received = {}
        for name, (shape, dtype) in spec[0].items():
            if shape == "object":
                received[name] = dtype
                continue
            wire = wire_dtype(dtype)
            tensor = (weights[name].to(self.device, wire) if self.rank == 0 else
                      torch.empty(shape, dtype=wire, device=self.device))
            dist.broadcast(tensor, src=0)
            received[name] = tensor.to(dtype)
        return received

    # -------------------------------------------------------------- training
    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        raise NotImplementedError

    @property
    def model(self) -> nn.Module:
        """The unwrapped model (``module.model``)."""
        return self.module.model

    @property
    def objective(self) -> nn.Module:
        """The objective :meth:`train_step` uses: the training module's (the configured
        one, whose parameters are trained), until :meth:`set_objective` swaps in another."""
        return self.module.objective if self._swapped_objective is None \
            else self._swapped_objective

    def set_objective(self, objective: nn.Module) -> None:
        """Train with ``objective`` from the next step on (``ObjectiveWarmup``'s swap, and
        the swap back to the configured one). A swapped-in objective is moved to the
        device; its parameters are not trained."""
        if objective is self.objective:
            return
        configured = objective is self.module.objective
        if isinstance(objective, nn.Module) and not configured:
            objective.to(self.device)  # a warm-up objective the hook built on the CPU
        self._swapped_objective = None if configured else objective

    @property
    def owns_schedule(self) -> bool:
        """The learning rate comes from elsewhere (a DeepSpeed JSON scheduler)."""
        return False

    def param_groups(self) -> list[dict]:
        raise NotImplementedError

    def to_device(self, batch: Any) -> Any:
        """A batch (from pinned memory when the device is a GPU) moved to the device."""
        return move_to_device(batch, self.device, non_blocking=self.device.type == "cuda")

    def train_step(self, micro_batches: Iterable[dict]) -> StepResult:
        """One optimisation step over a window of ``train.accumulate_steps`` micro-batches
        (fewer where the data ran out), under :attr:`objective`; a window with a
        non-finite loss or gradient on any rank is skipped on every rank."""
        objective = self.objective
        window_ok, count, sums = True, 0, {}
        for batch, last in flag_last(micro_batches):
            outputs, nonfinite = self.micro_step(self.to_device(batch), objective, last)
            window_ok &= not nonfinite
            count += 1
            for key, value in outputs.items():
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    value = value.detach().float().reshape(())
                    sums[key] = sums[key] + value if key in sums else value
        applied = self.apply_step(window_ok) if count else False
        if isinstance(objective, StepAwareObjective):
            objective.finish_step(applied)
        return StepResult(applied=applied, nonfinite=count > 0 and not applied,
                          outputs={k: v / count for k, v in sums.items()}, micro_batches=count)

    def micro_step(self, batch: dict, objective: nn.Module,
                   last: bool) -> tuple[dict[str, torch.Tensor], bool]:
        """Forward and backward of one micro-batch on the device; ``last`` ends the window
        (where data parallel reduces). Returns (outputs, whether any rank's loss was
        non-finite)."""
        raise NotImplementedError

    def loss_scale(self) -> float:
        """The fp16 loss scale the strategy's backward applies (1 without one): what
        ``TrainingStep.cache_gradients`` scales its loss by (train.grad_cache_chunk)."""
        return 1.0

    def loss_is_nonfinite(self, loss: torch.Tensor) -> bool:
        """True on every rank when the loss of any rank is NaN/inf (one all-reduce)."""
        return self.agree(not bool(torch.isfinite(loss)))[0]

    def apply_step(self, window_ok: bool) -> bool:
        """Apply the window's accumulated gradients; False when skipped (non-finite)."""
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints
    def save(self, directory: Path, state: dict) -> None:
        """Write a resumable checkpoint of everything plus the trainer's ``state``; first
        :meth:`check_finite` (a checkpoint holding NaN/inf is never written)."""
        raise NotImplementedError

    def keep_epoch(self, directory: Path, epoch: int, keep: int) -> None:
        """Keep the resumable checkpoint :meth:`save` has just written at the end of ``epoch``
        as ``epoch_<epoch>.pt``, and delete the epoch checkpoints older than the newest
        ``keep`` (collective; ``train.keep_epochs``, where :attr:`supports_epoch_checkpoints`)."""
        raise NotImplementedError

    def read_state(self, directory: Path) -> dict:
        """The trainer's state in the latest checkpoint of ``directory``, nothing restored
        (``FileNotFoundError`` without a complete checkpoint)."""
        raise NotImplementedError

    def load(self, directory: Path, state: dict | None = None) -> dict:
        """Restore the latest checkpoint in ``directory``; return the trainer's state
        (``state``: :meth:`read_state`'s, not read again)."""
        raise NotImplementedError

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's copy of the model's and the objective's tensors (what checkpoints hold)."""
        return {**self.model.state_dict(),
                **{f"objective.{k}": v for k, v in self.module.objective.state_dict().items()}}

    def nonfinite_names(self, weights: dict[str, torch.Tensor] | None = None) -> list[str]:
        """The tensors holding NaN/inf on any rank (collective): each rank's
        :meth:`local_state`, rank 0's ``weights`` instead where given."""
        own = weights if weights is not None and self.is_main else self.local_state()
        return list(dict.fromkeys(name for found in all_objects(nonfinite_tensors(own))
                                  for name in found))

    def check_finite(self, directory: Path, step: int,
                     weights: dict[str, torch.Tensor] | None = None) -> None:
        """Raise ``NonFiniteStateError`` on every rank before anything holding NaN/inf is
        evaluated or checkpointed (collective; ``weights``: as :meth:`nonfinite_names`)."""
        names = self.nonfinite_names(weights)
        if names:
            raise NonFiniteStateError(names, directory, step, has_checkpoint(directory))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model's float32 weights on rank 0 (collective; None on other ranks)."""
        if not self.is_main:
            return None
        return cpu_float_state(self.model.state_dict())

    def evaluation_weights(self, weights: dict[str, torch.Tensor]
                           ) -> dict[str, torch.Tensor] | None:
        """Where every rank evaluates full float32 ``weights``: None when they were loaded
        into the trained model (:attr:`plain_module`), else ``weights`` for a float32 copy
        (ZeRO-3 partitions, bf16/fp16 engine weights)."""
        if not self.plain_module:
            return weights
        self.model.load_state_dict(weights)
        return None

    def restore_rng(self, states: list[dict]) -> None:
        """This rank's RNG state from a checkpoint's per-rank list."""
        if len(states) == self.world_size:
            set_rng_state(states[self.rank])
        else:
            logger.warning("the checkpoint holds RNG states of %d process(es), this run has %d: "
                           "random draws after the resume differ from the original run",
                           len(states), self.world_size)

    def close(self) -> None:
        """Leave the process group (at the end of a run)."""
        leave_process_group()
