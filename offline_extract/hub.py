"""Models and data sets named by a hub id ("org/name") instead of a local path.

An id is resolved through huggingface_hub into a folder of its local cache: the cache first, so a
machine without network runs what it has, then the hub unless HF_HUB_OFFLINE is set. Everything after
reads that folder, like any local path, and records the commit it came from, so that a later run
of the same id can tell a moved `main` apart from the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Whatever a model needs besides its weights: config, tokenizer, chat template, remote code.
MODEL_FILES = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class HubError(OSError):
    """A hub id that is neither in the local cache nor reachable; the message is one line."""


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    path: Path
    revision: str  # the commit the id resolved to


def looks_like_repo_id(name: str) -> bool:
    """ "org/name" or "name" as the hub spells them; a path (absolute, relative with ./ or ../, ~, or
    deeper than org/name) never is, so a missing directory is reported as one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "~", "/")) or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot(
    repo_id: str, repo_type: str, complete: Callable[[Path], bool], allow_patterns: list[str] | None = None
) -> Snapshot:
    """The local snapshot of `repo_id` (`repo_type` "model" or "dataset"), downloaded if need be.

    A cached snapshot is used when `complete` accepts it: an earlier AutoConfig call, for one, caches a
    model's config.json alone, which is no model to run.
    """
    from huggingface_hub import constants, snapshot_download

    def fetch(local: bool) -> Path:
        return Path(
            snapshot_download(repo_id, repo_type=repo_type, allow_patterns=allow_patterns, local_files_only=local)
        )

    what = f"{repo_type} {repo_id}"
    try:
        path = fetch(local=True)
        if complete(path):
            return Snapshot(repo_id, path, path.name)
        cached = f"the local hub cache ({constants.HF_HUB_CACHE}) holds an incomplete snapshot of {what}"
    except OSError:
        cached = f"{what} is not in the local hub cache ({constants.HF_HUB_CACHE})"
    if constants.is_offline_mode():
        raise HubError(f"{cached}, and HF_HUB_OFFLINE is set")
    try:
        path = fetch(local=False)
    except OSError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"{cached}, and the hub cannot be reached or does not have it ({reason})") from None
    if not complete(path):
        raise HubError(f"the hub's {what} has no {'weights' if repo_type == 'model' else 'data files'}")
    return Snapshot(repo_id, path, path.name)
