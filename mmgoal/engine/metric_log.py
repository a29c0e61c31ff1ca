"""A run's logs, on rank 0: ``metrics.jsonl``, ``train.log`` (plain text, as open_clip's
``out.log``; docs/getting_started.md, "The run directory") and the ``loggers:``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Collection, Sequence
from pathlib import Path

from mmgoal import strict_json
from mmgoal.engine.loggers import Logger
from mmgoal.files import MAX_ANNOTATION_BYTES, open_unlinked, read_text, write_text
from mmgoal.runs.run_dir import TEXT_LOG

logger = logging.getLogger(__name__)
# The step lines: to train.log always, to the console only without a progress bar (whose
# postfix shows the same numbers)
step_logger = logging.getLogger("mmgoal.steps")


class MetricLog:
    """Appends one strict JSON object per line to ``metrics.jsonl`` (NaN/inf as ``null``;
    rank 0 only: ``enabled``), hands each record to ``loggers`` and makes a training
    record a line of ``train.log`` (and of the console, unless ``progress`` shows a bar)."""

    def __init__(self, path: Path, enabled: bool = True, loggers: Sequence[Logger] = (),
                 progress: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self.loggers = list(loggers) if enabled else []
        self.progress = progress
        self._text: logging.Handler | None = None
        self._levels: tuple[int, bool] | None = None  # mmgoal's logger level, steps' propagate

    def open(self, config: dict, step: int) -> None:
        """Start the loggers beside ``metrics.jsonl`` with the resolved ``config``, from
        ``step`` (a resumed run's), and ``train.log``."""
        self.open_text()
        for sink in self.loggers:
            sink.open(self.path.parent, config, step)

    def open_text(self) -> None:
        """Start ``train.log`` (once): every mmgoal log line from here on, the run's setup
        (the model built, the batch, the learning rate) included."""
        if not self.enabled or self._text is not None:
            return
        stream = open_unlinked(self.path.parent / TEXT_LOG,
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, "the run's text log")
        self._text = logging.StreamHandler(stream)
        self._text.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                                  datefmt="%Y-%m-%d %H:%M:%S"))
        package = logging.getLogger("mmgoal")
        self._levels = package.level, step_logger.propagate
        if package.getEffectiveLevel() > logging.INFO:
            package.setLevel(logging.INFO)  # the file takes INFO whatever the console does
        package.addHandler(self._text)
        if self.progress:  # the bar shows them: the file alone gets the step lines
            step_logger.propagate = False
            step_logger.addHandler(self._text)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open_unlinked(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                           "the run's metrics log") as stream:
            stream.write(strict_json.dumps(record) + "\n")
        if record.get("type") == "train":
            step_logger.info(step_line(record))
        for sink in self.loggers:
            sink.log(record)

    def note(self, text: str) -> None:
        """A block of text in ``train.log`` alone (the final test table, which the command
        prints on the console itself)."""
        if self._text is not None:
            self._text.handle(logging.LogRecord("mmgoal", logging.INFO, __file__, 0, text,
                                                None, None))

    def close(self) -> None:
        """Close every logger, also after an error: one that fails to close is reported and
        the others still close, so the error that ended the run is the one raised."""
        for sink in self.loggers:
            try:
                sink.close()
            except Exception as error:  # a logger's own failure must not hide the run's
                logger.warning("%s failed to close: %s", type(sink).__name__, error)
        self.close_text()

    def close_text(self) -> None:
        """Stop ``train.log`` (a trainer that never trains, when it is collected)."""
        if self._text is not None:
            package = logging.getLogger("mmgoal")
            package.removeHandler(self._text)
            step_logger.removeHandler(self._text)
            package.setLevel(self._levels[0])
            step_logger.propagate = self._levels[1]
            self._text.close()
            self._text = None

    def truncate_after(self, step: int, redone: Collection[str] = ()) -> None:
        """Drop the records of steps after ``step``, and those of the ``redone`` types
        (``val``, ``test``) at ``step``: a run resumed from a checkpoint at ``step`` logs
        them again (a run killed after its last checkpoint, or in a validation after it)."""
        if not self.path.is_file():
            return
        text = read_text(self.path, "metrics log", MAX_ANNOTATION_BYTES)
        records = [(line, json.loads(line)) for line in text.splitlines(keepends=True)]
        kept = [line for line, record in records if record.get("step", 0) < step
                or (record.get("step", 0) == step and record.get("type") not in redone)]
        write_text(self.path, "".join(kept))


def step_line(record: dict) -> str:
    """``epoch 0 step 40/120 loss 0.4123 lr 1.00e-03 samples/s 84.2 eta 0:06:12`` (and the
    objective's other outputs) of a training record."""
    done = f"{record['step']}/{record['total_steps']}" if "total_steps" in record \
        else str(record["step"])
    parts = [f"epoch {record['epoch']} step {done}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"samples/s {record['samples_per_s']:.1f}"]
    if record.get("eta_s") is not None:
        parts.append(f"eta {datetime.timedelta(seconds=round(record['eta_s']))}")
    return " ".join(parts)
