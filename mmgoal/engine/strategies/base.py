"""What every strategy does: processes, collective decisions, checkpoint pointers.

A strategy owns everything that depends on how many processes train and how:
the process group, the optimizer and how gradients are reduced, clipped and
applied, mixed precision, and the checkpoint files. The trainer talks to the
strategy only (``forward``, ``backward``, ``drop_micro_batch``, ``step``,
``save``, ``load``...), so it reads the same for one process, ``torchrun`` and
``deepspeed``.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmgoal.objectives.gather import world_info

logger = logging.getLogger(__name__)

LATEST = "latest"


def launched_world_size() -> int:
    """The number of processes a launcher (torchrun, deepspeed, SLURM via them) started."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(timeout_minutes: float) -> None:
    """Join the launcher's process group (gloo on CPU, NCCL on GPUs), once."""
    if dist.is_initialized() or launched_world_size() == 1:
        return
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                           f"unset; start the run with torchrun or deepspeed (docs/distributed.md)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def write_pointer(path: Path, value: str) -> None:
    """Atomically point ``path`` at ``value`` (write a temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as stream:
        stream.write(value)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def read_pointer(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def has_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a resumable checkpoint of any strategy."""
    return (directory / "last.pt").is_file() or (directory / "deepspeed" / LATEST).is_file()


def prune_except(directory: Path, keep: str) -> None:
    """Remove every checkpoint folder in ``directory`` but ``keep`` (and unfinished ones)."""
    for child in directory.iterdir():
        if child.is_dir() and child.name != keep:
            shutil.rmtree(child, ignore_errors=True)


class Strategy:
    """Base class; see the module docstring. Subclasses implement the training calls.

    Attributes:
        plain_module: the wrapped model holds full float32 weights on every rank,
            so rank 0 can evaluate it directly (else ``evaluation_model`` builds a copy).
    """

    plain_module = True

    def __init__(self, timeout_minutes: float = 60.0) -> None:
        self.join_process_group(timeout_minutes)
        self.rank, self.world_size = world_info()
        self.module: nn.Module | None = None

    def join_process_group(self, timeout_minutes: float) -> None:
        init_process_group(timeout_minutes)

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
        values = torch.tensor([float(f) for f in flags])
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

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    # -------------------------------------------------------------- training
    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        raise NotImplementedError

    @property
    def model(self) -> nn.Module:
        """The unwrapped model (``module.model``)."""
        return self.module.model

    @property
    def owns_schedule(self) -> bool:
        """The learning rate comes from elsewhere (a DeepSpeed JSON scheduler)."""
        return False

    def param_groups(self) -> list[dict]:
        raise NotImplementedError

    def forward(self, batch: dict, objective: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def drop_micro_batch(self) -> None:
        """A non-finite micro-batch: no gradient from it; its optimizer step is skipped."""
        raise NotImplementedError

    def step(self) -> bool:
        """Apply the accumulated gradients; False when the step was skipped (non-finite)."""
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints
    def save(self, directory: Path, state: dict) -> None:
        """Write a resumable checkpoint of everything plus the trainer's ``state``."""
        raise NotImplementedError

    def read_state(self, directory: Path) -> dict:
        """The trainer's state in the latest checkpoint of ``directory``, nothing restored.

        Raises:
            FileNotFoundError: there is no complete checkpoint.
        """
        raise NotImplementedError

    def load(self, directory: Path, state: dict | None = None) -> dict:
        """Restore the latest checkpoint in ``directory``; return the trainer's state.

        ``state``: what ``read_state`` returned for it already (not read again).

        Raises:
            FileNotFoundError: there is no complete checkpoint.
        """
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model's float32 weights on rank 0 (collective; None on other ranks)."""
        if not self.is_main:
            return None
        return {k: v.detach().float() if v.is_floating_point() else v
                for k, v in self.model.state_dict().items()}

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
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
