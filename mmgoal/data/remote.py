"""Shards from anywhere webdataset reads, with retries: local files, HTTP(S) URLs, ``pipe:``.

A remote shard is read through :class:`ResilientStream`: a failed read is retried where it
broke (``Range``, or read again and skipped to the byte), so the tar reader sees one
unbroken stream; after the last retry a :class:`ShardReadError` is counted and skipped like
a corrupt sample. :func:`shard_sizes` reads an epoch's size from ``sizes.json`` or
img2dataset stats, not the shards. docs/data.md, "Shards on S3, GCS or HTTP".
"""

from __future__ import annotations

import glob
import hashlib
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import braceexpand

from mmgoal.data.tars import (
    MAX_SAMPLE_BYTES,
    OversizedSampleError,
    ShardError,
    tar_stream_samples,
)
from mmgoal.files import open_regular

logger = logging.getLogger(__name__)

REMOTE_PREFIXES = ("http://", "https://", "pipe:")
RETRIES = 3  # reads of a remote shard after the first one fails
TIMEOUT = 60.0  # seconds a remote read may wait for a byte
MIN_RATE = 1024.0  # bytes/s a remote shard must send, averaged over TIMEOUT seconds
BACKOFF = 1.0  # seconds before the first retry, doubled each time
SIZES_FILE = "sizes.json"
CHUNK = 1 << 20


class ShardReadError(ShardError):
    """A remote shard could not be read, after its retries (counted as a skipped sample)."""


class SlowShardError(OSError):
    """A remote shard that sends its bytes slower than the reader's ``min_rate`` (retried)."""


class RateFloor:
    """Fails a transfer whose bytes come slower than ``min_rate`` bytes/s, averaged over
    each window of ``window`` seconds: a server that drips a byte a second never lets a
    per-read timeout expire, and would hold a reader for ever."""

    def __init__(self, min_rate: float, window: float) -> None:
        self.min_rate, self.window = min_rate, window
        self.start, self.count = time.monotonic(), 0

    def received(self, size: int) -> None:
        """Count ``size`` bytes just received; a SlowShardError where the window that just
        ended brought too few."""
        self.count += size
        elapsed = time.monotonic() - self.start
        if elapsed < self.window:
            return
        if self.count < self.min_rate * elapsed:
            raise SlowShardError(f"{self.count} bytes came in {elapsed:.1f} s, slower than "
                                 f"{self.min_rate:g} bytes/s (the reader's min_rate)")
        self.start, self.count = time.monotonic(), 0


def is_remote(url: str) -> bool:
    return str(url).startswith(REMOTE_PREFIXES)


TRUST_FLAG = "--trust-data-paths"


class UntrustedDataPathError(ValueError):
    """A ``pipe:`` command or a remote URL that a file named, not the user (see
    :func:`check_trusted_locations`)."""


def check_trusted_locations(shards: str | Sequence[str], key: str, source: str) -> None:
    """Refuse shards that would run a ``pipe:`` command or fetch a URL when a file that may
    be anyone's named them (a checkpoint's config, a run folder), not the command line
    (docs/received_files.md). ``key``: the config key holding them (``data.test.shards``);
    ``source``: where the config came from (``the config stored in best.pt``).
    """
    for _, location in brace_expanded(shards):
        if is_remote(location):
            would = (f"run the command {location.removeprefix('pipe:')!r}"
                     if location.startswith("pipe:") else f"fetch {location}")
            raise UntrustedDataPathError(
                f"{key} of {source} would {would}; mmgoal runs no command and fetches no URL "
                f"that a received file names. If you trust the file, pass {TRUST_FLAG}; or "
                f"give the shards yourself (--shards PATTERN, or --cfg-options {key}=...)")


# Shards a pattern may stand for: LAION-5B is about 600,000; a few bytes of braces
# ({0..999999999}) would otherwise list a billion names.
MAX_SHARDS = 1_000_000


def brace_expanded(shards: str | Sequence[str]) -> Iterator[tuple[str, str]]:
    """``(pattern, name)`` for every name the brace patterns of ``shards`` stand for
    (``train-{000..009}.tar``), in order; a ValueError past :data:`MAX_SHARDS`."""
    patterns = [shards] if isinstance(shards, str) else list(shards)
    count = 0
    for pattern in patterns:
        for name in braceexpand.braceexpand(str(pattern)):
            count += 1
            if count > MAX_SHARDS:
                raise ValueError(f"the shard patterns {shards!r} stand for more than "
                                 f"{MAX_SHARDS:,} shards; write fewer, larger shards")
            yield str(pattern), name


def split_folder(shards: Any, split: str) -> Any:
    """``shards`` as a split reads them: a local folder (alone or in a list) stands for its
    ``<split>-*.tar`` where it has some (a folder of every split, as make-synthetic and
    make-shards write), else for all its ``*.tar``; anything else is returned as it is."""
    if isinstance(shards, list):
        return [split_folder(item, split) for item in shards]
    if not isinstance(shards, str) or is_remote(shards) or not Path(shards).is_dir():
        return shards
    folder = shards.rstrip("/") or "/"
    own = f"{folder}/{split}-*.tar"
    return own if glob.glob(own) else f"{folder}/*.tar"


def _found_beside(path: str) -> str:
    """What the folder of a missing shard holds, for the error: its ``.tar`` files, or
    that it is missing or empty."""
    folder = Path(path).parent
    if not Path(path).suffix:  # a folder's name, most likely
        return f"{path} does not exist: name a folder of shards or the shards, or " \
               f"generate the data first, e.g. mmgoal make-synthetic --out {path}"
    if not folder.is_dir():
        return f"{folder} does not exist: generate the data first, e.g. mmgoal " \
               f"make-synthetic --out {folder}"
    tars = sorted(p.name for p in folder.glob("*.tar"))
    if not tars:
        return f"{folder} holds no .tar file: generate the data first, e.g. mmgoal " \
               f"make-synthetic --out {folder}"
    shown = ", ".join(tars[:4]) + (f", ... ({len(tars)} in all)" if len(tars) > 4 else "")
    return (f"{folder} holds {shown}: name the folder ({folder}) or a glob "
            f"({folder}/*.tar) to read the shards that are there")


def expand_shards(shards: str | Sequence[str]) -> list[str]:
    """Shard paths and URLs from brace patterns (``a-{000..009}.tar``), globs or lists.

    A local shard must exist; a URL or ``pipe:`` command is taken as it is, and may hold no
    glob (a store cannot be listed: use braces).
    """
    paths: list[str] = []
    for pattern, expanded in brace_expanded(shards):
        if is_remote(expanded):
            if any(c in expanded for c in "*?[") and not expanded.startswith("pipe:"):
                raise ValueError(f"shard URL {expanded!r} holds a glob, which a remote "
                                 f"store cannot expand; name the shards with a brace "
                                 f"pattern (train-{{000000..000099}}.tar)")
            paths.append(expanded)
        elif any(c in expanded for c in "*?["):
            matches = sorted(glob.glob(expanded))
            if not matches:
                raise FileNotFoundError(f"shard pattern {expanded!r} matches no file; "
                                        f"{_found_beside(expanded)}")
            # a file that a glob matched is a file, whatever its name: one named
            # 'pipe:...' or 'http:...' must not become a command or a request
            paths.extend(f"./{m}" if is_remote(m) else m for m in matches)
        elif Path(expanded).is_dir():  # a folder named where a split is not known
            paths.extend(expand_shards(f"{expanded.rstrip('/')}/*.tar"))
        elif not Path(expanded).is_file():
            raise FileNotFoundError(f"shard {expanded!r} does not exist (from {pattern!r}); "
                                    f"{_found_beside(expanded)}")
        else:
            paths.append(expanded)
    if not paths:
        raise FileNotFoundError(f"no shards given by {shards!r}")
    return paths


def shard_listing(shards: str | Sequence[str]) -> list[list]:
    """``[[file name, bytes, digest], ...]`` of a split's shards: what a report records of
    the test set it was measured on, so that runs on other test sets are never compared
    (mmgoal compare-runs) and an evaluation of other data is named apart. File names, not
    paths: a data set moved elsewhere still matches. The digest tells apart shards of
    equal names and sizes (tars grow in 10 KiB records); a remote shard's size and digest
    are not asked for (None)."""
    return [[str(path).rsplit("/", 1)[-1],  # a pipe: command's shard: its last path part
             *((None, None) if is_remote(path) else
               (Path(path).stat().st_size, _ends_digest(path)))]
            for path in expand_shards(shards)]


def _ends_digest(path: str, span: int = 1 << 16) -> str:
    """A short hash of a file's first and last ``span`` bytes (tar headers and samples at
    both ends), read without reading the file whole."""
    with open_regular(path, "shard") as stream:
        digest = hashlib.blake2b(stream.read(span), digest_size=8)
        stream.seek(max(stream.seek(0, os.SEEK_END) - span, 0))
        digest.update(stream.read(span))
    return digest.hexdigest()


def same_shards(listing: Sequence[Sequence], other: Sequence[Sequence]) -> bool:
    """Whether two listings (:func:`shard_listing`) name the same files: names and sizes alike, and
    digests where both have one (a report written before listings had them has none)."""
    return len(listing) == len(other) and all(
        list(a[:2]) == list(b[:2]) and (len(a) < 3 or len(b) < 3 or a[2] == b[2])
        for a, b in zip(listing, other))


class ShardChangedError(ShardError):
    """A resumed read of an HTTP shard that is not the object the first read began: the
    bytes already read and the rest do not belong together (:func:`tar_samples` reads
    the shard again from its start)."""


def _identity(response: Any, position: int) -> tuple[int | None, str | None]:
    """``(length of the whole object, ETag)`` of an HTTP answer from byte ``position``,
    each None where the answer does not say (``Content-Range`` of a 206, ``Content-Length``
    of a 200)."""
    etag = response.headers.get("ETag")
    if response.status == 206:
        total = (response.headers.get("Content-Range") or "").rpartition("/")[2]
        return (int(total) if total.isdigit() else None), etag
    length = response.headers.get("Content-Length")
    return (int(length) if length is not None and length.isdigit() else None), etag


def _opened_http(url: str, position: int, timeout: float,
                 identity: tuple[int | None, str | None] | None
                 ) -> tuple[Any, tuple[int | None, str | None]]:
    """An HTTP response from byte ``position`` on, and the object's (length, ETag). A
    resumed read whose answer differs from ``identity``, or says neither, raises
    :class:`ShardChangedError`: another body would otherwise be read on as the same tar.
    """
    request = urllib.request.Request(url, headers={"Range": f"bytes={position}-"}
                                     if position else {})
    response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 (the user's URL)
    found = _identity(response, position)
    if position:
        starts = (response.headers.get("Content-Range") or "").removeprefix("bytes ")
        resumed_at = int(starts.split("-", 1)[0]) if starts[:1].isdigit() else None
        known = [(was, now) for was, now in zip(identity or (None, None), found)
                 if was is not None or now is not None]
        if (response.status == 206 and resumed_at != position) or not known or any(
                was != now for was, now in known):
            response.close()
            raise ShardChangedError(
                f"shard {url} was read again from byte {position}, and the answer is not "
                f"the object the first read began (length, ETag: {identity} then {found}; "
                f"HTTP {response.status})")
        if response.status != 206:
            _skip(response, position)  # no Range: read again up to where it broke
    return response, found


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
    """The bytes of one remote shard (``http(s)://`` or ``pipe:``), reopened where a read
    fails: no byte for ``timeout`` seconds, or under ``min_rate`` bytes/s over a
    ``timeout``-second window (:class:`RateFloor`). ``retries`` reads after the first
    failure, ``backoff`` seconds before the first, doubled each time; then ``read`` raises
    :class:`ShardReadError` (:class:`ShardChangedError` for a changed HTTP object).
    """

    def __init__(self, url: str, retries: int = RETRIES, timeout: float = TIMEOUT,
                 backoff: float = BACKOFF, min_rate: float = MIN_RATE) -> None:
        super().__init__()
        self.url, self.retries, self.timeout, self.backoff = url, retries, timeout, backoff
        self.min_rate = min_rate
        self.position = 0
        self.failures = 0
        self.identity: tuple[int | None, str | None] | None = None  # the first answer's
        self._stream: Any = None
        self._rate = RateFloor(min_rate, timeout)
        self._open()

    @property
    def length(self) -> int | None:
        """The shard's bytes, where the server said."""
        return None if self.identity is None else self.identity[0]

    def _open(self) -> None:
        while True:
            try:
                if self.url.startswith("pipe:"):
                    self._stream = _Pipe(self.url.removeprefix("pipe:"), self.timeout)
                    _skip(self._stream, self.position)
                else:
                    self._stream, found = _opened_http(self.url, self.position, self.timeout,
                                                       self.identity)
                    self.identity = self.identity or found
                self._rate = RateFloor(self.min_rate, self.timeout)
                return
            except ShardChangedError:
                raise
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
                # what has come (read1), not the whole buffer: a slow server is then seen
                data = getattr(self._stream, "read1", self._stream.read)(len(buffer))
                if not data and self.length is not None and self.position < self.length:
                    raise OSError(f"the connection ended at byte {self.position} of "
                                  f"{self.length}")
                if data:  # at the end, the last window is a part: not judged
                    self._rate.received(len(data))
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


def open_shard(url: str, retries: int = RETRIES, timeout: float = TIMEOUT,
               min_rate: float = MIN_RATE) -> Any:
    """A readable binary stream of a shard: a local file as webdataset opens it, a remote
    one as a buffered :class:`ResilientStream`."""
    if is_remote(url):
        return io.BufferedReader(ResilientStream(url, retries, timeout, min_rate=min_rate),
                                 buffer_size=CHUNK)
    return open_regular(url.removeprefix("file://"), "shard")  # never a FIFO, a device


def _opened_shards(sources: Iterable[dict], handler: Callable[[Exception], bool],
                   opener: Callable[[str], Any]) -> Iterator[dict]:
    for source in sources:
        url = source["url"]
        try:
            stream = opener(url)
        except ShardError as error:  # a ShardReadError, which names the shard itself
            failure = error
        except Exception as error:  # noqa: BLE001 (counted and skipped, as webdataset does)
            failure = ShardError(f"shard {url} could not be opened ({type(error).__name__}: "
                                 f"{error})")
        else:
            yield {**source, "stream": stream}
            continue
        if not handler(failure):
            break


# Shards a reader names whose samples fall short of what sizes.json claims; then it
# stops naming them (a sizes.json of thousands of shards, all wrong, is said enough).
MAX_SHORT_SHARDS_SAID = 5


def tar_samples(handler: Callable[[Exception], bool],
                select_files: Callable[[str], bool] | None = None, retries: int = RETRIES,
                timeout: float = TIMEOUT, max_sample_bytes: int = MAX_SAMPLE_BYTES,
                min_rate: float = MIN_RATE, claimed: Mapping[str, int] | None = None
                ) -> Callable[[Iterable[dict]], Iterator[dict]]:
    """The pipeline stage from ``{"url": ...}`` items to samples (webdataset's
    ``tarfile_to_samples`` on :func:`open_shard` and
    :func:`~mmgoal.data.tars.tar_stream_samples`). A shard changed under a resumed read is
    read again from its start, once, without repeats. A shard with fewer samples than
    ``claimed`` (``sizes.json``) is warned of: an epoch planned from the claim repeats samples.
    """
    said: set[str] = set()  # the short shards named, each once (a pass reads it again)

    def stage(sources: Iterable[dict]) -> Iterator[dict]:
        def opener(url: str) -> Any:
            return open_shard(url, retries, timeout, min_rate)

        for source in _opened_shards(sources, handler, opener):
            url = source["url"]
            held = yield from _shard_samples(url, source["stream"], handler, opener,
                                             select_files, max_sample_bytes)
            if claimed and held is not None and held < claimed.get(url, 0) and url not in said:
                said.add(url)
                if len(said) <= MAX_SHORT_SHARDS_SAID:
                    logger.warning(
                        "shard %s holds %d samples, and %s beside it claims %d: an epoch "
                        "planned from it is longer than the data, so samples repeat within "
                        "it; correct %s or set train.samples_per_epoch%s", url, held,
                        SIZES_FILE, claimed[url], SIZES_FILE,
                        " (further short shards are not named)"
                        if len(said) == MAX_SHORT_SHARDS_SAID else "")

    return stage


def raise_problem(error: Exception) -> bool:
    """The handler of a reader that stops at the first problem (a conversion, a check)."""
    raise error


def iter_samples(shards: str | Sequence[str], handler: Callable[[Exception], bool],
                 select_files: Callable[[str], bool] | None = None,
                 max_sample_bytes: int = MAX_SAMPLE_BYTES) -> Iterator[dict]:
    """Every sample of ``shards`` (patterns, paths or URLs) in order, each shard opened by
    :func:`open_shard` and read by the bounded tar reader, its problems given to
    ``handler``: the one reader of every command that reads shards outside training."""
    stage = tar_samples(handler, select_files=select_files, max_sample_bytes=max_sample_bytes)
    return stage({"url": url} for url in expand_shards(shards))


def _shard_samples(url: str, stream: Any, handler: Callable[[Exception], bool],
                   opener: Callable[[str], Any], select_files: Callable[[str], bool] | None,
                   max_sample_bytes: int) -> Iterator[dict]:
    """The samples of one opened shard (see :func:`tar_samples`); returns how many it
    holds, or None where it could not be read to a sound end."""
    given: set[str] = set()
    met: dict[str, list[Exception]] = {"changed": [], "failed": [], "oversized": []}

    def meet(error: Exception) -> None:
        if isinstance(error, ShardChangedError) and not given_twice:
            met["changed"].append(error)  # read again below, once
            return
        if isinstance(error, (ShardError, OversizedSampleError)):
            met["failed" if isinstance(error, ShardError) else "oversized"].append(error)
        handler(error)

    given_twice = False
    while True:
        with stream:  # a pipe: command ends with its shard
            for sample in tar_stream_samples(stream, url, meet, select_files, max_sample_bytes):
                if sample["__key__"] not in given:
                    given.add(sample["__key__"])
                    yield sample
        if not met["changed"] or given_twice:
            return None if met["failed"] else len(given) + len(met["oversized"])
        logger.warning("%s; reading it again from its start (the %d samples already read "
                       "are not given twice)", met["changed"][0], len(given))
        given_twice = True
        try:
            stream = opener(url)
        except ShardError as error:
            handler(error)
            return None


# sizes.json of LAION-5B's ~600,000 shards is about 20 MB; a file beside the shards larger
# than this is not one, and is not read further (an endless body would fill the memory).
MAX_JSON_BESIDE = 64 << 20
# A sample is at least one tar member, and a member at least its 512-byte header: a shard of
# L bytes holds at most L / 512 samples.
MIN_SAMPLE_BYTES = 512
# Shards whose length is asked for (HEAD) to check sizes.json: those with the largest claims.
CHECKED_CLAIMS = 8


def _json_beside(url: str, name: str, timeout: float, min_rate: float = MIN_RATE) -> Any:
    """``name`` in the folder of the shard ``url`` as JSON, or None where there is none; a
    ValueError past :data:`MAX_JSON_BESIDE` bytes, under ``min_rate``, or not JSON."""
    if url.startswith("pipe:"):
        return None
    location = posixpath.join(posixpath.dirname(url), name)
    body = bytearray()
    try:
        with urllib.request.urlopen(location, timeout=timeout) as response:  # noqa: S310
            rate = RateFloor(min_rate, timeout)
            while chunk := response.read1(CHUNK):
                rate.received(len(chunk))
                body += chunk
                if len(body) > MAX_JSON_BESIDE:
                    raise ValueError(f"{location} is larger than {MAX_JSON_BESIDE:,} bytes, "
                                     f"which no {name} of shards is; it is not read further")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
    except SlowShardError as error:
        raise ValueError(f"{location} came too slowly ({error})") from None
    try:
        return json.loads(body)
    except ValueError as error:
        raise ValueError(f"{location} is not JSON ({error})") from None


def _claim(value: Any, what: str) -> int:
    """A shard's claimed number of samples: a non-negative integer (``true``, ``64.9`` and
    ``-936`` are none)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is {json.dumps(value)[:80]}, which is no number of samples: "
                         f"it must be a non-negative integer; correct the file (or set "
                         f"train.samples_per_epoch)")
    return value


def shard_sizes(urls: Sequence[str], timeout: float = TIMEOUT) -> list[int] | None:
    """The samples of each remote shard, from ``sizes.json`` beside them or img2dataset's
    ``<name>_stats.json`` (``successes``); None where neither says (``pipe:`` never does).
    The files are claims: each count must be a non-negative integer, and the
    :data:`CHECKED_CLAIMS` largest are checked against their shard's length (HEAD).
    """
    sizes: dict[str, dict] = {}
    counts = []
    sources = []  # where each count came from, for messages
    for url in urls:
        folder = posixpath.dirname(url)
        if folder not in sizes:
            found = _json_beside(url, SIZES_FILE, timeout)
            if found is not None and not isinstance(found, dict):
                raise ValueError(f"{posixpath.join(folder, SIZES_FILE)} holds a JSON "
                                 f"{type(found).__name__}; it must map each shard's file name "
                                 f'to its samples ({{"train-000000.tar": 10000, ...}})')
            sizes[folder] = found or {}
        name = posixpath.basename(url)
        if name in sizes[folder]:
            source = f"{posixpath.join(folder, SIZES_FILE)}'s size of {name}"
            counts.append(_claim(sizes[folder][name], source))
        else:
            stats_name = posixpath.splitext(name)[0] + "_stats.json"
            stats = _json_beside(url, stats_name, timeout)
            if not isinstance(stats, dict) or "successes" not in stats:
                return None
            source = f"'successes' of {posixpath.join(folder, stats_name)}"
            counts.append(_claim(stats["successes"], source))
        sources.append(source)
    _check_claims(urls, counts, sources, timeout)
    return counts


def _check_claims(urls: Sequence[str], counts: list[int], sources: list[str],
                  timeout: float) -> None:
    """Refuse a claimed count that its shard's bytes cannot hold, for the
    :data:`CHECKED_CLAIMS` largest claims (a shard that does not say its length passes)."""
    largest = sorted(range(len(urls)), key=counts.__getitem__, reverse=True)[:CHECKED_CLAIMS]
    for index in largest:
        if counts[index] == 0 or urls[index].startswith("pipe:"):
            continue
        try:
            request = urllib.request.Request(urls[index], method="HEAD")
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
                length = response.headers.get("Content-Length")
        except (OSError, ValueError):  # a store that refuses HEAD: the read will tell
            continue
        if length is not None and length.isdigit() and \
                counts[index] * MIN_SAMPLE_BYTES > int(length):
            raise ValueError(
                f"{sources[index]} claims {counts[index]:,} samples, but the shard "
                f"{urls[index]} is {int(length):,} bytes, which hold at most "
                f"{int(length) // MIN_SAMPLE_BYTES:,} (each sample is at least a 512-byte "
                f"tar header); correct the file (or set train.samples_per_epoch)")
