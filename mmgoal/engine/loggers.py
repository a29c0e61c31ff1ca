"""Loggers: the records of ``metrics.jsonl`` sent on to TensorBoard or Weights & Biases,
on rank 0 only (docs/logging.md). Each package (the ``tracking`` extra) is imported when
its logger opens, never by ``import mmgoal``.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any, Literal

import yaml

from mmgoal.extras import require_extra
from mmgoal.files import read_text, write_text
from mmgoal.registry import LOGGERS

# Keys of a record that place it (the x axis, its kind) rather than measure anything.
PLACEMENT_KEYS = ("type", "step", "epoch")


class LoggerError(RuntimeError):
    """A logger could not start (W&B without a login): the run stops before training."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a ``metrics.jsonl`` record but its placement, named
    ``<type>/<key>``: ``{"type": "val", "step": 12, "epoch": 1, "rsum": 151.2}`` gives
    ``{"val/rsum": 151.2}``."""
    return {f"{record['type']}/{key}": float(value) for key, value in record.items()
            if key not in PLACEMENT_KEYS and isinstance(value, (int, float))
            and not isinstance(value, bool) and math.isfinite(value)}


class Logger:
    """Base class of the ``loggers:`` entries (docs/logging.md, "A logger of your own").

    Built on every rank, so the constructor only checks options and packages; rank 0
    alone calls ``open``, ``log`` per record and ``close``, however ``fit()`` ends. A
    subclass implements ``log_scalars``, or overrides ``log`` to see whole records.
    """

    def check(self, work_dir: Path) -> None:
        """Raise ``LoggerError`` for a place this logger could not write to, before the run
        writes anything (on rank 0, before ``config.yaml``). Nothing by default."""

    def open(self, work_dir: Path, config: dict[str, Any], step: int) -> None:
        """Start logging a run in ``work_dir`` (it exists) with the resolved ``config``, from
        ``step`` (0, or the checkpoint's step of a resumed run: later records follow it)."""

    def log(self, record: dict[str, Any]) -> None:
        """One record of ``metrics.jsonl`` (it has ``type`` and ``step``): its scalars."""
        values = scalars(record)
        if values:
            self.log_scalars(values, record["step"])

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        """``values`` (``{"train/loss": 0.41, ...}``) at the global ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_scalars (or log)")

    def close(self) -> None:
        """Flush and release what ``open`` started; a logger that never opened does nothing."""

    @classmethod
    def written_files(cls, work_dir: Path, **options: Any) -> list[Path]:
        """What a logger of these ``options`` wrote for the run in ``work_dir`` (that
        ``--overwrite`` deletes, and nothing else); none by default."""
        return []


def config_as_markdown(config: dict[str, Any]) -> str:
    """The config as YAML, indented into a markdown code block (TensorBoard's text tab
    renders markdown, which would join the YAML's lines)."""
    text = yaml.safe_dump(config, sort_keys=False)
    return "\n".join("    " + line for line in text.splitlines())


@LOGGERS.register()
class TensorBoardLogger(Logger):
    """Scalars as TensorBoard event files in ``log_dir`` (relative to the run directory),
    written every ``flush_secs``, and the resolved config as text (docs/logging.md,
    "TensorBoard"). A resumed run purges the steps after its checkpoint."""

    def __init__(self, log_dir: str = "tensorboard", flush_secs: float = 30.0) -> None:
        if flush_secs <= 0:
            raise ValueError(f"TensorBoardLogger flush_secs must be above 0, got {flush_secs!r}")
        require_extra("tensorboard", "loggers: [{type: TensorBoardLogger}]")
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self.writer = None

    def check(self, work_dir: Path) -> None:
        folder = Path(work_dir) / self.log_dir
        if folder.exists() and not folder.is_dir():
            raise LoggerError(f"TensorBoardLogger log_dir {folder} is a file, not a folder; "
                              f"give another log_dir (relative to the run directory)")

    @classmethod
    def written_files(cls, work_dir: Path, log_dir: str = "tensorboard",
                      **_: Any) -> list[Path]:
        """The event files in ``log_dir``; the folder itself where it holds nothing else."""
        folder = Path(work_dir) / log_dir
        if not folder.is_dir():
            return []
        events = sorted(folder.glob("events.out.tfevents.*"))
        others = [p for p in folder.iterdir() if p not in events]
        if events and not others and folder.resolve() != Path(work_dir).resolve():
            return [folder]
        return events

    def open(self, work_dir: Path, config: dict[str, Any], step: int) -> None:
        summary = importlib.import_module("torch.utils.tensorboard")
        self.writer = summary.SummaryWriter(log_dir=str(Path(work_dir) / self.log_dir),
                                            flush_secs=self.flush_secs,
                                            purge_step=step + 1 if step else None)
        self.writer.add_text("config", config_as_markdown(config), global_step=step)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@LOGGERS.register()
class WandbLogger(Logger):
    """Scalars to a Weights & Biases run, with the resolved config as the run's config;
    the options are ``wandb.init``'s, ``None`` leaving W&B's default (docs/logging.md,
    "Weights & Biases"). ``dir``, relative to the run directory, receives ``wandb/``; the
    run's id is kept in ``<work_dir>/wandb_id``, so a resumed run continues it."""

    ID_FILE = "wandb_id"

    def __init__(self, project: str | None = None, entity: str | None = None,
                 name: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, notes: str | None = None,
                 mode: Literal["online", "offline", "disabled"] | None = None,
                 dir: str = ".") -> None:
        require_extra("wandb", "loggers: [{type: WandbLogger}]")
        self.init_options = {"project": project, "entity": entity, "name": name,
                             "group": group, "tags": tags, "notes": notes, "mode": mode}
        self.dir = dir
        self.run = None

    @classmethod
    def written_files(cls, work_dir: Path, dir: str = ".", **_: Any) -> list[Path]:
        """``wandb_id`` and the W&B run folders of that id under ``<dir>/wandb`` (with the
        ``latest-run`` link where it points at one)."""
        id_file = Path(work_dir) / cls.ID_FILE
        if not id_file.is_file():
            return []
        run_id = read_text(id_file, "run id file").strip()
        wandb_dir = Path(work_dir) / dir / "wandb"
        runs = sorted(wandb_dir.glob(f"*-{run_id}")) if run_id else []
        latest = wandb_dir / "latest-run"
        link = [latest] if latest.is_symlink() and latest.resolve() in \
            [r.resolve() for r in runs] else []
        return [id_file, *runs, *link]

    def open(self, work_dir: Path, config: dict[str, Any], step: int) -> None:
        wandb = importlib.import_module("wandb")
        id_file = Path(work_dir) / self.ID_FILE
        run_dir = Path(work_dir) / self.dir
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                **{k: v for k, v in self.init_options.items() if v is not None},
                dir=str(run_dir), config=config, resume="allow",
                id=read_text(id_file, "run id file").strip() if id_file.is_file() else None)
        except wandb.errors.Error as error:  # no login, no network in online mode
            raise LoggerError(f"WandbLogger could not start a W&B run ({error}); log in with "
                              f"`wandb login`, or set mode: offline in its config and upload "
                              f"the run later with `wandb sync`") from error
        write_text(id_file, self.run.id + "\n")

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
