"""Images for the tests of image chats; the tiny Qwen2.5-VL's processor that reads them is `qwen_vl_dir`'s
(tests/conftest.py)."""

import numpy as np
from PIL import Image

PATCH = 28  # pixels per image token side: patch 14, merged 2 x 2


def save_image(path, height, width, seed=0):
    """A random RGB image of `height` x `width` pixels at `path` (PNG by its name)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path
