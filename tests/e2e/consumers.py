"""The trainers' own reading code, at pinned versions, in a virtual environment of its own: SpecForge and
speculators each pin their own SGLang, transformers and torch, so neither can join our environment.

The environment sees the system's packages (torch, safetensors, datasets, transformers, pydantic and the
other libraries their readers import come with SGLang's install) and adds the trainers' wheels alone,
from PyPI, without their dependencies. It is built once under ~/.cache (about 1 MB and a few seconds)
and reused while the pins stay the same.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PINS = ("specforge==0.2.0", "speculators==0.9.0", "hs-connectors==0.9.0")
READERS = Path(__file__).resolve().parent / "consumer_readers.py"


def consumer_python() -> Path:
    """The interpreter of the trainers' environment, built on first use."""
    key = hashlib.sha256(json.dumps([sys.version, *PINS]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "offline_extract"
    venv = cache / f"consumers-{key}"
    python = venv / "bin" / "python"
    if python.exists():
        return python
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="consumers-", dir=cache))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(build)], check=True)
        install = subprocess.run(
            [str(build / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-deps", *PINS], capture_output=True, text=True,
        )
        if install.returncode:
            raise RuntimeError(f"pip install --no-deps {' '.join(PINS)} failed:\n{install.stderr[-3000:]}")
        # A venv finds its packages relative to its own directory, so it may be renamed into place whole.
        build.rename(venv)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return python


def read_exports(jobs: list[dict], workdir: Path) -> list[dict]:
    """Runs consumer_readers.py on `jobs` in the trainers' environment; each job's result, in order."""
    for k, job in enumerate(jobs):
        job["dump"] = str(workdir / f"read_{k}.pt")
    spec = workdir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([str(consumer_python()), str(READERS), str(spec)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    import torch

    return [torch.load(job["dump"], weights_only=False) for job in jobs]
