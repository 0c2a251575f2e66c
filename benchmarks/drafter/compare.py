"""Two variants' feature files side by side, sample by sample, on the corpus records both views hold: what
separates the drafters trained on them when they differ by more than their seeds do.

For every shared record: the token ids (B's padding removed), the loss masks as stored, and the loss masks
as SpecForge's trainer takes them (it zeroes each sample's last position, and that position is padding in a
padded file but a real token in an unpadded one). For every `states_every`-th record: each aux layer's and
the final state's cosine against A's, token by token over the real tokens, with the worst token named.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.drafter import layout as lay
from benchmarks.drafter.states import specforge_path_of, unpadded


def shared_positions(layout: lay.Layout, a: str, b: str) -> list[int]:
    """The corpus positions both views hold, in order."""

    def positions(variant: str) -> set[int]:
        view = layout.view(variant)
        if not lay.is_done(view):
            raise RuntimeError(f"{view} is not complete: run `states {variant}` first (on this machine)")
        return {int(p.name[len("data_") :].split(".")[0]) for p in view.rglob("data_*.ckpt")}

    return sorted(positions(a) & positions(b))


def _load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _trained_mask(mask: np.ndarray) -> np.ndarray:
    """The loss mask as SpecForge's trainer applies it: the sample's last position never in the loss."""
    out = mask.copy()
    if len(out):
        out[-1] = 0
    return out


def _layers(record: dict) -> dict[str, np.ndarray]:
    """Each state of a file by name, (tokens, hidden) float32: aux_0.., then final."""
    final = record["hidden_state"].reshape(-1, record["hidden_state"].shape[-1]).float().numpy()
    hidden = final.shape[-1]
    aux = record["aux_hidden_state"].reshape(final.shape[0], -1).float().numpy()
    out = {f"aux_{k}": aux[:, k * hidden : (k + 1) * hidden] for k in range(aux.shape[1] // hidden)}
    out["final"] = final
    return out


def _cosines(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    num = (x * y).sum(-1)
    den = np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1)
    return num / np.maximum(den, 1e-30)


def one(args: tuple[str, str, int, bool]) -> dict:
    """The comparison of one record's two files (paths A, B, its position, whether to compare states)."""
    path_a, path_b, j, with_states = args
    ra, rb = _load(Path(path_a)), _load(Path(path_b))
    ids_a, ids_b = ra["input_ids"].reshape(-1).numpy(), rb["input_ids"].reshape(-1).numpy()
    real = len(unpadded(ids_b))
    out: dict = {"j": j, "tokens": len(ids_a), "padding_b": len(ids_b) - real}
    if real != len(ids_a) or not np.array_equal(ids_a, ids_b[:real]):
        out["ids_differ"] = True
        return out
    mask_a, mask_b = ra["loss_mask"].reshape(-1).numpy(), rb["loss_mask"].reshape(-1).numpy()
    out["stored_mask_differs"] = [int(i) for i in np.flatnonzero(mask_a != mask_b[:real])]
    out["padding_in_loss_b"] = int(mask_b[real:].sum())
    trained_a, trained_b = _trained_mask(mask_a), _trained_mask(mask_b)[:real]
    # Each position trained by one side only, as (token id, its distance from the sample's end).
    out["trained_only_a"] = [(int(ids_a[i]), int(i - real)) for i in np.flatnonzero(trained_a > trained_b)]
    out["trained_only_b"] = [(int(ids_a[i]), int(i - real)) for i in np.flatnonzero(trained_b > trained_a)]
    out["trained_a"], out["trained_b"] = int(trained_a.sum()), int(trained_b.sum())
    if with_states:
        la, lb = _layers(ra), _layers(rb)
        out["states"] = {}
        for name in la:
            cos = _cosines(la[name], lb[name][:real])
            worst = int(np.argmin(cos))
            out["states"][name] = {
                "min": float(cos[worst]),
                "worst_token": worst,
                "median": float(np.median(cos)),
                "below_0.99": int((cos < 0.99).sum()),
            }
    return out


def summary(rows: list[dict], tokenizer=None) -> dict:
    """What the per-record comparisons add up to."""
    name = (lambda i: tokenizer.convert_ids_to_tokens(i)) if tokenizer else str
    compared = [r for r in rows if not r.get("ids_differ")]
    only = {side: Counter() for side in ("a", "b")}
    for r in compared:
        for side in only:
            only[side].update((name(t), d) for t, d in r[f"trained_only_{side}"])
    out = {
        "records": len(rows),
        "ids_differ": [r["j"] for r in rows if r.get("ids_differ")],
        "stored_masks_differ": sum(bool(r["stored_mask_differs"]) for r in compared),
        "padding_tokens_b": sum(r["padding_b"] for r in rows),
        "padding_in_loss_b": sum(r["padding_in_loss_b"] for r in compared),
        "trained_positions": {"a": sum(r["trained_a"] for r in compared), "b": sum(r["trained_b"] for r in compared)},
        "trained_only": {
            side: [{"token": t, "from_end": d, "count": n} for (t, d), n in c.most_common(10)]
            for side, c in only.items()
        },
    }
    with_states = [r for r in compared if "states" in r]
    layers: dict = {}
    for r in with_states:
        for layer, s in r["states"].items():
            layers.setdefault(layer, []).append((s, r["j"]))
    out["states"] = {
        layer: {
            "records": len(xs),
            "min_cosine": min(s["min"] for s, _ in xs),
            "worst": min(((s["min"], j, s["worst_token"]) for s, j in xs))[1:],
            "median_of_medians": float(np.median([s["median"] for s, _ in xs])),
            "tokens_below_0.99": sum(s["below_0.99"] for s, _ in xs),
        }
        for layer, xs in layers.items()
    }
    return out


def compare(layout: lay.Layout, a: str, b: str, *, states_every: int = 10, workers: int = 8, tokenizer=None) -> dict:
    """Variant `a`'s files against `b`'s on every record both views hold (states on every
    `states_every`-th), with what each view's marker says of the records it could not place."""
    shared = shared_positions(layout, a, b)
    jobs = [
        (str(specforge_path_of(layout.view(a), j)), str(specforge_path_of(layout.view(b), j)), j, k % states_every == 0)
        for k, j in enumerate(shared)
    ]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(one, jobs, chunksize=64))
    else:
        rows = [one(job) for job in jobs]
    result = {"a": a, "b": b, "states_every": states_every, **summary(rows, tokenizer)}
    for side, variant in (("a", a), ("b", b)):
        facts = lay.read_json(lay.marker(layout.view(variant)))
        result[f"view_{side}"] = {k: facts.get(k) for k in ("view_samples", "unmatched_files", "samples")}
    return result
