"""Decoding an image, wherever mmgoal reads one: bounded in bytes and in pixels.

Every reader decodes through :func:`decode_image`: a regular file of at most
:data:`~mmgoal.files.MAX_IMAGE_BYTES`, refused from its header past PIL's
``Image.MAX_IMAGE_PIXELS``, where PIL itself only warns (docs/data.md, "What a conversion
takes").
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
    """The image in ``data`` (its bytes, or a file's path), decoded whole; ``where`` names
    it in messages. An ImageDecodeError where PIL cannot read it or it has too many pixels;
    a path's errors are :func:`~mmgoal.files.read_bytes`'s."""
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
