"""A shard's checksum: the sha256 of its 64 MiB blocks' sha256 digests, which threads compute side by side.

One sha256 over a whole file runs on one core, in file order (about 1.5-2 GB/s with SHA extensions): a
4.3 GB shard holding one 131,072-token sample could only be hashed that way once its first state tensor
was complete, i.e. after the last chunk, and that serial hash was most of the run's tail. Hashed block
by block, each block is hashed (by any thread) as soon as its bytes are final, and the tail hashes only
the blocks the last rows land in. A flipped byte still changes the checksum: it changes its block's
digest, hence the digest of the list.

Manifests written before this scheme record the plain `sha256` of each shard; `checksum` computes
whichever kind an entry records, so those outputs still verify.
"""
from __future__ import annotations

import hashlib
import os
from typing import Sequence

BLOCK_BYTES = 64 << 20
KEY = "block_sha256"  # the manifest key of this checksum
WHOLE_FILE_KEY = "sha256"  # the key of the plain sha256 that manifests of earlier versions record


def combine(block_digests: Sequence[bytes]) -> str:
    """The checksum of a file from its blocks' sha256 digests (raw, 32 bytes each), in file order."""
    return hashlib.sha256(b"".join(block_digests)).hexdigest()


def file_checksum(path: str | os.PathLike) -> str:
    """A file's checksum, read block by block."""
    digests = []
    with open(path, "rb", buffering=0) as f:
        while block := f.read(BLOCK_BYTES):
            digests.append(hashlib.sha256(block).digest())
    return combine(digests)


def whole_file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def recorded(entry: dict) -> tuple[str, str]:
    """(key, checksum) that a manifest or journal entry records for its shard."""
    key = KEY if KEY in entry else WHOLE_FILE_KEY
    return key, entry[key]


def checksum(path: str | os.PathLike, entry: dict) -> str:
    """The file's checksum of the kind `entry` records."""
    return file_checksum(path) if recorded(entry)[0] == KEY else whole_file_sha256(path)
