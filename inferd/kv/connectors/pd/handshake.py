"""The PD handshake: the receiver sends its KV block layout (inferd/kv/connectors/layout.py: the
model fingerprint, stored dtype, block size, layers, planes, KV heads, head dim, scales) with every
pull, and the sender refuses one whose layout is not its own, naming each field that differs,
before any byte moves. Blocks are copied as raw bytes: any difference would make the receiver
read garbage or another model's keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class KVLayoutMismatch(ValueError):
    """The two engines' KV layouts differ: their blocks cannot be exchanged."""


def layout_json(layout: Any) -> dict[str, Any]:
    """A layout (a dataclass) as JSON for the wire."""
    return dataclasses.asdict(layout)


def check_layout(mine: Any, peer: Any, peer_name: str = "the peer") -> None:
    """KVLayoutMismatch naming each field where `peer` (a layout's JSON) differs from `mine`."""
    names = [f.name for f in dataclasses.fields(mine)]
    if not isinstance(peer, dict) or sorted(peer) != sorted(names):
        raise KVLayoutMismatch(f"malformed KV layout from {peer_name}: {peer!r}")
    diffs = [
        f"{n}: here {getattr(mine, n)!r}, {peer_name} {peer[n]!r}"
        for n in names
        if getattr(mine, n) != peer[n]
    ]
    if diffs:
        raise KVLayoutMismatch(
            f"KV layouts differ, blocks cannot be transferred ({'; '.join(diffs)}): run the prefill "
            "and decode workers with the same model file, --quantization, --dtype, --kv-cache-dtype "
            "and --block-size"
        )
