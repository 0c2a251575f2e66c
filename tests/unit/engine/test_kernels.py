"""SGLang's JIT caches under one folder, and the nvcc-built modules prebuilt as the loaded model calls them
(`engine/kernels.py`), on the session's CPU engine."""

import os


def test_jit_caches_go_under_one_folder_unless_the_environment_says_otherwise(monkeypatch, tmp_path):
    from offline_extract.engine import kernels

    env = {k: v for k, v in os.environ.items() if k not in kernels.JIT_CACHES}
    monkeypatch.setattr(os, "environ", {**env, "TRITON_CACHE_DIR": "/mine/triton", "XDG_CACHE_HOME": str(tmp_path)})
    where = kernels.use_jit_cache()
    assert where["TRITON_CACHE_DIR"] == "/mine/triton"
    assert where["TVM_FFI_CACHE_DIR"] == str(tmp_path / "offline_extract" / "tvm-ffi")
    assert {k: os.environ[k] for k in kernels.JIT_CACHES} == where
    monkeypatch.setattr(os, "environ", dict(env))
    where = kernels.use_jit_cache(tmp_path / "kept")
    assert sorted(where.values()) == sorted(str(tmp_path / "kept" / folder) for folder in kernels.JIT_CACHES.values())


def test_the_kernel_prebuild_specializes_as_the_loaded_model_calls_sglangs_modules(tiny_engine):
    """What the prebuild derives from the config before the weights load is what SGLang's loaded model and
    KV pool hand its nvcc-built modules: the activation's output width, each attention layer's RoPE (its
    cos/sin cache's width is the rope_dim `apply_rope_with_cos_sin_cache_inplace` passes, neox style), and
    the K and V row bytes `_set_kv_buffer_impl` passes to the KV-store module."""
    from offline_extract.engine.kernels import kernel_shapes

    shapes = kernel_shapes(tiny_engine.runner.model_config, 1)
    pool = tiny_engine.runner.token_to_kv_pool
    assert shapes.kv_row_bytes == (pool.row_dim * pool.store_dtype.itemsize, pool.v_row_dim * pool.store_dtype.itemsize)
    assert shapes.dtype == pool.dtype == next(tiny_engine.runner.model.parameters()).dtype
    layers = tiny_engine.runner.model.model.layers
    for layer in layers:
        rope = layer.self_attn.rotary_emb
        assert (rope.head_size, rope.cos_sin_cache.size(-1), rope.is_neox_style) == (
            shapes.head_dim,
            shapes.rope_dim,
            shapes.rope_is_neox,
        )
        assert layer.mlp.gate_up_proj.output_size_per_partition // 2 == shapes.mlp_width
    # Per rank under TP=2: half the tiny model's two KV heads and half its MLP.
    halves = kernel_shapes(tiny_engine.runner.model_config, 2)
    assert halves.kv_row_bytes == tuple(b // 2 for b in shapes.kv_row_bytes)
    assert halves.mlp_width == shapes.mlp_width // 2 and halves.rope_dim == shapes.rope_dim
    assert shapes.mla_row_bytes is None


def test_an_mla_model_prebuilds_the_pools_store_as_sglang_names_it_on_hopper(monkeypatch, tmp_path):
    """DeepSeek-V3's MLA pool stores a long forward's rows with a TMA module keyed by the latent's and the
    RoPE part's bytes (512 and 64 bf16 values: the module an H200's first run built as
    set_mla_kv_buffer_1024_128, use_pdl true); before Hopper, SGLang stores them with Triton, and nothing
    is built ahead."""
    from functools import partial

    import torch
    from sglang.kernels.jit import utils
    from sglang.kernels.ops.kvcache.set_mla_kv_buffer import set_mla_kv_buffer_module
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers import activation

    from offline_extract.engine.kernels import kernel_shapes, prebuild_calls
    from offline_extract.testing.models import build_model

    config = ModelConfig(str(build_model("deepseek_v3", tmp_path / "m", dtype=torch.bfloat16, weights=False)))
    text = config.hf_text_config
    shapes = kernel_shapes(config, 2)
    assert shapes.mla_row_bytes == (2 * text.kv_lora_rank, 2 * text.qk_rope_head_dim) == (1024, 128)
    assert shapes.kv_row_bytes is None and shapes.rope_dim is None
    # SGLang defines its SiluAndMul rule on CUDA only; this model's dense MLP is not what is tested here.
    monkeypatch.setattr(activation, "_jit_act_supported", lambda x: False, raising=False)
    monkeypatch.setattr(utils, "is_arch_support_pdl", lambda: True)
    store = prebuild_calls(shapes)["set_mla_kv_buffer nope=1024 rope=128 bytes"]
    assert isinstance(store, partial) and (store.func, store.args) == (set_mla_kv_buffer_module, (1024, 128, True))
    monkeypatch.setattr(utils, "is_arch_support_pdl", lambda: False)
    assert not any(name.startswith("set_mla_kv_buffer") for name in prebuild_calls(shapes))


def test_a_failing_prebuild_is_recorded_and_the_rest_still_builds(monkeypatch, tmp_path):
    """A build that raises is kept for the record, not raised (the forward's own call tries again); builds
    run side by side, and the report times them against the load."""
    import time

    from offline_extract.engine.kernels import KernelPrebuild

    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "")  # the prebuild sets it for the process; restored after

    def broken():
        raise RuntimeError("ninja exited with status 1\nstderr: ...")

    def built():
        time.sleep(0.3)
        (tmp_path / "m.so").write_bytes(b"")

    builds = {"slow": built, "other": lambda: time.sleep(0.3), "broken": broken}
    prebuild = KernelPrebuild(lambda: builds, str(tmp_path), None)
    prebuild.loaded()
    prebuild.wait()
    report = prebuild.report()
    assert report["prebuild_failed"] == {"broken": "ninja exited with status 1"}
    assert report["prebuild_unfinished"] == [] and set(report["prebuild_modules"]) == {"slow", "other", "broken"}
    assert report["prebuild_modules"]["slow"] >= 0.3 and report["prebuild_serial_s"] >= 0.6
    assert report["prebuild_s"] < report["prebuild_serial_s"], "the builds ran side by side"
    assert 0 <= report["prebuild_during_load_s"] <= report["prebuild_s"] and report["prebuild_waited_s"] >= 0
    assert report["prebuild_cache_added"] == 1 and report["forward_cache_added"] == 0

    # A config the rules cannot read builds nothing ahead, and says why; the forward builds as before.
    unread = KernelPrebuild(lambda: {}["intermediate_size"], str(tmp_path), None)
    unread.wait()
    assert unread.report()["prebuild_failed"] == {"plan": "'intermediate_size'"}
    assert unread.report()["prebuild_modules"] == {} and unread.report()["prebuild_s"] == 0
