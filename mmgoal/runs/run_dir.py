"""A run directory: its files, where its weights are, and its life (start, resume).

A run directory holds ``config.yaml``, ``metrics.jsonl``, ``report.json`` and
``checkpoints/`` (``best.pt``, the strategy's resumable ``last.pt`` or
``deepspeed/<tag>/``, ``epoch_<E>.pt`` with ``train.keep_epochs``), written by the engine
and read back through :func:`weights_file` and :mod:`mmgoal.runs.loading`. One process at a
time writes it (:func:`run_lock`); a new run is refused where one is unless resumed or
``overwrite`` (which deletes what the old run wrote, :func:`run_written_files`), and a
resume may change only :data:`RESUMABLE` keys, recorded in ``config_changes.jsonl``
(docs/configs.md, "What a run writes"; docs/getting_started.md, "The run directory").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mmgoal.config import config_changes, describe_changes, load_config
from mmgoal.files import (
    MAX_ANNOTATION_BYTES,
    open_unlinked,
    read_text,
    refuse_link,
    remove_stale_temporaries,
    write_text,
)
from mmgoal.registry import LOGGERS

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
BEST = "best.pt"  # float32 weights of the best epoch (any strategy)
LAST = "last.pt"  # the torch strategy's resumable checkpoint
# train.keep_epochs: the torch strategy's resumable checkpoint at the end of epoch E (0-based,
# as metrics.jsonl and best.pt count epochs); exactly the names mmgoal writes
EPOCH_CHECKPOINT = re.compile(r"epoch_(0|[1-9][0-9]*)\.pt")
DEEPSPEED = "deepspeed"  # the DeepSpeed strategy's tags, under checkpoints/
DEEPSPEED_WEIGHTS = "weights.pt"  # a DeepSpeed tag's consolidated float32 model
LATEST = "latest"  # the pointer to the newest complete DeepSpeed tag
CHANGES_FILE = "config_changes.jsonl"
LOCK_FILE = ".mmgoal-run.lock"  # held by the process writing the run (run_lock)
# mmgoal export --format FORMAT: the file its folder is known by, and the model family that
# reads the folder back (its export_folder_section)
EXPORT_FOLDERS = {"open_clip": ("open_clip_config.json", "OpenCLIP"),
                  "hf": ("config.json", "HFCLIP")}
# What mmgoal export writes beside a folder export's files: the format and the files it
# wrote. A folder is an earlier export of mmgoal's (which a new export may write over) by
# this file alone, never by a library's file name, which anyone's folder may hold.
EXPORT_MANIFEST = ".mmgoal-export.json"
# What a run writes in its folder; the loggers' files are theirs to name (a logger class's
# written_files, mmgoal/engine/loggers.py), from the run's own config.
TEXT_LOG = "train.log"  # the run's text log, opened as it sets up, before config.yaml
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", TEXT_LOG, "report.json", CHANGES_FILE,
             f"{CHECKPOINTS}/{BEST}", f"{CHECKPOINTS}/{LAST}", f"{CHECKPOINTS}/{DEEPSPEED}")
DEFAULT_LOGGERS = [{"type": "TensorBoardLogger"}, {"type": "WandbLogger"}]
# Dotted keys (and every key below them) a resumed run may change.
RESUMABLE = (
    "train.epochs", "train.log_every", "train.eval_every", "train.eval_before_training",
    "train.progress", "train.early_stopping_patience",
    "train.checkpoint_every_steps", "train.keep_epochs", "train.max_nonfinite_steps",
    "train.device",
    "train.cudnn_benchmark", "train.accumulate_steps", "train.clip_grad", "optimizer.lr",
    "data.train.batch_size",
    "data.num_workers", "data.eval_batch_size", "data.val", "data.test", "evaluation",
    "strategy.timeout_minutes", "loggers",
)


def write_pointer(path: Path, value: str) -> None:
    """Atomically point ``path`` at ``value`` (:func:`mmgoal.files.write_text`)."""
    write_text(path, value)


def read_pointer(path: Path) -> str | None:
    return read_text(path, "pointer file").strip() if path.is_file() else None


def epoch_checkpoint_name(epoch: int) -> str:
    """``epoch_<epoch>.pt``: the checkpoint ``train.keep_epochs`` keeps of the end of ``epoch``."""
    return f"epoch_{epoch}.pt"


def epoch_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The epoch checkpoints of ``directory`` (a run's ``checkpoints/``), oldest first:
    ``(epoch, path)`` of each file named exactly as mmgoal names them (``epoch_3.pt``; not
    ``epoch_03.pt``, ``epoch_3.pt.bak``), a symbolic link left out (mmgoal did not write it)."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        matched = EPOCH_CHECKPOINT.fullmatch(path.name)
        if matched and path.is_file() and not path.is_symlink():
            found.append((int(matched.group(1)), path))
    return sorted(found)


def epoch_checkpoints_by_progress(directory: Path) -> list[tuple[tuple[int, int], Path]]:
    """The epoch checkpoints of ``directory``, oldest first by the progress each holds
    (``(epochs done, step)``, :func:`~mmgoal.runs.checkpoint.checkpoint_progress`), never by
    its name: a copy of ``epoch_1.pt`` named ``epoch_7.pt`` is the end of epoch 1 (said in
    the log; of two at the same progress, it is the older). A file whose progress cannot be
    read counts by its name, with no step."""
    from mmgoal.runs.checkpoint import checkpoint_progress  # torch: not for a tool's --help

    ordered = []
    for epoch, path in epoch_checkpoints(directory):
        progress = checkpoint_progress(path)
        if progress is None:
            progress = (epoch + 1, -1)
        elif progress[0] != epoch + 1:
            logger.warning("%s holds the end of epoch %d (step %d), not of epoch %d as its name "
                           "says: it counts as what it holds", path, progress[0] - 1,
                           progress[1], epoch)
        ordered.append((progress, progress[0] == epoch + 1, path))
    return [(progress, path) for progress, _, path in sorted(ordered)]


def prune_epoch_checkpoints(directory: Path, keep: int) -> list[Path]:
    """Delete the epoch checkpoints of ``directory`` but the newest ``keep`` by progress
    (:func:`epoch_checkpoints_by_progress`); return them."""
    kept = epoch_checkpoints_by_progress(directory)
    older = [path for _, path in kept[:max(len(kept) - keep, 0)]]
    for path in older:
        path.unlink()
    return older


def clear_unfinished_copies(directory: Path) -> list[Path]:
    """Delete the temporary files that writes killed in ``directory`` (a run's
    ``checkpoints/``) left, whatever they were writing (a ``train.keep_epochs`` copy is never
    written again under its name); an epoch copy lost so is said in the log. Returns them."""
    stale = remove_stale_temporaries(directory / "x", name="*")
    for tmp in stale:
        target = tmp.name[1:].rsplit(".tmp-", 1)[0]
        if EPOCH_CHECKPOINT.fullmatch(target) and not (directory / target).exists():
            logger.warning("train.keep_epochs: %s was being written when the run was stopped, "
                           "so the end of that epoch is not kept (its unfinished copy, %s, is "
                           "removed)", target, tmp.name)
    return stale


def latest_deepspeed_tag(directory: Path) -> Path | None:
    """The folder of the newest complete DeepSpeed tag in ``directory`` (a run's
    ``checkpoints/``), which ``deepspeed/latest`` names; None where no tag is complete."""
    tag = read_pointer(directory / DEEPSPEED / LATEST)
    return directory / DEEPSPEED / tag if tag else None


def has_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` (a run's ``checkpoints/``) holds a resumable checkpoint of any
    strategy."""
    return ((directory / LAST).is_file() or latest_deepspeed_tag(directory) is not None
            or bool(epoch_checkpoints(directory)))


def weights_file(path: str | os.PathLike, which: str = "best_or_latest") -> Path:
    """The file with the float32 weights of a run directory, or ``path`` itself if a file.

    Args:
        which: ``best`` (``best.pt``), ``latest`` (a DeepSpeed tag's ``weights.pt``,
            else ``last.pt``, else the newest ``epoch_<E>.pt``) or ``best_or_latest``
            (best.pt where the run validated, else the latest).

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder without such a checkpoint.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist; give a run directory or a checkpoint "
                                f"file")
    checkpoints = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    candidates = []
    if which in ("best", "best_or_latest"):
        candidates.append(checkpoints / BEST)
    if which in ("latest", "best_or_latest"):
        tag = latest_deepspeed_tag(checkpoints)
        candidates.append(tag / DEEPSPEED_WEIGHTS if tag is not None else checkpoints / LAST)
        kept = epoch_checkpoints_by_progress(checkpoints)
        if tag is None and kept:
            candidates.append(kept[-1][1])
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if (path / "adapter_config.json").is_file():  # peft's save_pretrained, or mmgoal's export
        raise FileNotFoundError(f"{path} is a folder of LoRA adapters (peft's format), not a "
                                f"model: load them onto their base model with "
                                f"peft.PeftModel.from_pretrained, or start a run from them "
                                f"with model.peft.pretrained: {path} (docs/models.md, LoRA)")
    raise FileNotFoundError(f"{path} holds no {'best' if which == 'best' else 'complete'} "
                            f"checkpoint (looked for {' and '.join(map(str, candidates))})")


def export_folder_format(path: str | os.PathLike) -> str | None:
    """The ``mmgoal export --format`` whose folder ``path`` is (``open_clip``, ``hf``), or
    None: a run folder, a file, anything else."""
    path = Path(path)
    if not path.is_dir() or (path / CHECKPOINTS).is_dir():
        return None
    return next((fmt for fmt, (marker, _) in EXPORT_FOLDERS.items()
                 if (path / marker).is_file()), None)


def check_is_folder(work_dir: Path) -> None:
    """A ``ValueError`` when ``work_dir`` exists and is not a folder."""
    if work_dir.exists() and not work_dir.is_dir():
        raise ValueError(f"--work-dir {work_dir} is a file; give a run directory (new or an "
                         f"earlier run's)")


class RunFolderLocked(ValueError):
    """Another live process holds the run folder (:func:`run_lock`)."""


@contextlib.contextmanager
def run_lock(work_dir: str | os.PathLike, wait_seconds: float = 0.0) -> Iterator[Path]:
    """Hold the run folder ``work_dir`` for the life of the block: one writer per run.

    The lock is an OS file lock (``flock``) on ``work_dir/.mmgoal-run.lock``, so it ends
    with the process that holds it, however that ends: a SIGKILLed run leaves the file
    but no lock. The file names its holder (PID, host, since when) for the message a
    second process gets. On a network file system without ``flock`` support the
    lock is only as good as that system's.

    Args:
        wait_seconds: how long to wait for a holder to let go before refusing (a
            requeued job beside the run it replaces, still writing its last checkpoint).

    Raises:
        RunFolderLocked: another process held it for all of ``wait_seconds``.
        ValueError: ``work_dir`` is a file or cannot be created, or its lock file is a
            folder or (:class:`~mmgoal.files.LinkedPathError`) a symbolic link.
    """
    import fcntl

    work_dir = Path(work_dir)
    check_is_folder(work_dir)
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--work-dir {work_dir} cannot be created ({error.strerror}); give a "
                         f"folder you can write, or create it first") from error
    path = work_dir / LOCK_FILE
    # a received run folder's lock may be a link to a file of yours: not followed
    stream = open_unlinked(path, os.O_RDWR | os.O_CREAT, "the run lock")
    deadline = time.monotonic() + wait_seconds
    try:
        while True:
            try:
                fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = read_text(path, "run lock").strip() or "another process"
                    waited = f" (waited {wait_seconds:g} s)" if wait_seconds else ""
                    raise RunFolderLocked(
                        f"--work-dir {work_dir} is in use by {holder}{waited}: two processes "
                        f"writing one run would mix their checkpoints and metrics; wait for "
                        f"it to end (or stop it), or choose another --work-dir") from None
                time.sleep(0.2)
        stream.seek(0)
        stream.truncate()
        stream.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        stream.flush()
        yield path
    finally:
        stream.close()  # closing releases the lock


def logger_files(work_dir: Path, loggers: Iterable[dict]) -> list[Path]:
    """The files and folders the ``loggers`` of a run's config wrote in ``work_dir``, as each
    logger class says (``written_files``; a logger type not registered here is skipped)."""
    found: list[Path] = []
    for logger_cfg in loggers:
        name = logger_cfg.get("type") if isinstance(logger_cfg, dict) else None
        if name in LOGGERS and hasattr(LOGGERS.get(name), "written_files"):
            options = {k: v for k, v in logger_cfg.items() if k != "type"}
            found += LOGGERS.get(name).written_files(work_dir, **options)
    return found


def run_written_files(work_dir: str | os.PathLike) -> list[Path]:
    """What a run wrote in ``work_dir`` that is still there: its files (:data:`RUN_FILES`)
    and its loggers' (those of its ``config.yaml``, else the loggers' default places)."""
    work_dir = Path(work_dir)
    try:
        stored = stored_config(work_dir)
    except ValueError:  # an unreadable config.yaml: the default places, then
        stored = None
    loggers = stored.get("loggers") or [] if stored is not None else DEFAULT_LOGGERS
    # a checkpoint write that a kill interrupted leaves its temporary file
    unfinished = sorted((work_dir / CHECKPOINTS).glob(".*.tmp-*"))
    kept = [path for _, path in epoch_checkpoints(work_dir / CHECKPOINTS)]
    paths = [work_dir / name for name in RUN_FILES] + kept + unfinished + \
        logger_files(work_dir, loggers)
    return list(dict.fromkeys(p for p in paths if p.exists() or p.is_symlink()))


def existing_run_files(work_dir: str | os.PathLike) -> list[str]:
    """The files of a run that ``work_dir`` already holds, relative to it (empty: none)."""
    return _relative(Path(work_dir), run_written_files(work_dir))


def _relative(work_dir: Path, paths: list[Path]) -> list[str]:
    return [str(path.relative_to(work_dir)) if path.is_relative_to(work_dir) else str(path)
            for path in paths]


def prepare_work_dir(work_dir: str | os.PathLike, resume: bool,
                     overwrite: bool = False) -> list[str]:
    """Check ``work_dir`` before a run starts in it; with ``overwrite``, delete what the
    run there wrote (:func:`run_written_files`) and nothing else.

    Returns:
        What ``overwrite`` deleted (relative to ``work_dir``; empty otherwise).

    Raises:
        ValueError: ``work_dir`` is a file; or it holds a run and neither ``resume``
            nor ``overwrite`` is given.
        LinkedPathError: a run file (or ``checkpoints/``, or an ``epoch_<E>.pt`` there) is
            a symbolic link, which the run would write through.
    """
    work_dir = Path(work_dir)
    check_is_folder(work_dir)
    for name in (CHECKPOINTS, *RUN_FILES):  # a received run folder's links: never followed
        refuse_link(work_dir / name)
    if (work_dir / CHECKPOINTS).is_dir():  # where train.keep_epochs would write
        for path in (work_dir / CHECKPOINTS).iterdir():
            if EPOCH_CHECKPOINT.fullmatch(path.name):
                refuse_link(path)
    if resume:
        return []
    written = run_written_files(work_dir)
    found = _relative(work_dir, written)
    if found in ([], [TEXT_LOG]):  # a run stopped in its setup: the next appends its log
        return []
    if not overwrite:
        go_on = ("continue it with --resume, " if has_checkpoint(work_dir / CHECKPOINTS)
                 else "it has no checkpoint to resume: ")
        raise ValueError(f"--work-dir {work_dir} already holds a run ({', '.join(found)}); "
                         f"{go_on}start afresh with --overwrite (its run files are "
                         f"deleted), or choose another --work-dir")
    for path in written:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    checkpoints = work_dir / CHECKPOINTS
    if checkpoints.is_dir() and not any(checkpoints.iterdir()):  # the run made it
        checkpoints.rmdir()
    return found


def resumable(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUMABLE)


def stored_config(work_dir: str | os.PathLike) -> dict | None:
    """The config a run trains with: its ``config.yaml`` with every recorded change applied
    (``None`` when the directory has no config.yaml)."""
    work_dir = Path(work_dir)
    if not (work_dir / CONFIG_FILE).is_file():
        return None
    cfg = load_config(work_dir / CONFIG_FILE)
    for record in read_changes(work_dir):
        for key, (_, value) in record["changes"].items():
            _set(cfg, key.split("."), value)
    return cfg


def resume_changes(work_dir: str | os.PathLike, requested: dict,
                   resolve=lambda cfg: cfg) -> dict[str, list]:
    """What a resume with the ``requested`` config changes in the run's own config.

    Args:
        work_dir: the run directory.
        requested: the resolved config given for the resume (file + overrides).
        resolve: resolves the stored config the same way (defaults written out).

    Returns:
        The accepted changes (dotted key -> [old, new]); empty for a run without
        a stored config.

    Raises:
        ValueError: a change of a key that must not change on resume, each named.
    """
    stored = stored_config(work_dir)
    if stored is None:
        return {}
    changes = dict(sorted(config_changes(resolve(stored), requested).items()))
    refused = {key: change for key, change in changes.items() if not resumable(key)}
    if refused:
        raise ValueError(
            f"--resume: the config differs from the one {work_dir} was trained with in keys "
            f"a resumed run must keep: {describe_changes(refused, 8)}. Resume with the run's own "
            f"{Path(work_dir) / CONFIG_FILE} (changing only {', '.join(RESUMABLE)}), or "
            f"start a new run in another --work-dir")
    return changes


def record_changes(work_dir: str | os.PathLike, changes: dict[str, list], epoch: int,
                   step: int) -> None:
    """Append one resume's accepted changes to ``config_changes.jsonl``."""
    if not changes:
        return
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "epoch": epoch, "step": step,
              "changes": changes}
    with open_unlinked(Path(work_dir) / CHANGES_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                       "the run's record of config changes") as stream:
        stream.write(json.dumps(record) + "\n")


def read_changes(work_dir: str | os.PathLike) -> Iterable[dict]:
    path = Path(work_dir) / CHANGES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in read_text(path, "run log", MAX_ANNOTATION_BYTES)
            .splitlines() if line.strip()]


def _set(cfg: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        cfg = cfg.setdefault(key, {})
    cfg[keys[-1]] = value
