"""Files mmgoal writes: whole or not at all, and never through a link it did not make.

A folder mmgoal writes into may be someone else's (a lock linked to a file of yours), so
files are written through :func:`write_atomically` (a new ``O_EXCL | O_NOFOLLOW`` temporary
renamed over the target) or :func:`open_unlinked`; files a user names are read through
:func:`open_regular` and :func:`read_bytes`. The rules: docs/received_files.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


class LinkedPathError(ValueError):
    """A symbolic link stands where mmgoal would write a file: refused, not followed."""


class NotAFileError(ValueError):
    """A device, FIFO, socket or folder where mmgoal reads a file: refused, never opened."""


class OversizedFileError(ValueError):
    """A file larger than what mmgoal reads for its kind: refused unread."""


# What mmgoal reads whole, by kind of file. A list of names, prompts or one image's captions
# is KBs (ImageNet-21k's class names are 0.4 MB); a data set's annotation file is MBs (COCO's
# Karpathy JSON is 140 MB); a text file past its bound is not what the user meant.
MAX_LIST_BYTES = 16 << 20
MAX_ANNOTATION_BYTES = 1 << 30
# One image file (a 20-megapixel JPEG is about 10 MB); shard samples have their own bound
MAX_IMAGE_BYTES = 64 << 20
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a folder"))


def _not_a_file(path: str | os.PathLike, what: str, mode: int) -> NotAFileError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return NotAFileError(f"{what} {path} is {kind}, not a file; mmgoal reads no "
                         f"devices, FIFOs or sockets (it could fill memory or wait for ever): "
                         f"give a regular file")


def check_regular(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """The ``stat`` of ``path`` (links followed) when it is a regular file, read nothing;
    else a :class:`NotAFileError` (FileNotFoundError where nothing is there)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _not_a_file(path, what, info.st_mode)
    return info


def open_regular(path: str | os.PathLike, what: str = "file") -> IO[bytes]:
    """``path`` opened for binary reading when it is a regular file, checked before opening
    (opening a device can act) and again once open without blocking (a FIFO swapped in
    would wait for ever); ``what`` names it in messages (``caption file``)."""
    check_regular(path, what)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ENXIO:  # a socket swapped in
            raise NotAFileError(f"{what} {path} is a socket, not a file") from None
        raise
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise _not_a_file(path, what, info.st_mode)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_bytes(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`); an
    :class:`OversizedFileError`, unread, when it holds more than ``limit`` bytes."""
    with open_regular(path, what) as stream:
        size = os.fstat(stream.fileno()).st_size
        data = stream.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise OversizedFileError(f"{what} {path} holds {max(size, len(data)):,} bytes, more "
                                 f"than the {limit:,} mmgoal reads for a {what}: it is not "
                                 f"read (is it the right file?)")
    return data


def read_text(path: str | os.PathLike, what: str, limit: int = MAX_LIST_BYTES,
              encoding: str = "utf-8") -> str:
    """The text of the regular file ``path``, bounded as :func:`read_bytes` bounds it."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {path} is not {encoding.upper()} text ({error})") from None


def refuse_link(path: str | os.PathLike) -> None:
    """Raise :class:`LinkedPathError` when ``path`` is a symbolic link (to anything, or to
    nothing)."""
    if os.path.islink(path):
        raise LinkedPathError(
            f"{path} is a symbolic link (to {os.readlink(path)}); mmgoal writes no file "
            f"through a link it did not make, since the folder may be someone else's and the "
            f"link would send the write to a file of yours: remove the link, or write "
            f"somewhere else")


def open_unlinked(path: str | os.PathLike, flags: int, what: str) -> IO:
    """``path`` opened with ``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)`` (created with
    the umask's permissions where ``flags`` has ``O_CREAT``) as a text stream; ``what``
    names it in messages (``the run lock``)."""
    mode = "a" if flags & os.O_APPEND else "r+" if flags & os.O_RDWR else "w"
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a folder; mmgoal writes a file there: move the "
                         f"folder away") from None
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            refuse_link(path)
        raise
    return os.fdopen(descriptor, mode)


def remove_stale_temporaries(path: Path, name: str | None = None) -> list[Path]:
    """Delete the temporary files of earlier writes of ``path`` whose process is gone (a
    SIGKILLed save leaves a full-size ``.<name>.tmp-<pid>``); return them. ``name``: a glob
    of the targets' names instead (``*``: of every file in ``path``'s folder)."""
    stale = []
    for tmp in path.parent.glob(f".{name or path.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            stale.append(tmp)
    return stale


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def umask() -> int:
    """This process's umask, read without changing it where Linux shows it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def temporary_for(path: str | os.PathLike, remove_stale: bool = False,
                  durable: bool = True) -> Iterator[Path]:
    """A new temporary file beside ``path`` (``.<name>.tmp-<pid>``, ``O_EXCL | O_NOFOLLOW``)
    for the block to write, then fsynced, given the umask's permissions (safetensors writes
    0600) and renamed over ``path``; if the block raises, ``path`` is untouched.

    Args:
        durable: fsync the file and the folder (off for many small files one can rewrite).
        remove_stale: first delete what killed writes of ``path`` left (lists the folder).
    """
    path = Path(path)
    refuse_link(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if remove_stale:
        remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if os.path.lexists(tmp):  # this process's own leftover, or a link someone placed there
        tmp.unlink()
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600))
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask())
        if durable:
            with open(tmp, "rb+") as stream:
                os.fsync(stream.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if not durable:
        return
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object],
                     remove_stale: bool = False, durable: bool = True) -> None:
    """``write(temporary_path)``, then the temporary file renamed over ``path``
    (:func:`temporary_for`, which says what ``remove_stale`` and ``durable`` do)."""
    with temporary_for(path, remove_stale, durable) as tmp:
        write(tmp)


def write_text(path: str | os.PathLike, text: str, durable: bool = True) -> None:
    """``path`` holds ``text`` afterwards, written as :func:`write_atomically` writes."""
    write_atomically(path, lambda tmp: tmp.write_text(text), durable=durable)


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """A new folder beside ``folder`` for the block to write into (``save_pretrained``);
    then each file gets the umask's permissions and is renamed into ``folder``, never
    through a link; if the block raises, nothing reaches ``folder``.
    """
    folder = Path(folder)
    refuse_link(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    if os.path.lexists(staging):
        _remove(staging)
    staging.mkdir()
    try:
        yield staging
        files = sorted(p.relative_to(staging) for p in staging.rglob("*") if not p.is_dir())
        for name in files:
            for part in (*reversed(name.parents[:-1]), name):  # its folders too
                refuse_link(folder / part)
        mode = 0o666 & ~umask()
        for name in files:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.chmod(staging / name, mode)
            os.replace(staging / name, folder / name)
    finally:
        _remove(staging)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def save_figure(figure, path: str | os.PathLike, dpi: int) -> None:
    """A matplotlib ``figure`` saved to ``path`` as :func:`write_atomically` writes, in the
    format its suffix names (``.png``, ``.pdf``, ``.svg``; none: PNG)."""
    suffix = Path(path).suffix.lstrip(".").lower()
    write_atomically(path, lambda tmp: figure.savefig(tmp, format=suffix or "png", dpi=dpi))
