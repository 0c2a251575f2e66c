"""The trainers' own reading code, at pinned versions, in a virtual environment of its own: SpecForge and
speculators each pin their own SGLang, transformers and torch, so neither can join our environment.

The environment sees the packages of the interpreter that runs the tests (torch, safetensors, datasets,
transformers, pydantic and most other libraries their readers import come with SGLang's install), after
its own: the trainers' wheels and the few libraries their readers need beyond those (READERS_NEED), from
PyPI, without their dependencies. Those packages are the
test interpreter's wherever they are installed: the system's, a virtual environment's or conda's (a venv's
--system-site-packages would mean the base interpreter's, which lack them when the install went into a
venv). It is built once under ~/.cache (about 1 MB and a few seconds) and reused while the pins and the
test interpreter's package directories stay the same.
"""

import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

PINS = ("specforge==0.2.0", "speculators==0.9.0", "hs-connectors==0.9.0")
# What the readers import beyond SGLang's install: speculators' config schema is built on pydantic-settings,
# which reads .env files with python-dotenv. A system Python may hold them for other packages; a fresh venv
# does not.
READERS_NEED = ("pydantic-settings==2.14.1", "python-dotenv==1.2.2")
READERS = Path(__file__).resolve().parent / "consumer_readers.py"


def consumer_python() -> Path:
    """The interpreter of the trainers' environment, built on first use."""
    ours = _package_dirs()
    key = hashlib.sha256(json.dumps([sys.version, ours, *PINS, *READERS_NEED]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "offline_extract"
    venv = cache / f"consumers-{key}"
    python = venv / "bin" / "python"
    if python.exists():
        return python
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="consumers-", dir=cache))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(build)], check=True)
        # Read after the environment's own site-packages, so that the trainers' wheels come first; addsitedir
        # also reads the .pth files there (an editable install's among them).
        (_site_packages(build) / "zz_test_interpreter.pth").write_text(
            "".join(f"import site; site.addsitedir({d!r})\n" for d in ours)
        )
        install = subprocess.run(
            [
                str(build / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                *PINS,
                *READERS_NEED,
            ],
            capture_output=True,
            text=True,
        )
        if install.returncode:
            raise RuntimeError(
                f"pip install --no-deps {' '.join(PINS + READERS_NEED)} failed:\n{install.stderr[-3000:]}"
            )
        # A venv finds its packages relative to its own directory, so it may be renamed into place whole.
        build.rename(venv)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return python


def _package_dirs() -> list[str]:
    """Where the interpreter running the tests finds its installed packages, in its own order."""
    dirs = site.getsitepackages()
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _site_packages(venv: Path) -> Path:
    python = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(python.stdout.strip())


def read_exports(jobs: list[dict], workdir: Path) -> list[dict]:
    """Runs consumer_readers.py on `jobs` in the trainers' environment; each job's result, in order."""
    for k, job in enumerate(jobs):
        job["dump"] = str(workdir / f"read_{k}.pt")
    spec = workdir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run(
        [str(consumer_python()), str(READERS), str(spec)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    import torch

    return [torch.load(job["dump"], weights_only=False) for job in jobs]
