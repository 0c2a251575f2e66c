"""HF's reference model, built on the weights read ahead as from the files, and the read-ahead's memory bound."""

import pytest


def test_the_preload_takes_at_most_half_the_available_memory_for_all_the_hosts_readers():
    from offline_extract.engine.reference import preload_refusal

    assert preload_refusal(16_000_000_000, 1, 100_000_000_000) is None
    assert preload_refusal(16_000_000_000, 4, 128_000_000_000) is None
    assert preload_refusal(16_000_000_000, 8, 128_000_000_000) == (
        "8 x 16.0 GB of weights exceed 50% of the host's 128.0 GB available"
    )
    assert preload_refusal(1, 1, None) == "the host's available memory is unknown"


@pytest.mark.parametrize("arch", ["llama", "llama4", "kimi_k25", "qwen2_5_vl", "qwen3_vl"])
def test_hf_built_on_the_read_tensors_is_hf_built_from_the_files(arch, tiny_model_dir, tmp_path):
    """The gate's reference on weights read ahead (a plain model; Llama-4, whose config HF builds on its text
    part; Kimi-K2.5, a wrapper whose tensors are renamed; Qwen2.5-VL and Qwen3-VL, HF's vision-language
    classes, tower and all, on each release's tensor names) has the class and every weight of HF's own load."""
    import torch

    from offline_extract.engine.checkpoint import checkpoint_tensors
    from offline_extract.engine.reference import load_hf_model
    from offline_extract.testing.models import build_model

    path = str(build_model(arch, tmp_path / "m", tokenizer_dir=tiny_model_dir))
    files = load_hf_model(path, "bfloat16", "cpu")
    read = load_hf_model(path, "bfloat16", "cpu", tensors=checkpoint_tensors(path, resident=True))
    assert type(read) is type(files)
    ours, theirs = read.state_dict(), files.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
