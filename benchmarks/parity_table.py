"""The per-family parity table of docs/parity.md, built from the parity JSONs the test suites write
(`OFFLINE_EXTRACT_RESULTS=DIR`: tests/unit/engine/test_architectures.py on CPU, tests/gpu/test_gpu_architectures.py,
tests/gpu/test_gpu_fp8.py and tests/gpu/test_gpu_mxfp4.py on the GPU, `-m "gpu and moe"` the MoE ones).

\b
    python benchmarks/parity_table.py [RESULTS_DIR] [--page docs/parity.md]

prints the table, or with --page replaces the one between its parity-table markers. RESULTS_DIR defaults to
benchmarks/results/parity. A family whose run has no file yet reads "pending".
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
# The checkout first, as bin/ scripts put it (run as a file, this imports its own benchmarks and offline_extract).
sys.path.insert(0, str(ROOT))

from benchmarks import program  # noqa: E402
from offline_extract.engine.families import BY_NAME, FAMILIES  # noqa: E402
from offline_extract.engine.parity import MOE_HALF_MIN_MEDIAN_COSINE  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "parity"
PAGE = ROOT / "docs" / "parity.md"
GPU_BACKENDS = ("flashinfer", "fa3")
START, END = "<!-- parity-table -->", "<!-- /parity-table -->"


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _states(rows: list[dict], moe: bool = False) -> str:
    """Over all layers compared: pass or FAIL under the product's gate (a MoE model's median token, else every
    token), the worst token and the worst median."""
    passed = all(r["median_cosine"] >= MOE_HALF_MIN_MEDIAN_COSINE for r in rows) if moe else all(r["ok"] for r in rows)
    return (
        f"{'pass' if passed else '**FAIL**'}: worst token {min(r['cosine'] for r in rows):.4f}, "
        f"median ≥ {min(r['median_cosine'] for r in rows):.5f}"
    )


# The CPU suite's fp32 rule (tests/unit/engine/test_architectures.py): relative to the states' scale, which grows to about 11
# on GLM-4.5 and DeepSeek-V3 (their routed scaling), where an absolute 1e-5 would be fp32 rounding's own size.
CPU_FP32_MAX_REL = 1e-5


def _cpu(result: dict | None, arch: str) -> str:
    if result is None:
        return "no CPU run (docs/supported-models.md)"
    rows = result["rows"] + result.get("image_rows", [])
    rel = max(r["max_rel"] for r in rows)
    verdict = "pass" if rel <= CPU_FP32_MAX_REL else "**FAIL**"
    return f"{verdict}, {result['dtype']}: max rel {rel:.1e} (max abs {max(r['max_abs'] for r in rows):.1e})" + _images(
        result, arch
    )


def _gpu(result: dict | None, moe: bool, arch: str, backend: str) -> str:
    """The product's gate as --verify applies it: on a MoE model, against HF on the engine's experts."""
    if result is None:
        runs_on = BY_NAME[arch].gpu_backends or [backend]
        return "pending" if backend in runs_on else f"— (SGLang runs it on {' and '.join(runs_on)} only)"
    if moe and "forced_routing" in result:
        return _states(result["forced_routing"]["rows"], moe=True) + " (HF on the engine's experts)"
    text = _states(result["rows"] + result.get("image_rows", []), moe=moe) + (" (unforced)" if moe else "")
    return text + _images(result, arch)


def _images(result: dict, arch: str) -> str:
    """What a row of a family that takes images says of them: a run before its image chats were gated
    holds text records alone, which the row must not pass off as the family's whole gate."""
    if "image_rows" in result:
        return ", image chats included"
    return "; text only, image chats pending" if BY_NAME[arch].images else ""


def _forced(results: Path, arch: str, moe: bool) -> str:
    if not moe:
        return "—"
    runs = {b: _load(results, f"{arch}-{b}") for b in ("triton", *GPU_BACKENDS, "cpu_bf16")}
    forced = {b: r["forced_routing"] for b, r in runs.items() if r and "forced_routing" in r}
    if not forced:
        return "pending"
    worst, where = min((min(row["cosine"] for row in f["rows"]), b) for b, f in forced.items())
    text = f"{worst:.4f} on {where.replace('_', ' ')}" + (f" (of {', '.join(forced)})" if len(forced) > 1 else "")
    floor = [f["fp32_reference"] for f in forced.values() if "fp32_reference" in f]
    if floor:
        ours = min(min(r["cosine"] for r in f["engine_rows"]) for f in floor)
        theirs = min(min(r["cosine"] for r in f["hf_bf16_rows"]) for f in floor)
        text += f"; vs HF fp32: engine {ours:.4f}, HF's own bf16 {theirs:.4f}"
    return text


def _quantized(results: Path, arch: str, fmt: str | None) -> str:
    if fmt is None:
        return "—"
    if fmt == "fp8":
        result = _load(results, f"fp8-{arch}")
        if result is None:
            return "FP8: pending"
        rep = result["report"]
        rows = (rep.get("forced_routing") or rep["checks"][0])["rows"]
        return f"FP8: median ≥ {min(r['median_cosine'] for r in rows):.4f} (gate 0.98)"
    found = {b: _load(results, f"mxfp4-{arch}-{b}") for b in ("triton", "fa3")}
    done = {b: r for b, r in found.items() if r}
    if not done:
        return "MXFP4: pending"
    return "MXFP4: " + "; ".join(f"{b} {_states(r['forced_routing']['rows'], moe=True)}" for b, r in done.items())


def table(results: Path) -> str:
    lines = [
        "| family | CPU, engine vs HF | GPU bf16, triton | GPU bf16, flashinfer / fa3 | forced routing, worst token (bf16) "
        "| quantized checkpoint |",
        "|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        # A MoE family with a forceable HF block: --verify forces its routing.
        arch, moe, fmt = family.name, family.routing is not None, family.quantized
        others = [f"{b}: {_gpu(r, moe, arch, b)}" for b in GPU_BACKENDS if (r := _load(results, f"{arch}-{b}"))]
        cpu, triton = (
            _cpu(_load(results, f"{arch}-cpu"), arch),
            _gpu(_load(results, f"{arch}-triton"), moe, arch, "triton"),
        )
        lines.append(
            f"| {family.label} | {cpu} | {triton} | "
            f"{'; '.join(others) or 'pending'} | {_forced(results, arch, moe)} | {_quantized(results, arch, fmt)} |"
        )
    return "\n".join(lines)


@program(__doc__)
@click.argument(
    "results",
    metavar="[RESULTS_DIR]",
    required=False,
    default=RESULTS,
    type=click.Path(file_okay=False, path_type=Path),
)
@click.option(
    "--page",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Replace the table between the parity-table markers in this file.",
)
def main(results: Path, page: Path | None) -> None:
    text = table(results)
    if page is None:
        click.echo(text)
        return
    current = page.read_text()
    if START not in current or END not in current:
        raise click.ClickException(f"{page} has no {START} ... {END} markers")
    page.write_text(
        re.sub(f"{re.escape(START)}.*?{re.escape(END)}", lambda m: f"{START}\n{text}\n{END}", current, flags=re.S)
    )


if __name__ == "__main__":
    main()
