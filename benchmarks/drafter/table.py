"""The result: one JSON of every drafter's serving figures, its training record and the commands that made
them, and the markdown table of the README's "Does it train a good drafter?"."""

from __future__ import annotations

import json
from statistics import mean

from benchmarks.drafter import layout as lay

TARGET = "target"
LABELS = {
    "ours": "(a) ours",
    "specforge": "(b) SpecForge's generator",
    "offbyone": "(c) ours, aux layers one deeper",
    "prenorm": "(d) ours, pre-norm final state as post-norm",
    "fp8": "(e) ours, --store fp8",
}
# (a) must reach this share of (b)'s acceptance length, and (e) this share of (a)'s.
PARITY = 0.98
# A drafter trained on the pre-norm final state must fall to at most this share of (a): the control bites.
FAULT_CEILING = 0.9
# What a drafter was trained with, as its train record states it and the serving record of it repeats it: a
# serving figure stands for the drafter its train record describes, and every drafter is trained alike but for
# its variant and seed.
TRAINED = ("variant", "seed", "steps", "batch_size", "learning_rate", "max_length")
ALIKE = ("steps", "batch_size", "learning_rate", "max_length")


def trained(facts: dict) -> dict:
    """The TRAINED facts of a train record (or of a drafter's DONE marker, which holds the same)."""
    return {k: facts.get(k) for k in TRAINED}


def mismatches(result: dict) -> list[str]:
    """Why `result`'s figures cannot be set side by side, in words (none: they can): a serving record of
    another drafter than its train record describes (one trained again since), or drafters trained unalike."""
    problems = []
    for name, r in sorted(result["serve"].items()):
        t = result["train"].get(name)
        if name == TARGET:
            continue
        if t is None:
            problems.append(f"{name} was served, but DATA holds no train record of it")
        elif r.get("trained") != trained(t):
            served = r.get("trained") or "settings its serving record does not state"
            problems.append(
                f"{name} was served as trained with {served}, and its train record says {trained(t)}: "
                f"remove its serving record and serve it again where it is trained"
            )
    for key in ALIKE:
        values = {name: t.get(key) for name, t in sorted(result["train"].items())}
        if len(set(values.values())) > 1:
            problems.append(
                f"the drafters were trained with different {key} ({', '.join(f'{n} {v}' for n, v in values.items())}): "
                f"train every one alike"
            )
    return problems


def collect(layout: lay.Layout) -> dict:
    serve = {p.stem: lay.read_json(p) for p in sorted((layout.data / "serve").glob("*.json"))}
    train = {p.stem: lay.read_json(p) for p in sorted((layout.data / "train").glob("*.json"))}
    commands = []
    if layout.commands.exists():
        commands = [json.loads(line) for line in layout.commands.read_text().splitlines() if line.strip()]
    return {"serve": serve, "train": train, "commands": commands}


def _by_variant(runs: dict) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, r in runs.items():
        if name != TARGET and r.get("accept_length") is not None:
            out.setdefault(name.rsplit("-s", 1)[0], []).append(r["accept_length"])
    return out


def verdicts(serve: dict) -> dict:
    """The targets, from the acceptance lengths measured so far (None where a side is missing):
    (a) at PARITY of (b) at least, and (b) ahead by no more than twice the larger seed spread (else the gap
    is more than the seeds explain); (d) at most FAULT_CEILING of (a); (c)'s margin below (a) in (a)'s seed
    spreads; (e) at PARITY of (a) at least."""
    by_variant = _by_variant(serve)
    lengths = {v: mean(xs) for v, xs in by_variant.items()}
    spread = {v: max(xs) - min(xs) for v, xs in by_variant.items() if len(xs) > 1}
    a, b = lengths.get("ours"), lengths.get("specforge")
    out = {"accept_length_mean": lengths, "seed_spread": spread, "seeds": {v: len(xs) for v, xs in by_variant.items()}}
    out["ours_over_specforge"] = a / b if a and b else None
    out["ours_reaches_parity"] = out["ours_over_specforge"] >= PARITY if out["ours_over_specforge"] else None
    widest = max((spread.get(v, 0.0) for v in ("ours", "specforge")), default=0.0)
    out["gap_within_seed_noise"] = (b - a <= 2 * widest) if a and b and widest else None
    d = lengths.get("prenorm")
    out["prenorm_over_ours"] = d / a if a and d else None
    out["prenorm_caught"] = out["prenorm_over_ours"] <= FAULT_CEILING if out["prenorm_over_ours"] else None
    c = lengths.get("offbyone")
    out["offbyone_margin_in_seed_spreads"] = (a - c) / spread["ours"] if a and c and spread.get("ours") else None
    out["fp8_over_ours"] = lengths["fp8"] / a if a and lengths.get("fp8") else None
    out["fp8_holds"] = out["fp8_over_ours"] >= PARITY if out["fp8_over_ours"] else None
    return out


def _f(x, digits=3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _order(name: str) -> tuple:
    """The table's rows: (a) to (e), then any other variant, each by seed."""
    variant, seed = name.rsplit("-s", 1)
    return (list(LABELS).index(variant) if variant in LABELS else len(LABELS), variant, int(seed))


def markdown(result: dict) -> str:
    serve = result["serve"]
    base = (serve.get(TARGET) or {}).get("batch1_decode_tok_s")
    lines = [
        "| drafter | seed | samples | acceptance length | first-position acceptance | decode tok/s (batch 1) | vs target alone |",
        "|---|---|---|---|---|---|---|",
        f"| none (target alone) | | | | | {_f(base, 0)} | 1.00 |",
    ]
    for name in sorted((n for n in serve if n != TARGET), key=_order):
        r, t = serve[name], result["train"].get(name, {})
        variant, seed = name.rsplit("-s", 1)
        speed = r.get("batch1_decode_tok_s")
        lines.append(
            f"| {LABELS.get(variant, variant)} | {seed} | {t.get('view', {}).get('view_samples', '')} | "
            f"{_f(r.get('accept_length'))} | {_f(r.get('first_position_accept_rate'))} | {_f(speed, 0)} | "
            f"{_f(speed / base if speed and base else None, 2)} |"
        )
    v = result["verdicts"]
    spread = ", ".join(f"{k} {_f(x)}" for k, x in v["seed_spread"].items()) or "not measured"
    lines += [
        "",
        (
            f"(a) / (b) mean acceptance length: {_f(v['ours_over_specforge'])} (target ≥ {PARITY}); "
            f"spread between seeds: {spread}; (b) - (a) within twice the larger spread: {v['gap_within_seed_noise']}; "
            f"(d) / (a): {_f(v['prenorm_over_ours'])} (target ≤ {FAULT_CEILING}); "
            f"(c) below (a) by {_f(v['offbyone_margin_in_seed_spreads'], 1)} seed spreads of (a); "
            f"(e) / (a): {_f(v['fp8_over_ours'])} (target ≥ {PARITY})."
        ),
    ]
    return "\n".join(lines)


def table(layout: lay.Layout) -> dict:
    """Every measurement of `layout`'s DATA, with the issue's verdicts; refused (ValueError) where the figures
    cannot be set side by side (`mismatches`)."""
    result = collect(layout)
    problems = mismatches(result)
    if problems:
        raise ValueError("the measurements cannot be compared:\n  " + "\n  ".join(problems))
    result["verdicts"] = verdicts(result["serve"])
    result["markdown"] = markdown(result)
    return result
