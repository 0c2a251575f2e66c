#!/usr/bin/env python
"""Writes a corpus of image chats for `bin/bench.py --data`: OpenAI-style chats, each a user turn of one or two
images and a question, then the assistant's answer in English, with the images written beside the corpus
(JPEG and PNG, of the sizes photos and screenshots come in), all drawn from --seed, so that a bench row names
the corpus it ran on by its command.

\b
    python benchmarks/image_chats.py /dev/shm/oe40/image_chats.jsonl --chats 1024
    python benchmarks/image_chats.py chats.jsonl --chats 8 --sizes 28x56,56x56     # a tiny model's images

The images are smooth colour fields with edges and grain, which compress and decode as photos do, unlike
noise (a PNG of noise is several times larger than a photo's); they go to the folder named as the corpus
without its suffix, `image_chats/`, and the records name them relative to the corpus file, as
bin/extract.py reads them.
"""

import json
import sys
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import program  # noqa: E402
from offline_extract.default_model import TRAINING_TEXT  # noqa: E402

# Width x height: a vision model's own square, phone photos, a laptop screenshot, HD video frames.
SIZES = "448x448,640x480,800x600,1024x768,1280x720"
QUESTIONS = (
    "What is in this picture?",
    "Describe the image in a few sentences.",
    "What stands out in this photo, and why?",
    "Write a caption for this image.",
    "What colours dominate the scene?",
)
COMPARE = "Compare the two images."
# Real English sentences for the answers (the embedded model's training text).
SENTENCES = tuple(s.strip() + "." for s in TRAINING_TEXT.replace("\n", " ").split(".") if len(s.split()) > 3)


def picture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An RGB image of `height` x `width`: a coarse random colour grid smoothly enlarged, a bright band across
    it and a little grain."""
    from PIL import Image

    coarse = rng.integers(0, 256, (int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR), dtype=np.int16)
    row = int(rng.integers(0, height))
    field[row : row + max(1, height // 12)] += 60
    field += rng.integers(-6, 7, field.shape, dtype=np.int16)
    return np.clip(field, 0, 255).astype(np.uint8)


def chat(rng: np.random.Generator, index: int, sizes: list[tuple[int, int]], folder: Path, corpus: Path) -> dict:
    """Record `index`: its images written to `folder` (a third of them PNG, the rest JPEG), named relative to
    the corpus file."""
    from PIL import Image

    parts = []
    for k in range(1 if rng.random() < 0.8 else 2):
        width, height = sizes[int(rng.integers(len(sizes)))]
        png = rng.random() < 1 / 3
        path = folder / f"{index:06d}_{k}.{'png' if png else 'jpg'}"
        image = Image.fromarray(picture(rng, width, height))
        image.save(path, **({} if png else {"quality": 90}))
        parts.append({"type": "image_url", "image_url": {"url": str(path.relative_to(corpus.parent))}})
    question = COMPARE if len(parts) == 2 else QUESTIONS[int(rng.integers(len(QUESTIONS)))]
    answer = " ".join(SENTENCES[int(i)] for i in rng.integers(0, len(SENTENCES), int(rng.integers(2, 7))))
    return {
        "id": f"image-chat-{index}",
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ],
    }


def write_image_chats(corpus: Path, chats: int, seed: int = 0, sizes: str = SIZES) -> int:
    """`chats` image chats in the JSONL file `corpus`, their images (how many it returns) in the folder beside
    it (`corpus` without its suffix); the same files for the same arguments."""
    shapes = [tuple(int(n) for n in size.split("x")) for size in sizes.split(",")]
    folder = corpus.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = [chat(rng, i, shapes, folder, corpus) for i in range(chats)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    return sum(len(r["messages"][0]["content"]) - 1 for r in records)


@program(help=__doc__)
@click.argument("corpus", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--chats", default=512, show_default=True, help="Records to write.")
@click.option("--seed", default=0, show_default=True)
@click.option("--sizes", default=SIZES, show_default=True, help="Comma-separated WIDTHxHEIGHT, drawn evenly.")
def main(corpus, chats, seed, sizes):
    images = write_image_chats(corpus, chats, seed, sizes)
    click.echo(f"{chats} image chats, {images} images -> {corpus}")


if __name__ == "__main__":
    main()
