"""Chat prompts from real text available offline: the docstrings of Python's standard library.

Source: the `.py` files of the running interpreter's standard library (`sysconfig`'s `stdlib` path), read
with `ast` (nothing is imported), without its test suites. Licence: the Python Software Foundation License
Version 2 (the licence of CPython's source, its docstrings included), as the interpreter's LICENSE file
says. The text depends on the interpreter's version, so the prompts are built once on one machine and
carried (`SOURCE.json` records the version and each file's sha256); built again with the same version they
come out byte for byte the same.

A document is one module file. Every docstring of at least MIN_DOC_CHARS characters (module, class,
function, method) is cut to at most EXCERPT_CHARS at a line break and put into instruction templates. The
held-out prompts come from modules that give no training prompt: modules are ordered by the sha256 of
their path and the first ones go to the held-out set until it has `heldout` prompts (one template a
docstring there); every other module's docstrings each give TEMPLATES_PER_DOC prompts with different
templates, and `train` of those are kept in a fixed pseudo-random order.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MIN_DOC_CHARS = 40
EXCERPT_CHARS = 400
TEMPLATES_PER_DOC = 3
SEED = 0
# The system turn every prompt carries, written out so that every pipeline renders the same tokens (a
# template such as SmolLM2's inserts a default system turn only when a chat has none, SpecForge adds its
# own): this is SmolLM2-Instruct's default.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
LICENCE = "Python Software Foundation License Version 2"
TEMPLATES = (
    "Explain what `{name}` from Python's `{module}` module does, based on its documentation:\n\n{doc}",
    "Summarize the following documentation of `{name}` in a few sentences.\n\n{doc}",
    "Here is the docstring of `{name}` ({module}):\n\n{doc}\n\nWrite a short example that uses it.",
    "{doc}\n\nWhat is this documentation describing, and when would someone use it?",
    "I am reading the docs for `{name}`:\n\n{doc}\n\nCan you explain it to a beginner?",
    "Rewrite this documentation of `{name}` as a short list of key points:\n\n{doc}",
)


@dataclass(frozen=True)
class Doc:
    module: str  # dotted module name: the document it belongs to
    name: str  # qualified name within the module ('' for the module's own docstring)
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_test(rel: str) -> bool:
    parts = rel.split("/")
    return parts[0] == "site-packages" or any(p in ("test", "tests", "idle_test") for p in parts[:-1])


def module_files(root: Path) -> list[tuple[str, Path]]:
    """(module name, file) of every standard-library source outside the test suites, sorted by path."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _is_test(rel):
            continue
        name = rel[:-3].replace("/", ".").removesuffix(".__init__")
        out.append((name, path))
    return out


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """The docstring up to `limit` characters, cut at the last line break before it (or at `limit`)."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > limit // 2 else limit].rstrip()


def docs_of(module: str, source: str) -> list[Doc]:
    """Every docstring of a module long enough to explain, in source order; [] for a file ast cannot read."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []

    def visit(node, prefix: str):
        doc = ast.get_docstring(node)
        if doc and len(doc) >= MIN_DOC_CHARS:
            out.append(Doc(module, prefix, excerpt(doc)))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}.{child.name}" if prefix else child.name)

    visit(tree, "")
    return out


def _key(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:8], "big")


def prompt(doc: Doc, template: int) -> str:
    name = f"{doc.module}.{doc.name}" if doc.name else doc.module
    return TEMPLATES[template].format(name=name, module=doc.module, doc=doc.text)


def record(kind: str, i: int, doc: Doc, template: int) -> dict:
    """A chat record as both our reader and SpecForge's read it (`conversations` of from/value turns);
    `source` names the document, for the held-out check."""
    return {
        "id": f"{kind}-{i:06d}",
        "source": doc.module,
        "conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": prompt(doc, template)}],
    }


@dataclass
class Built:
    train: list[dict]
    heldout: list[dict]
    source: dict


def build(train: int, heldout: int, root: Path | None = None) -> Built:
    root = root or stdlib_root()
    files = module_files(root)
    # A module's share of the held-out set is decided by its path's hash alone, so it does not move when
    # another module changes.
    files.sort(key=lambda mf: _key(mf[0]))
    held, pool, held_modules = [], [], []
    digests = {}
    for module, path in files:
        raw = path.read_bytes()
        digests[module] = hashlib.sha256(raw).hexdigest()
        docs = docs_of(module, raw.decode("utf-8", errors="replace"))
        if not docs:
            continue
        if len(held) < heldout:
            held_modules.append(module)
            held.extend((d, _key(d.module, d.name, "heldout") % len(TEMPLATES)) for d in docs)
        else:
            for d in docs:
                order = sorted(range(len(TEMPLATES)), key=lambda t: _key(d.module, d.name, str(t)))
                pool.extend((d, t) for t in order[:TEMPLATES_PER_DOC])
    if len(pool) < train or len(held) < heldout:
        raise ValueError(
            f"{root} gives {len(pool)} training and {len(held)} held-out prompts, fewer than the "
            f"{train} and {heldout} asked for"
        )
    random.Random(SEED).shuffle(pool)
    source = {
        "text": f"docstrings of Python {sys.version.split()[0]}'s standard library ({root}), tests excluded",
        "licence": LICENCE,
        "python": sys.version.split()[0],
        "train": train,
        "heldout": heldout,
        "heldout_modules": held_modules,
        "templates": list(TEMPLATES),
        "system": SYSTEM,
        "files_sha256": hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest(),
    }
    return Built(
        [record("train", i, d, t) for i, (d, t) in enumerate(pool[:train])],
        [record("heldout", i, d, t) for i, (d, t) in enumerate(held[:heldout])],
        source,
    )


def dump_jsonl_gz(records: list[dict]) -> bytes:
    """Records as gzipped JSON lines, with no timestamp in the gzip header, so equal records give equal bytes."""
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write(raw)
    return buf.getvalue()


def load_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]
