"""Training a drafter with SpecForge 0.2.0's own trainer, offline EAGLE-3 (`specforge train --config`,
`data.hidden_states_path`), in the peer bundle's site, then `specforge export --to sglang` for serving.

Every variant trains from the same config but for its view and seed: the same draft architecture (one
LlamaForCausalLMEagle3 layer shaped after the target, SpecForge's default draft vocabulary of 32,000
tokens), the same steps, batch size, learning rate and TTT length.

SpecForge reads the target's lm_head from the file its `*.index.json` names for `model.lm_head_key`, and
refuses a checkpoint without an index. A single-file checkpoint with tied embeddings (SmolLM2) has
neither, so SpecForge gets a copy it can load: links to the target's files plus a
`model.safetensors.index.json` mapping every tensor to `model.safetensors`, with `lm_head_key` the
embedding (tied weights are the same matrix). Nothing of the target is changed.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import yaml

from benchmarks.drafter import layout as lay
from benchmarks.drafter.states import PEER_SITE

EMBEDDING_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
DRAFT_VOCAB = 32000  # SpecForge's EAGLE-3 default (TargetDerivedDraftDefaults)
TARGET_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_bias",
)


def write_draft_config(model: str, dest: Path) -> dict:
    """One EAGLE-3 draft layer shaped after the target, as SpecForge derives it when given none."""
    target = json.loads((Path(model) / "config.json").read_text())
    draft = {k: target[k] for k in TARGET_KEYS if k in target}
    draft.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=min(DRAFT_VOCAB, target["vocab_size"]),
        torch_dtype="bfloat16",
    )
    lay.write_json(dest, draft)
    return draft


def tensor_names(model: Path) -> dict[str, str]:
    """Tensor name -> file, from the checkpoint's index or its one safetensors file."""
    index = next(iter(model.glob("*.index.json")), None)
    if index:
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def target_copy(model: str, dest: Path) -> dict:
    """The target as SpecForge can load it (see the module docstring); returns the model keys to use."""
    src = Path(model).resolve()
    names = tensor_names(src)
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        # Drafters trained side by side on one GPU each make this copy: the first link made stands.
        with contextlib.suppress(FileExistsError):
            os.symlink(f, dest / f.name)
    made = None
    if not list(src.glob("*.index.json")):
        made = dest / "model.safetensors.index.json"
        lay.write_json(
            made,
            {"metadata": {"note": "added for SpecForge, which reads only indexed checkpoints"}, "weight_map": names},
        )
    lm_head = LM_HEAD_KEY if LM_HEAD_KEY in names else EMBEDDING_KEY
    return {
        "target_copy": str(dest),
        "index_added": made is not None,
        "lm_head_key": lm_head,
        "embedding_key": EMBEDDING_KEY,
    }


def config(
    layout: lay.Layout,
    run: str,
    view: Path,
    keys: dict,
    *,
    seed: int,
    steps: int,
    batch_size: int,
    max_length: int,
    learning_rate: float,
) -> dict:
    out = layout.train_dir(run)
    return {
        "run_id": run,
        "output_dir": str(out),
        "model": {
            "target_model_path": keys["target_copy"],
            "draft_model_config": str(layout.draft_config),
            "embedding_key": keys["embedding_key"],
            "lm_head_key": keys["lm_head_key"],
            "torch_dtype": "bfloat16",
        },
        "data": {"hidden_states_path": str(view), "max_length": max_length, "cache_dir": str(out / "cache")},
        "training": {
            "strategy": "eagle3",
            "num_epochs": 1,
            "max_steps": steps,
            "batch_size": batch_size,
            "learning_rate": learning_rate,
            "max_grad_norm": 0.5,
            "ttt_length": 7,
            "attention_backend": "sdpa",
            "save_interval": 500,
            "log_interval": 50,
            "seed": seed,
        },
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def peer_env() -> dict:
    """This environment with the peer bundle's site first: SpecForge's trainer runs on its own pins."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PEER_SITE), env.get("PYTHONPATH", "")) if p)
    return env


def export_to_sglang(layout: lay.Layout, run: str, checkpoint: Path, env: dict) -> list[str]:
    """`specforge export --to sglang` of a run's last checkpoint into its drafter folder; returns its argv."""
    argv = [lay.python(), "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", str(checkpoint)]
    argv += ["--draft-config", str(layout.draft_config), "--output-dir", str(layout.drafter(run))]
    lay.run_logged(layout, f"export {run}", argv, layout.logs / f"export_{run}.log", env=env)
    return argv


def run_name(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


def train(
    layout: lay.Layout,
    variant: str,
    model: str,
    *,
    seed: int,
    steps: int,
    batch_size: int,
    max_length: int,
    learning_rate: float,
    command: str,
) -> dict:
    """Trains and exports one drafter; a run cut short resumes from its last checkpoint. `command`, the one
    that asked for it, heads its record."""
    run = run_name(variant, seed)
    drafter = layout.drafter(run)
    if lay.is_done(drafter):
        return {**lay.read_json(lay.marker(drafter)), "skipped": True}
    view = layout.view(variant)
    if not lay.is_done(view):
        raise RuntimeError(f"{view} is not complete: run `states {variant}` first (on this machine)")
    write_draft_config(model, layout.draft_config)
    keys = target_copy(model, layout.target_copy)
    settings = {"seed": seed, "steps": steps, "batch_size": batch_size, "max_length": max_length}
    cfg = config(layout, run, view, keys, learning_rate=learning_rate, **settings)
    out = layout.train_dir(run)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    latest = out / f"{run}-latest"
    argv = [lay.python(), "-m", "specforge.cli", "train", "--config", str(cfg_path)]
    if latest.exists():
        argv.append(f"training.resume_from={latest}")
    env = peer_env()
    wall = lay.run_logged(layout, f"train {run}", argv, layout.logs / f"train_{run}.log", env=env)
    export = export_to_sglang(layout, run, latest, env)
    facts = {
        "command": command,
        "run": run,
        "variant": variant,
        **settings,
        "learning_rate": learning_rate,
        "train": argv,
        "export": export,
        "train_wall_s": round(wall, 1),
        "config": cfg,
        **keys,
        "view": lay.read_json(lay.marker(view)),
    }
    lay.mark_done(drafter, **facts)
    lay.write_json(layout.train_record(run), facts)
    return facts
