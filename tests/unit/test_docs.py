"""Every command the README, CONTRIBUTING.md, docs/ and benchmarks/README.md give can be pasted as it stands: a bin/ or benchmarks/
command line parses with the program's own options, torchrun's part with torchrun's parser, a script or test
file it names exists, and no `...` stands in for what the reader would have to guess. The training snippet
runs on an output directory, and every name the pages give in an engine module is defined there."""

import ast
import fnmatch
import importlib
import importlib.util
import json
import re
import shlex
import sys
import warnings

import click
import pytest
from torch.distributed.run import get_args_parser

from extract_runs import ROOT

from offline_extract.testing.shards import write_synthetic

PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
]
PROGRAMS = ("python", "torchrun", "bash")
# Tools of other projects that a page tells the reader to run; their options are theirs to check.
OTHERS = ("pip", "jq", "speculators")
# Scripts that a documented script writes, run where the checkout has them: the parts of make_sglang_bundle.sh.
WRITTEN_SCRIPTS = re.compile(r"\.sglang-bundle-[0-9.]+/[0-9]+/stage\.sh")


def _commands(page):
    """(page name, command) for each command line of `page`: the lines of its code blocks that start a
    program, and each inline code span that does."""
    text = page.read_text()
    found = []
    for language, fence in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if language in ("", "bash", "sh", "shell"):
            found += [line.strip() for line in fence.splitlines()]
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for block in re.findall(r"(?:^|\n\n)((?: {4}.*(?:\n|$))+)", text):
        found += [line.strip() for line in block.splitlines()]
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]
    commands = []
    for line in found:
        for part in re.split(r"&&(?=(?:[^'\"]*['\"][^'\"]*['\"])*[^'\"]*$)", line):  # && outside quotes
            part = part.split("  #")[0].strip()
            words = part.split()
            if words and words[0] in PROGRAMS + OTHERS and len(words) > 1:
                commands.append((page.name, part))
    return commands


COMMANDS = sorted({c for page in PAGES if page.exists() for c in _commands(page)})


def _click_command(script):
    """The click command that `python SCRIPT` (a bin/ or benchmarks/ file) or `python -m MODULE` (a module of
    benchmarks or offline_extract) runs."""
    if script.startswith("bin/"):
        spec = importlib.util.spec_from_file_location(f"bin_{script[4:-3]}", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main
    return importlib.import_module(script.removesuffix(".py").replace("/", ".")).main


def _parses(command, args):
    """click's own parse of `args`, as the command would take them; --help counts as a parse."""
    try:
        command.make_context(command.name or "command", list(args))
    except click.exceptions.Exit as e:  # --help or --version: printed, and parsed
        assert e.exit_code == 0, (args, e)


def _check_pytest(words, where):
    paths = [w for w in words if w.startswith("tests")]
    for path in paths:
        assert (ROOT / path.split("::")[0]).exists(), f"{where}: {path} does not exist"
    if "-k" in words:
        name = words[words.index("-k") + 1]
        sources = "".join((ROOT / p).read_text() for p in paths)
        assert re.search(rf"def test_\w*{re.escape(name)}", sources), f"{where}: -k {name} selects no test of {paths}"


@pytest.mark.parametrize("page, line", COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_each_command_in_the_docs_pastes_as_it_stands(page, line, monkeypatch):
    where = f"{page}: `{line}`"
    assert "..." not in line, f"{where}: '...' is no command; write out what the reader should type"
    words = shlex.split(line)
    program, args = words[0], words[1:]
    if program in OTHERS:
        return
    if program == "bash" and args[0] == "-c":
        for part in args[1].split("&&"):
            test_each_command_in_the_docs_pastes_as_it_stands(page, part.strip(), monkeypatch)
        return
    if program == "bash":
        assert (ROOT / args[0]).is_file() or WRITTEN_SCRIPTS.fullmatch(args[0]), f"{where}: {args[0]} does not exist"
        return
    if program == "torchrun":
        parsed = get_args_parser().parse_args(args)
        script, args = parsed.training_script, parsed.training_script_args
    elif args[:2] == ["-m", "pytest"]:
        _check_pytest(args[2:], where)
        return
    elif args[0] == "-m" and args[1] in sys.stdlib_module_names:  # python -m venv: Python's own
        return
    elif args[0] == "-m":
        script, args = args[1], args[2:]
    else:
        script, args = args[0], args[1:]
    assert script.startswith(("bin/", "benchmarks", "offline_extract.")), (
        f"{where}: runs {script}, which this test does not know"
    )
    monkeypatch.syspath_prepend(str(ROOT / "bin"))  # for bin/'s `import _bin_path`, which takes it off again
    _parses(_click_command(script), args)


def test_the_docs_give_the_commands_this_test_checks():
    # The pages' commands are found at all: a change to how they are written would otherwise pass unchecked.
    lines = {line for _, line in COMMANDS}
    assert "python bin/inspect.py out --verify" in lines
    assert any(line.startswith("torchrun --nnodes 2") and "--tp 4" in line for line in lines)
    assert "python -m pytest" in lines


# The options by which a documented command writes a path, and whether that is a directory.
WRITES = {"--out": True, "--to": True, "--corpus": False}


def _written_here() -> list[tuple[str, str, bool]]:
    """(command, path, is a directory) for each relative path that a documented command writes: in the checkout,
    where the README's commands run."""
    written = []
    for _, line in COMMANDS:
        words = shlex.split(line)
        if words[1:3] == ["-m", "venv"]:
            written.append((line, words[3], True))
        written += [(line, words[i + 1], WRITES[w]) for i, w in enumerate(words[:-1]) if w in WRITES]
    # Absolute paths are elsewhere; OUT, DEST and FILE stand for the reader's own.
    return [(line, p, is_dir) for line, p, is_dir in written if not (p.startswith(("/", "$", "~")) or p.isupper())]


def _ignored(path: str, is_dir: bool) -> bool:
    """Whether a pattern of .gitignore of one path component covers `path`'s first (the paths the pages write are
    at the top of the checkout)."""
    patterns = [p for p in (ROOT / ".gitignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    first, *rest = path.split("/")
    return any(
        fnmatch.fnmatchcase(first, pattern.strip("/")) and (is_dir or rest or not pattern.endswith("/"))
        for pattern in patterns
    )


def test_git_ignores_what_the_documented_commands_write_in_the_checkout():
    # out-layers and out-dflash, which the README's own commands write, showed up in `git status`.
    written = _written_here()
    assert {"out", "out-layers", "out-specforge", "english.jsonl"} <= {path for _, path, _ in written}
    assert [(line, path) for line, path, is_dir in written if not _ignored(path, is_dir)] == []


def test_a_sample_the_docs_inspect_is_in_the_output_they_inspect():
    # `inspect /data/hs --sample conversation-42` named a sample that no output of the README holds.
    ids = {json.loads(line).get("id") for line in (ROOT / "examples" / "corpus.jsonl").read_text().splitlines()}
    shown = [shlex.split(line) for _, line in COMMANDS if " --sample " in line]
    assert shown, "the pattern finds the pages' --sample"
    for words in shown:
        assert words[2] == "out", f"{words}: inspects the README's output, of examples/corpus.jsonl"
        assert words[words.index("--sample") + 1] in ids, words


def test_the_training_snippet_runs_on_an_output_directory_as_the_page_says(tmp_path, capsys):
    # It read "/data/hs", asked for 4 workers (a warning on 2 cores) and left its batches of 6 unexplained.
    text = (ROOT / "docs" / "training.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    lengths = [5, 3, 7, 2, 9, 4, 6, 8, 3, 5, 2, 4] * 2  # as many samples as the README's output holds
    write_synthetic(tmp_path, lengths, hidden_size=8)
    assert snippet.count('"out"') == 2, "it reads the README's output"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the DataLoader's warning of more workers than cores, among others
        warnings.filterwarnings("ignore", "(?s).*has no manifest.json")  # synthetic shards have none; a run's have
        exec(compile(snippet.replace('"out"', repr(str(tmp_path))), "docs/training.md", "exec"), {})
    printed = [line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines()]
    assert sum(int(rest.split()[-1]) for _, rest in printed) == 2 * sum(lengths), printed
    # Each epoch as the page explains it: each of the 2 workers batches its 12 samples as 8 and 4.
    for epoch in ("0", "1"):
        sizes = sorted(int(re.match(r"torch.Size\(\[(\d+),", rest)[1]) for e, rest in printed if e == epoch)
        assert sizes == [4, 4, 8, 8], printed
    assert "batches of 8, 8, 4 and 4" in " ".join(text.split())


def _defined(module) -> set[str]:
    """The names `module` defines at its top level, read from its source: importing the engine imports SGLang."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_the_docs_name_engine_functions_where_they_are_defined():
    # A function moved out of one engine module into another leaves the pages pointing at the old one.
    engine = {path.stem: _defined(path) for path in (ROOT / "offline_extract" / "engine").glob("*.py")}
    named = [
        (page.name, module, name)
        for page in PAGES
        for module, name in re.findall(r"`(?:engine/)?(\w+)\.(\w+)", page.read_text())
        if module in engine and name != "py"
    ]
    assert len(named) > 20, "the pattern finds the pages' engine names"
    assert [n for n in named if n[2] not in engine[n[1]]] == []


def test_no_page_repeats_the_bound_of_the_image_threads_default():
    # options.MOST_IMAGE_THREADS bounds it, and --help states its value from there (tests/unit/test_options.py):
    # a page that gave the number too would go stale when it changes.
    defaults = [
        (page.name, " ".join(default.split()))
        for page in PAGES
        for default in re.findall(r"`--image-threads`[^()]{0,80}\(default: ([^)]*)\)", page.read_text())
    ]
    assert defaults, "the pattern finds the pages' defaults of --image-threads"
    assert [(page, default) for page, default in defaults if re.search(r"\d", default)] == []
