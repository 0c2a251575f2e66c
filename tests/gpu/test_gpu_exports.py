"""Exports that convert the final state, on the GPU (run with `-m gpu`): a pre-norm run exported to
SpecForge and a post-norm run exported to speculators, each against a direct run of the other state on
the same batches, through SGLang's fused CUDA norm kernels in bf16.

    python -m pytest -m gpu tests/gpu/test_gpu_exports.py
"""

import pytest
import torch
from extract_runs import ROOT, run_extract, succeeded
from safetensors.torch import load_file

from offline_extract.final_norm import recorded
from offline_extract.store.index import iter_samples, shard_paths
from offline_extract.store.shard import open_shard
from offline_extract.testing.models import build_model
from offline_extract.training.export import export_specforge, export_speculators, speculators_path

pytestmark = pytest.mark.gpu

CORPUS = ROOT / "examples" / "corpus.jsonl"
MIN_COSINE = 0.999


def _extract(out, *args):
    succeeded(run_extract(out, *args, timeout=1200))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same corpus and batches extracted post-norm and pre-norm, stored as bf16 and as fp8."""
    tmp = tmp_path_factory.mktemp("runs")
    model = build_model("llama", tmp / "m", dtype=torch.bfloat16, device="cuda")
    outs = {}
    for store in ("bf16", "fp8"):
        for state in ("post-norm", "pre-norm"):
            outs[store, state] = tmp / f"{store}-{state}"
            _extract(
                outs[store, state],
                "--model",
                model,
                "--data",
                CORPUS,
                "--final-state",
                state,
                "--store",
                store,
                "--attention-backend",
                "triton",
            )
    return outs


def _by_id(out):
    return {info.id: t for info, t in iter_samples(out)}


def test_the_run_records_the_models_final_norm(runs):
    run = open_shard(shard_paths(runs["bf16", "post-norm"])[0]).run
    norm = recorded(run.final_norm)
    assert norm is not None and norm.weight.shape == (run.hidden_size,) and norm.weight_offset == 0.0


# The converted state of a bf16 or fp8 run against the direct bf16 run of the other state: an fp8 run
# against a direct fp8 run would add two independent fp8 errors, which alone reach cosine 0.999.
@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_pre_norm_run_exported_to_specforge_matches_a_post_norm_run(runs, store, tmp_path):
    export_specforge(runs[store, "pre-norm"], tmp_path / "sf", progress=False)
    direct = _by_id(runs["bf16", "post-norm"])
    for i, (info, _) in enumerate(iter_samples(runs[store, "pre-norm"])):
        data = _load_specforge(next((tmp_path / "sf").rglob(f"data_{i}.ckpt*")))
        cosine = torch.nn.functional.cosine_similarity(
            data["hidden_state"][0].float(), direct[info.id]["hidden_states"].float(), dim=-1
        )
        assert cosine.min() >= MIN_COSINE, (info.id, cosine.min().item())


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_post_norm_run_exported_to_speculators_matches_a_pre_norm_run(runs, store, tmp_path):
    export_speculators(runs[store, "post-norm"], tmp_path / "spec", progress=False)
    direct = _by_id(runs["bf16", "pre-norm"])
    for i, (info, _) in enumerate(iter_samples(runs[store, "post-norm"])):
        hs = load_file(speculators_path(tmp_path / "spec", i))
        stacked = hs["hidden_states"].to(torch.bfloat16)
        if "hidden_states_scales" in hs:
            stacked = stacked * hs["hidden_states_scales"].to(torch.bfloat16)
        cosine = torch.nn.functional.cosine_similarity(
            stacked[:, -1].float(), direct[info.id]["hidden_states"].float(), dim=-1
        )
        assert cosine.min() >= MIN_COSINE, (info.id, cosine.min().item())


def _load_specforge(path):
    import gzip
    import io

    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True)
    return torch.load(path, weights_only=True)
