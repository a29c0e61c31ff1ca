"""One image decoder for every reader (mmgoal/data/images.py): bounded in pixels from the
header, in bytes, and never a device or FIFO."""

import io
import os

import pytest
from PIL import Image

from mmgoal.data.images import ImageDecodeError, decode_image
from mmgoal.files import NotAFileError


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_past_the_pixel_bound_is_refused_where_pil_only_warns(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert decode_image(png(25, 40), "fits").size == (25, 40)  # 1,000 pixels: the bound
    # 1,600 pixels: between one and two times the bound, where PIL decodes with a warning
    with pytest.raises(ImageDecodeError, match=r"^big.png: 40 x 40 pixels, more than the "
                                               r"1,000 mmgoal decodes \(PIL\.Image\."
                                               r"MAX_IMAGE_PIXELS\)"):
        decode_image(png(40, 40), "big.png")
    with pytest.raises(ImageDecodeError, match=r"^x: unreadable image \(not an image format PIL "
                                               r"knows\)"):
        decode_image(b"not an image", "x")


def test_an_image_path_that_is_a_fifo_or_device_is_never_opened(tmp_path):
    os.mkfifo(tmp_path / "fifo.png")
    with pytest.raises(NotAFileError, match=r"is a FIFO \(named pipe\), not a file"):
        decode_image(tmp_path / "fifo.png", "x")
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    with pytest.raises(NotAFileError, match=r"zero.png is a character device, not a file"):
        decode_image(tmp_path / "zero.png", "x")
    (tmp_path / "a.png").write_bytes(png(3, 2))
    assert decode_image(tmp_path / "a.png", "a").size == (3, 2)
