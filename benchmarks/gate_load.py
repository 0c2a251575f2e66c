"""The parity gate's HF side alone (no SGLang): where `bin/extract.py --verify` spends its seconds once SGLang is
up, and what each way of getting HF's weights onto the device costs.

\b
1. HF's model of the checkpoint from the files, as the gate loaded it before its weights were read ahead, and
   from the tensors read ahead (`checkpoint.checkpoint_tensors(resident=True)`, what `ReferencePreload` reads
   beside SGLang's start-up), each split as the run's `timings` split it: model class and config, the load on
   the host, the move to the device.
2. The copy to the device alone, tensor by tensor, from the files' mapped pages, from resident pageable memory
   and from pinned memory (the pinning timed apart): what pinning the read-ahead weights would still gain.
3. HF's forwards over `--samples` samples of `--length` tokens as the gate runs them (in half precision, in
   --dtype and in float32 on the same weights, `parity.float32_pass`), and the comparison against states held on
   the host, as the gate holds the engine's (here HF's own, so every row passes); the device's peak memory.

\b
    python benchmarks/gate_load.py --model /dev/shm/offline_extract_peers_llama3_8b --json gate_load.json

Seconds are wall time, the device synchronized at each end.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import emit, program  # noqa: E402

from offline_extract.engine import checkpoint, parity, reference  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _import_model_class(model: str) -> None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]


def _load(model: str, dtype: str, device: torch.device, tensors=None) -> tuple[torch.nn.Module, dict]:
    """load_hf_model, split at the points it marks."""
    at = {}
    start = time.perf_counter()
    hf = reference.load_hf_model(
        model, dtype, str(device), tensors=tensors, mark=lambda point: at.__setitem__(point, time.perf_counter())
    )
    _sync(device)
    end = time.perf_counter()
    return hf, {
        "config_s": at["hf configured"] - start,
        "to_host_s": at["hf on host"] - at["hf configured"],
        "to_device_s": end - at["hf on host"],
    }


def _copy_to_device(tensors: dict, device: torch.device) -> float:
    start = time.perf_counter()
    on_device = [t.to(device, non_blocking=True) for t in tensors.values()]
    _sync(device)
    seconds = time.perf_counter() - start
    del on_device
    _free(device)
    return seconds


def _copies(model: str, device: torch.device) -> dict:
    """Every weight to the device, tensor by tensor, from three kinds of host memory."""
    result = {"mapped_to_device_s": _copy_to_device(checkpoint.checkpoint_tensors(model), device)}
    start = time.perf_counter()
    resident = checkpoint.checkpoint_tensors(model, resident=True)
    result["read_resident_s"] = time.perf_counter() - start
    result["resident_to_device_s"] = _copy_to_device(resident, device)
    if device.type == "cuda":
        start = time.perf_counter()
        pinned = {name: t.pin_memory() for name, t in resident.items()}
        result["pin_s"] = time.perf_counter() - start
        del resident
        result["pinned_to_device_s"] = _copy_to_device(pinned, device)
    return result


def _forwards_and_comparison(hf, device: torch.device, dtype: str, samples: int, length: int) -> dict:
    """The gate's own comparison (parity.compare) of states held on the host, as it holds the engine's (here HF's
    own, so every row passes): its HF forwards (in half precision, in `dtype` and in float32, parity.float32_pass)
    and the rest."""
    layers = hf.config.num_hidden_layers
    layer_ids = sorted({1, layers // 2 - 1, layers - 4} & set(range(layers - 1))) or [0]
    generator = torch.Generator().manual_seed(0)
    held = []
    for _ in range(samples):
        ids = torch.randint(0, hf.config.vocab_size, (length,), generator=generator).tolist()
        hs = parity.hf_hidden_states(hf, ids, device)
        held.append((ids, torch.cat([hs[k + 1] for k in layer_ids], dim=-1).cpu(), hs[-1].cpu()))
        del hs
    forwards: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    rows = parity.compare(held, hf, layer_ids, dtype, timed=forwards.append)
    total = time.perf_counter() - start
    return {
        "forwards_s": sum(forwards),
        "first_forward_s": forwards[0],
        "compare_s": total - sum(forwards),
        "against_float32": rows[0].floor_rel_err is not None,
        "rows_ok": all(row.ok for row in rows),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


@program(__doc__)
@click.option("--model", required=True, help="A checkpoint directory (safetensors).")
@click.option("--dtype", type=click.Choice(sorted(parity.TOLERANCES)), default="bfloat16", show_default=True)
@click.option("--device", "device_name", default="cuda", show_default=True)
@click.option("--samples", default=8, show_default=True, help="The gate's samples (bin/extract.py --verify N).")
@click.option("--length", default=2000, show_default=True, help="Tokens a sample.")
@click.option("--json", "json_path", default=None, help="Also write the result to this file.")
def main(model: str, dtype: str, device_name: str, samples: int, length: int, json_path: str | None) -> None:
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    result = {
        "model": model,
        "dtype": dtype,
        "device": str(device),
        "checkpoint_bytes": checkpoint.checkpoint_bytes(model),
        "samples": samples,
        "length": length,
    }
    # In a run SGLang has imported transformers' modeling code by the gate; here it is imported first, apart.
    start = time.perf_counter()
    _import_model_class(model)
    result["transformers_import_s"] = time.perf_counter() - start

    hf, result["from_files"] = _load(model, dtype, device)
    del hf
    _free(device)

    start = time.perf_counter()
    tensors = checkpoint.checkpoint_tensors(model, resident=True)
    read = time.perf_counter() - start
    hf, result["read_ahead"] = _load(model, dtype, device, tensors)
    result["read_ahead"]["read_s"] = read
    del tensors
    result.update(_forwards_and_comparison(hf, device, dtype, samples, length))
    del hf
    _free(device)

    result["copies"] = _copies(model, device)
    emit(result, json_path)


if __name__ == "__main__":
    main()
