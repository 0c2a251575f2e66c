"""The parity gate's criteria, on rows with known numbers (the comparisons themselves are in test_engine
and, per architecture, test_architectures)."""

import contextlib
import dataclasses
import json

import pytest
import torch

from offline_extract.engine import parity, reference
from offline_extract.engine.parity import (
    MOE_HALF_MIN_MEDIAN_COSINE,
    LayerParity,
    ParityError,
    _passes,
    check,
    criterion,
)


def _row(cosine, median, max_abs=0.05, max_rel=0.01):
    return LayerParity("aux 3", 4, max_abs, max_rel, cosine, median, 0.97, 2.5, False)


def test_dense_bf16_needs_every_token():
    assert _passes(_row(0.9995, 0.99999), "bfloat16", moe=False)
    assert not _passes(_row(0.93, 0.99999), "bfloat16", moe=False), "one diverged token fails a dense model"
    assert not _passes(_row(0.9995, 0.99999, max_rel=0.2), "bfloat16", moe=False)


def test_moe_half_precision_judges_the_typical_token():
    # Tokens whose near-tied router picked other experts: far off, while the median token is exact.
    assert _passes(_row(0.62, 0.9991), "bfloat16", moe=True)
    # A layer off by one moves every token, the median too.
    assert not _passes(_row(0.62, 0.978), "bfloat16", moe=True)
    assert not _passes(_row(0.99, MOE_HALF_MIN_MEDIAN_COSINE - 1e-4), "bfloat16", moe=True)


def test_moe_in_fp32_keeps_the_strict_gate():
    # fp32 rounding never flips a routing choice on the test models: the dense rule applies.
    assert not _passes(_row(0.62, 0.9999999, max_rel=1e-6), "float32", moe=True)
    assert _passes(_row(0.9999999, 0.9999999, max_rel=1e-6), "float32", moe=True)


def test_fp32_is_judged_relative_to_the_states_scale():
    # States of scale 7: 2.4e-6 apart is a few float32 steps (measured on an AMD EPYC), not a mismatch.
    assert _passes(_row(0.9999999, 0.9999999, max_abs=2.4e-6 * 7, max_rel=2.4e-6), "float32", moe=False)
    assert not _passes(_row(0.9999999, 0.9999999, max_abs=1e-3, max_rel=1.4e-4), "float32", moe=False)


def test_failure_names_the_criterion_and_the_layer():
    bad = LayerParity("aux 3", 4, 3.0, 0.5, 0.62, 0.97, 0.97, 2.5, False)
    with pytest.raises(ParityError, match=r"(?s)median-token cosine >= 0.995.*aux 3 \(HF hidden_states\[4\]\)"):
        check([bad], "bfloat16", 8, moe=True)
    assert "every token's cosine >= 0.999" in criterion("bfloat16", moe=False)


@pytest.mark.slow
def test_verify_passes_a_bf16_moe_model_and_records_why(tiny_model_dir, tmp_path):
    """Qwen3-MoE in bf16 on CPU: the gate sends HF to the experts the engine chose, so that routing flips (seen
    on the GPU and on CPU alike) do not count, judges the typical token, records every token's worst case next
    to it, and records per MoE layer how often HF's own router would have chosen otherwise."""

    import torch
    from extract_runs import ROOT, run_extract, succeeded

    from offline_extract.store.index import shard_paths
    from offline_extract.store.shard import open_shard
    from offline_extract.testing.models import build_model

    model = build_model("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir)
    out = tmp_path / "out"
    succeeded(
        run_extract(
            out, "--model", model, "--data", ROOT / "examples" / "corpus.jsonl", "--dtype", "bfloat16", "--verify", "8"
        )
    )
    run = open_shard(shard_paths(out)[0]).run
    rows = run.parity
    assert [r["layer"] for r in rows] == ["aux 1", "aux 3", "aux 4", "last"]
    for r in rows:
        assert r["ok"] and r["median_cosine"] >= MOE_HALF_MIN_MEDIAN_COSINE, json.dumps(r)
        assert r["neighbour_cosine"] < r["median_cosine"] - 0.01, "the match discriminates an off-by-one"
        # On the same experts, every token matches as on a dense model.
        assert r["cosine"] >= 0.999, json.dumps(r)
    routing = run.parity_routing
    assert [layer["layer"] for layer in routing] == list(range(8))
    for layer in routing:
        assert layer["tokens"] > 0 and layer["weight_max_abs_diff"] == 0.0 and layer["disagreement_rate"] <= 0.15


def test_the_hf_reference_computes_no_full_vocab_logits(tiny_model_dir):
    """The gate's HF forward reads hidden states only: the LM head sees one position, however long the sample
    (a 131k-token sample's logits alone would be 34 GB on the GPU beside the engine)."""
    from offline_extract.engine.parity import hf_hidden_states
    from offline_extract.engine.reference import load_hf_model

    hf = load_hf_model(str(tiny_model_dir), "float32", "cpu")
    seen = []
    hf.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    ids = list(range(3, 40))
    states = hf_hidden_states(hf, ids, "cpu")
    assert seen == [(1, 1, hf.config.hidden_size)]
    assert len(states) == hf.config.num_hidden_layers + 1 and states[-1].shape == (len(ids), hf.config.hidden_size)


def test_one_samples_hf_states_are_dropped_before_the_next_samples_forward():
    """compare_states folds one sample at a time: when the next sample's HF states are computed, the previous
    sample's are gone (for a 131k-token sample of an 8B model they are 35 GB on the GPU)."""
    import weakref

    import torch

    from offline_extract.engine.parity import compare_states

    layer_ids, hidden, tokens = [0, 1], 8, 5
    alive_when_next_made = []
    previous = []

    def sample():  # made in a frame of its own, as parity.compare's HF forward is
        hs = tuple(torch.randn(tokens, hidden) for _ in range(4))
        previous[:] = [weakref.ref(t) for t in hs]
        return torch.cat([hs[k + 1] for k in layer_ids], dim=-1), hs[-1].clone(), hs

    def pairs():
        for _ in range(3):
            alive_when_next_made.append([r() is not None for r in previous])
            yield sample()

    rows = compare_states(pairs(), layer_ids, "float32")
    assert [r.ok for r in rows] == [True] * 3
    assert alive_when_next_made == [[], [False] * 4, [False] * 4]


def test_the_comparison_by_chunks_of_tokens_is_the_comparison_of_whole_samples(monkeypatch):
    """compare_states takes COMPARE_TOKENS tokens at a time (bounded memory on the device): cut into chunks of 7
    tokens, with a worst token and a worst gap in the last chunk only, every row is that of whole samples."""
    import dataclasses

    import torch

    from offline_extract.engine import parity

    generator = torch.Generator().manual_seed(0)
    layer_ids, samples = [0, 2], []
    for tokens in (5, 30):
        hs = tuple(torch.randn(tokens, 16, generator=generator) * (1 + layer) for layer in range(5))
        aux = torch.cat([hs[k + 1] for k in layer_ids], dim=-1) + 1e-3 * torch.randn(tokens, 32, generator=generator)
        aux[-1] += 0.5  # the last token, in the last chunk, is the worst
        samples.append((aux, hs[-1].clone(), hs))

    def rows(chunk):
        monkeypatch.setattr(parity, "COMPARE_TOKENS", chunk)
        return parity.compare_states(iter(samples), layer_ids, "float32")

    whole, chunked = rows(1 << 20), rows(7)
    for a, b in zip(whole, chunked):
        # a mean of float32 cosines, summed by chunks: apart by float32 rounding
        assert b.neighbour_cosine == pytest.approx(a.neighbour_cosine, rel=1e-5)
        assert dataclasses.replace(b, neighbour_cosine=a.neighbour_cosine) == a
    assert not whole[0].ok and whole[0].max_abs > 0.4


def _floor_row(median, worst, floor_median, floor_worst):
    return LayerParity(
        "aux 14", 15, 256.0, 0.01, 0.97, 0.9999, 0.9, 2.5, False, worst, median, floor_worst, floor_median
    )


def test_half_precision_is_judged_against_float32_by_hfs_own_distance_from_it():
    """The figures of SmolLM2-135M in bf16 (H200, relative error against HF in float32): the engine's worst token
    0.24 where HF's own is 0.22 passes, which the dense bf16 rule (every token's cosine >= 0.999 against HF in
    bf16) refused; a state whose typical token sits twice as far from float32 as HF's does not."""
    median, worst = parity.HALF_FLOOR["median"], parity.HALF_FLOOR["worst"]
    row = _floor_row(median=0.0101, worst=0.24, floor_median=0.0112, floor_worst=0.22)
    assert _passes(row, "bfloat16", moe=False) and row.floor_ratio() == pytest.approx(
        max(0.0101 / (median["factor"] * 0.0112 + median["slack"]), 0.24 / (worst["factor"] * 0.22 + worst["slack"]))
    )
    # Every token further off: what a layer off by one or a perturbed state does.
    assert not _passes(_floor_row(2 * 0.0112, 0.24, 0.0112, 0.22), "bfloat16", moe=False)
    # A few tokens broken, the median untouched.
    assert not _passes(_floor_row(0.0101, 0.9, 0.0112, 0.22), "bfloat16", moe=False)
    # Where HF's half precision is near exact, the slack decides.
    assert _passes(_floor_row(median["slack"] * 0.9, worst["slack"] * 0.9, 0.0, 0.0), "float16", moe=False)
    assert not _passes(_floor_row(median["slack"] * 1.1, 0.0, 0.0, 0.0), "float16", moe=False)
    # A MoE model keeps its median rule: its rows carry no float32 reference.
    assert not parity.judged_against_float32("bfloat16", moe=True, fp8=False)
    assert not parity.judged_against_float32("bfloat16", moe=False, fp8=True)
    assert parity.judged_against_float32("float16", moe=False, fp8=False)
    assert not parity.judged_against_float32("float32", moe=False, fp8=False)
    assert _floor_row(0.0, 0.0, 0.0, 0.0).floor_ratio() == 0.0 and _row(0.9, 0.9).floor_ratio() is None


def test_a_half_precision_refusal_names_the_rule_and_both_distances_from_float32():
    bad = _floor_row(median=0.0301, worst=0.24, floor_median=0.0112, floor_worst=0.22)
    bad = dataclasses.replace(bad, ok=False)
    with pytest.raises(ParityError) as refused:
        check([bad], "bfloat16", 32)
    said = str(refused.value)
    assert said.startswith(
        "parity gate failed on 32 samples in bfloat16 (required: each token's relative error against HF in float32, "
        f"at the median token at most {parity.HALF_FLOOR['median']['factor']} x HF bfloat16's own + "
        f"{parity.HALF_FLOOR['median']['slack']}, at the worst token at most {parity.HALF_FLOOR['worst']['factor']} "
        f"x HF bfloat16's own + {parity.HALF_FLOOR['worst']['slack']}):\n"
    )
    assert (
        f"  aux 14 (HF hidden_states[15]): relative error vs HF float32 worst=0.24 median=0.0301, HF bfloat16's "
        f"own worst=0.22 median=0.0112 ({bad.floor_ratio():.2f} x what is allowed); cosine worst=0.970000 "
        f"median=0.999900\n"
    ) in said


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_float32_pass_is_hf_in_float32_on_the_same_weights(arch, tiny_model_dir, tmp_path):
    """The gate's float32 reference holds no float32 copy of the model (parity.float32_pass): it computes what HF
    loaded in float32 from the same half-precision checkpoint computes, and leaves the model as it was."""
    from offline_extract.testing.models import build_model

    path = str(build_model(arch, tmp_path / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir))
    ids = list(range(3, 40))
    half = reference.load_hf_model(path, "bfloat16", "cpu")
    before = parity.hf_hidden_states(half, ids, "cpu")
    with parity.float32_pass(half):
        exact = parity.hf_hidden_states(half, ids, "cpu")
    loaded = parity.hf_hidden_states(reference.load_hf_model(path, "float32", "cpu"), ids, "cpu")
    assert all(h.dtype == torch.float32 for h in exact)
    for ours, theirs in zip(exact, loaded):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item()), arch
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert all(torch.equal(a, b) for a, b in zip(parity.hf_hidden_states(half, ids, "cpu"), before))
    # Half precision is measurably off float32 here, so the comparison above is not of two bf16 runs.
    assert max((a.float() - b).abs().max().item() for a, b in zip(before, exact)) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"])
def test_the_gate_holds_only_the_reference_states_it_reads_and_those_are_hfs_own(arch, tiny_model_dir, tmp_path):
    """hf_hidden_states with `keep` (what parity.compare asks for) takes each kept layer's output as HF makes it,
    the others not held: the same tensors as HF's own list of every layer, in half precision and in float32."""
    from offline_extract.testing.models import build_model

    path = str(build_model(arch, tmp_path / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir))
    hf = reference.load_hf_model(path, "bfloat16", "cpu")
    layers = hf.config.get_text_config().num_hidden_layers
    keep = parity.reference_indices([0, 3], layers)
    assert keep == {0, 1, 2, 3, 4, 5, layers - 1, layers}
    ids = list(range(3, 40))
    for final_state in ("post-norm", "pre-norm"):
        for pass_ in (contextlib.nullcontext, lambda: parity.float32_pass(hf)):
            with pass_():
                every = parity.hf_hidden_states(hf, ids, "cpu", final_state)
                kept = parity.hf_hidden_states(hf, ids, "cpu", final_state, keep)
            assert len(kept) == len(every) == layers + 1
            for i, (ours, theirs) in enumerate(zip(kept, every)):
                assert (ours is None) == (i not in keep) and (ours is None or torch.equal(ours, theirs)), (arch, i)


@pytest.mark.parametrize(
    "arch, hf_class",
    [("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), ("llama4", "Llama4ForConditionalGeneration")],
)
def test_the_kept_states_of_an_image_chat_are_hfs_own_with_the_images_in_place(
    arch, hf_class, tiny_model_dir, tmp_path
):
    """hf_hidden_states on a vision-language model takes the images through HF's own class (Llama 4's too, though
    its text alone has a causal-LM class): with `keep`, the same tensors as HF's list of every layer, where
    hidden_states[0] is the first layer's input, the image embeddings already in place of the image tokens'."""
    from arch_parity import image_samples

    from offline_extract.testing.models import build_model

    path = str(build_model(arch, tmp_path / "m", tokenizer_dir=tiny_model_dir))
    hf = reference.load_hf_model(path, "float32", "cpu")
    assert type(hf).__name__ == hf_class
    (ids, images), _ = image_samples(path)
    keep = parity.reference_indices([0, 3], hf.config.get_text_config().num_hidden_layers)
    every = parity.hf_hidden_states(hf, ids, "cpu", images=images)
    kept = parity.hf_hidden_states(hf, ids, "cpu", keep=keep, images=images)
    for i, (ours, theirs) in enumerate(zip(kept, every)):
        assert (ours is None) == (i not in keep) and (ours is None or torch.equal(ours, theirs)), i
    # Without the pixels the image tokens' embeddings are the placeholder's, and only theirs differ.
    text = parity.hf_hidden_states(hf, ids, "cpu")
    mask = torch.from_numpy(images.token_mask)
    assert torch.equal(every[0][~mask], text[0][~mask])
    assert (every[0][mask] - text[0][mask]).abs().max().item() > 0.1
