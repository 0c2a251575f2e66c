"""The final norm a run records, and the conversions between the pre- and post-norm final states that
exports make with it: against the SGLang engine in fp32 and against HF transformers in bf16 (CPU)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from offline_extract.engine import parity, reference
from offline_extract.final_norm import FinalNorm, recorded
from offline_extract.store.index import iter_samples
from offline_extract.testing.shards import write_synthetic
from offline_extract.training.export import (
    MANIFEST_NAME,
    ExportError,
    export_specforge,
    export_speculators,
    specforge_path,
    speculators_path,
)

H = 64


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _seqs(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 380, n).astype(np.int32) for n in lengths]


@pytest.fixture(scope="module")
def states(tiny_engine):
    """The engine's post- and pre-norm final states of the same batch (fp32), and its recorded norm."""
    seqs = _seqs([37, 90, 5], seed=11)
    post = tiny_engine.capture(seqs).last.clone()
    tiny_engine.final_state = "pre-norm"
    try:
        pre = tiny_engine.capture(seqs).last.clone()
    finally:
        tiny_engine.final_state = tiny_engine.cfg.final_state
    return seqs, pre, post, tiny_engine.final_norm()


def test_the_engine_records_the_final_norm_it_ran(states, tiny_model_dir):
    *_, norm = states
    hf = reference.load_hf_model(str(tiny_model_dir), "float32", "cpu")
    assert torch.equal(norm.weight, hf.model.norm.weight.detach())
    assert norm.eps == hf.config.rms_norm_eps and norm.weight_offset == 0.0
    # Not all ones: the conversions below would not notice a missing gain otherwise.
    assert (norm.weight - 1).abs().max() > 0.1
    again = FinalNorm.from_json(json.loads(json.dumps(norm.to_json())))
    assert torch.equal(again.weight, norm.weight) and (again.eps, again.weight_offset) == (norm.eps, norm.weight_offset)


def test_pre_norm_state_converts_to_the_engines_post_norm_state_in_fp32(states, tiny_model_dir):
    seqs, pre, post, norm = states
    scale = post.abs().max().item()
    assert (norm.apply(pre) - post).abs().max().item() <= 1e-6 * scale
    hf = reference.load_hf_model(str(tiny_model_dir), "float32", "cpu")
    start = 0
    for ids in seqs:
        rows = slice(start, start + len(ids))
        start += len(ids)
        assert (
            norm.apply(pre[rows]) - parity.hf_hidden_states(hf, ids.tolist(), "cpu")[-1]
        ).abs().max() <= 1e-5 * scale


def test_post_norm_state_converts_to_the_pre_norm_direction_which_the_norm_maps_back(states):
    _, pre, post, norm = states
    back = norm.undo(post)
    assert _cosine(back, pre).min() >= 1 - 1e-6
    # Each token's own scale is what RMSNorm removes: it differs from token to token and cannot come back.
    ratio = pre.norm(dim=-1) / back.norm(dim=-1)
    assert ratio.max() / ratio.min() > 1.1
    # Within eps / 2 relative (module docstring) plus float32 rounding.
    assert ((norm.apply(back) - post).abs() <= post.abs() * (norm.eps / 2 + 1e-6) + 1e-6).all()


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_conversions_against_hf_in_bf16(tiny_model_dir, weight_offset):
    """bf16 states as a bf16 run stores them, HF's own bf16 norm as the reference (its gain convention
    stood in for by moving the weight when Gemma's 1 + w is tested)."""
    hf = reference.load_hf_model(str(tiny_model_dir), "bfloat16", "cpu")
    weight = hf.model.norm.weight.detach().float()
    norm = FinalNorm(weight - weight_offset, hf.config.rms_norm_eps, weight_offset)
    for ids in _seqs([64, 200], seed=12):
        post = parity.hf_hidden_states(hf, ids.tolist(), "cpu")[-1]
        pre = parity.hf_hidden_states(hf, ids.tolist(), "cpu", final_state="pre-norm")[-1]
        assert post.dtype == pre.dtype == torch.bfloat16
        converted = norm.apply(pre).bfloat16()
        # HF rounds twice (normed state to bf16, then times the bf16 weight), we once: a bf16 step or two.
        assert _cosine(converted, post).min() >= 0.9999
        assert ((converted.float() - post.float()).abs() <= post.float().abs() * 2**-6 + 1e-3).all()
        back = norm.undo(post).bfloat16()
        assert _cosine(back, pre).min() >= 0.999
        assert _cosine(norm.apply(back), post).min() >= 0.9999


def test_a_zero_gain_element_comes_back_as_zero():
    norm = FinalNorm(torch.tensor([1.0, 0.0, -2.0, 0.5]), 1e-6, 0.0)
    pre = torch.tensor([[3.0, 7.0, -1.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    back = norm.undo(norm.apply(pre))
    assert back[0, 1] == 0 and torch.isfinite(back).all() and torch.equal(back[1], torch.zeros(4))
    kept = [0, 2, 3]
    assert _cosine(back[0, kept], pre[0, kept]) >= 1 - 1e-6
    assert recorded(None) is None


@pytest.fixture
def norm():
    g = torch.Generator().manual_seed(3)
    return FinalNorm(1 + 0.2 * torch.randn(H, generator=g), 1e-5, 0.0)


def test_a_pre_norm_run_exports_to_specforge_with_the_post_norm_state(norm, tmp_path):
    out = tmp_path / "pre"
    write_synthetic(out, [5, 9, 3], hidden_size=H, final_state="pre-norm", final_norm=norm.to_json())
    summary = export_specforge(out, tmp_path / "sf", progress=False)
    assert "converted from pre-norm to post-norm" in summary.notes[0]
    manifest = json.loads((tmp_path / "sf" / MANIFEST_NAME).read_text())
    assert (manifest["final_state"], manifest["final_state_converted_from"]) == ("post-norm", "pre-norm")
    for i, (_, shard) in enumerate(iter_samples(out)):
        data = torch.load(specforge_path(tmp_path / "sf", i), weights_only=True)
        assert torch.equal(data["hidden_state"][0], norm.apply(shard["hidden_states"]).bfloat16())
        assert torch.equal(data["aux_hidden_state"][0], shard["aux_hidden_states"])


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_a_post_norm_run_exports_to_speculators_with_a_pre_norm_state(norm, tmp_path, store):
    out = tmp_path / "post"
    write_synthetic(out, [5, 9, 3], hidden_size=H, final_norm=norm.to_json(), store=store)
    summary = export_speculators(out, tmp_path / "spec", progress=False)
    assert any("converted from post-norm to pre-norm" in note for note in summary.notes)
    # An fp8 run's converted final state is not rounded to fp8 a second time: that export is bf16, and says so.
    assert any("written as bf16, not fp8" in note for note in summary.notes) == (store == "fp8")
    for i, (_, shard) in enumerate(iter_samples(out)):
        hs = load_file(speculators_path(tmp_path / "spec", i))
        assert set(hs) == {"hidden_states", "token_ids"} and hs["hidden_states"].dtype == torch.bfloat16
        stacked = hs["hidden_states"]
        assert torch.equal(stacked[:, :-1].flatten(1), shard["aux_hidden_states"])
        last = stacked[:, -1]
        assert torch.equal(last, norm.undo(shard["hidden_states"]).bfloat16())
        # What speculators does with it: the verifier's norm gives the post-norm state back.
        assert _cosine(norm.apply(last), shard["hidden_states"]).min() >= 0.9999


def test_a_run_without_a_recorded_norm_is_still_refused(tmp_path):
    out = tmp_path / "old"
    write_synthetic(out, [4], hidden_size=H, final_state="pre-norm")
    with pytest.raises(ExportError, match="recorded no final norm"):
        export_specforge(out, tmp_path / "sf", progress=False)
    assert not (tmp_path / "sf").exists()


def test_a_pre_norm_dspark_run_exports_its_post_norm_target_state(norm, tmp_path):
    out = tmp_path / "dspark"
    write_synthetic(
        out, [6, 4], hidden_size=H, num_aux=5, final_state="pre-norm", final_norm=norm.to_json(), recipe="dspark"
    )
    export_specforge(out, tmp_path / "sf", progress=False)
    for i, (_, shard) in enumerate(iter_samples(out)):
        data = torch.load(specforge_path(tmp_path / "sf", i), weights_only=True)
        assert torch.equal(data["target_last_hidden_states"][0], norm.apply(shard["hidden_states"]).bfloat16())
        assert torch.equal(data["hidden_states"][0], shard["aux_hidden_states"])
