"""A sample's images, as the target model's own HF processor prepared them for its tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# eq=False: the generated __eq__/__hash__ would compare numpy arrays, which raises.
@dataclass(frozen=True, eq=False)
class Images:
    """A sample's images as the model's own HF processor prepared them."""

    # What the processor returned beside input_ids and attention_mask, e.g. pixel_values and image_grid_thw,
    # under the processor's own keys: the engine hands them to the model's vision tower as they are.
    processor_outputs: dict[str, np.ndarray]
    token_mask: np.ndarray  # bool [num_tokens]: True at the image (placeholder) tokens
    fingerprint: str  # sha256 over the images' bytes, for the run identity
