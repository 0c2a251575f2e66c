"""benchmarks/results/ holds one record a published figure, named as docs/architecture.md says
(`<what>-<device>-<yyyymmdd>/`, every JSON in it with the command that made it); the programs' ad-hoc runs go to
a folder git ignores; and every result a page cites is there."""

import json
import re
import subprocess

from extract_runs import ROOT

from benchmarks import RUNS
from benchmarks.bench_options import BenchOptions

RESULTS = ROOT / "benchmarks" / "results"
RECORD = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*-(?:cpu|[a-z]\d{3}(?:x\d+)?)-20\d{6}[a-z]?")
# Written by the test suites (OFFLINE_EXTRACT_RESULTS), each file with its command: docs/parity.md's table.
PARITY = "parity"
# The drafter pipeline's records, named before the rule and cited by benchmarks/drafter/README.md; the list
# only shrinks.
DRAFTER = {"gpu_20261202b", "gpu_20261202c", "gpu_20261203b", "gpu_20261203c", "gpu_20261203d"}
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks").rglob("README.md")),
]
# A result a page names: under benchmarks/results/ from the root, or results/ from benchmarks/ and below.
CITED = re.compile(r"(?:benchmarks/|\.\./)?results/([\w.\-/*]+)")


def test_every_record_is_named_by_the_rule():
    names = {p.name for p in RESULTS.iterdir()}
    odd = sorted(n for n in names if not (RECORD.fullmatch(n) or n == PARITY or n in DRAFTER))
    assert not odd, f"name these <what>-<device>-<yyyymmdd> (docs/architecture.md): {odd}"
    assert DRAFTER <= names, f"gone, so take them off DRAFTER: {DRAFTER - names}"
    assert all((RESULTS / n).is_dir() for n in names)


def test_every_json_of_a_record_holds_its_command():
    records = [p for p in RESULTS.iterdir() if RECORD.fullmatch(p.name)]
    assert len(records) >= 10
    missing = [
        str(path.relative_to(RESULTS))
        for record in records
        for path in sorted(record.rglob("*.json"))
        # A logs/ folder holds what the programs logged, as they wrote it (a logging configuration is JSON too).
        if "logs" not in path.relative_to(record).parts[:-1] and not json.loads(path.read_text()).get("command")
    ]
    assert not missing, f"a figure without its command does not count: {missing}"


def test_ad_hoc_runs_go_where_git_ignores_them():
    assert (ROOT / BenchOptions.results_dir) == RUNS
    ignored = subprocess.run(["git", "check-ignore", "-q", str(RUNS / "x.json")], cwd=ROOT)
    assert ignored.returncode == 0, f"{RUNS} is not ignored by git"


def _cited() -> list[tuple[str, str]]:
    """(page, path) of every result the pages name; a path in capitals (drafter_DATE.json) stands for one."""
    return [
        (str(page.relative_to(ROOT)), path.rstrip("."))
        for page in PAGES
        for path in CITED.findall(page.read_text())
        if not re.search(r"[A-Z]{3,}", path)
    ]


def test_every_result_a_page_cites_is_there():
    cited = _cited()
    assert len(cited) > 10, "the pattern finds the pages' citations"
    gone = [(page, path) for page, path in cited if not list(RESULTS.glob(path.rstrip("/")))]
    assert not gone, f"cited, but not in benchmarks/results/: {gone}"
