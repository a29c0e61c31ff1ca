"""Starting a run in its folder: ``mmgoal train`` (every rank) and each cell of ``mmgoal
sweep`` start through :func:`started_run`, so each refuses what the others refuse. What the
run folder holds and why: :mod:`mmgoal.runs.run_dir`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mmgoal.runs.run_dir import (
    CHECKPOINTS,
    has_checkpoint,
    prepare_work_dir,
    record_changes,
    resume_changes,
    run_lock,
)
from mmgoal.runs.schema import check_data_paths, check_test_shards, resolve_config

logger = logging.getLogger(__name__)


@dataclass
class RunStart:
    """What :func:`started_run` decided: ``changes``, a resume's accepted config changes
    (dotted key -> [old, new]); ``deleted``, what ``overwrite`` deleted (relative to
    ``work_dir``); ``finished``, the report of a finished run ``reuse`` accepted."""

    work_dir: Path
    resume: bool = False
    changes: dict[str, list] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    finished: dict | None = None

    def record(self, epoch: int, step: int) -> None:
        """Record the resume's accepted changes (``config_changes.jsonl``), once the
        trainer has said the epoch and step it resumes at."""
        record_changes(self.work_dir, self.changes, epoch, step)


@contextlib.contextmanager
def started_run(work_dir: str | os.PathLike, cfg: dict, resume: bool = False,
                auto_resume: bool = False, overwrite: bool = False, lock_wait: float = 0.0,
                main_rank: bool = True,
                reuse: Callable[[Path, dict], dict | None] | None = None
                ) -> Iterator[RunStart]:
    """The run folder ``work_dir`` held and checked for a run of ``cfg`` (resolved), for the
    life of the block: rank 0 holds its run lock (up to ``lock_wait`` seconds);
    ``reuse(work_dir, cfg)`` may accept a finished run (:attr:`RunStart.finished`, nothing
    else checked); the run resumes when asked or with ``auto_resume``; rank 0 checks the
    folder (:func:`~mmgoal.runs.run_dir.prepare_work_dir`) and a resume's config changes
    (:func:`~mmgoal.runs.run_dir.resume_changes`); every split's shards exist, and a COCO
    test split carries its protocols' ids.
    """
    work_dir = Path(work_dir)
    with contextlib.ExitStack() as held:
        if main_rank:
            held.enter_context(run_lock(work_dir, lock_wait))
        finished = reuse(work_dir, cfg) if reuse is not None else None
        if finished is not None:
            yield RunStart(work_dir, finished=finished)
            return
        resume = resume or (auto_resume and has_checkpoint(work_dir / CHECKPOINTS))
        deleted = prepare_work_dir(work_dir, resume, overwrite) if main_rank else []
        if deleted:
            logger.warning("--overwrite: deleted the earlier run's %s", ", ".join(deleted))
        changes = resume_changes(work_dir, cfg, resolve_config) if resume else {}
        check_data_paths(cfg)
        check_test_shards(cfg)
        yield RunStart(work_dir, resume, changes, deleted)
