"""One architecture's engine against HF transformers, in a process of its own (SGLang allows one
ModelRunner per process). Run by test_architectures.py and test_gpu_architectures.py; prints nothing,
writes a JSON report.

    python tests/arch_parity.py MODEL_DIR --out report.json [--hf-reference DIR] [--device cuda --dtype bfloat16
        --attention-backend triton] [--layer-sets "0,3,6;1,2;2,5;0"] [--forced-routing]

The engine starts with SGLang's default layer ids; each --layer-sets entry then re-points the running
engine's capture and is compared against HF again, so every id mapping is checked on the same weights.
--forced-routing (MoE models) also compares the default ids against HF routed to the experts the engine
chose (`parity.ForcedRouting`), and reports per MoE layer how often HF's own choice differs.
"""
import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_extract.engine import parity  # noqa: E402
from offline_extract.engine.distributed import free_port  # noqa: E402
from offline_extract.engine.sglang_adapter import Engine, EngineConfig, prepare_process  # noqa: E402

LENGTHS = (5, 37, 64)  # several requests in one batch, so packing by request is exercised too


def _route_mla_prefill_to_absorbed_path() -> None:
    """SGLang 0.5.17's DeepSeek attention has no dispatch entry for torch_native and falls back to the
    triton one, which picks the MHA prefill path; torch_native then reads K back from the MLA latent cache
    and fails ("Expected size for first two dimensions of batch2 tensor to be: [4, 192] but got: [4, 576]"
    for the tiny DeepSeek-V3: the 192-wide MHA key against the 576-wide latent).
    SGLang's absorbed-MLA path, which it uses for decode and prefix prefill, runs on torch_native, so the
    CPU check routes prefill there. It computes the same attention in a different association, which is
    why MLA gets a relative rather than an absolute fp32 tolerance; GPU backends keep SGLang's dispatch."""
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
    rows = parity.compare_states(pairs, engine.layer_ids, engine.dtype, moe=engine.is_moe if moe is None else moe,
                                 fp8=parity.is_fp8_block(engine.quantization))
    return [r.to_json() for r in rows]


def _forced_routing(engine, hf, captured, seqs, chosen) -> dict:
    """The engine's states against HF sent to the engine's experts, sequence by sequence."""
    bounds = np.cumsum([0, *map(len, seqs)])
    if any(len(ids) != 1 or len(ids[0]) != bounds[-1] for ids in chosen.values()):
        raise RuntimeError(f"expected one routing of {bounds[-1]} tokens per MoE layer, got "
                           f"{ {layer: [tuple(t.shape) for t in ids] for layer, ids in chosen.items()} }")
    forcing = parity.ForcedRouting(hf)
    device = next(hf.parameters()).device
    try:
        forced_states = []
        for a, b, s in zip(bounds, bounds[1:], seqs):
            forcing.set({layer: ids[0][a:b] for layer, ids in chosen.items()})
            forced_states.append([h.float().cpu() for h in parity.hf_hidden_states(hf, s.tolist(), device)])
    finally:
        forcing.remove()
    return {
        "moe_layers": sorted(chosen),
        "routing": [forcing.layers[layer].to_json() for layer in sorted(forcing.layers)],
        # With the experts aligned, judged as a dense model is: every token (FP8: the median token).
        "rows": _compare(engine, captured, seqs, forced_states, moe=False),
        "off_by_one_rows": _compare(engine, captured, seqs, forced_states, moe=False, early=True),
    }


def run_report(model, out, *args: str) -> dict:
    """Run this script on `model` in a process of its own, for the tests; a failure shows its stderr or the
    traceback its report carries."""
    cmd = [sys.executable, __file__, str(model), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=900)
    assert proc.returncode == 0 and Path(out).exists(), proc.stderr[-4000:]
    report = json.loads(Path(out).read_text())
    assert "error" not in report, report.get("traceback")
    return report


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
    args = ap.parse_args()

    report = {"model": args.model, "device": args.device, "dtype": args.dtype}
    try:
        prepare_process(args.device)
        if args.device == "cpu":
            _route_mla_prefill_to_absorbed_path()
        engine = Engine(
            EngineConfig(
                model_path=args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                max_tokens_per_batch=1024, max_seqs_per_batch=8, context_length=1024, nccl_port=free_port(),
                mem_fraction_static=0.5,
            )
        )
        report.update(
            architecture=engine.architecture, num_layers=engine.num_layers, attention_backend=engine.attention_backend,
            quantization=engine.quantization,
        )
        rng = np.random.default_rng(0)
        seqs = [rng.integers(6, 380, n).astype(np.int32) for n in LENGTHS]  # inside the tiny tokenizer's vocab
        if args.forced_routing:
            with engine.recording_routing() as chosen:
                captured = engine.capture(seqs)
        else:
            captured = engine.capture(seqs)
        hf = parity.load_hf_model(args.hf_reference or args.model, args.dtype, args.device)
        device = next(hf.parameters()).device
        hf_states = [[h.float().cpu() for h in parity.hf_hidden_states(hf, s.tolist(), device)] for s in seqs]
        if args.forced_routing:
            report["forced_routing"] = _forced_routing(engine, hf, captured, seqs, chosen)
        del hf

        # Bare prefill must turn capture fully off, and capture must come back unchanged after it.
        report["bare_prefill_returned"] = engine.prefill(seqs) is not None
        again = engine.capture(seqs)
        report["recapture_max_abs"] = max(
            (again.aux - captured.aux).abs().max().item(), (again.last - captured.last).abs().max().item()
        )

        # First SGLang's default ids (requested None), as the engine chose them at start.
        checks = [{"requested": None, "layer_ids": list(engine.layer_ids), "capture_points": engine.capture_points,
                   "rows": _compare(engine, captured, seqs, hf_states),
                   "off_by_one_rows": _compare(engine, captured, seqs, hf_states, early=True)}]
        for spec in [s for s in args.layer_sets.split(";") if s]:
            check = {"requested": [int(x) for x in spec.split(",")]}
            checks.append(check)
            try:
                engine.layer_ids = engine._configure_capture(engine.runner.model, tuple(check["requested"]))
            except ValueError as e:
                check["error"] = str(e)
                continue
            check["layer_ids"], check["capture_points"] = list(engine.layer_ids), list(engine.capture_points)
            check["rows"] = _compare(engine, engine.capture(seqs), seqs, hf_states)
        report["checks"] = checks
    except Exception as e:  # the report carries the failure, so the test can show it
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
