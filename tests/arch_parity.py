"""One architecture's engine against HF transformers, in a process of its own (SGLang allows one
ModelRunner per process). Run by test_architectures.py and test_gpu_architectures.py; prints nothing,
writes a JSON report.

    python tests/arch_parity.py MODEL_DIR --out report.json [--hf-reference DIR] [--device cuda --dtype bfloat16
        --attention-backend triton] [--layer-sets "0,3,6;1,2;2,5;0"] [--forced-routing [--fp32-reference]]

The engine starts with SGLang's default layer ids; each --layer-sets entry then re-points the running
engine's capture and is compared against HF again, so every id mapping is checked on the same weights.
--forced-routing (MoE models) also compares every layer set against HF routed to the experts the engine
chose (`parity.ForcedRouting`), and reports per MoE layer how often HF's own choice differs; with
--fp32-reference, the engine's states and HF's own bf16 states are each compared against HF in fp32 on the same
experts, which measures how far bf16 arithmetic alone moves the model.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_extract.data.images import Images, as_array  # noqa: E402
from offline_extract.engine import checkpoint, parity  # noqa: E402
from offline_extract.engine.moe import triton_kernels_routing  # noqa: E402
from offline_extract.engine.multimodal import IMAGE_MODELS  # noqa: E402
from offline_extract.engine.reference import load_hf_model  # noqa: E402
from offline_extract.engine.distributed import free_port  # noqa: E402
from offline_extract.engine.kernels import kernel_shapes  # noqa: E402
from offline_extract.engine.sglang_adapter import Engine, EngineConfig, prepare_process  # noqa: E402

LENGTHS = (5, 37, 64)  # several requests in one batch, so packing by request is exercised too

# A vision-language model's image chats, rendered and prepared by its own HF processor: one image, then two
# of other sizes around the text, so that each image's tokens and positions are found apart; batched with a
# text sequence, so that image and text requests are packed together.
IMAGE_CHATS = (
    ([(28, 56)], "What is in the picture?", "A fox."),
    ([(56, 56), (28, 28)], "Compare the two.", "The first is larger."),
)


def image_samples(model_dir: str) -> list[tuple[np.ndarray, Images]]:
    """(input ids, Images) of each IMAGE_CHATS entry, random pixels from a fixed seed."""
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    image_token = AutoConfig.from_pretrained(model_dir).image_token_id
    rng = np.random.default_rng(0)
    samples = []
    for sizes, question, answer in IMAGE_CHATS:
        pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        content = [{"type": "image"}, {"type": "text", "text": question}] + [{"type": "image"}] * (len(sizes) - 1)
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        text = processor.apply_chat_template(messages, tokenize=False)
        # The template writes the BOS itself.
        out = {
            k: as_array(v)
            for k, v in processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False).items()
        }
        ids = out.pop("input_ids")[0]
        out.pop("attention_mask")
        fingerprint = hashlib.sha256(b"".join(p.tobytes() for p in pictures)).hexdigest()
        samples.append((ids, Images(out, ids == image_token, fingerprint)))
    return samples


# The FP8 block-quantized checkpoints the CPU and GPU suites build, and their config overrides.
# SGLang fuses DeepSeek's q_a_proj and kv_a_proj_with_mqa and concatenates their block scales, which lines up
# only when q_lora_rank is a whole number of 128-blocks (DeepSeek-V3's 1536 is; the tiny config's 192 is not).
FP8_OVERRIDES = {"qwen3": {}, "deepseek_v3": {"q_lora_rank": 256}}


# With the experts aligned, how much further from HF in fp32 the engine's bf16 states may be than HF's own bf16
# states are, per layer, for its worst and its median token: 1 - cosine at most this factor times HF's own,
# plus a floor for where HF's bf16 is near-exact. Kernels round differently (fused ops, accumulation order),
# hence the factor; an off-by-one or a wrong side of a norm lands at 1 - cosine of 0.05 or more, orders of
# magnitude out.
BF16_FLOOR_FACTOR = 3.0
BF16_FLOOR_SLACK = {"cosine": 1e-4, "median_cosine": 1e-5}


def beyond_bf16_floor(fp32_reference: dict) -> list[str]:
    """The layers where the engine's bf16 states are further from HF in fp32 than bf16 arithmetic explains."""
    bad = []
    hf_rows = {r["layer"]: r for r in fp32_reference["hf_bf16_rows"]}
    for ours in fp32_reference["engine_rows"]:
        hfs = hf_rows[ours["layer"]]
        for key, slack in BF16_FLOOR_SLACK.items():
            if 1 - ours[key] > BF16_FLOOR_FACTOR * (1 - hfs[key]) + slack:
                bad.append(f"{ours['layer']} {key}: engine {ours[key]:.6f}, HF bf16 {hfs[key]:.6f} (vs HF fp32)")
    return bad


def _route_mla_prefill_to_absorbed_path() -> None:
    """SGLang 0.5.17's DeepSeek attention has no dispatch entry for torch_native and falls back to the
    triton one, which picks the MHA prefill path; torch_native then reads K back from the MLA latent cache
    and fails ("Expected size for first two dimensions of batch2 tensor to be: [4, 192] but got: [4, 576]"
    for the tiny DeepSeek-V3: the 192-wide MHA key against the 576-wide latent).
    SGLang's absorbed-MLA path, which it uses for decode and prefix prefill, runs on torch_native, so the
    CPU check routes prefill there. It computes the same attention in a different association, whose fp32
    rounding the relative tolerance (tests/unit/engine/test_architectures.py) allows; GPU backends keep SGLang's
    dispatch."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


def _compare(engine, captured, seqs, hf_states, moe=None, early=False):
    """Each captured state against HF through the product's own parity gate (rows as it records them); moe
    overrides which of the gate's rules applies. early=True compares every state with the HF state one layer
    before the right one, the off-by-one the gate must reject."""
    bounds = np.cumsum([0, *map(len, seqs)])
    pairs = (
        (captured.aux[a:b].cpu(), captured.last[a:b].cpu(), [hs[0], *hs[:-1]] if early else hs)
        for a, b, hs in zip(bounds, bounds[1:], hf_states)
    )
    rows = parity.compare_states(
        pairs,
        engine.layer_ids,
        engine.dtype,
        moe=engine.is_moe if moe is None else moe,
        fp8=checkpoint.is_fp8_block(engine.quantization),
    )
    return [r.to_json() for r in rows]


def _image_check(engine, hf, samples, text) -> dict:
    """The image samples and a text sequence captured in one batch, against HF's vision-language class on the
    same processor outputs: every token, then the image tokens alone; and the gate's verdict on the states
    compared one layer early."""
    seqs, images = [ids for ids, _ in samples] + [text], [im for _, im in samples] + [None]
    captured = engine.capture(seqs, images)
    device = next(hf.parameters()).device
    hf_states = [
        [h.float().cpu() for h in parity.hf_hidden_states(hf, s.tolist(), device, images=im)]
        for s, im in zip(seqs, images)
    ]
    bounds = np.cumsum([0, *map(len, seqs)])
    masks = [torch.from_numpy(im.token_mask) for im in images[:-1]]
    image_pairs = (
        (captured.aux[a:b][m].cpu(), captured.last[a:b][m].cpu(), [h[m] for h in hs])
        for a, b, m, hs in zip(bounds, bounds[1:], masks, hf_states)
    )
    return {
        "image_tokens": [int(m.sum()) for m in masks],
        "rows": _compare(engine, captured, seqs, hf_states),
        "image_token_rows": [r.to_json() for r in parity.compare_states(image_pairs, engine.layer_ids, engine.dtype)],
        "off_by_one_rows": _compare(engine, captured, seqs, hf_states, early=True),
    }


def _forced_states(hf, seqs, chosen) -> tuple[list, "parity.ForcedRouting"]:
    """HF's states for each sequence with every MoE block sent to the engine's experts, and the forcing's record."""
    bounds = np.cumsum([0, *map(len, seqs)])
    if any(len(ids) != 1 or len(ids[0]) != bounds[-1] for ids in chosen.values()):
        raise RuntimeError(
            f"expected one routing of {bounds[-1]} tokens per MoE layer, got "
            f"{ {layer: [tuple(t.shape) for t in ids] for layer, ids in chosen.items()} }"
        )
    forcing = parity.ForcedRouting(hf)
    device = next(hf.parameters()).device
    try:
        states = []
        for a, b, s in zip(bounds, bounds[1:], seqs):
            forcing.set({layer: ids[0][a:b] for layer, ids in chosen.items()})
            states.append([h.float().cpu() for h in parity.hf_hidden_states(hf, s.tolist(), device)])
    finally:
        forcing.remove()
    return states, forcing


def _forced_routing(engine, hf, captured, seqs, chosen) -> tuple[dict, list]:
    """The engine's states against HF sent to the engine's experts, and those HF states."""
    forced_states, forcing = _forced_states(hf, seqs, chosen)
    return {
        "moe_layers": sorted(chosen),
        "routing": [forcing.layers[layer].to_json() for layer in sorted(forcing.layers)],
        # With the experts aligned, judged as a dense model is: every token (FP8: the median token).
        "rows": _compare(engine, captured, seqs, forced_states, moe=False),
        "off_by_one_rows": _compare(engine, captured, seqs, forced_states, moe=False, early=True),
    }, forced_states


def _exact_reference(engine, hf_path, device, captured, seqs, chosen, forced_states) -> dict:
    """How far bf16 arithmetic itself moves this model: the engine's states, and HF's own bf16 states, each
    against HF in fp32 on the same weights and the same (the engine's) experts. Where HF's own bf16 run is far
    from fp32, no bf16 implementation can be expected to match it token by token; the engine is then held to
    being about as close to fp32 as HF's bf16 is."""
    hf32 = load_hf_model(hf_path, "float32", device)
    exact, _ = _forced_states(hf32, seqs, chosen)
    del hf32
    # HF's own bf16 against fp32 at every layer, so that any layer set can be looked up.
    every_id = range(len(exact[0]) - 2)
    pairs = ((torch.cat([hs[k + 1] for k in every_id], dim=-1), hs[-1], ref) for hs, ref in zip(forced_states, exact))
    return {
        "engine_rows": _compare(engine, captured, seqs, exact, moe=False),
        "hf_bf16_rows": [r.to_json() for r in parity.compare_states(pairs, every_id, engine.dtype)],
    }


# What a results file keeps of each parity row: enough to tell a right state from an off-by-one (the
# neighbouring layer's cosine) without the report's every field.
ROW_KEYS = ("layer", "hf_index", "max_abs", "max_rel", "cosine", "median_cosine", "neighbour_cosine", "ok")


def _routing_under_triton_kernels(engine) -> dict:
    """What the GPU's warm-up compiles the routing for where SGLang takes the triton_kernels MoE runner (GPT-OSS
    on Hopper; `moe.triton_kernels_routing`), with that runner, and with the runner SGLang chose here."""
    from dataclasses import asdict

    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat
    from sglang.srt.layers.moe.utils import MoeRunnerBackend, get_flags

    def routing():
        return triton_kernels_routing(engine.runner.model, engine.routed_experts, engine.runner.model_config.dtype)

    chosen = routing()
    moe = get_flags().moe
    # SGLang 0.5.17's TopK asks the runner backend at each forward; 0.5.23's took its output format from its
    # experts' runner as the model loaded (bind_runner_backend), so there the format is what a runner sets.
    topks = [m for m in engine.runner.model.modules() if isinstance(m, TopK)]
    formats = [t.topk_config.output_format for t in topks]
    before, moe.runner_backend = moe.runner_backend, MoeRunnerBackend.TRITON_KERNELS
    if hasattr(TopK, "bind_runner_backend"):
        for t in topks:
            t.topk_config.output_format = TopKOutputFormat.TRITON_KERNEL
    try:
        forced = routing()
    finally:
        moe.runner_backend = before
        for t, output_format in zip(topks, formats):
            t.topk_config.output_format = output_format
    return {"chosen": chosen and asdict(chosen), "forced": forced and asdict(forced)}


def write_result(rep: dict, arch: str, backend: str) -> None:
    """With OFFLINE_EXTRACT_RESULTS set, a run's rows (each layer once, from the checks in order), its image
    chats' rows likewise (a vision-language model), the MoE comparisons as reported, and the pytest command that
    ran them, to <that dir>/<arch>-<backend>.json: what benchmarks/parity_table.py builds docs/parity.md's table
    from."""
    results = os.environ.get("OFFLINE_EXTRACT_RESULTS")
    if not results:
        return

    def each_layer_once(checks):
        rows, seen = [], set()
        for r in (r for check in checks for r in check):
            if r["layer"] not in seen:
                seen.add(r["layer"])
                rows.append({k: r[k] for k in ROW_KEYS})
        return rows

    result = {
        "command": " ".join(["python -m pytest", *sys.argv[1:]]),
        "architecture": arch,
        "backend": backend,
        "dtype": rep["dtype"],
        "quantization": rep.get("quantization"),
        "rows": each_layer_once(check.get("rows", []) for check in rep["checks"]),
    }
    if any("images" in check for check in rep["checks"]):
        result["image_rows"] = each_layer_once(check["images"]["rows"] for check in rep["checks"] if "images" in check)
    if "forced_routing" in rep:
        result["forced_routing"] = rep["forced_routing"]
    Path(results).mkdir(parents=True, exist_ok=True)
    (Path(results) / f"{arch}-{backend}.json").write_text(json.dumps(result, indent=2) + "\n")


def run_report(model, out, *args: str, script: str = __file__) -> dict:
    """Run this script (or another `script` taking MODEL --out REPORT) on `model` in a process of its own, for the
    tests; a failure shows its stderr or the traceback its report carries."""
    cmd = [sys.executable, script, str(model), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=900)
    assert proc.returncode == 0 and Path(out).exists(), proc.stderr[-4000:]
    report = json.loads(Path(out).read_text())
    assert "error" not in report, report.get("traceback")
    return report


def _recording_qk_norm() -> set[tuple[int, str]]:
    """The head size and dtype of each call to SGLang's QK-norm (models/utils.py apply_qk_norm) from now on,
    as each model file calls it by the name it imported."""
    asked: set[tuple[int, str]] = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.srt.models.") and callable(getattr(module, "apply_qk_norm", None)):

            def recording(*args, _original=module.apply_qk_norm, **kwargs):
                q = kwargs["q"] if "q" in kwargs else args[0]
                head_dim = kwargs["head_dim"] if "head_dim" in kwargs else args[4]
                asked.add((head_dim, str(q.dtype).removeprefix("torch.")))
                return _original(*args, **kwargs)

            module.apply_qk_norm = recording
    return asked


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf-reference", default=None, help="HF-loadable directory with the same weights (default: model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--layer-sets", default="", help="';'-separated comma lists of layer ids to re-point capture to")
    ap.add_argument("--forced-routing", action="store_true", help="also compare against HF routed like the engine")
    ap.add_argument(
        "--fp32-reference",
        action="store_true",
        help="with --forced-routing: also compare the engine and HF's own run against HF in fp32",
    )
    args = ap.parse_args()

    report = {"model": args.model, "device": args.device, "dtype": args.dtype}
    try:
        prepare_process(args.device)
        if args.device == "cpu":
            _route_mla_prefill_to_absorbed_path()
        engine = Engine(
            EngineConfig(
                model_path=args.model,
                device=args.device,
                dtype=args.dtype,
                attention_backend=args.attention_backend,
                max_tokens_per_batch=1024,
                max_seqs_per_batch=8,
                context_length=1024,
                nccl_port=free_port(),
                mem_fraction_static=0.5,
            )
        )
        report.update(
            architecture=engine.architecture,
            num_layers=engine.num_layers,
            attention_backend=engine.attention_backend,
            quantization=engine.quantization,
            # Which of SGLang's methods runs the experts: shows that a quantized checkpoint took its own path.
            expert_methods=sorted(
                {
                    type(m.quant_method).__name__
                    for name, m in engine.runner.model.named_modules()
                    if name.endswith(".experts") and hasattr(m, "quant_method")
                }
            ),
            # Which of SGLang's attention backends runs a vision tower (its VisionAttention modules).
            vision_attention=sorted(
                {m.qkv_backend_name for m in engine.runner.model.modules() if hasattr(m, "qkv_backend_name")}
            ),
        )
        # What its QK-norm is asked for in the forwards below, beside what the start-up prebuilds for it.
        qk_norm_asked = _recording_qk_norm()
        shapes = kernel_shapes(engine.runner.model_config, 1)
        report["qk_norm_shapes"] = {
            "qk_norm": shapes.qk_norm,
            "head_dim": shapes.head_dim,
            "dtype": str(shapes.dtype).removeprefix("torch."),
        }
        rng = np.random.default_rng(0)
        seqs = [rng.integers(6, 380, n).astype(np.int32) for n in LENGTHS]  # inside the tiny tokenizer's vocab
        if args.forced_routing:
            with engine.recording_routing() as chosen:
                captured = engine.capture(seqs)
        else:
            captured = engine.capture(seqs)
        hf = load_hf_model(args.hf_reference or args.model, args.dtype, args.device)
        device = next(hf.parameters()).device
        hf_states = [[h.float().cpu() for h in parity.hf_hidden_states(hf, s.tolist(), device)] for s in seqs]
        if args.forced_routing:
            report["forced_routing"], forced_states = _forced_routing(engine, hf, captured, seqs, chosen)
        if args.fp32_reference:
            report["forced_routing"]["fp32_reference"] = _exact_reference(
                engine, args.hf_reference or args.model, args.device, captured, seqs, chosen, forced_states
            )

        # Bare prefill must turn capture fully off, and capture must come back unchanged after it.
        report["bare_prefill_returned"] = engine.prefill(seqs) is not None
        again = engine.capture(seqs)
        report["recapture_max_abs"] = max(
            (again.aux - captured.aux).abs().max().item(), (again.last - captured.last).abs().max().item()
        )

        # A vision-language model's image chats, checked at every layer set as its text is.
        samples = image_samples(args.model) if engine.architecture in IMAGE_MODELS else []
        # First SGLang's default ids (requested None), as the engine chose them at start.
        checks = [
            {
                "requested": None,
                "layer_ids": list(engine.layer_ids),
                "capture_points": engine.capture_points,
                "rows": _compare(engine, captured, seqs, hf_states),
                "off_by_one_rows": _compare(engine, captured, seqs, hf_states, early=True),
            }
        ]
        if samples:
            checks[0]["images"] = _image_check(engine, hf, samples, seqs[1])
            # A sequence with images over one forward's budget (1024 tokens here), which is never chunked.
            ids, images = samples[0]
            try:
                engine.capture([np.concatenate([ids, np.full(1024, 6)])], [images])
            except ValueError as e:
                report["image_over_budget"] = str(e)
        for spec in [s for s in args.layer_sets.split(";") if s]:
            check = {"requested": [int(x) for x in spec.split(",")]}
            checks.append(check)
            try:
                engine.layer_ids = engine._configure_capture(engine.runner.model, tuple(check["requested"]))
            except ValueError as e:
                check["error"] = str(e)
                continue
            check["layer_ids"], check["capture_points"] = list(engine.layer_ids), list(engine.capture_points)
            if args.forced_routing:
                with engine.recording_routing() as again_chosen:
                    states = engine.capture(seqs)
                # The same inputs route the same way unless a kernel sums in a varying order (atomics) and a
                # near-tie flips; HF then follows this capture's routing.
                check["rerouted"] = any(
                    not torch.equal(again_chosen[layer][0], ids[0]) for layer, ids in chosen.items()
                )
                reference = _forced_states(hf, seqs, again_chosen)[0] if check["rerouted"] else forced_states
                check["forced_rows"] = _compare(engine, states, seqs, reference, moe=False)
            else:
                states = engine.capture(seqs)
            check["rows"] = _compare(engine, states, seqs, hf_states)
            if samples:
                check["images"] = _image_check(engine, hf, samples, seqs[1])
        report["checks"] = checks
        report["qk_norm_asked"] = sorted(qk_norm_asked)
        # The warm-up a GPU run starts with: on a MoE model, a forward of each token count it names.
        report["is_moe"], report["warm_up_token_counts"] = engine.is_moe, engine.warm_up_token_counts()
        engine.warm_up()
        report["triton_kernels_routing"] = _routing_under_triton_kernels(engine)
        del hf
    except Exception as e:  # the report carries the failure, so the test can show it
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
