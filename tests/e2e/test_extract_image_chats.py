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


# bin/extract.py with the look ahead for image chats cut to two rows, so that the corpus's image chat comes past it.
_LOOKING_TWO_ROWS_AHEAD = """
import sys
sys.path.insert(0, "bin")
import _bin_path
from offline_extract import extraction
from offline_extract.commands.extract import main

extraction.ROWS_TOGETHER = 2
sys.argv = ["extract.py", *sys.argv[1:]]
main()
"""


def test_an_image_chat_for_a_text_only_model_refuses_the_run_and_the_directory_says_so(tmp_path):
    """The first image chats are refused before the model loads (tests/unit/test_preflight.py); one past them
    stops the run as it is tokenized, and the directory reads as refused with the verdict, not as an interrupted
    run that a re-run would finish (a re-run stops at the same record)."""
    import subprocess
    import sys

    from click.testing import CliRunner
    from extract_runs import ROOT

    from offline_extract.commands import inspect

    save_image(tmp_path / "a.png", PATCH, PATCH)
    corpus = tmp_path / "c.jsonl"
    picture = {"id": "pic", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}
    corpus.write_text(
        "".join(json.dumps({"input_ids": list(range(5, 40))}) + "\n" for _ in range(20))
        + json.dumps({**picture, "images": ["a.png"]})
        + "\n"
    )
    out = tmp_path / "out"
    # A forward of each record, and a shard of a few: shards complete before the image chat's turn comes.
    args = [
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--no-progress",
        "--shard-size-mb",
        "0.01",
        "--tokens-per-batch",
        "40",
    ]
    run = subprocess.run(
        [sys.executable, "-c", _LOOKING_TWO_ROWS_AHEAD, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    verdict = (
        f"{corpus}:21 (id 'pic') holds 1 image, but the default model is a text-only model (its config.json has no "
        f"vision_config): nothing of it reads images. Give a vision-language model, or a corpus without images"
    )
    assert run.returncode == 1 and run.stderr.endswith(f"Error: {verdict}\n"), run.stderr[-3000:]
    recorded = json.loads((out / "manifest.json").read_text())
    advice = "Give a vision-language model, or a corpus without image chats, and a new --out"
    assert (recorded["status"], recorded["result"]) == (
        "refused",
        {"refused_by": "the tokenizer", "verdict": verdict, "advice": advice},
    )
    kept = sum(shard["num_samples"] for shard in recorded["shards"].values())
    assert kept > 0, "the shards completed before the image chat are kept"
    checked = CliRunner().invoke(inspect.main, [str(out), "--verify"])
    assert checked.exit_code == 1
    assert checked.output == (
        f"verified {len(recorded['shards'])} shards holding {kept} samples in {out}: no problems\n"
        f"refused: the run was refused by the tokenizer (manifest.json status 'refused'); re-running the same command "
        f"gives the same verdict:\n{verdict}\n{advice}\n"
    )
