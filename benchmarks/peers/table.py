#!/usr/bin/env python
"""Markdown rows of benchmarks/README.md's peer table from bench results that hold `peers`.

\b
    python -m benchmarks.peers.table $OUT/bench_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import program  # noqa: E402


def _num(x, digits: int = 0) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def _cos(stats: dict | None, keys) -> str:
    if not stats:
        return ""
    parts = [f"{k}: {stats[k]['cosine_mean']:.5f} / {stats[k]['cosine_min']:.4f}" for k in keys if k in stats]
    return "; ".join(parts) or "none stored"


def rows(result: dict, name: str) -> list[str]:
    ours = result.get("extract_tok_s")
    if ours is None:  # a run cut short before ours was measured (its `parts` say what it holds)
        out = [f"| ours **not measured**: parts left {', '.join(result['parts']['left'])} | | | | | | | | `{name}` |"]
    else:
        out = [
            f"| ours ({result['out_kind']}) | | {_num(ours)} | 1.00 | {_num(result['bytes_per_token'])} | "
            f"{_num(result['host_peak_rss_bytes'] / 1e9, 1)} GB | (reference) | (reference) | `{name}` |"
        ]
    for p in result.get("peers", []):
        cos = p["cosine_vs_ours"] or {}
        aux = [k for k in cos if k != "final"]
        final = cos.get("final")
        final_cell = (
            ""
            if not final
            else f"{final['cosine_mean']:.5f} / {final['cosine_min']:.4f}, {final['norm_ratio_mean']:.3f}"
        )
        ratio = f"{ours / p['tok_s']:.2f}" if p["tok_s"] and ours else ""
        rss = "" if p["host_peak_rss_bytes"] is None else f"{p['host_peak_rss_bytes'] / 1e9:.1f} GB"
        status = f" **error**: {p['error'].strip().splitlines()[-1]}" if p.get("error") else ""
        out.append(
            f"| {p['name']}{status} | {p['version']} | {_num(p['tok_s'])} | {ratio} | "
            f"{_num(p['bytes_per_token'])} | {rss} | {_cos(cos, aux)} | {final_cell} | `{name}` |"
        )
    return out


@program(__doc__)
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def main(results):
    for path in results:
        result = json.loads(path.read_text())
        if "peers" not in result:
            raise click.ClickException(f"{path} has no `peers`: it was not run with --baseline")
        print("\n".join(rows(result, path.name)))


if __name__ == "__main__":
    main()
