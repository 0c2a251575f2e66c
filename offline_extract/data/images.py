"""A sample's images, as the target model's own HF processor prepared them for its tokens, and a record's
images read and decoded for that processor (their bytes fingerprinted on the way)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import stat
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from offline_extract.data.corpus import ImageRef
from offline_extract.data.sources import file_kind
from offline_extract.formatting import human_bytes

# The most bytes an image file may hold; a larger one is refused unread. A photo of tens of megapixels takes a few
# tens of MB, and the vision processors shrink every image to a few megapixels: a file past this is no image a
# chat means (a video, a disk image named by mistake), and each image thread would hold it whole.
MAX_IMAGE_BYTES = 256 << 20


# eq=False: the generated __eq__/__hash__ would compare numpy arrays, which raises.
@dataclass(frozen=True, eq=False)
class Images:
    """A sample's images as the model's own HF processor prepared them."""

    # What the processor returned beside input_ids and attention_mask, e.g. pixel_values and image_grid_thw,
    # under the processor's own keys: the engine hands them to the model's vision tower as they are.
    processor_outputs: dict[str, np.ndarray]
    token_mask: np.ndarray  # bool [num_tokens]: True at the image (placeholder) tokens
    fingerprint: str  # sha256 over the images' bytes, for the run identity


def as_array(output) -> np.ndarray:
    """One of an HF processor's image outputs (a torch tensor, as the image processor's return_tensors="pt" gives
    it) as numpy. numpy has no bfloat16, in which Llama 4's processor normalizes its pixels (as Meta's code does):
    float32 holds those values exactly, and the engine and HF take them back to the model's dtype."""
    import torch

    return (output.float() if output.dtype == torch.bfloat16 else output).numpy()


class ImageError(ValueError):
    """An image of a record that cannot be used: missing, unreadable or not decodable; the message names it."""


def image_bytes(ref: ImageRef) -> bytes:
    """The bytes of one image: its file's, or its data: URL's payload (base64, or percent-encoded)."""
    if ref.location.startswith("data:"):
        header, comma, payload = ref.location.partition(",")
        if not comma:
            raise ImageError(f"{ref.named} has no ',' between its media type and its data")
        if header.endswith(";base64"):
            try:
                return base64.b64decode(payload, validate=True)
            except binascii.Error as e:
                raise ImageError(f"{ref.named} is not valid base64: {e}") from None
        return urllib.parse.unquote_to_bytes(payload)
    return _file_bytes(ref)


def _file_bytes(ref: ImageRef) -> bytes:
    """A regular file's bytes, at most MAX_IMAGE_BYTES. Anything else is refused before it is read: a FIFO would
    block the run until something wrote to it, a device such as /dev/zero never ends. Opened without blocking and
    judged again by what was opened, so that a path swapped after the first look is not read either."""
    try:
        _check_regular(ref, os.stat(ref.location))
        fd = os.open(ref.location, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            _check_regular(ref, os.fstat(fd))
            data = f.read(MAX_IMAGE_BYTES + 1)
    except FileNotFoundError:
        raise ImageError(f"{ref.named} not found") from None
    except OSError as e:
        raise ImageError(f"{ref.named} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_IMAGE_BYTES:  # it grew after its size was looked at
        raise _too_large(ref, f"more than {human_bytes(MAX_IMAGE_BYTES)}")
    return data


def _check_regular(ref: ImageRef, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ImageError(f"{ref.named} is {file_kind(st.st_mode)}, not a regular file: an image is read from a file")
    if st.st_size > MAX_IMAGE_BYTES:
        raise _too_large(ref, human_bytes(st.st_size))


def _too_large(ref: ImageRef, size: str) -> ImageError:
    return ImageError(
        f"{ref.named} holds {size}, past the {human_bytes(MAX_IMAGE_BYTES)} an image file may hold: give a smaller "
        "image (the model's processor shrinks it to a few megapixels anyway)"
    )


def decode(ref: ImageRef, data: bytes):
    """The image decoded whole (PIL), in RGB, as vision processors take it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ImageError(f"{ref.named} is too large to decode: {e}") from None
    except UnidentifiedImageError:  # its words name an in-memory buffer
        raise ImageError(f"{ref.named} does not decode: not in an image format PIL reads") from None
    except (OSError, ValueError, SyntaxError) as e:  # a damaged or truncated file of a known format
        raise ImageError(f"{ref.named} does not decode: {e}") from None


def load_images(refs: Sequence[ImageRef]) -> tuple[list, str]:
    """A record's images decoded, and the fingerprint of their bytes (`fingerprint`)."""
    data = [image_bytes(ref) for ref in refs]
    return [decode(ref, d) for ref, d in zip(refs, data)], _fingerprint(data)


def fingerprint(refs: Sequence[ImageRef]) -> str:
    """The fingerprint of a record's images, read without decoding them: the sha256 over each image's own sha256,
    in order. Equal fingerprints mean the same bytes, so the same pixels."""
    return _fingerprint([image_bytes(ref) for ref in refs])


def _fingerprint(data: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    for d in data:
        digest.update(hashlib.sha256(d).digest())
    return digest.hexdigest()
