"""Block hashes as the KV events carry them: one 64-bit id per full block, chained over the path.

The hash of block i covers every token of blocks [0, i] (the parent's hash is folded in) and the
cache salt, which leads the first block as it leads the prefix cache's first key: equal hashes mean
the same prefix under the same salt. The engine (prefix_cache.py) and the router (kv_index.py)
compute them with this one function, so they agree on any machine and Python run (no `hash()`,
whose seed differs per process).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # the parent hash of a sequence's first block


def block_hash(parent: int, key: Sequence) -> int:
    """The hash of one block: its parent's hash and its key (the block's token ids, led by the
    salt for a salted sequence's first block, as the prefix cache's keys are)."""
    h = hashlib.blake2b(struct.pack("<Q", parent), digest_size=8)
    if key and isinstance(key[0], str):  # the salt: tagged with a length, so never equal to ids
        salt = key[0].encode()
        h.update(b"salt" + struct.pack("<I", len(salt)) + salt)
        key = key[1:]
    h.update(struct.pack(f"<{len(key)}q", *key))
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The hashes of the full blocks of `token_ids`, first block first."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        key: tuple = tuple(token_ids[i * block_size : (i + 1) * block_size])
        if i == 0 and salt is not None:
            key = (salt, *key)
        parent = block_hash(parent, key)
        hashes.append(parent)
    return hashes
