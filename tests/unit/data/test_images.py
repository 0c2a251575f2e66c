import base64
import os
import threading
import hashlib
import io
import urllib.parse

import numpy as np
import pytest
from PIL import Image

from offline_extract.data.corpus import ImageRef
from offline_extract.data import images
from offline_extract.data.images import ImageError, load_images


def png_bytes(height=6, width=10, seed=0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_file_and_data_urls_decode_to_the_same_pixels_and_fingerprint_their_bytes(tmp_path):
    data = png_bytes()
    (tmp_path / "a.png").write_bytes(data)
    refs = [
        ImageRef("images[0]", str(tmp_path / "a.png")),
        ImageRef("images[1]", "data:image/png;base64," + base64.b64encode(data).decode()),
        ImageRef("images[2]", "data:image/png," + urllib.parse.quote_from_bytes(data)),
    ]
    decoded, fingerprint = load_images(refs)
    assert [image.mode for image in decoded] == ["RGB"] * 3
    assert all(np.array_equal(np.asarray(decoded[0]), np.asarray(image)) for image in decoded[1:])
    image_sha = hashlib.sha256(data).digest()
    assert fingerprint == hashlib.sha256(image_sha * 3).hexdigest()
    # Another image, or the same ones in another order, is another fingerprint.
    (tmp_path / "b.png").write_bytes(png_bytes(seed=1))
    assert load_images(refs[:2])[1] != fingerprint
    assert (
        load_images([ImageRef("images[0]", str(tmp_path / "b.png")), refs[0]])[1]
        != load_images([refs[0], ImageRef("images[0]", str(tmp_path / "b.png"))])[1]
    )


def test_a_palette_image_is_given_in_rgb(tmp_path):
    Image.new("P", (4, 4), 3).save(tmp_path / "p.png")
    (image,), _ = load_images([ImageRef("images[0]", str(tmp_path / "p.png"))])
    assert image.mode == "RGB" and image.size == (4, 4)


@pytest.mark.parametrize(
    "make, location, reason",
    [
        (None, "missing.png", "images[0] ({}) not found"),
        (
            lambda p: p.mkdir(),
            "folder.png",
            "images[0] ({}) is a directory, not a regular file: an image is read from a file",
        ),
        (
            lambda p: p.write_bytes(b"not an image"),
            "text.png",
            "images[0] ({}) does not decode: not in an image format PIL reads",
        ),
        (lambda p: p.write_bytes(png_bytes(60, 60)[:200]), "cut.png", "images[0] ({}) does not decode: "),
        (None, "data:image/png;base64,@@@", "images[0] (a data: URL) is not valid base64: "),
        (None, "data:image/png;base64", "images[0] (a data: URL) has no ',' between its media type and its data"),
    ],
    ids=["missing", "a folder", "not an image", "cut short", "bad base64", "no comma"],
)
def test_an_unusable_image_is_named_with_the_reason(tmp_path, make, location, reason):
    path = tmp_path / location
    if make is not None:
        make(path)
    where = location if location.startswith("data:") else str(path)
    with pytest.raises(ImageError) as error:
        load_images([ImageRef("images[0]", where)])
    message, expected = str(error.value), reason.format(path)
    if expected.endswith(": "):  # then the library's own words of what is wrong
        assert message.startswith(expected) and len(message) > len(expected)
    else:
        assert message == expected


def _refusal(location: str, seconds: float = 30) -> str:
    """load_images' refusal of the image at `location`, on a thread, failing the test where it does not end."""
    raised = []

    def load():
        try:
            load_images([ImageRef("images[0]", location)])
        except ImageError as e:
            raised.append(str(e))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"reading {location} did not end"
    (message,) = raised
    return message


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    assert _refusal(str(tmp_path / "pipe.png")) == (
        f"images[0] ({tmp_path / 'pipe.png'}) is a FIFO (named pipe), not a regular file: an image is read from a file"
    )


def test_a_device_is_refused_unread():
    assert _refusal("/dev/zero") == (
        "images[0] (/dev/zero) is a character device, not a regular file: an image is read from a file"
    )


def test_a_file_past_the_limit_is_refused_unread(tmp_path):
    huge = tmp_path / "huge.png"
    with open(huge, "wb") as f:
        f.truncate(images.MAX_IMAGE_BYTES + 1)  # sparse: nothing of it is on disk
    assert _refusal(str(huge)) == (
        f"images[0] ({huge}) holds 268.4 MB, past the 268.4 MB an image file may hold: give a smaller image "
        "(the model's processor shrinks it to a few megapixels anyway)"
    )


def test_a_file_that_holds_more_than_its_size_says_is_read_only_up_to_the_limit(monkeypatch):
    # A procfs file says it is empty and holds more: only what the limit allows is read, and the rest refused.
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 16)
    assert _refusal("/proc/self/status") == (
        "images[0] (/proc/self/status) holds more than 16 B, past the 16 B an image file may hold: give a smaller "
        "image (the model's processor shrinks it to a few megapixels anyway)"
    )
