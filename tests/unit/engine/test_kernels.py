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


def test_the_kv_store_module_is_prebuilt_with_the_arguments_sglangs_pool_asks_for(tiny_engine, monkeypatch):
    """SGLang memoizes each module on its exact arguments, so a prebuild asked with others builds a module the
    forward never finds, or fails: 0.5.23's takes a thread count, which its pool passes as 0."""
    from sglang.kernels.ops.kvcache import kvcache
    from sglang.srt.layers import activation

    from offline_extract.engine.kernels import kernel_shapes, prebuild_calls

    asked = []
    monkeypatch.setattr(kvcache, "_jit_kvcache_module", lambda *args, **kwargs: asked.append((args, kwargs)))
    # SGLang defines its SiluAndMul rule on CUDA only; the activation module is not what is tested here.
    monkeypatch.setattr(activation, "_jit_act_supported", lambda x: False, raising=False)
    shapes = kernel_shapes(tiny_engine.runner.model_config, 1)
    k_bytes, v_bytes = shapes.kv_row_bytes
    assert kvcache.can_use_store_cache.__wrapped__(k_bytes, v_bytes)  # the pool's own call, not memoized
    prebuild_calls(shapes)[f"kvcache k={k_bytes} v={v_bytes} bytes"]()
    assert len(asked) == 2 and asked[1] == asked[0], asked


def test_the_rms_norms_are_prebuilt_as_the_loaded_models_norms_call_them(tiny_engine, monkeypatch):
    """FlashInfer compiles an RMSNorm for each row width, dtype and contiguity (not the row count): the
    prebuild's one row must ask sgl_kernel what every norm of the loaded model asks on CUDA, with and
    without a residual."""
    import sys

    import torch
    from sglang.srt.layers import activation, layernorm

    from offline_extract.engine.kernels import kernel_shapes, prebuild_calls

    # SGLang defines its SiluAndMul rule on CUDA only; the activation module is not what is tested here.
    monkeypatch.setattr(activation, "_jit_act_supported", lambda x: False, raising=False)
    asked = []

    def recorder(name):
        def call(x, *args):  # rmsnorm(x, weight, eps), fused_add_rmsnorm(x, residual, weight, eps)
            asked.append((name, x.shape[-1], x.dtype, args[-2].dtype, x.is_contiguous()))

        return call

    names = ("rmsnorm", "fused_add_rmsnorm")
    # SGLang imports them from sgl_kernel on CUDA only.
    for name in names:
        monkeypatch.setattr(layernorm, name, recorder(name), raising=False)
    norms = [m for m in tiny_engine.runner.model.modules() if isinstance(m, layernorm.RMSNorm)]
    assert len(norms) == 2 * len(tiny_engine.runner.model.model.layers) + 1
    for norm in norms:
        x = torch.zeros(3, norm.weight.shape[0], dtype=norm.weight.dtype)
        norm.forward_cuda(x)
        norm.forward_cuda(x, torch.zeros_like(x))
    forward, asked[:] = set(asked), []
    for name in names:
        monkeypatch.setattr(sys.modules["sgl_kernel"], name, recorder(name), raising=False)
    shapes = kernel_shapes(tiny_engine.runner.model_config, 1)
    dtype = str(shapes.dtype).removeprefix("torch.")
    prebuild_calls(shapes, device="cpu")[f"rms_norm hidden={shapes.hidden} {dtype}"]()
    assert set(asked) == forward and len(forward) == 2, (asked, forward)


def test_the_qk_norm_module_is_prebuilt_with_the_arguments_sglang_asks_for_where_the_family_norms_q_and_k(
    monkeypatch, tmp_path
):
    """Qwen3's attention asks SGLang's QK-norm for its head size and dtype (can_use_fused_inplace_qknorm, then
    the module itself, each memoized on those arguments): the prebuild asks the same. GLM-4.5 norms q and k
    only where its config says so, and Llama never."""
    import torch
    from sglang.kernels.ops.layernorm import norm
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers import activation

    from offline_extract.engine.kernels import kernel_shapes, prebuild_calls
    from offline_extract.testing.models import build_model

    # SGLang defines its SiluAndMul rule on CUDA only; the activation module is not what is tested here.
    monkeypatch.setattr(activation, "_jit_act_supported", lambda x: False, raising=False)
    asked = []
    monkeypatch.setattr(norm, "_jit_qknorm_module", lambda *args, **kwargs: asked.append((args, kwargs)))

    def qk_norms(arch, **overrides):
        path = build_model(
            arch, tmp_path / f"{arch}{len(overrides)}", dtype=torch.bfloat16, weights=False, overrides=overrides
        )
        shapes = kernel_shapes(ModelConfig(str(path)), 1)
        return shapes, {name: call for name, call in prebuild_calls(shapes).items() if name.startswith("qknorm")}

    shapes, calls = qk_norms("qwen3")
    assert list(calls) == [f"qknorm head_dim={shapes.head_dim} bfloat16"]
    assert norm.can_use_fused_inplace_qknorm.__wrapped__(shapes.head_dim, torch.bfloat16)  # SGLang's own ask
    calls[f"qknorm head_dim={shapes.head_dim} bfloat16"]()
    assert len(asked) == 2 and asked[1] == asked[0] == ((shapes.head_dim, torch.bfloat16), {}), asked
    assert qk_norms("glm4_moe")[1] and not qk_norms("glm4_moe", use_qk_norm=False)[1]
    assert not qk_norms("llama")[1]


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


def test_the_routing_prebuild_covers_every_row_block_of_a_forward_at_each_specialization():
    """triton_kernels' routing compiles anew for each block of 32 token counts (its bitmatrix's row stride
    is a constexpr), and Triton specializes the count itself: 1, a multiple of 16, neither. Every forward of
    1 to the budget's tokens falls in a variant that one of the prebuild's counts compiled, and none of the
    counts is over the budget; the counts are dealt out whole to the processes, each GPU of a node from its
    own place in the list."""
    from offline_extract.engine.kernels import routing_shares
    from offline_extract.engine.moe import routing_token_counts

    def variant(m: int) -> tuple:
        return (-(-m // 32), m == 1, m % 16 == 0)

    for budget in (16384, 1000):
        counts = routing_token_counts(budget)
        assert {variant(m) for m in range(1, budget + 1)} == {variant(m) for m in counts}
        assert max(counts) <= budget and len(counts) == len(set(counts))
    counts = routing_token_counts(16384)
    # 512 blocks, each a multiple of 16 and another count, and 1.
    assert len(counts) == 1025 and counts[:4] == [1, 2, 16, 33]
    shares = routing_shares(counts, 1, 2, 8)
    assert len(shares) == 8 and sorted(m for share in shares for m in share) == counts
    assert shares[0][0] == counts[len(counts) // 2] and routing_shares(counts, 0, 2, 8)[0][0] == 1


def test_a_routing_prebuild_that_cannot_compile_is_recorded_not_raised(tmp_path):
    """The compiling processes import this package without the caller's sys.path (a bin/ script's) and get as
    far as the GPU: on this CPU host each one fails there, and the report keeps each failure's last line."""
    from offline_extract.engine.kernels import RoutingPrebuild
    from offline_extract.engine.moe import Routing

    prebuild = RoutingPrebuild(Routing(32, 4, False, "bfloat16"), 33, 0)
    report = prebuild.wait()
    # 1, 2, 16 and 33 tokens, on as many of this host's cores.
    processes = min(4, len(os.sched_getaffinity(0)))
    assert report["routing_prebuild_processes"] == processes and report["routing_prebuild_token_counts"] == 4
    assert len(report["routing_prebuild_failed"]) == processes, report
    assert all("No module named" not in why for why in report["routing_prebuild_failed"]), report
    assert all(("CUDA" in why or "NVIDIA" in why) for why in report["routing_prebuild_failed"]), report
    assert 0 < report["routing_prebuild_s"] and prebuild.wait() == report
    prebuild.stop()  # nothing left running: a no-op


def test_triton_compiles_names_each_kernel_compiled_and_splits_them_at_the_warm_up(tmp_path, monkeypatch):
    """Compiled here for Hopper by Triton's own ptxas, as a forward's first launch compiles on a GPU: the
    listener hears the compiler, whatever launched it."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from offline_extract.engine.kernels import TritonCompiles

    @triton.jit
    def doubled(x, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i) * 2)

    def compile_for(block: int) -> None:
        source = ASTSource(fn=doubled, signature={"x": "*fp32", "BLOCK": "constexpr"}, constexprs={"BLOCK": block})
        triton.compile(source, target=GPUTarget("cuda", 90, 32))

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    heard = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: heard.append(kw["cache_hit"]))
    compiles = TritonCompiles()
    compile_for(16)
    compile_for(16)  # from the cache: nothing compiles
    compiles.warm()
    compile_for(32)
    report = compiles.report()
    assert (report["triton_compiled"], report["triton_loaded"], report["triton_compiled_in_extraction"]) == (1, 1, 1)
    ((kernel,),) = [report["triton_kernels"]]
    assert kernel["kernel"] == "doubled" and kernel["specialized"] == "BLOCK=16" and kernel["seconds"] > 0
    assert report["triton_compile_s"] == kernel["seconds"]
    assert report["triton_compiled_in_extraction_kernels"] == ["doubled"]
    assert heard == [False, True, False], "the listener set before it hears every compile too"
