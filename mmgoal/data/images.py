"""Decoding an image, wherever mmgoal reads one: bounded in bytes and in pixels.

Every reader (shard samples, make-shards, zero-shot sets, ``mmgoal.api``, inspect-shards)
decodes through :func:`decode_image`. An image file is read as a regular file only
(:func:`mmgoal.files.read_bytes`: no device, FIFO or socket) of at most
:data:`~mmgoal.files.MAX_IMAGE_BYTES`, and an image of more than PIL's
``Image.MAX_IMAGE_PIXELS`` (89.5 megapixels, about 9,460 x 9,460) is refused from its
header, before it is decoded: PIL itself only warns between one and two times that
bound, and such an image decodes to up to 537 MB of RGB (2 GB peaks in an evaluation).
Raise ``PIL.Image.MAX_IMAGE_PIXELS`` in your own code to take larger images.
"""

from __future__ import annotations

import io
import os
import warnings

from PIL import Image, UnidentifiedImageError

from mmgoal.files import MAX_IMAGE_BYTES, read_bytes


class ImageDecodeError(ValueError):
    """An image that cannot be decoded, or that is past the pixel bound: skipped and counted
    by the readers that skip (training, make-shards, zero-shot), a sentence elsewhere."""


def decode_image(data: bytes | str | os.PathLike, where: str) -> Image.Image:
    """The image in ``data`` (its bytes, or a file's path), decoded whole.

    Args:
        where: what the image is, for messages (``sample 'a' of x.tar``, a path).

    Raises:
        ImageDecodeError: not an image format PIL knows, damaged, or more pixels than
            ``Image.MAX_IMAGE_PIXELS``.
        FileNotFoundError, NotAFileError, OversizedFileError: a path that is missing, not a
            regular file, or larger than :data:`~mmgoal.files.MAX_IMAGE_BYTES`.
    """
    if not isinstance(data, bytes):
        data = read_bytes(data, "image", MAX_IMAGE_BYTES)
    try:
        with warnings.catch_warnings():  # the bound below says it as a refusal
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
        width, height = image.size
        limit = Image.MAX_IMAGE_PIXELS
        if limit and width * height > limit:
            raise ImageDecodeError(f"{where}: {width} x {height} pixels, more than the "
                                   f"{limit:,} mmgoal decodes (PIL.Image.MAX_IMAGE_PIXELS); "
                                   f"shrink it, or raise that bound in your own code")
        image.load()
    except ImageDecodeError:
        raise
    except UnidentifiedImageError:  # its message names the BytesIO, not the file
        raise ImageDecodeError(f"{where}: unreadable image (not an image format PIL "
                               f"knows)") from None
    except Exception as error:  # PIL raises many types for broken files
        raise ImageDecodeError(f"{where}: unreadable image ({error})") from error
    return image
