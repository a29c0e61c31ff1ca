"""Imported by multi-process test runs (``custom_imports: [distributed_fixtures]``).

``GlobalBatchSlices`` gives rank ``r`` of ``W`` the ``r``-th slice of the same
global batches that one process with a ``W`` times larger batch sees, so a
2-rank run and a single process can be compared weight for weight. The hooks
interrupt a run at a fixed step the way a cluster does.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable

import torch

from mmgoal.data.pipeline import EvalReader, SkipCounter, collate_batch, iter_eval_batches
from mmgoal.distributed import world_info
from mmgoal.engine.hooks import Hook
from mmgoal.registry import DATASETS, HOOKS, OBJECTIVES


@DATASETS.register(force=True)
class GlobalBatchSlices(torch.utils.data.IterableDataset):
    """This rank's slice of seeded global batches of (image, first caption) samples."""

    def __init__(self, shards: str, batch_size: int, tokenizer: Callable, transform: Callable,
                 seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.tokenizer, self.seed = batch_size, tokenizer, seed
        self.samples = []
        for batch in iter_eval_batches(EvalReader(shards, batch_size=64), transform):
            for k, (image, image_id, captions) in enumerate(zip(
                    batch["images"], batch["image_ids"], batch["captions"])):
                sample = {"image": image, "image_id": image_id, "caption": captions[0]}
                if "boxes" in batch:  # a region encoder's (SCAN's)
                    sample["boxes"] = batch["boxes"][k, :batch["box_lengths"][k]]
                self.samples.append(sample)
        self.epoch = 0

    def num_samples(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        rank, world = world_info()
        order = list(range(len(self.samples)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        size = self.batch_size * world
        for start in range(0, len(order) - size + 1, size):
            mine = order[start + rank * self.batch_size:start + (rank + 1) * self.batch_size]
            yield collate_batch([self.samples[i] for i in mine], self.tokenizer, SkipCounter())


@HOOKS.register(force=True)
class SignalLauncherAt(Hook):
    """Rank ``rank`` sends SIGTERM to its launcher after ``step`` (a preempted job)."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def after_step(self, trainer, outputs) -> None:
        if trainer.step == self.step and trainer.strategy.rank == self.rank:
            os.kill(os.getppid(), signal.SIGTERM)


@HOOKS.register(force=True)
class KillAllAt(Hook):
    """Rank 0 SIGKILLs the launcher and every rank after ``step`` (a lost node), once per
    run directory: the resumed run (with the same config) passes that step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, trainer, outputs) -> None:
        marker = trainer.work_dir / "killed_once"
        if trainer.step == self.step and trainer.strategy.rank == 0 and not marker.exists():
            marker.touch()
            os.killpg(os.getpgid(0), signal.SIGKILL)


@OBJECTIVES.register(force=True)
class NaNOnOneRank(torch.nn.Module):
    """GOAL cir x sig_ms whose loss is NaN on rank ``rank`` from call ``first`` (1-based) on,
    for ``count`` calls: a fault that only one rank sees."""

    def __init__(self, rank: int = 1, first: int = 3, count: int = 1) -> None:
        super().__init__()
        self.inner = OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir",
                                       "pair": "sig_ms"})
        self.rank, self.first, self.count, self.calls = rank, first, count, 0

    def forward(self, inputs):
        self.calls += 1
        outputs = self.inner(inputs)
        if world_info()[0] == self.rank and self.first <= self.calls < self.first + self.count:
            outputs["goal_loss"] = outputs["goal_loss"] * float("nan")
        return outputs


@HOOKS.register(force=True)
class SaveRankWeights(Hook):
    """Every rank writes its own model weights at the end (``rank{r}.pt`` in the run)."""

    def after_train(self, trainer) -> None:
        torch.save(trainer.model.state_dict(),
                   trainer.work_dir / f"rank{trainer.strategy.rank}.pt")


@HOOKS.register(force=True)
class InfOnRankAt(Hook):
    """Rank ``rank`` fills its copy of the first weight with inf after ``step``: non-finite
    state that only one rank holds."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def after_step(self, trainer, outputs) -> None:
        if trainer.step == self.step and trainer.strategy.rank == self.rank:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("inf"))
