"""Shards from anywhere webdataset reads, with retries: local files, HTTP(S) URLs, ``pipe:``.

A shard is named as webdataset names it: a local path, an ``http://`` or ``https://``
URL (S3, GCS and Azure serve these too, presigned or public), or ``pipe:COMMAND``,
a command that writes the tar to its standard output (``pipe:aws s3 cp
s3://bucket/train-000.tar -``, ``pipe:gsutil cat gs://...``, ``pipe:curl -s -L ...``).
Brace patterns expand in all of them (``https://host/train-{000..099}.tar``).

A remote shard is read through :class:`ResilientStream`: a read that fails (the
connection drops, the server stops answering within ``timeout`` seconds, the
command exits with an error) is retried where it broke, up to ``retries`` times
with a doubling pause (an HTTP server that honours ``Range`` resumes at the byte;
otherwise the shard is read again and the bytes already read are skipped), so the
tar reader sees one unbroken stream. After the last retry the read fails with
:class:`ShardReadError`, which the pipeline counts and skips like a corrupt sample,
naming the shard and why. Local files are opened as webdataset opens them.

An epoch's size of remote shards is not found by reading them: :func:`shard_sizes`
reads ``sizes.json`` beside them (``{"train-000.tar": 10000, ...}``, the
webdataset and open_clip convention) or img2dataset's ``<shard>_stats.json``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import select
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from webdataset.tariterators import group_by_keys, tar_file_expander

logger = logging.getLogger(__name__)

REMOTE_PREFIXES = ("http://", "https://", "pipe:")
RETRIES = 3  # reads of a remote shard after the first one fails
TIMEOUT = 60.0  # seconds a remote read may wait for a byte
BACKOFF = 1.0  # seconds before the first retry, doubled each time
SIZES_FILE = "sizes.json"
CHUNK = 1 << 20


class ShardReadError(OSError):
    """A remote shard could not be read, after its retries (counted as a skipped sample)."""


def is_remote(url: str) -> bool:
    return str(url).startswith(REMOTE_PREFIXES)


def _opened_http(url: str, position: int, timeout: float) -> tuple[Any, int | None]:
    """An HTTP response from byte ``position`` on, and the shard's length where known."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={position}-"}
                                     if position else {})
    response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 (the user's URL)
    length = response.headers.get("Content-Length")
    if position and response.status == 206:  # resumed at the byte
        return response, position + int(length) if length is not None else None
    total = int(length) if length is not None else None
    _skip(response, position)  # no Range: read again up to where it broke
    return response, total


def _skip(stream: Any, count: int) -> None:
    while count > 0:
        chunk = stream.read(min(count, CHUNK))
        if not chunk:
            raise OSError(f"ended after {count} bytes fewer than were read before")
        count -= len(chunk)


class _Pipe:
    """A command's standard output, read with a timeout; the command's exit status is
    checked at its end."""

    def __init__(self, command: str, timeout: float) -> None:
        self.command = command
        self.process = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        self.timeout = timeout

    def read(self, size: int) -> bytes:
        descriptor = self.process.stdout.fileno()
        ready, _, _ = select.select([descriptor], [], [], self.timeout)
        if not ready:
            raise TimeoutError(f"the command wrote nothing for {self.timeout:g} s")
        data = os.read(descriptor, size)
        if not data:
            status = self.process.wait(timeout=self.timeout)
            if status:
                error = self.process.stderr.read().decode(errors="replace").strip()
                raise OSError(f"the command exited with status {status}"
                              f"{': ' + error.splitlines()[-1] if error else ''}")
        return data

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class ResilientStream(io.RawIOBase):
    """The bytes of one remote shard, reopened where a read fails (see the module docstring).

    Args:
        url: an ``http(s)://`` URL or ``pipe:COMMAND``.
        retries: reads after the first one fails.
        timeout: seconds a read may wait for data.
        backoff: seconds before the first retry, doubled for each later one.

    Raises:
        ShardReadError: (from ``read``) the shard failed ``retries + 1`` times.
    """

    def __init__(self, url: str, retries: int = RETRIES, timeout: float = TIMEOUT,
                 backoff: float = BACKOFF) -> None:
        super().__init__()
        self.url, self.retries, self.timeout, self.backoff = url, retries, timeout, backoff
        self.position = 0
        self.failures = 0
        self.length: int | None = None
        self._stream: Any = None
        self._open()

    def _open(self) -> None:
        while True:
            try:
                if self.url.startswith("pipe:"):
                    self._stream = _Pipe(self.url.removeprefix("pipe:"), self.timeout)
                    _skip(self._stream, self.position)
                else:
                    self._stream, self.length = _opened_http(self.url, self.position,
                                                             self.timeout)
                return
            except Exception as error:  # noqa: BLE001 (every way a store can fail)
                self._failed(error)

    def _failed(self, error: Exception) -> None:
        """Count a failure; wait and return (to try again) or raise when none is left."""
        self.failures += 1
        if self._stream is not None:
            try:
                self._stream.close()
            except Exception:  # noqa: BLE001 (a broken stream may fail to close too)
                pass
            self._stream = None
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if isinstance(error, TimeoutError) or "timed out" in reason:
            reason = f"no data for {self.timeout:g} s ({reason})"
        # the store's answer (404, 403) will not change: no retry for it
        final = isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500 \
            and error.code not in (408, 429)
        if final or self.failures > self.retries:
            raise ShardReadError(f"shard {self.url} could not be read after "
                                 f"{self.failures} attempt(s), at byte {self.position}: {reason}")
        pause = self.backoff * 2 ** (self.failures - 1)
        logger.warning("shard %s: read failed at byte %d (%s); retry %d of %d in %.1f s",
                       self.url, self.position, reason, self.failures, self.retries, pause)
        time.sleep(pause)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._stream is None:
                self._open()
            try:
                data = self._stream.read(len(buffer))
                if not data and self.length is not None and self.position < self.length:
                    raise OSError(f"the connection ended at byte {self.position} of "
                                  f"{self.length}")
            except Exception as error:  # noqa: BLE001 (a dropped connection, a timeout...)
                self._failed(error)
                continue
            buffer[:len(data)] = data
            self.position += len(data)
            return len(data)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super().close()


def open_shard(url: str, retries: int = RETRIES, timeout: float = TIMEOUT) -> Any:
    """A readable binary stream of a shard: a local file as webdataset opens it, a remote
    one as a buffered :class:`ResilientStream`."""
    if is_remote(url):
        return io.BufferedReader(ResilientStream(url, retries, timeout), buffer_size=CHUNK)
    return open(url.removeprefix("file://"), "rb")


def _opened_shards(sources: Iterable[dict], handler: Callable[[Exception], bool],
                   retries: int, timeout: float) -> Iterator[dict]:
    for source in sources:
        url = source["url"]
        try:
            yield {**source, "stream": open_shard(url, retries, timeout)}
        except Exception as error:  # noqa: BLE001 (counted and skipped, as webdataset does)
            if not isinstance(error, ShardReadError):  # which names the shard itself
                error.args = (*error.args, url)
            if not handler(error):
                break


def tar_samples(handler: Callable[[Exception], bool],
                select_files: Callable[[str], bool] | None = None, retries: int = RETRIES,
                timeout: float = TIMEOUT) -> Callable[[Iterable[dict]], Iterator[dict]]:
    """The pipeline stage from ``{"url": ...}`` items to samples (``webdataset``'s
    ``tarfile_to_samples``, with :func:`open_shard` opening each shard)."""
    def stage(sources: Iterable[dict]) -> Iterator[dict]:
        files = tar_file_expander(_opened_shards(sources, handler, retries, timeout),
                                  handler=handler, select_files=select_files)
        return group_by_keys(files, handler=handler)

    return stage


def _json_beside(url: str, name: str, timeout: float) -> Any:
    """``name`` in the folder of the shard ``url`` as JSON, or None where there is none."""
    if url.startswith("pipe:"):
        return None
    location = posixpath.join(posixpath.dirname(url), name)
    try:
        with urllib.request.urlopen(location, timeout=timeout) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
    except ValueError as error:
        raise ValueError(f"{location} is not JSON ({error})") from None


def shard_sizes(urls: Sequence[str], timeout: float = TIMEOUT) -> list[int] | None:
    """The samples of each remote shard, from ``sizes.json`` beside them or each shard's
    img2dataset ``<name>_stats.json`` (``successes``); None where neither says (a
    ``pipe:`` command's shards never say)."""
    sizes: dict[str, dict] = {}
    counts = []
    for url in urls:
        folder = posixpath.dirname(url)
        if folder not in sizes:
            sizes[folder] = _json_beside(url, SIZES_FILE, timeout) or {}
        name = posixpath.basename(url)
        if name in sizes[folder]:
            counts.append(int(sizes[folder][name]))
            continue
        stats = _json_beside(url, posixpath.splitext(name)[0] + "_stats.json", timeout)
        if not isinstance(stats, dict) or "successes" not in stats:
            return None
        counts.append(int(stats["successes"]))
    return counts
