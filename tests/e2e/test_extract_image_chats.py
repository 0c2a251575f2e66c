"""Image chats through bin/extract.py on each image family's tiny random model (testing/models.py), on CPU: the
image tokens' positions in the shards and the datasets, a bad image rejected by name, the dry run's image count, and a resume
or a rerun of the finished run refused once a kept sample's image has changed."""

import json

import pytest

from extract_runs import run_extract
from image_chats import PATCH, save_image

from offline_extract.engine.families import FAMILIES
from offline_extract.store import integrity
from offline_extract.store.shard import read_header
from offline_extract.testing.models import build_model
from offline_extract.training.datasets import HiddenStateDataset


# Qwen3-VL's processor resizes the same images to its 32-pixel blocks: as many image tokens. A family SGLang
# cannot run on CPU (Llama 4) has its image chats held on the GPU (tests/gpu/test_gpu_architectures.py).
@pytest.mark.parametrize("family", [f.name for f in FAMILIES if f.images and f.not_on_cpu is None])
def test_image_chats_extract_with_their_image_tokens_and_a_changed_image_refuses_the_resume(family, tmp_path):
    model = build_model(family, tmp_path / "model")
    save_image(tmp_path / "wide.png", PATCH, 2 * PATCH)  # 2 image tokens
    save_image(tmp_path / "square.png", 2 * PATCH, 2 * PATCH, seed=1)  # 4
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "id": "pic",
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": "wide.png"}},
                                {"type": "text", "text": "what is it?"},
                            ],
                        },
                        {"role": "assistant", "content": "a picture"},
                    ],
                },
                {
                    "id": "text",
                    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                },
                {
                    "id": "llava",
                    "conversations": [{"from": "human", "value": "<image> and this"}, {"from": "gpt", "value": "two"}],
                    "images": ["square.png"],
                },
                {
                    "id": "gone",
                    "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
                    "images": ["missing.png"],
                },
            ]
        )
    )
    out = tmp_path / "out"
    common = ("--model", model, "--data", corpus)
    dry = run_extract(out, *common, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "image tokens 6 " in dry.stdout and "in 2 samples with images" in dry.stdout

    run = run_extract(out, *common)
    assert run.returncode == 0, run.stderr
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert (reject["id"], reject["reason"]) == ("gone", f"images[0] ({tmp_path / 'missing.png'}) not found")
    dataset = HiddenStateDataset(out)
    images = {}
    for i in range(len(dataset)):
        item = dataset[i]
        assert not (item["image_mask"].bool() & item["loss_mask"].bool()).any()
        assert item["aux_hidden_states"].shape[0] == item["input_ids"].numel()
        images[item["id"]] = int(item["image_mask"].sum())
    assert images == {"pic": 2, "text": 0, "llava": 4}
    (shard,) = out.glob("shard_*.safetensors")
    assert [s.images_sha256 is not None for s in read_header(shard).samples] == [True, False, True]
    assert integrity.verify(out).problems == []

    save_image(tmp_path / "square.png", 2 * PATCH, 2 * PATCH, seed=2)
    changed = "c.jsonl:3 (id 'llava'): its images' bytes differ from those it was extracted from"
    refused = run_extract(out, *common, "--dry-run")
    assert refused.returncode != 0
    assert changed in refused.stderr
    # The run is complete: a rerun checks the images as a resume does, rather than saying "already complete".
    refused = run_extract(out, *common)
    assert refused.returncode != 0 and "already complete" not in refused.stderr
    assert changed in refused.stderr
