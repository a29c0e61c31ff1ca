"""A shard's tar stream, member by member, into samples: bounded, and damage said.

WebDataset's reader (``tar_file_expander`` + ``group_by_keys``) reads every member whole
into memory and ends quietly where ``tarfile`` does (a zeroed header mid-file, junk after
the archive, a cut header). :func:`tar_stream_samples` reads the same layout but skips a
sample over ``max_sample_bytes`` unread (member sizes are in their headers: a 9 MB
``.tar.gz`` may unpack to 2 GB), and says why a shard ended before its file did
(:class:`TarDamageError`, naming the byte), reading at most :data:`END_PADDING` zeros after
the end-of-archive marker so that an endless stream behind a valid tar ends.
"""

from __future__ import annotations

import logging
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO

from mmgoal.files import open_regular

logger = logging.getLogger(__name__)

# The members that hold a sample's image, in the order they are looked for
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
# A sample's members together (images, JSON, region features): a 20-megapixel JPEG is
# about 10 MB, a sample of 100 regions of 2048 float32 features 0.8 MB.
MAX_SAMPLE_BYTES = 64 * 2**20
# Zeros after the end-of-archive marker that may pad a tar to its record size (GNU
# tar's largest blocking factors stay below this).
END_PADDING = 2**20
_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # prefix/key.ext, as webdataset splits
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's own members (__key__...), never data


class ShardError(OSError):
    """A shard that could not be read to its end: the samples after the failure are lost."""


class TarDamageError(ShardError):
    """A shard whose tar ends before its file does, or is cut: ``samples`` read (or skipped)
    before the damage, ``reason`` what is wrong and at which byte."""

    def __init__(self, url: str, samples: int, reason: str) -> None:
        super().__init__(f"shard {url} is damaged after {samples} samples: {reason}; the rest "
                         f"of it is not read (mmgoal inspect-shards says more)")
        self.samples, self.reason = samples, reason


class OversizedSampleError(ValueError):
    """A sample whose members hold more than ``max_sample_bytes``: skipped unread."""


def sample_member(name: str) -> tuple[str, str] | None:
    """The sample key and extension of a tar member's name, webdataset's rule: the key is
    the path up to the first dot of the file name (``a/b/0001.seg.png``: ``a/b/0001``,
    ``seg.png``); None for a name that is no sample's (no dot, ``__key__``-style members).
    Every reader of shards keys samples by it."""
    match = _MEMBER.match(name)
    if match is None or _META.match(name):
        return None
    return match.group(1), match.group(2).lower()


def sample_keys(url: str) -> list[str]:
    """The sample keys of the local shard ``url`` in order, from its tar headers (no
    member is read); a damaged shard's keys before the damage, with a warning."""
    keys: dict[str, None] = {}
    try:
        with open_regular(url, "shard") as stream, tarfile.open(fileobj=stream) as archive:
            for member in archive:
                named = sample_member(member.name) if member.isreg() else None
                if named is not None:
                    keys[named[0]] = None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:  # EOFError: a cut .gz
        logger.warning("shard %s is damaged (%s); counting its %d readable samples",
                       url, error, len(keys))
    return list(keys)


class _HeaderEnd(tarfile.TarInfo):
    """A ``TarInfo`` that records on its archive why the member list ended: ``tarfile``
    ends it quietly at a zero block, at a cut header and at bytes that are no header."""

    @classmethod
    def fromtarfile(cls, archive: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(archive)
        except tarfile.HeaderError as error:
            archive.ended_by = error
            raise


def tar_stream_samples(stream: IO[bytes], url: str, handler: Callable[[Exception], object],
                       select_files: Callable[[str], bool] | None = None,
                       max_sample_bytes: int = MAX_SAMPLE_BYTES) -> Iterator[dict]:
    """The samples of one shard's tar stream (``.tar``, or compressed: ``.tar.gz``...):
    ``{"__key__", "__url__", ext: bytes, ...}``, members grouped by key.

    ``handler`` gets each problem (and may raise to stop): an :class:`OversizedSampleError`
    or a member given twice (skipped), and at most one :class:`ShardError`, after which the
    rest of the shard is lost. ``select_files`` keeps the members whose names it accepts.
    """
    sample: dict | None = None
    size = 0  # bytes of the current sample's members, read or not
    samples = 0  # samples of this shard given out or skipped, for the damage's message

    def finished() -> Iterator[dict]:
        nonlocal samples
        samples += 1
        if size <= max_sample_bytes:
            yield sample
            return
        handler(OversizedSampleError(
            f"sample {sample['__key__']!r} of {url} holds {size:,} bytes, more than "
            f"data.max_sample_bytes ({max_sample_bytes:,}); skipped unread (raise the bound "
            f"if such samples are meant)"))

    failure: ShardError | None = None
    reason = None
    partial = None  # the sample whose member was being read when the stream failed
    try:
        archive = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_HeaderEnd)
        for member in archive:
            archive.members = []  # a stream's members would pile up for the whole shard
            named = sample_member(member.name) if member.isreg() else None
            if named is None or (select_files is not None and not select_files(member.name)):
                continue
            key, ext = named
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    yield from finished()
                sample, size = {"__key__": key, "__url__": url}, 0
            size += member.size
            if size > max_sample_bytes:
                continue  # never read: the stream skips its bytes
            if ext in sample:
                handler(ValueError(f"sample {key!r} of {url} holds {member.name} twice; the "
                                   f"second is left out"))
                continue
            partial = sample
            sample[ext] = archive.extractfile(member).read()
            partial = None
        reason = _end_damage(archive)
    except ShardError as error:  # the stream's own failure, which names the shard
        failure = error
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:  # EOFError: a cut .gz
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if sample is not None and sample is not partial:  # a member cut short: no sample
        yield from finished()
    if reason is not None:
        failure = TarDamageError(url, samples, reason)
    if failure is not None:
        handler(failure)


def _end_damage(archive: tarfile.TarFile) -> str | None:
    """Why the member list of ``archive`` ended early, or None for a sound end: the
    end-of-archive marker followed by nothing but padding (at most :data:`END_PADDING`
    bytes read after it)."""
    ended_by = getattr(archive, "ended_by", None)
    at = archive.offset
    if isinstance(ended_by, tarfile.EmptyHeaderError):
        return (f"it ends at byte {at} without the tar's end-of-archive marker (cut short "
                f"between two members?)")
    if isinstance(ended_by, tarfile.TruncatedHeaderError):
        return f"it is cut short inside the header at byte {at}"
    if isinstance(ended_by, tarfile.InvalidHeaderError):
        return (f"the bytes at {at} are not a tar header ({ended_by}): a damaged header, or "
                f"data after the tar")
    if not isinstance(ended_by, tarfile.EOFHeaderError):
        return None
    read = 0
    while read <= END_PADDING:
        block = archive.fileobj.read(64 * 1024)
        if not block:
            return None
        if block.count(0) != len(block):
            return (f"a zero block at byte {at} ends its tar, but data follows it (a zeroed "
                    f"header, or data after the tar): the members after it are not read")
        read += len(block)
    return f"more than {END_PADDING:,} bytes follow the end-of-archive marker at byte {at}"
