"""The tables of this record's README, from its files: python3 summary.py (in this folder)."""

import glob
import json
import re
import statistics


def forwards(use: dict) -> str:
    own = use["threads"]["forwards"]
    asleep = use["host_s"] - own["cpu_s"] - own["queued_s"]
    return f"{own['cpu_s']:.2f} / {own['queued_s']:.2f} / {asleep:.2f}"


for call in ("call1", "call2", "call3"):
    # In the order they ran.
    ran = [json.loads(line)["step"] for line in open(f"{call}/steps.jsonl")]
    bare = []
    print(f"\n{call}\n\n| bench | bare tok/s | made beforehand | fed | forwards' thread, made beforehand | fed |")
    print("|---|---|---|---|---|---|")
    for path in sorted(glob.glob(f"{call}/bench_*/*.json"), key=lambda p: ran.index(p.split("/")[1])):
        r = json.load(open(path))
        bare.append(r["bare_prefill_tok_s"])
        made, fed = r["extract_ranks"][0]["host_use"], r["extract_fed_ranks"][0]["host_use"]
        print(
            f"| {path.split('/')[1]} | {r['bare_prefill_tok_s']:,.0f} | {r['extract_over_bare']:.3f} | "
            f"{r['extract_fed_over_bare']:.3f} | {forwards(made)} | {forwards(fed)} |"
        )
    bare_mean = statistics.mean(bare)
    print(f"\n| bin/extract.py | tok/s | over the call's bare ({bare_mean:,.0f}) | forwards' thread | input wait s |")
    print("|---|---|---|---|---|")
    for path in sorted(glob.glob(f"{call}/extract_*.json"), key=lambda p: ran.index(p.split("/")[1][:-5])):
        m = json.load(open(path))
        log = open(path[: -len(".json")] + ".log").read()
        rate = float(re.search(r"([\d,]+) tok/s over", log).group(1).replace(",", ""))
        t = m["timings"]
        print(
            f"| {path.split('/')[1][:-5]} | {rate:,.0f} | {rate / bare_mean:.3f} | {forwards(t['host_use'])} | "
            f"{t['input_wait_s']:.2f} |"
        )
