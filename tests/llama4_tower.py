"""SGLang's Llama 4 vision tower and projector, as the engine loads them, against HF's on the same tiles, in a
process of its own (SGLang allows one ModelRunner per process). Run by tests/unit/engine/test_multimodal.py;
writes a JSON report.

    python tests/llama4_tower.py MODEL_DIR --out report.json

The engine refuses Llama 4 on CPU before loading it (families._CHUNKED): its decoder's chunked attention and
CUDA-only RoPE have no CPU path. The tower and projector have one and run before the decoder, so this process
alone lifts the refusal, loads the model through the engine (its enable_multimodal, SGLang's own load_weights),
and runs only mllama4.py's get_image_feature on the items `image_request` builds.
"""

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arch_parity import image_samples  # noqa: E402

from offline_extract.engine import parity, sglang_adapter  # noqa: E402
from offline_extract.engine.distributed import free_port  # noqa: E402
from offline_extract.engine.families import BY_NAME  # noqa: E402
from offline_extract.engine.multimodal import image_request  # noqa: E402
from offline_extract.engine.reference import load_hf_model  # noqa: E402


def _report(model_dir: str) -> dict:
    sglang_adapter._refuse_unsupported_attention = lambda *args: None
    sglang_adapter._refuse_on_cpu = lambda *args: None
    engine = sglang_adapter.Engine(
        sglang_adapter.EngineConfig(model_path=model_dir, device="cpu", dtype="float32", nccl_port=free_port())
    )
    model, hf = engine.runner.model, load_hf_model(model_dir, "float32", "cpu")
    report = {"has_vision": model.has_vision, "chats": []}
    for ids, images in image_samples(model_dir):
        _, mm = image_request(model, engine.runner.model_config.hf_config, BY_NAME["llama4"].images, ids, images)
        pixels = parity.hf_image_inputs(hf, images, "cpu")["pixel_values"]
        with torch.no_grad():
            ours = model.get_image_feature(mm.mm_items)
            tower = hf.get_image_features(pixel_values=pixels, vision_feature_select_strategy="default")
            theirs = hf.multi_modal_projector(tower.last_hidden_state.flatten(0, -2))
        report["chats"].append(
            {
                "items": len(mm.mm_items),
                "image_tokens": int(images.token_mask.sum()),
                "shapes": [list(ours.shape), list(theirs.shape)],
                "max_abs": (ours - theirs).abs().max().item(),
                "scale": theirs.abs().max().item(),
            }
        )
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sglang_adapter.prepare_process("cpu")
    try:
        report = _report(args.model)
    except Exception as e:  # the report carries the failure, so the test can show it
        report = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
