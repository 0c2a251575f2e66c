"""A vision-language model's HF processor without a model, for the tests of image chats that need no forward:
Qwen2.5-VL's own processor over the tiny model's tokenizer with Qwen's vision tokens added."""
import numpy as np
from PIL import Image

# Qwen2-VL's rendering of image parts: a placeholder the processor expands to the image's tokens.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PATCH = 28  # pixels per image token side: patch 14, merged 2 x 2


def qwen_processor(tokenizer_dir, max_pixels=PATCH * PATCH * 64):
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                                "<|video_pad|>"]})
    images = Qwen2VLImageProcessor(min_pixels=PATCH * PATCH, max_pixels=max_pixels)
    return Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(),
                               chat_template=TEMPLATE)


def save_image(path, height, width, seed=0):
    """A random RGB image of `height` x `width` pixels at `path` (PNG by its name)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path
