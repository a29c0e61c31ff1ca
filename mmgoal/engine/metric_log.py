"""``metrics.jsonl``, a run's log: one JSON object per logged step and epoch, on rank 0.

Every record also goes to the loggers of the config's ``loggers:`` (TensorBoard, W&B:
:mod:`mmgoal.engine.loggers`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from mmgoal import strict_json
from mmgoal.engine.loggers import Logger
from mmgoal.files import open_unlinked, write_text

logger = logging.getLogger(__name__)


class MetricLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (rank 0 only: ``enabled``);
    a NaN or inf value (a diverged loss) is written as ``null``. Every record also goes
    to ``loggers`` (TensorBoard, W&B), between :meth:`open` and :meth:`close`.
    """

    def __init__(self, path: Path, enabled: bool = True, loggers: Sequence[Logger] = ()) -> None:
        self.path = path
        self.enabled = enabled
        self.loggers = list(loggers) if enabled else []

    def open(self, config: dict, step: int) -> None:
        """Start the loggers beside ``metrics.jsonl`` with the resolved ``config``, from
        ``step`` (a resumed run's)."""
        for sink in self.loggers:
            sink.open(self.path.parent, config, step)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open_unlinked(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                           "the run's metrics log") as stream:
            stream.write(strict_json.dumps(record) + "\n")
        for sink in self.loggers:
            sink.log(record)

    def close(self) -> None:
        """Close every logger, also after an error: one that fails to close is reported and
        the others still close, so the error that ended the run is the one raised."""
        for sink in self.loggers:
            try:
                sink.close()
            except Exception as error:  # a logger's own failure must not hide the run's
                logger.warning("%s failed to close: %s", type(sink).__name__, error)

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after ``step``: a run resumed from a checkpoint at
        ``step`` logs those steps again (a run killed after its last checkpoint)."""
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True)
                if json.loads(line).get("step", 0) <= step]
        write_text(self.path, "".join(kept))
