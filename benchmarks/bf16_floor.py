"""How far bf16 arithmetic alone moves each architecture: HF transformers' own bf16 states against its fp32
states on the same generated weights, with HF's bf16 MoE blocks sent to the experts its fp32 run chose
(`parity.ForcedRouting`), and unforced (each routing itself). No SGLang: this is the floor under any bf16
implementation's parity, the engine's included (docs/moe-bf16-investigation.md).

\b
    python benchmarks/bf16_floor.py [--device cuda] [--archs qwen3,gpt_oss,...] [--out FILE.json]

Per architecture and layer: the worst and the median token's cosine, over sequences of 5, 37 and 64 tokens.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import program  # noqa: E402

from offline_extract.default_model import ensure_tiny_model  # noqa: E402
from offline_extract.engine import parity, reference  # noqa: E402
from offline_extract.testing.models import build_model  # noqa: E402

ARCHS = ("qwen3", "qwen3_moe", "qwen2_moe", "qwen3_next", "minimax_m2", "glm4_moe", "gpt_oss", "deepseek_v3")
LENGTHS = (5, 37, 64)


def _runs(hf, seqs, device, experts=None):
    """HF's states per sequence, and the experts each MoE layer routed to (forced to `experts` if given)."""
    forcing = parity.ForcedRouting(hf) if parity.ForcedRouting.supports(hf) else None
    states, chosen = [], []
    try:
        for i, s in enumerate(seqs):
            if forcing:
                forcing.set(experts[i] if experts else None)
            states.append([h.float().cpu() for h in parity.hf_hidden_states(hf, s, device)])
            chosen.append(dict(forcing.own_choice) if forcing else {})
    finally:
        if forcing:
            forcing.remove()
    return states, chosen


def _rows(bf16, fp32) -> list[dict]:
    every_id = range(len(fp32[0]) - 2)
    pairs = ((torch.cat([hs[k + 1] for k in every_id], dim=-1), hs[-1], ref) for hs, ref in zip(bf16, fp32))
    return [
        {k: r[k] for k in ("layer", "cosine", "median_cosine")}
        for r in (row.to_json() for row in parity.compare_states(pairs, every_id, "bfloat16"))
    ]


def measure(arch: str, root: Path, device: str) -> dict:
    model = build_model(arch, root / arch, dtype=torch.bfloat16, device=device, tokenizer_dir=ensure_tiny_model())
    rng = np.random.default_rng(0)
    seqs = [rng.integers(6, 380, n).tolist() for n in LENGTHS]  # as tests/arch_parity.py draws them
    hf32 = reference.load_hf_model(str(model), "float32", device)
    exact, chosen = _runs(hf32, seqs, device)
    del hf32
    hf16 = reference.load_hf_model(str(model), "bfloat16", device)
    result = {"unforced": _rows(_runs(hf16, seqs, device)[0], exact)}
    if any(chosen):
        result["forced_to_fp32_experts"] = _rows(_runs(hf16, seqs, device, chosen)[0], exact)
    return result


@program(__doc__)
@click.option("--device", default="cpu", show_default=True)
@click.option("--archs", default=",".join(ARCHS), show_default=True, help="Comma-separated architectures.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    show_default="benchmarks/results/bf16_floor_cpu.json",
    default=Path(__file__).resolve().parent / "results" / "bf16_floor_cpu.json",
)
def main(device: str, archs: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {arch: measure(arch, Path(tmp), device) for arch in archs.split(",")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"command": " ".join(["python", *sys.argv]), "device": device, "architectures": results}, indent=2)
        + "\n"
    )


if __name__ == "__main__":
    main()
