"""Writing WebDataset shards: tars of samples ``{"__key__": str, ext: bytes, ...}``, each
entry a ``<key>.<ext>`` member. A shard is written to a temporary file and renamed when
complete (:func:`mmgoal.files.temporary_for`): no truncated shard looks finished.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from mmgoal.files import temporary_for

if TYPE_CHECKING:  # webdataset imports torch: loaded with the first shard, not before
    import webdataset as wds


class ShardWriter:
    """Writes samples into numbered shards of at most ``max_count`` samples.

    Shards are ``{prefix}-{index:06d}.tar``, or ``{index}.tar`` for an empty prefix
    (CLIP_benchmark's layout), from ``first_index`` (a conversion writes shard ``i`` alone);
    ``paths`` lists those written, in order.
    """

    def __init__(self, out_dir: str | os.PathLike, prefix: str, max_count: int = 1000,
                 first_index: int = 0) -> None:
        if max_count < 1:
            raise ValueError(f"max_count must be at least 1, got {max_count}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_count = max_count
        self.first_index = first_index
        self.paths: list[Path] = []
        self._stream = None
        self._staged = contextlib.ExitStack()  # the shard's temporary file, renamed on close
        self._writer: wds.TarWriter | None = None
        self._count = 0

    def _open_next(self) -> None:
        import webdataset as wds

        self._close_current()
        index = self.first_index + len(self.paths)
        path = self.out_dir / (f"{self.prefix}-{index:06d}.tar" if self.prefix else f"{index}.tar")
        self._stream = open(self._staged.enter_context(temporary_for(path)), "wb")
        # A fixed mtime makes the bytes of a shard a function of its samples only; an int,
        # because a float one puts a PAX header before every member, which doubles the
        # header parsing of every reader (bench/data.py).
        self._writer = wds.TarWriter(self._stream, mtime=0)
        self.paths.append(path)
        self._count = 0

    def _close_current(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._stream.close()
        self._writer = self._stream = None
        self._staged.close()  # fsynced and renamed

    def write(self, sample: dict) -> None:
        """Append one sample (``__key__`` plus ``ext: bytes`` entries)."""
        if "__key__" not in sample:
            raise ValueError("a shard sample needs a '__key__' entry")
        if self._writer is None or self._count >= self.max_count:
            self._open_next()
        self._writer.write({**sample, "__key__": str(sample["__key__"])})
        self._count += 1

    def close(self) -> None:
        self._close_current()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        elif self._writer is not None:  # leave no half-written shard behind
            self._writer.close()
            self._stream.close()
            self._staged.__exit__(exc_type, exc, tb)  # its temporary file removed
            self.paths.pop()
            self._writer = self._stream = None
