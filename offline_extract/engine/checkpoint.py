"""A checkpoint's weight files: which they are, whether they are whole, and the tensors in them, read as stored
or dequantized (FP8 blocks, MXFP4 experts) for HF's reference. The run checks the files before SGLang loads
them (`check_checkpoint_complete`, `check_safetensors`, `check_pickled_weights`) and holds the config's sizes
against them (`check_config_sizes`); the parity gate reads them (`engine/reference.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file  # here, so that ReferencePreload's thread imports nothing

from offline_extract.store.journal import load_json
from offline_extract.formatting import listing

CHECKPOINT_INDEX = "model.safetensors.index.json"  # maps each tensor to the file that holds it
# What to do about a damaged file of the model's (its config.json, its index): the user's to fetch again, where a
# damaged file of ours is deleted or restored (store.journal.load_json).
DAMAGED_MODEL_FILE = (
    "it is damaged, or was cut short by an interrupted download or copy. Download or copy it again, then re-run"
)


def checkpoint_files(model_path: str) -> list[Path]:
    """The safetensors files HF transformers loads the checkpoint from: those its index names, else its
    model.safetensors; none where its weights are in another format (HF reads those itself)."""
    root = Path(model_path)
    index = root / CHECKPOINT_INDEX
    if index.is_file():
        return sorted({root / name for name in _weight_map(index).values()})
    single = root / "model.safetensors"
    return [single] if single.is_file() else []


def _weight_map(index: Path) -> dict[str, str]:
    """The index's map of each tensor to the file holding it. A damaged index is refused naming it (and where
    its JSON breaks), where json's bare error named no file and SGLang's load would fail on it with a traceback."""
    document = load_json(index, DAMAGED_MODEL_FILE)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(f, str) for f in weight_map.values())):
        raise ValueError(f'{index} has no "weight_map" object naming the file of each tensor: {DAMAGED_MODEL_FILE}')
    return weight_map


def unindexed(model_dir: Path, prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `prefixes` under which the checkpoint's index names no weight: all of them where it has no index."""
    index = model_dir / CHECKPOINT_INDEX
    names = _weight_map(index) if index.is_file() else {}
    return tuple(p for p in prefixes if not any(name.startswith(p) for name in names))


class WeightsMissing(FileNotFoundError):
    """Weight files that the checkpoint's index names and that are not there: an interrupted download or copy."""

    SHOWN = 5  # names listed; a checkpoint of hundreds of files missing most of them would fill the screen

    def __init__(self, index: Path, missing: list[Path]):
        names = ", ".join(f.name for f in missing[: self.SHOWN])
        if len(missing) > self.SHOWN:
            names += f" and {len(missing) - self.SHOWN} more"
        super().__init__(
            f"{index} lists {len(missing)} weight file{'s' if len(missing) > 1 else ''} that {index.parent} lacks: "
            f"{names}. The download or copy did not finish: download or copy the model again (a Hugging Face "
            f"download fetches only what is missing), then re-run"
        )


def check_checkpoint_complete(model_dir: Path) -> None:
    """Raises WeightsMissing where the index names files that are not there (SGLang's load refuses them too,
    but with a RuntimeError's traceback, once the model is built and the load begins)."""
    missing = [f for f in checkpoint_files(str(model_dir)) if not f.is_file()]
    if missing:
        raise WeightsMissing(model_dir / CHECKPOINT_INDEX, missing)


def checkpoint_bytes(model_path: str) -> int:
    """The size of the checkpoint HF transformers loads (`checkpoint_files`): what the gate's read-ahead holds
    in host memory."""
    return sum(f.stat().st_size for f in checkpoint_files(model_path))


class WeightsUnreadable(ValueError):
    """A checkpoint's weight file that cannot be read: named, with what was wrong and what to do."""

    def __init__(self, path: Path, error: Exception):
        if isinstance(error, OSError):
            what = f"cannot be read ({error.strerror or error}): check its permissions and its disk, or copy it again"
        else:  # safetensors' own error, which names no file
            what = (
                f"is not a whole safetensors file ({error}): it is damaged, or was cut short by an interrupted "
                f"download or copy. Download or copy it again"
            )
        super().__init__(f"{path} {what}, then re-run")


def check_safetensors(path: Path) -> None:
    """Raises WeightsUnreadable where safetensors cannot open `path`: its header is damaged, or the file is
    shorter or longer than the header says. Reads the header only, so it costs milliseconds on any checkpoint."""
    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as e:  # safetensors raises its own SafetensorError
        raise WeightsUnreadable(path, e) from e


# What HF's Trainer saves beside a model's weights (its arguments, optimizer and scheduler states): pickled objects
# that SGLang's loader leaves out of the weights it reads.
TRAINER_FILES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def check_pickled_weights(model_dir: Path) -> None:
    """Raises ValueError naming a pickled weight file (torch.save's *.bin or *.pt, which SGLang loads where the
    checkpoint has no safetensors files) that holds objects beyond tensors: SGLang loads those files with torch's
    weights_only unpickler, which refuses them, but in a traceback whose advice is to load them without it, which
    would run whatever code the file names. Reads each file's pickle alone, not its tensors, and runs none of it."""
    if any(model_dir.glob("*.safetensors")):
        return
    for path in sorted(f for pattern in ("*.bin", "*.pt") for f in model_dir.glob(pattern)):
        if path.name in TRAINER_FILES:
            continue
        try:
            beyond = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except ValueError:  # torch.save's format before zip files: weights_only alone judges it, as it loads
            continue
        except (OSError, RuntimeError) as e:  # unreadable, or not a whole zip file
            raise WeightsUnreadable(path, e) from e
        if beyond:
            raise ValueError(
                f"{path} holds pickled objects beyond tensors ({listing(sorted(beyond), 3)}), which are refused: "
                f"loading them would run code the file names. Use a checkpoint of safetensors weights, or convert "
                f"this one's tensors where you trust its source"
            )


# A decoder's embedding, whose name less this (model., language_model.model., model.language_model.) is where its
# layers' weights are named too.
EMBEDDING = "embed_tokens.weight"
_LAYER = re.compile(r"layers\.(\d+)\.")
# Sizes a config states that a decoder's weights show: (the key, the weight under the decoder's name, its dimension).
SIZES_SHOWN = (
    ("vocab_size", re.compile(re.escape(EMBEDDING)), 0),
    ("hidden_size", re.compile(re.escape(EMBEDDING)), 1),
    ("intermediate_size", re.compile(r"layers\.\d+\.mlp\.down_proj\.weight"), 1),  # a dense layer's MLP
)
# The dtypes a weight is stored in at its own shape; a packed 4-bit encoding (bitsandbytes) stores another.
_UNPACKED = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def check_config_sizes(model_dir: Path, num_layers: int, sizes: Mapping[str, object], where: str) -> None:
    """The decoder's `num_layers` and `sizes` (its config's SIZES_SHOWN keys), as config.json gives them under
    `where`, held against the safetensors weights' names and headers: SGLang allocates the model from the config
    before it reads a weight, so a config that is not the weights' (edited, or another model's) would fail only
    there, on an allocation no machine may hold, or run layers the weights lack on what the allocation held.
    Raises ValueError naming the key, the weight and its file. A checkpoint in another format, or whose decoder
    has no `EMBEDDING`, is not checked."""
    check_checkpoint_complete(model_dir)
    files = _weight_files(model_dir)
    embeddings = [name for name in files if name.endswith(EMBEDDING) and not _LAYER.search(name)]
    if not embeddings:
        return
    decoder = min(embeddings, key=len).removesuffix(EMBEDDING)
    layers = {int(m[1]) for name in files if name.startswith(decoder) and (m := _LAYER.match(name, len(decoder)))}
    missing = [str(i) for i in range(num_layers) if i not in layers]
    if missing:
        raise ValueError(
            f"{model_dir / 'config.json'} gives {where}num_hidden_layers {num_layers}, but the "
            f"weights hold no {decoder}layers.N.* for layers {listing(missing)}. The config is not these weights': "
            f"put back the config.json that came with them"
        )
    for key, pattern, dim in SIZES_SHOWN:
        name = next(
            (name for name in files if name.startswith(decoder) and pattern.fullmatch(name, len(decoder))), None
        )
        if name is None or sizes.get(key) is None:
            continue
        dtype, shape = _dtype_and_shape(files[name], name)
        if dtype in _UNPACKED and shape[dim] != sizes[key]:
            raise ValueError(
                f"{model_dir / 'config.json'} gives {where}{key} {sizes[key]}, but the weights say {shape[dim]}: "
                f"{name} in {files[name].name} has the shape {list(shape)}. The config is not these weights': put "
                f"back the config.json that came with them"
            )


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Each safetensors weight's file, by the weight's name: as the index maps them, else model.safetensors's."""
    index = model_dir / CHECKPOINT_INDEX
    if index.is_file():
        return {name: model_dir / file for name, file in _weight_map(index).items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return {}
    try:
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise WeightsUnreadable(single, e) from e


def _dtype_and_shape(path: Path, name: str) -> tuple[str, list[int]]:
    try:
        with safe_open(path, framework="pt") as f:
            weight = f.get_slice(name)
            return weight.get_dtype(), weight.get_shape()
    except Exception as e:  # a damaged file, one the index names that is not there, a name it lacks
        raise WeightsUnreadable(path, e) from e


def checkpoint_tensors(model_path: str, resident: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, as safetensors maps them from the files, or with
    `resident` copied into host memory of their own: a mapped tensor is read from the file (page by page,
    on one thread) only when something first reads it, such as the copy to the GPU."""
    files = checkpoint_files(model_path)
    if not files:
        raise FileNotFoundError(f"no safetensors weights (model.safetensors or an index of them) in {model_path}")
    raw: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors = load_file(path)
        except Exception as e:  # an I/O error mid-read, or a file damaged since the run's checks
            raise WeightsUnreadable(path, e) from e
        raw.update((name, t.clone() if resident else t) for name, t in tensors.items())
    return raw


def is_fp8_block(quantization: dict | None) -> bool:
    return bool(quantization and quantization.get("quant_method") == "fp8" and quantization.get("weight_block_size"))


def dequantized_fp8_tensors(
    model_path: str,
    dtype: torch.dtype,
    raw: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor of an FP8 block-quantized checkpoint, each e4m3 weight multiplied by its block's
    `weight_scale_inv` and rounded once to `dtype`; and the names of those weights. `raw`: the checkpoint's
    tensors already read (`checkpoint_tensors`)."""
    raw = checkpoint_tensors(model_path) if raw is None else raw
    tensors, quantized = {}, set()
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        scale = raw.get(f"{name}_scale_inv")
        if scale is not None:
            rows, cols = t.shape
            block_rows, block_cols = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
            expanded = scale.float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
            t = (t.float() * expanded[:rows, :cols]).to(dtype)
            quantized.add(name)
        tensors[name] = t
    return tensors, quantized


def is_mxfp4(quantization: dict | None) -> bool:
    return bool(quantization and quantization.get("quant_method") == "mxfp4")


# The OCP microscaling FP4 element (e2m1) by its 4-bit code: codes 0-7 these magnitudes, 8-15 the same negated.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32  # elements sharing one e8m0 scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., K/32, 16] uint8 (two e2m1 codes a byte, the lower nibble first) with [..., K/32] e8m0 scales
    (2^(s-127)) -> [..., K] in `dtype` (exact in bf16: an e2m1 value times a power of two)."""
    values = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)], dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values[codes], exponents[..., None]).flatten(-2).to(dtype)


def dequantized_mxfp4_tensors(
    model_path: str,
    dtype: torch.dtype,
    raw: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor of an MXFP4 checkpoint (GPT-OSS as released), each expert projection's `<name>_blocks` and
    `<name>_scales` ([experts, out, in/32, 16] and [experts, out, in/32]) dequantized into `<name>` in HF's
    layout ([experts, in, out]); and the names of those projections. `raw`: the checkpoint's tensors already
    read (`checkpoint_tensors`)."""
    raw = checkpoint_tensors(model_path) if raw is None else raw
    tensors, quantized = {}, set()
    for name, t in raw.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            name = name.removesuffix("_blocks")
            t = dequantize_mxfp4(t, raw[f"{name}_scales"], torch.float32).transpose(1, 2).to(dtype)
            quantized.add(name)
        tensors[name] = t
    return tensors, quantized
