"""A shard's checksum: the xxh3_128 of its 64 MiB blocks' xxh3_128 digests, which threads compute side by side.

The checksum is there to catch damage (a flipped bit on a disk or in a copy, a file cut short or written
twice over), not an adversary who forges a file to match: a 128-bit non-cryptographic hash tells damage
apart as surely as sha256 does, at several times the rate (benchmarks/README.md, "Checksums"); the
writer hashes every byte it writes and the datasets read every shard once to verify it, so with sha256
a small model's extraction and its first epoch would run at the hash's rate, not the GPU's.

One hash over a whole file runs on one core, in file order: a 4.3 GB shard holding one 131,072-token
sample could only be hashed that way once its first state tensor was complete, i.e. after the last
chunk. Hashed block by block, each block is hashed (by any thread) as soon as its bytes are final, and
the tail hashes only the blocks the last rows land in. A flipped byte still changes the checksum: it
changes its block's digest, hence the digest of the list.

Manifests and journals of earlier versions record `block_sha256` (the same scheme with sha256) or the
plain `sha256` of each shard; `checksum` computes whichever kind an entry records, so those outputs still
verify, and a resumed one may list shards of several kinds.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Sequence

import xxhash

BLOCK_BYTES = 64 << 20
KEY = "block_xxh3_128"  # the manifest and journal key of the checksum new shards get
BLOCK_SHA256_KEY = "block_sha256"  # the same scheme with sha256, which earlier versions record
WHOLE_FILE_KEY = "sha256"  # the plain sha256 of the whole file, which still earlier versions record
# Each block-wise kind's hash, which digests both the blocks and the list of their digests.
_BLOCK_HASHES: dict[str, Callable] = {KEY: xxhash.xxh3_128, BLOCK_SHA256_KEY: hashlib.sha256}
KEYS = (KEY, BLOCK_SHA256_KEY, WHOLE_FILE_KEY)


def new_block_hash():
    """A hash object for one block of a new shard (its `digest()` goes to `combine`)."""
    return xxhash.xxh3_128()


def combine(block_digests: Sequence[bytes], key: str = KEY) -> str:
    """The checksum of kind `key` of a file from its blocks' raw digests, in file order."""
    return _BLOCK_HASHES[key](b"".join(block_digests)).hexdigest()


def file_checksum(path: str | os.PathLike, key: str = KEY) -> str:
    """A file's checksum of kind `key` (by default the one new shards get), read block by block."""
    if key == WHOLE_FILE_KEY:
        return _whole_file_sha256(path)
    digests = []
    with open(path, "rb", buffering=0) as f:
        while block := f.read(BLOCK_BYTES):
            digests.append(_BLOCK_HASHES[key](block).digest())
    return combine(digests, key)


def _whole_file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def recorded(entry: dict) -> tuple[str, str]:
    """(key, checksum) that a manifest or journal entry records for its shard."""
    key = next((k for k in KEYS if k in entry), None)
    if key is None:
        raise KeyError(f"the entry records no checksum (none of {', '.join(KEYS)}): {entry}")
    return key, entry[key]


def checksum(path: str | os.PathLike, entry: dict) -> str:
    """The file's checksum of the kind `entry` records."""
    return file_checksum(path, recorded(entry)[0])
